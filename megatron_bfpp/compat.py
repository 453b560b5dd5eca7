"""The one module that owns every megatron-core call whose form depends on the installed version.

megatron_bfpp serves the megatron-core versions in ``SUPPORTED_WINDOW`` (the 0.16.1, 0.17.1,
0.18.2 and 0.19.2 wheels, and Megatron-LM checkouts whose ``megatron/core`` is 0.16, 0.19 or
0.20) on the torch versions of ``TORCH_WINDOW``. Everything else
imports megatron-core names that are the same across that window directly; a call whose
signature or location changed goes through a shim here, and each shim says which versions it
covers. The version is read from ``megatron.core.package_info`` (never guessed from a
``TypeError``), and a version outside the window fails with one line that names it, before any
rank builds a model or sends a message. A torch older than ``TORCH_WINDOW`` fails the same way;
a newer one runs, with one warning line naming the tested versions.

Calls checked to be the same in 0.16.1, 0.17.1, 0.18.2, 0.19.2 and 0.20.0 (so they are made
directly):
``finalize_model_grads_func(model, num_tokens, pg_collection=, force_all_reduce=)``,
``clear_embedding_activation_buffer``, ``finish_embedding_wgrad_compute``, the model config's
``no_sync_func`` / ``grad_sync_func`` / ``param_sync_func``, ``get_model_config``,
``get_model_type``, ``is_pp_last_stage``, the ``parallel_state`` getters and
``initialize_model_parallel``, ``DistributedDataParallel`` / ``DistributedDataParallelConfig``,
``get_megatron_optimizer`` / ``OptimizerConfig``, ``OptimizerParamScheduler``, ``GPTModel`` and
the local layer spec, and the ``tensor_parallel.random`` internals the CPU adapter redirects.
"""

from __future__ import annotations

import contextlib
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
    "distributed_optimizers",
    "extra_main_grad_params",
    "finish_partial_grad_sync",
    "forward_step",
    "guard_zero_grad_buffer",
    "is_multi_module_collection",
    "is_supported",
    "linear_function_args",
    "linear_function_option",
    "local_linear_layers",
    "megatron_core_version",
    "megatron_linear_forward",
    "model_params_from_main_params",
    "model_process_groups",
    "optimizer_on_shards",
    "param_bucket_ranges",
    "param_gather_suppressed",
    "process_groups_without_embedding_group",
    "restore_torch_adam_steps",
    "sharded_param_buckets",
    "shared_embedding_chunk",
    "start_partial_grad_sync",
    "tensor_parallel_reduced_params",
    "torch_adam_state_for_load",
    "transformer_engine_layers",
    "uses_position_embedding_group",
    "wgrad_operands",
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


# The megatron-core versions we test and serve: the one statement of the window. setup.py's pin
# is tied to it by tests/unit/test_versions.py.
SUPPORTED_WINDOW: tuple[MinorRange, ...] = (
    MinorRange((0, 16), (0, 16), "3.10/3.11"),
    MinorRange((0, 17), (0, 20), ">= 3.12"),
)
_WINDOW_TEXT = " or ".join(map(str, SUPPORTED_WINDOW))


@dataclass(frozen=True)
class TorchWindow:
    """The torch releases megatron_bfpp is tested with: from ``first`` (major, minor) on; the
    ``tested`` versions are the ones the CI stacks run (scripts/setup.sh pins each stack to one).
    Older releases are refused; newer ones run with a warning, since a torch release rarely
    breaks what we call but nothing here has run on it."""

    first: tuple[int, int]
    tested: tuple[str, ...]

    def __str__(self) -> str:
        return f"torch {' and '.join(self.tested)}"


# The one statement of the torch window; setup.py's pin and scripts/setup.sh's stacks are tied
# to it by tests/unit/test_versions.py.
TORCH_WINDOW = TorchWindow(first=(2, 13), tested=("2.13.0", "2.14.1"))


class UnsupportedVersionError(RuntimeError):
    """megatron-core or torch is missing or outside the versions megatron_bfpp supports."""


class UnsupportedMegatronError(UnsupportedVersionError):
    """megatron-core is missing or outside the versions megatron_bfpp supports."""


class UnsupportedTorchError(UnsupportedVersionError):
    """torch is older than the versions megatron_bfpp supports."""


def _release(version: str) -> tuple[int, ...]:
    """``(2, 14, 1)`` from ``2.14.1+cu130`` or ``2.15.0a0+git...``."""
    parts = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        parts.append(int(digits or 0))
    return tuple(parts)


