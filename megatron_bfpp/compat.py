"""Every megatron-core call whose form depends on the installed version, each shim saying which
versions it covers (docs/architecture.md); the version is from ``package_info``, never guessed."""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "SUPPORTED_WINDOW",
    "TORCH_WINDOW",
    "ShardedBucket",
    "TorchWindow",
    "UnsupportedMegatronError",
    "UnsupportedTorchError",
    "UnsupportedVersionError",
    "accumulate_wgrad_fused",
    "backward_step",
    "call_megatron_get_forward_backward_func",
    "check_megatron_core",
    "check_torch",
    "default_process_groups",
    "extra_main_grad_params",
    "finish_partial_grad_sync",
    "guard_zero_grad_buffer",
    "is_multi_module_collection",
    "is_supported",
    "linear_function_args",
    "linear_function_option",
    "local_linear_layers",
    "loss_stage_told",
    "main_weight_shards",
    "megatron_core_version",
    "model_params_from_main_params",
    "model_process_groups",
    "optimizer_on_shards",
    "param_bucket_ranges",
    "param_gather_suppressed",
    "process_groups_without_embedding_group",
    "restore_torch_adam_steps",
    "set_a2a_streams",
    "sharded_param_buckets",
    "shared_embedding_chunk",
    "tensor_parallel_reduced_params",
    "torch_adam_state_for_load",
    "transformer_engine_layers",
    "uses_position_embedding_group",
]


@dataclass(frozen=True)
class MinorRange:
    """An inclusive range of megatron-core (major, minor) versions and the Pythons they need."""

    first: tuple[int, int]
    last: tuple[int, int]
    python: str

    def __contains__(self, version: object) -> bool:
        return isinstance(version, tuple) and self.first <= version[:2] <= self.last

    def __str__(self) -> str:
        first, last = (f"{major}.{minor}.x" for major, minor in (self.first, self.last))
        return f"{first if first == last else f'{first}-{last}'} (Python {self.python})"


# The one statement of the megatron-core window (setup.py's pin: tests/unit/test_versions.py).
SUPPORTED_WINDOW: tuple[MinorRange, ...] = (
    MinorRange((0, 16), (0, 16), "3.10/3.11"),
    MinorRange((0, 17), (0, 20), ">= 3.12"),
)
_WINDOW_TEXT = " or ".join(map(str, SUPPORTED_WINDOW))


@dataclass(frozen=True)
class TorchWindow:
    """torch from ``first`` (major, minor) on; ``tested``: the CI stacks' versions. Newer
    releases run with a warning, since one rarely breaks what we call but none has run here."""

    first: tuple[int, int]
    tested: tuple[str, ...]

    def __str__(self) -> str:
        return f"torch {' and '.join(self.tested)}"


# The one statement of the torch window (setup.py, scripts/setup.sh: tests/unit/test_versions.py).
TORCH_WINDOW = TorchWindow(first=(2, 13), tested=("2.13.0", "2.14.1"))


class UnsupportedVersionError(RuntimeError):
    """megatron-core or torch is missing or outside the versions megatron_bfpp supports."""


class UnsupportedMegatronError(UnsupportedVersionError):
    """megatron-core is missing or outside the versions megatron_bfpp supports."""


class UnsupportedTorchError(UnsupportedVersionError):
    """torch is older than the versions megatron_bfpp supports."""


def _release(version: str) -> tuple[int, ...]:
    """``(2, 14, 1)`` from ``2.14.1+cu130`` or ``2.15.0a0+git...``."""
    return tuple(
        int("".join(itertools.takewhile(str.isdigit, part)) or 0)
        for part in version.split("+")[0].split(".")[:3]
    )