def check_torch(version: str | None = None) -> str | None:
    """Raise :class:`UnsupportedTorchError` (one line naming the version) for a torch older than
    ``TORCH_WINDOW``; return the one warning line for a torch newer than every tested one, else
    None. The callers (launcher, ``install()``, bfpp-train) print the warning once per run."""
    if version is None:
        import torch

        version = str(torch.__version__)
    found = _release(version)
    tested = [_release(v) for v in TORCH_WINDOW.tested]
    if found[:2] < TORCH_WINDOW.first:
        first = ".".join(map(str, TORCH_WINDOW.first))
        raise UnsupportedTorchError(
            f"torch {version} is older than megatron_bfpp supports (torch >= {first}; tested: "
            f"{', '.join(TORCH_WINDOW.tested)}); install e.g. pip install "
            f"'torch=={TORCH_WINDOW.tested[-1]}'"
        )
    if found[:2] > max(tested)[:2]:
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


def forward_step(
    forward_step_func: Any,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    input_tensor: Any,
    forward_data_store: list[Any],
    config: Any,
    cp_group_size: int,
    *,
    collect_non_loss_data: bool,
    is_first_microbatch: bool,
    current_microbatch: int,
    vp_stage: int | None,
    is_last_stage: bool,
) -> Any:
    """megatron-core's ``forward_step``: the same signature in 0.16, 0.19 and 0.20 (0.19 moved
    ``set_current_microbatch`` into ``cuda_graphs`` without changing this call)."""
    check_megatron_core()
    from megatron.core.pipeline_parallel import schedules

    return schedules.forward_step(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        input_tensor,
        forward_data_store,
        config,
        cp_group_size,
        collect_non_loss_data=collect_non_loss_data,
        checkpoint_activations_microbatch=None,
        is_first_microbatch=is_first_microbatch,
        current_microbatch=current_microbatch,
        vp_stage=vp_stage,
        is_last_stage=is_last_stage,
    )


def backward_step(
    input_tensor: Any, output_tensor: Any, output_tensor_grad: Any, *, model_type: Any, config: Any
) -> Any:
    """megatron-core's ``backward_step``: 0.16 takes ``model_type`` before ``config``; 0.17 to
    0.20 dropped it."""
    from megatron.core.pipeline_parallel import schedules

    if _at_least(0, 17):
        return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)
    return schedules.backward_step(
        input_tensor, output_tensor, output_tensor_grad, model_type, config
    )


def default_process_groups() -> Any:
    """The ``ProcessGroupCollection`` megatron-core's schedules build from ``parallel_state`` when
    the caller passes none (0.16 and 0.17: tp, cp, embd, pos_embd, pp, dp_cp; 0.18 adds
    tp_dp_cp; 0.19 and 0.20 add dp too; their ``finalize_model_grads`` may read them)."""
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
    """megatron-core's own ``get_forward_backward_func``: 0.19 and 0.20 take
    ``schedule_pg_collection`` (Megatron-LM passes it on every call); 0.16 to 0.18 have no such
    argument and none of their callers pass one."""
    if _at_least(0, 19):
        return original(
            pp_size=pp_size, vp_size=vp_size, schedule_pg_collection=schedule_pg_collection
        )
    if schedule_pg_collection is not None:
        raise UnsupportedMegatronError(
            "schedule_pg_collection needs megatron-core >= 0.19; "
            f"found {'.'.join(map(str, megatron_core_version()))}"
        )
    return original(pp_size=pp_size, vp_size=vp_size)


def is_multi_module_collection(schedule_pg_collection: Any) -> bool:
    """True for 0.19+'s ``MultiModuleProcessGroupCollection`` (cross-grid multi-module pipelines,
    which megatron runs with its bridge schedule); 0.16 has no such class, and 0.17 and 0.18,
    which define it, take no ``schedule_pg_collection`` to pass one in."""
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
    """Each bucket of a megatron-core DDP chunk's buffers, dense and expert-parallel.

    The same attributes in 0.16.1, 0.19.2 and 0.20.0 (``bucket_groups``,
    ``expert_parallel_bucket_groups``, ``buckets``, ``param_data``, ``grad_data``,
    ``intra_distributed_optimizer_instance_group/size/rank``); kept here because they are
    buffer internals rather than API, so a release that moves them changes one function.
    """
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
    """How many parameters keep their ``main_grad`` outside the gradient buffer (0.19's
    ``params_with_extra_main_grads``, copied in and out around the reduction); 0.16 has none."""
    return sum(
        len(getattr(bucket, "params_with_extra_main_grads", ()))
        for group in [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]
        for bucket in group.buckets
    )


def param_bucket_ranges(chunk: Any) -> dict[Any, tuple[Any, int, int]]:
    """``param -> (bucket, start, end)``: where each parameter's elements lie in its bucket
    (``param_index_map`` and ``bucket.offset``, the same in 0.16.1, 0.19.2 and 0.20.0)."""
    ranges: dict[Any, tuple[Any, int, int]] = {}
    for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            bucket = buffer.buckets[bucket_id]
            ranges[param] = (bucket, start - bucket.offset, end - bucket.offset)
    return ranges


def tensor_parallel_reduced_params(chunks: Any, config: Any) -> tuple[list[Any], list[Any]]:
    """The parameters whose gradients megatron-core's ``finalize_model_grads`` all-reduces over
    the tensor-parallel group after the data-parallel reduction: ``(summed, averaged)``.

    Mirrors ``_allreduce_non_tensor_model_parallel_grads`` of 0.16.1, 0.19.2 and 0.20.0:
    sequence-parallel parameters and q/k layer norms are summed, parameters marked
    ``average_gradients_across_tp_domain`` averaged."""
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
    """``(chunk index, weight)`` of the word-embedding weight this rank all-reduces with the
    other end of the pipeline in ``finalize_model_grads`` (tied input and output embeddings),
    or None. Mirrors ``_allreduce_embedding_grad``'s choice (0.16.1, 0.19.2, 0.20.0): the
    first chunk on the first pipeline stage, the last chunk on the last."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
    from megatron.core.utils import get_attr_wrapped_model

    group = getattr(groups, "embd", None)
    if group is None or group.size() <= 1:
        return None
    if dist.get_rank() not in dist.get_process_group_ranks(group):
        return None
    if is_pp_first_stage(groups.pp):
        index = 0
    elif is_pp_last_stage(groups.pp) or getattr(config, "mtp_num_layers", None):
        index = len(chunks) - 1
    else:
        index = 0
    module = get_attr_wrapped_model(chunks[index], "pre_process", return_model_obj=True)
    if not (
        getattr(module, "share_embeddings_and_output_weights", False)
        or getattr(config, "mtp_num_layers", 0)
    ):
        return None
    return index, module.shared_embedding_or_output_weight()


def uses_position_embedding_group(groups: Any) -> bool:
    """Whether ``finalize_model_grads`` would all-reduce position embeddings over the pipeline
    (encoder-decoder models split at a pipeline rank)."""
    import torch.distributed as dist

    group = getattr(groups, "pos_embd", None)
    if group is None or group.size() <= 1:
        return False
    return dist.get_rank() in dist.get_process_group_ranks(group)


def distributed_optimizers(optimizer: Any) -> list[Any]:
    """The distributed optimizers inside what ``get_megatron_optimizer`` returned (it chains
    several for separate parameter groups in 0.19), or a one-line error naming what it is."""
    inner = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    for each in inner:
        if not hasattr(each, "model_param_gbuf_map"):
            raise ValueError(
                f"fully sharded training steps megatron-core's DistributedOptimizer, got a "
                f"{type(each).__name__}; build the optimizer with use_distributed_optimizer=True "
                "(Megatron-LM: --use-distributed-optimizer)"
            )
        config = each.config
        if getattr(config, "use_precision_aware_optimizer", False):
            raise ValueError(
                "fully sharded training (optim_grads_params) does not support the "
                "precision-aware optimizer; drop --use-precision-aware-optimizer"
            )
        ddp_config = each.ddp_config
        if getattr(ddp_config, "fp8_param_gather", False) or getattr(
            ddp_config, "fp4_param_gather", False
        ):
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
    """Step megatron-core's distributed optimizer on shard-only buffers.

    The optimizer touches the full buffers in exactly two places, the same in 0.16.1, 0.19.2
    and 0.20.0: ``_copy_model_grads_to_main_grads`` reads this rank's range of each
    parameter's ``main_grad`` (a view into the gradient buffer) and
    ``_copy_main_params_to_model_params`` writes the updated range into the parameter buffer;
    with fp32 parameters its main parameters are themselves views into that buffer. Here
    ``param_shard(bucket)`` / ``grad_shard(bucket)`` give the bucket's kept shard (this rank's
    part of the bucket, ``gbuf_local`` coordinates): the fp32 main parameters are re-pointed at
    the kept parameter shards (once: they stay there, the same tensor objects the Adam state
    is keyed by), and for the step's duration the two copies read and write the kept shards.
    Everything else (unscaling and the inf check, the global norm and clipping, zero counting,
    Adam) runs on the main parameters and their gradients, unchanged.
    """
    import torch

    inner = distributed_optimizers(optimizer)

    def local(opt: Any, param: Any) -> tuple[Any, int, int]:
        gbuf_index, _, bucket_id = opt.model_param_gbuf_map[param]
        bucket = opt.buffers[gbuf_index].buckets[bucket_id]
        found = opt._get_model_param_range_map(param)["gbuf_local"]
        return bucket, int(found.start), int(found.end)

    def pairs(opt: Any) -> Iterator[tuple[Any, Any]]:
        for model_groups, main_groups in (
            (opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
            (opt.model_fp32_groups, opt.shard_fp32_groups),
        ):
            for model_group, main_group in zip(model_groups, main_groups, strict=True):
                yield from zip(model_group, main_group, strict=True)

    def copy_grads(opt: Any) -> Callable[[], None]:
        def copy() -> None:
            for param, main in pairs(opt):
                bucket, start, end = local(opt, param)
                main.grad = grad_shard(bucket)[start:end].float()

        return copy

    def copy_params(opt: Any) -> Callable[[], None]:
        def copy() -> None:
            for param, main in pairs(opt):
                bucket, start, end = local(opt, param)
                param_shard(bucket)[start:end].copy_(main)

        return copy

    with torch.no_grad():
        for opt in inner:
            if getattr(opt, "_bfpp_on_shards", False):
                continue
            for model_group, main_group in zip(
                opt.model_fp32_groups, opt.shard_fp32_groups, strict=True
            ):
                for param, main in zip(model_group, main_group, strict=True):
                    bucket, start, end = local(opt, param)
                    kept = param_shard(bucket)
                    main.set_(kept.untyped_storage(), kept.storage_offset() + start, (end - start,))
            opt._bfpp_on_shards = True
    for opt in inner:
        opt._copy_model_grads_to_main_grads = copy_grads(opt)
        opt._copy_main_params_to_model_params = copy_params(opt)
    try:
        yield
    finally:
        for opt in inner:
            del opt._copy_model_grads_to_main_grads
            del opt._copy_main_params_to_model_params


def start_partial_grad_sync(chunk: Any) -> None:
    """Start the DDP chunk's gradient reduction while it is still in ``no_sync``, for a run of
    its backwards before its last (fully sharded breadth-first with groups): megatron-core's own
    ``start_grad_sync`` (scaling, reduce-scatter into the buffer), which DDP's hooks would not
    dispatch inside ``no_sync``. 0.16.1, 0.19.2 and 0.20.0 alike."""
    chunk.start_grad_sync()


def finish_partial_grad_sync(chunk: Any) -> None:
    """Finish such a reduction (start and finish it without ``overlap_grad_reduce``) and leave
    the chunk's buckets ready to reduce again this step: 0.19 marks a bucket group finished for
    the iteration (``grad_reduce_finished``, cleared by ``zero_grad_buffer``), which would turn
    the chunk's last reduction of the step into a no-op; 0.16.1 has no such flag."""
    chunk.finish_grad_sync()
    for group in [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]:
        if hasattr(group, "grad_reduce_finished"):
            group.grad_reduce_finished = False