def check_torch(version: str | None = None) -> str | None:
    """Raise :class:`UnsupportedTorchError` for a torch older than ``TORCH_WINDOW``; return the
    warning line (its callers print once per run) for one newer than every tested one."""
    if version is None:
        import torch

        version = str(torch.__version__)
    found = _release(version)
    if found[:2] < TORCH_WINDOW.first:
        first = ".".join(map(str, TORCH_WINDOW.first))
        raise UnsupportedTorchError(
            f"torch {version} is older than megatron_bfpp supports (torch >= {first}; tested: "
            f"{', '.join(TORCH_WINDOW.tested)}); install e.g. pip install "
            f"'torch=={TORCH_WINDOW.tested[-1]}'"
        )
    if found[:2] > max(map(_release, TORCH_WINDOW.tested))[:2]:
        return (
            f"megatron_bfpp: warning: torch {version} is newer than the versions megatron_bfpp "
            f"is tested with ({', '.join(TORCH_WINDOW.tested)}); it runs, untested"
        )
    return None


@functools.cache
def megatron_core_version() -> tuple[int, int, int]:
    """The installed (or checkout's) megatron-core version, from its ``package_info``."""
    try:
        from megatron.core import package_info
    except ImportError as error:
        raise UnsupportedMegatronError(
            f"megatron-core is not importable ({error}); install megatron-core {_WINDOW_TEXT}"
        ) from None
    return (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))


def is_supported(version: tuple[int, int, int]) -> bool:
    return any(version in window for window in SUPPORTED_WINDOW)