def guard_zero_grad_buffer(chunk: Any, around: Callable[[Callable[[], None]], None]) -> None:
    """Route the DDP chunk's ``zero_grad_buffer`` (which zeroes the whole gradient buffer, and
    which training loops call before each step) through ``around(original)``, so a released
    buffer is allocated for it. An instance attribute, set once."""
    if getattr(chunk, "_bfpp_zero_guarded", False):
        return
    original = chunk.zero_grad_buffer
    chunk.zero_grad_buffer = functools.partial(around, original)
    chunk._bfpp_zero_guarded = True


@contextlib.contextmanager
def param_gather_suppressed(chunks: Any) -> Iterator[None]:
    """Run a distributed-optimizer step without its closing parameter all-gather.

    0.16.1, 0.19.2 and 0.20.0 skip that gather when the DDP config's ``overlap_param_gather``
    is set (the forward pre-hooks would gather instead); with sharded parameters the schedule
    gathers each chunk itself, so the step's gather would be a whole extra collective per
    bucket. The flag is set only for the step and restored after it, also on error.
    """
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
    """Make the (whole, unsharded) model's parameters what the distributed optimizer's main
    parameters say, as after an optimizer step: each rank casts its main parameters into its
    range of the parameter buffers and the buffers are all-gathered over data parallelism.

    A ``torch_dist`` checkpoint of a fully sharded run stores the parameters only as the main
    parameters of the optimizer's ``dp_reshardable`` state, so no rank gathers a chunk to save;
    loading rebuilds the model from them. The same two calls run after every step in 0.16.1,
    0.19.2 and 0.20.0 (``_copy_main_params_to_model_params``, then the DDP chunks'
    ``start_param_sync``), so the result is bit-identical to the model the step left.
    """
    for opt in distributed_optimizers(optimizer):
        opt._copy_main_params_to_model_params()
    for chunk in chunks:
        chunk.start_param_sync(force_sync=True)


def _torch_adams(optimizer: Any) -> list[Any]:
    """The torch ``Adam`` optimizers inside megatron-core's (chained) optimizer. Apex's and
    Transformer Engine's FusedAdam keep the step in their param groups and need neither fix
    below."""
    import torch

    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]]
    return [o for o in inner if isinstance(o, torch.optim.Adam)]


def torch_adam_state_for_load(optimizer: Any) -> None:
    """Zero Adam state (step 0) for parameters that have none yet, before a load.

    Without Apex or Transformer Engine (on CPU, always), megatron-core's distributed optimizer
    (0.16.1, 0.19.2, 0.20.0) reads ``step`` from torch Adam's state to build its
    ``sharded_state_dict`` and asserts there is one (``assert len(steps) == 1`` in
    ``state_dict``), so a fresh optimizer cannot describe what it loads: Megatron-LM's own
    resume failed so. The load overwrites these values; without a load, Adam's first step from
    a zero state at step 0 is its first step from no state.
    """
    import torch

    for inner in _torch_adams(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }


def restore_torch_adam_steps(optimizer: Any) -> None:
    """Each parameter's Adam ``step`` from the checkpoint, in its own tensor, after a load.

    Without Apex or Transformer Engine, megatron-core's distributed optimizer keeps the step in
    its param groups and, loading, (1) puts one tensor in every parameter's state (torch Adam
    adds 1 to it in place once per parameter) and then (2) copies the loading template's step
    over it (the optimizer's step before the load). Measured with 0.16 and 0.19: without this,
    training after a resume differs from the uninterrupted run.
    """
    import torch

    for inner in _torch_adams(optimizer):
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = inner.state[param]
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.full_like(state["step"], float(group["step"]))


class _PipelineGroupAs:
    """A pipeline process group that reports another rank: what a V-shape chunk's layers see.

    megatron-core derives a chunk's layers (how many, their global numbers, the checkpoint keys
    of its layers) from ``(vp_stage, pipeline rank)`` in the looped placement, where chunk ``c``
    of rank ``r`` is global stage ``c * p + r``. A V-shape chunk holding global stage ``s`` is,
    to that arithmetic, looped slot ``(s // p, s % p)``; this group reports ``s % p``. It is
    used only as the model's ``pg_collection.pp``, which 0.16.1, 0.19.2 and 0.20.0 read for
    ``rank()`` (layer offsets, first/last checks of the tied-embedding setup) and ``size()``;
    anything else is the real group's.
    """

    def __init__(self, group: Any, rank: int) -> None:
        self._group = group
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