def check_megatron_core(version: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """Raise :class:`UnsupportedMegatronError` (one line naming the version) outside the window."""
    found = megatron_core_version() if version is None else version
    if not is_supported(found):
        text = ".".join(map(str, found))
        raise UnsupportedMegatronError(
            f"megatron-core {text} is not supported by megatron_bfpp; install megatron-core "
            f"{_WINDOW_TEXT} (e.g. pip install 'megatron-core==0.19.2' on Python 3.12)"
        )
    return found


def _at_least(major: int, minor: int) -> bool:
    return check_megatron_core()[:2] >= (major, minor)


def backward_step(
    input_tensor: Any, output_tensor: Any, output_tensor_grad: Any, *, model_type: Any, config: Any
) -> Any:
    """megatron-core's ``backward_step``: 0.16 takes ``model_type`` before ``config``."""
    from megatron.core.pipeline_parallel import schedules

    before_config = () if _at_least(0, 17) else (model_type,)
    return schedules.backward_step(
        input_tensor, output_tensor, output_tensor_grad, *before_config, config
    )


def set_a2a_streams(config: Any) -> None:
    """megatron-core's combined step's all-to-all stream, as its schedules set it: newer releases
    take ``high_priority`` (``config.high_priority_a2a_comm_stream``), 0.16-0.17 do not."""
    import inspect

    from megatron.core.pipeline_parallel.utils import set_streams

    if "high_priority" in inspect.signature(set_streams).parameters:
        set_streams(high_priority=config.high_priority_a2a_comm_stream)
    else:
        set_streams()


def default_process_groups() -> Any:
    """The ``ProcessGroupCollection`` megatron-core's schedules build when the caller passes none
    (0.18 adds tp_dp_cp, 0.19 dp; their ``finalize_model_grads`` may read them)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    collection = ProcessGroupCollection()
    collection.tp = parallel_state.get_tensor_model_parallel_group()
    collection.cp = parallel_state.get_context_parallel_group()
    collection.embd = parallel_state.get_embedding_group(check_initialized=False)
    collection.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    collection.pp = parallel_state.get_pipeline_model_parallel_group()
    collection.dp_cp = parallel_state.get_data_parallel_group(
        with_context_parallel=True, partial_data_parallel=False
    )
    if _at_least(0, 18):
        collection.tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(
            with_context_parallel=True
        )
    if _at_least(0, 19):
        collection.dp = parallel_state.get_data_parallel_group(
            with_context_parallel=False, partial_data_parallel=False
        )
    return collection


def call_megatron_get_forward_backward_func(
    original: Any, *, pp_size: int | None, vp_size: int | None, schedule_pg_collection: Any
) -> Any:
    """megatron's own ``get_forward_backward_func``: 0.19+ take ``schedule_pg_collection``."""
    extra = {"schedule_pg_collection": schedule_pg_collection} if _at_least(0, 19) else {}
    if schedule_pg_collection is not None and not extra:
        raise UnsupportedMegatronError(
            "schedule_pg_collection needs megatron-core >= 0.19; "
            f"found {'.'.join(map(str, megatron_core_version()))}"
        )
    return original(pp_size=pp_size, vp_size=vp_size, **extra)


def is_multi_module_collection(schedule_pg_collection: Any) -> bool:
    """True for 0.19+'s ``MultiModuleProcessGroupCollection`` (cross-grid multi-module pipelines,
    run by megatron's bridge schedule); older versions take no ``schedule_pg_collection``."""
    if schedule_pg_collection is None or not _at_least(0, 19):
        return False
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

    return isinstance(schedule_pg_collection, MultiModuleProcessGroupCollection)


class ShardedBucket(NamedTuple):
    """One bucket of a megatron-core DDP chunk as the sharding runtime sees it."""

    param_data: Any  # the flat full-parameter view the distributed optimizer all-gathers into
    group: Any  # the group the distributed optimizer shards this bucket over
    size: int
    rank: int
    grad_data: Any  # the flat full-gradient view it reduce-scatters
    bucket: Any  # megatron-core's bucket object (the optimizer's buffers point at it)


def sharded_param_buckets(chunk: Any) -> list[ShardedBucket]:
    """Each bucket of a megatron-core DDP chunk's buffers, dense and expert-parallel: buffer
    internals (the same in 0.16.1 to 0.20.0) rather than API, so a move changes one function."""
    groups = [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]
    return [
        ShardedBucket(
            bucket.param_data,
            group.intra_distributed_optimizer_instance_group,
            int(group.intra_distributed_optimizer_instance_size),
            int(group.intra_distributed_optimizer_instance_rank),
            bucket.grad_data,
            bucket,
        )
        for group in groups
        for bucket in group.buckets
    ]


def extra_main_grad_params(chunk: Any) -> int:
    """Parameters keeping ``main_grad`` outside the gradient buffer (0.19's; 0.16 has none)."""
    found = sharded_param_buckets(chunk)
    return sum(len(getattr(each.bucket, "params_with_extra_main_grads", ())) for each in found)


def param_bucket_ranges(chunk: Any) -> dict[Any, tuple[Any, int, int]]:
    """``param -> (bucket, start, end)``: where each parameter lies in its bucket."""
    ranges: dict[Any, tuple[Any, int, int]] = {}
    for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            bucket = buffer.buckets[bucket_id]
            ranges[param] = (bucket, start - bucket.offset, end - bucket.offset)
    return ranges


def tensor_parallel_reduced_params(chunks: Any, config: Any) -> tuple[list[Any], list[Any]]:
    """``(summed, averaged)``: the parameters whose gradients ``finalize_model_grads``
    all-reduces over tensor parallelism (``_allreduce_non_tensor_model_parallel_grads``)."""
    from megatron.core.utils import get_attr_wrapped_model

    summed: list[Any] = []
    averaged: list[Any] = []
    for chunk in chunks:
        for name, param in get_attr_wrapped_model(chunk, "named_parameters")():
            if not param.requires_grad:
                continue
            if getattr(param, "average_gradients_across_tp_domain", False):
                averaged.append(param)
            elif (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
            ):
                summed.append(param)
    return summed, averaged


def shared_embedding_chunk(chunks: Any, config: Any, groups: Any) -> tuple[int, Any] | None:
    """``(chunk index, weight)`` of the tied word embedding this rank all-reduces with the other
    pipeline end in ``finalize_model_grads``, or None, as ``_allreduce_embedding_grad`` chooses."""
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
    from megatron.core.utils import get_attr_wrapped_model

    if not _all_reduces_over(groups, "embd"):
        return None
    first = is_pp_first_stage(groups.pp)
    last = not first and (is_pp_last_stage(groups.pp) or getattr(config, "mtp_num_layers", None))
    index = len(chunks) - 1 if last else 0
    module = get_attr_wrapped_model(chunks[index], "pre_process", return_model_obj=True)
    if not (
        getattr(module, "share_embeddings_and_output_weights", False)
        or getattr(config, "mtp_num_layers", 0)
    ):
        return None
    return index, module.shared_embedding_or_output_weight()


def uses_position_embedding_group(groups: Any) -> bool:
    """Whether ``finalize_model_grads`` would all-reduce position embeddings over the pipeline."""
    return _all_reduces_over(groups, "pos_embd")


def _all_reduces_over(groups: Any, name: str) -> bool:
    """Whether this rank is in ``groups.<name>`` and it holds another rank to all-reduce with."""
    import torch.distributed as dist

    group = getattr(groups, name, None)
    if group is None or group.size() <= 1:
        return False
    return dist.get_rank() in dist.get_process_group_ranks(group)


def _distributed_optimizers(optimizer: Any) -> list[Any]:
    """The distributed optimizers in ``get_megatron_optimizer``'s result, or a one-line error."""
    inner = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    for each in inner:
        if not hasattr(each, "model_param_gbuf_map"):
            raise ValueError(
                f"fully sharded training steps megatron-core's DistributedOptimizer, got a "
                f"{type(each).__name__}; build the optimizer with use_distributed_optimizer=True "
                "(Megatron-LM: --use-distributed-optimizer)"
            )
        if getattr(each.config, "use_precision_aware_optimizer", False):
            raise ValueError(
                "fully sharded training (optim_grads_params) does not support the "
                "precision-aware optimizer; drop --use-precision-aware-optimizer"
            )
        if any(getattr(each.ddp_config, f"{kind}_param_gather", False) for kind in ("fp8", "fp4")):
            raise ValueError(
                "fully sharded training (optim_grads_params) does not support FP8/FP4 "
                "parameter gathers; drop --fp8-param-gather"
            )
    return inner


ShardOf = Callable[[Any], Any]


@contextlib.contextmanager
def optimizer_on_shards(
    optimizer: Any, param_shard: ShardOf, grad_shard: ShardOf
) -> Iterator[None]:
    """Step megatron-core's distributed optimizer on shard-only buffers: the two copies that
    touch the full buffers (0.16.1 to 0.20.0) read and write the kept shards for the step, and
    fp32 main parameters, views into them, are re-pointed at the kept shards once."""
    import torch

    inner = _distributed_optimizers(optimizer)

    def shards(opt: Any, *, fp32_only: bool = False) -> Iterator[tuple[Any, Any, int, int]]:
        """Each main parameter with its model parameter's bucket and range in the bucket."""
        kinds = [(opt.model_fp32_groups, opt.shard_fp32_groups)]
        if not fp32_only:
            kinds.insert(0, (opt.model_float16_groups, opt.shard_fp32_from_float16_groups))
        for model_groups, main_groups in kinds:
            for model_group, main_group in zip(model_groups, main_groups, strict=True):
                for param, main in zip(model_group, main_group, strict=True):
                    gbuf_index, _, bucket_id = opt.model_param_gbuf_map[param]
                    found = opt._get_model_param_range_map(param)["gbuf_local"]
                    bucket = opt.buffers[gbuf_index].buckets[bucket_id]
                    yield main, bucket, int(found.start), int(found.end)

    def copy_grads(opt: Any) -> None:
        for main, bucket, start, end in shards(opt):
            main.grad = grad_shard(bucket)[start:end].float()

    def copy_params(opt: Any) -> None:
        for main, bucket, start, end in shards(opt):
            param_shard(bucket)[start:end].copy_(main)

    with torch.no_grad():
        for opt in inner:
            if getattr(opt, "_bfpp_on_shards", False):
                continue
            for main, bucket, start, end in shards(opt, fp32_only=True):
                kept = param_shard(bucket)
                main.set_(kept.untyped_storage(), kept.storage_offset() + start, (end - start,))
            opt._bfpp_on_shards = True
    for opt in inner:
        opt._copy_model_grads_to_main_grads = functools.partial(copy_grads, opt)
        opt._copy_main_params_to_model_params = functools.partial(copy_params, opt)
    try:
        yield
    finally:
        for opt in inner:
            del opt._copy_model_grads_to_main_grads
            del opt._copy_main_params_to_model_params


def finish_partial_grad_sync(chunk: Any) -> None:
    """Finish such a reduction and leave the buckets ready to reduce again this step: 0.19's
    ``grad_reduce_finished`` (0.16.1 has none) would make the step's last reduction a no-op."""
    chunk.finish_grad_sync()
    for group in [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]:
        if hasattr(group, "grad_reduce_finished"):
            group.grad_reduce_finished = False


def guard_zero_grad_buffer(chunk: Any, around: Callable[[Callable[[], None]], None]) -> None:
    """Route ``zero_grad_buffer`` through ``around(original)``: a released buffer is allocated."""
    if getattr(chunk, "_bfpp_zero_guarded", False):
        return
    chunk.zero_grad_buffer = functools.partial(around, chunk.zero_grad_buffer)
    chunk._bfpp_zero_guarded = True


@contextlib.contextmanager
def param_gather_suppressed(chunks: Any) -> Iterator[None]:
    """Run a distributed-optimizer step without its closing parameter all-gather (the schedule
    gathers each sharded chunk): ``overlap_param_gather`` set for the step skips it."""
    configs = {id(chunk.ddp_config): chunk.ddp_config for chunk in chunks}.values()
    saved = [(config, config.overlap_param_gather) for config in configs]
    for config, _ in saved:
        config.overlap_param_gather = True
    try:
        yield
    finally:
        for config, value in saved:
            config.overlap_param_gather = value


def model_params_from_main_params(optimizer: Any, chunks: Any) -> None:
    """Rebuild the model's parameters from the optimizer's main parameters (all a fully sharded
    ``torch_dist`` checkpoint stores) with a step's two calls: bit-identical to a step's."""
    for opt in _distributed_optimizers(optimizer):
        opt._copy_main_params_to_model_params()
    for chunk in chunks:
        chunk.start_param_sync(force_sync=True)


def main_weight_shards(optimizer: Any) -> list[Any]:
    """The fp32 main weights a bf16 / fp16 distributed optimizer keeps apart from the model's
    (its ``shard_fp32_from_float16_groups``, in order); none in fp32, where they view the model's
    weights. A per-rank checkpoint saves them: rebuilt from bf16 weights, they would round."""
    return [
        shard
        for each in _distributed_optimizers(optimizer)
        for group in each.shard_fp32_from_float16_groups
        for shard in group
    ]


def _adam_params(optimizer: Any) -> Iterator[tuple[Any, dict[str, Any], Any]]:
    """Each parameter of the torch ``Adam`` optimizers inside megatron-core's (chained) one."""
    import torch

    for each in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(each.optimizer, torch.optim.Adam):
            for group in each.optimizer.param_groups:
                for param in group["params"]:
                    yield each.optimizer, group, param


def torch_adam_state_for_load(optimizer: Any) -> None:
    """Zero Adam state for parameters that have none yet, before a load: the distributed
    optimizer's ``sharded_state_dict`` asserts torch Adam's ``step`` (zero is none to Adam)."""
    import torch

    for inner, _, param in _adam_params(optimizer):
        if not inner.state[param]:
            inner.state[param] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }


def restore_torch_adam_steps(optimizer: Any) -> None:
    """Each parameter's Adam ``step`` from the checkpoint, in its own tensor, after a load (the
    distributed optimizer loads one shared, stale tensor: a resumed run differed)."""
    import torch

    for inner, group, param in _adam_params(optimizer):
        state = inner.state[param] if "step" in group else {}
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = torch.full_like(state["step"], float(group["step"]))


class _PipelineGroupAs:
    """A pipeline process group that reports another rank, so megatron-core numbers a V-shape
    chunk's layers as the looped slot's holding its stage (``megatron.chunks``)."""

    def __init__(self, group: Any, rank: int) -> None:
        self._group = group
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


class _OneRankGroup:
    """An embedding group of this rank alone: ``finalize_model_grads`` skips its all-reduce."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def model_process_groups(*, pipeline_rank: int, base: Any = None) -> Any:
    """The ``ProcessGroupCollection`` a model builds with (a copy of ``base``, or megatron's),
    its pipeline group reporting ``pipeline_rank``, without an embedding group."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if base is None:
        groups = ProcessGroupCollection.use_mpu_process_groups()
    else:
        groups = copy.copy(base)
        if isinstance(groups.pp, _PipelineGroupAs):
            groups.pp = groups.pp._group
    groups.pp = _PipelineGroupAs(groups.pp, pipeline_rank)
    groups.embd = None
    return groups


@contextlib.contextmanager
def building_as_pipeline_rank(pipeline_rank: int) -> Iterator[None]:
    """megatron's pipeline rank is ``pipeline_rank`` while a chunk is built for that rank's slot: a
    layout counts its layers by ``parallel_state``'s rank, not the model's groups (0.16-0.20)."""
    from megatron.core import parallel_state

    before = parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK
    parallel_state.set_pipeline_model_parallel_rank(pipeline_rank)
    try:
        yield
    finally:
        parallel_state.set_pipeline_model_parallel_rank(before)


@contextlib.contextmanager
def loss_stage_told(is_last_stage: bool, cp_group_size: int) -> Iterator[None]:
    """megatron-core's combined step asks ``parallel_state`` whether its forward's chunk takes the
    loss, which a V placement's (rank 0's second chunk) is not to it; the step is told, as the
    plain forward tells ``forward_step`` (``is_last_stage``)."""
    from megatron.core.pipeline_parallel import schedules

    original = schedules.forward_step_calc_loss
    schedules.forward_step_calc_loss = functools.partial(
        original, cp_group_size=cp_group_size, is_last_stage=is_last_stage
    )
    try:
        yield
    finally:
        schedules.forward_step_calc_loss = original


def process_groups_without_embedding_group(groups: Any) -> Any:
    """A copy of ``groups`` whose embedding group is this rank alone (tied copies on one rank)."""
    stripped = copy.copy(groups)
    stripped.embd = _OneRankGroup()
    return stripped


# runtime.deferred_wgrad: ``LinearWithGradAccumulationAndAsyncCommunication``'s forward and
# backward context match in 0.16.1 to 0.20.0; its argument list does not: it is built by name.


def transformer_engine_layers(module: Any) -> list[Any]:
    """The Transformer Engine layers in ``module`` (they keep their own weight GEMMs)."""
    prefix = "megatron.core.extensions.transformer_engine"
    return [
        m
        for m in module.modules()
        if type(m).__module__.startswith(prefix) and getattr(m, "weight", None) is not None
    ]


def local_linear_layers(module: Any) -> list[Any]:
    """megatron-core's tensor-parallel linear layers in ``module`` (not Transformer Engine's)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return [m for m in module.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]


@functools.cache
def _linear_parameter_names() -> tuple[tuple[str, ...], Any]:
    import inspect

    from megatron.core.tensor_parallel import layers

    forward = layers.LinearWithGradAccumulationAndAsyncCommunication.forward
    names = tuple(inspect.signature(forward).parameters)[1:]  # without ctx
    return names, inspect.signature(layers.linear_with_grad_accumulation_and_async_allreduce)


def linear_function_args(input: Any, weight: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """The arguments ``linear_with_grad_accumulation_and_async_allreduce`` would hand its
    autograd Function for this call, in its order (defaults filled in, group resolved)."""
    from megatron.core.tensor_parallel.layers import get_tensor_model_parallel_group_if_none

    names, wrapper = _linear_parameter_names()
    bound = wrapper.bind(input, weight, *args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    if values.get("async_grad_allreduce") is not None:  # 0.16's deprecated spelling
        values["allreduce_dgrad"] = values["async_grad_allreduce"]
    values["tp_group"] = get_tensor_model_parallel_group_if_none(values.get("tp_group"))
    return tuple(values[name] for name in names)


def linear_function_option(args: tuple[Any, ...], name: str, default: Any = None) -> Any:
    """One named argument of a ``linear_function_args`` tuple, or ``default`` in this version."""
    names, _ = _linear_parameter_names()
    return args[names.index(name)] if name in names else default


def accumulate_wgrad_fused(total_input: Any, grad_output: Any, main_grad: Any) -> None:
    """Add the weight gradient into ``main_grad`` with megatron-core's fused CUDA kernel."""
    import torch
    from megatron.core.tensor_parallel import layers

    kernels = layers.fused_weight_gradient_mlp_cuda
    if main_grad.dtype == torch.float32:
        kernels.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        kernels.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    else:
        raise RuntimeError(
            f"gradient accumulation fusion does not support main_grad of type {main_grad.dtype}"
        )