class _OneRankGroup:
    """An embedding group of this rank alone, for ``finalize_model_grads``: 0.16.1, 0.19.2 and
    0.20.0 skip the embedding all-reduce when ``embd.size()`` is 1 (and look the global group
    up when it is ``None``, which would pair ranks that hold no embedding under the V-shape)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def model_process_groups(
    *, pipeline_rank: int | None, embedding_group: bool, base: Any = None
) -> Any:
    """The ``ProcessGroupCollection`` a megatron-core model builds with (a copy of ``base``, or
    by default ``use_mpu_process_groups``, the same in 0.16.1, 0.19.2 and 0.20.0), with the
    pipeline group reporting ``pipeline_rank`` (``None``: the real rank) and, without
    ``embedding_group``, no embedding group: a model with its input embedding and its tied
    output layer on one rank neither copies nor all-reduces them over the pipeline."""
    import copy

    from megatron.core.process_groups_config import ProcessGroupCollection

    if base is None:
        groups = ProcessGroupCollection.use_mpu_process_groups()
    else:
        groups = copy.copy(base)
        if isinstance(groups.pp, _PipelineGroupAs):
            groups.pp = groups.pp._group
    if pipeline_rank is not None:
        groups.pp = _PipelineGroupAs(groups.pp, pipeline_rank)
    if not embedding_group:
        groups.embd = None
    return groups


def process_groups_without_embedding_group(groups: Any) -> Any:
    """A copy of a schedule's process groups whose embedding group is this rank alone, for
    ``finalize_model_grads`` of a model whose tied embedding copies sit on one rank."""
    import copy

    stripped = copy.copy(groups)
    stripped.embd = _OneRankGroup()
    return stripped


# --- deferred weight gradients (runtime.deferred_wgrad) ---------------------------------------
# megatron-core's local linear layers (``ColumnParallelLinear``, ``RowParallelLinear``) run their
# GEMMs through ``LinearWithGradAccumulationAndAsyncCommunication``. Its forward, and the context
# fields its backward reads (saved input and weight, ``main_grad``, ``use_bias``,
# ``gradient_accumulation_fusion``, ``allreduce_dgrad``, ``sequence_parallel``, ``tp_group``),
# are the same in 0.16.1, 0.19.2 and 0.20.0; its argument list is not (0.16 wraps a deprecated
# ``async_grad_allreduce``, 0.19 adds ``gtp_remat_size``), so the arguments are built by name.


def transformer_engine_layers(module: Any) -> list[Any]:
    """The Transformer Engine layers megatron-core built into ``module`` (its
    ``megatron.core.extensions.transformer_engine`` wrappers), which keep their own weight GEMMs
    in the backward."""
    prefix = "megatron.core.extensions.transformer_engine"
    return [
        m
        for m in module.modules()
        if type(m).__module__.startswith(prefix) and getattr(m, "weight", None) is not None
    ]


def local_linear_layers(module: Any) -> list[Any]:
    """megatron-core's own tensor-parallel linear layers in ``module`` (not Transformer
    Engine's, which have their own delayed weight-gradient mechanism)."""
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
    """The arguments megatron-core's ``linear_with_grad_accumulation_and_async_allreduce``
    would hand its autograd Function for this call of a layer's ``_forward_impl``, in the
    Function's order (defaults filled in, the tensor-parallel group resolved)."""
    from megatron.core.tensor_parallel.layers import get_tensor_model_parallel_group_if_none

    names, wrapper = _linear_parameter_names()
    bound = wrapper.bind(input, weight, *args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    if values.get("async_grad_allreduce") is not None:  # 0.16's deprecated spelling
        values["allreduce_dgrad"] = values["async_grad_allreduce"]
    values["tp_group"] = get_tensor_model_parallel_group_if_none(values.get("tp_group"))
    return tuple(values[name] for name in names)


def megatron_linear_forward(ctx: Any, *args: Any) -> Any:
    """megatron-core's own linear forward on ``ctx``: the same output and saved state as
    ``linear_with_grad_accumulation_and_async_allreduce``, for a Function whose backward
    differs only in when the weight gradient is computed."""
    from megatron.core.tensor_parallel.layers import (
        LinearWithGradAccumulationAndAsyncCommunication,
    )

    return LinearWithGradAccumulationAndAsyncCommunication.forward(ctx, *args)


def linear_function_option(args: tuple[Any, ...], name: str, default: Any = None) -> Any:
    """One named argument of a ``linear_function_args`` tuple (``default`` if this version
    has no such argument, e.g. ``gtp_remat_size`` before 0.19)."""
    names, _ = _linear_parameter_names()
    return args[names.index(name)] if name in names else default


def wgrad_operands(grad_output: Any, total_input: Any) -> tuple[Any, Any]:
    """megatron-core's 2-D, contiguous operands of a weight-gradient GEMM."""
    from megatron.core.tensor_parallel.layers import prepare_input_tensors_for_wgrad_compute

    return prepare_input_tensors_for_wgrad_compute(grad_output, total_input)  # type: ignore[no-any-return]


def accumulate_wgrad_fused(total_input: Any, grad_output: Any, main_grad: Any) -> None:
    """Gradient-accumulation fusion: add the weight gradient into ``main_grad`` with the CUDA
    kernel megatron-core's linear backward uses (GPU only, like that option)."""
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
