"""``bfpp-plan profile``: time one pipeline stage of a megatron-core GPT / LLaMA here, so
``recommend --profile`` plans with a measured stage, not the built-in curve: seconds per micro-batch
of its forward, backward (B), split backward as the runtime runs it (I, W) and ``t_host``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_bfpp.compat import megatron_core_version
from megatron_bfpp.files import write_output
from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.plan.presets import Model
from megatron_bfpp.plan.profile import Measurement, StageProfile, profile_from_dict, profile_to_dict
from megatron_bfpp.runtime import deferred_wgrad

__all__ = [
    "StoredActivations",
    "measure_host_time",
    "measure_stage",
    "measure_stored_activations",
    "write_profile",
]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def measure_stage(
    *,
    model: Model,
    num_layers: int,
    micro_batch_sizes: Sequence[int],
    device: str = "auto",
    dtype: str | None = None,
    warmup: int = 2,
    iterations: int = 5,
) -> StageProfile:
    """Time ``num_layers`` layers of ``model`` per micro-batch size (median of ``iterations``)."""
    target, chosen = _device_and_dtype(device, dtype)
    if num_layers > model.num_layers:
        raise ScheduleError(
            f"--profile-layers {num_layers} is more than the model's {model.num_layers} layers"
        )
    if target.type == "cpu":
        _warm_allocator()
    with warnings.catch_warnings(), _single_rank(target):
        warnings.simplefilter("ignore")  # megatron-core's notes on missing GPU-only extras
        block = _build_block(model, num_layers, target, _DTYPES[chosen])
        rows = [_measure(block, model, b, warmup, iterations) for b in micro_batch_sizes]
        smallest = min(micro_batch_sizes)
        host = measure_host_time(
            block, model, micro_batch_size=smallest, warmup=warmup, iterations=iterations
        )
        del block
        ends = _EndStages(model, target, _DTYPES[chosen])
        for i, row in enumerate(rows):
            embedding, output = ends.measure(row.micro_batch_size, warmup, iterations)
            rows[i] = dataclasses.replace(row, embedding_s=embedding, output_s=output)
    name = torch.cuda.get_device_name(target) if target.type == "cuda" else _cpu_name()
    return StageProfile(
        device=name,
        device_type=target.type,
        model=model,
        num_layers=num_layers,
        tensor_parallel=1,
        dtype=chosen,
        measurements=tuple(rows),
        torch_version=torch.__version__,
        megatron_core_version=".".join(map(str, megatron_core_version())),
        t_host=host,
    )


HOST_MICROBATCHES = 4  # per calibration step: 8 compute actions


def measure_host_time(
    block: torch.nn.Module,
    model: Model,
    *,
    micro_batch_size: int = 1,
    warmup: int = 2,
    iterations: int = 5,
) -> float:
    """Seconds per compute action our runtime spends beyond the kernels: a one-rank 1F1B step of
    ``HOST_MICROBATCHES`` through ``get_forward_backward_func`` less the same computes called
    bare, per compute action (median of ``iterations`` after ``warmup``; 0 when hidden)."""
    from megatron.core import parallel_state

    from megatron_bfpp.runtime.api import get_forward_backward_func

    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ScheduleError(
            "measure_host_time times a one-rank pipeline: call it outside a pipeline-parallel job"
        )
    device, dtype = next(block.parameters()).device, next(block.parameters()).dtype
    chunk = _Chunk(block, _rotary(block, model, device))
    step = get_forward_backward_func("1f1b")
    shape, m = (model.seq_length, micro_batch_size, model.hidden_size), HOST_MICROBATCHES

    def bare(inputs: list[torch.Tensor]) -> None:
        for x in inputs:
            torch.autograd.backward(chunk(x).float().mean())

    def runtime(inputs: list[torch.Tensor]) -> None:
        step(
            forward_step_func=_host_forward_step,
            data_iterator=iter(inputs),
            model=[chunk],
            num_microbatches=m,
            seq_length=model.seq_length,
            micro_batch_size=micro_batch_size,
        )

    extra = []
    for index in range(warmup + iterations):
        inputs = [torch.randn(shape, device=device, dtype=dtype) for _ in range(m)]
        seconds = {}
        for work in (bare, runtime) if index % 2 else (runtime, bare):  # neither always first
            for p in block.parameters():  # each creates the gradients alike: none accumulated
                p.grad = None
            seconds[work] = _timed(device, functools.partial(work, inputs))
        if index >= warmup:
            extra.append((seconds[runtime] - seconds[bare]) / (2 * m))
    return max(0.0, statistics.median(extra))


class _Chunk(torch.nn.Module):
    """The profiled layers as a megatron-core model chunk (config, model_type, set_input_tensor)."""

    def __init__(self, block: torch.nn.Module, rotary: Any) -> None:
        from megatron.core.enums import ModelType

        super().__init__()
        self.block, self.rotary = block, rotary
        self.config = block.config
        self.model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, tensors: Any) -> None:
        """A one-rank pipeline's only stage takes its input from the data."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.block(hidden, attention_mask=None, rotary_pos_emb=self.rotary)
        return output


def _host_forward_step(data_iterator: Any, model: torch.nn.Module) -> Any:
    """The bare calls as a megatron-core forward step: the chunk, then its output's mean as loss."""
    output = model(next(data_iterator))

    def loss(out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        value = out.float().mean()
        return value, {"loss": value.detach()}

    return output, loss


def write_profile(profile: StageProfile, path: str | Path) -> None:
    """Write the JSON profile atomically, after reading it back as ``recommend --profile`` will,
    so that a measurement it would refuse fails now rather than later."""
    data = profile_to_dict(profile)
    try:
        profile_from_dict(data)
    except ScheduleError as error:
        raise ScheduleError(
            f"{error} (measured here; rerun with more --iterations on a quieter device)"
        ) from None
    write_output(path, (json.dumps(data, indent=2) + "\n").encode())


def _device_and_dtype(device: str, dtype: str | None) -> tuple[torch.device, str]:
    """The device and dtype: bf16 on a GPU unless told, fp32 on CPU (megatron-core's CPU dtype)."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ScheduleError("--device cuda: no CUDA device is available here")
        target = torch.device("cuda", torch.cuda.current_device())
    else:
        target = torch.device("cpu")
    chosen = dtype or ("bf16" if target.type == "cuda" else "fp32")
    if chosen not in _DTYPES:
        raise ScheduleError(f"dtype must be one of {', '.join(_DTYPES)}, got {chosen!r}")
    if target.type == "cpu" and chosen != "fp32":
        raise ScheduleError(f"--dtype {chosen} on CPU: megatron-core's CPU path is fp32 only")
    return target, chosen


def _warm_allocator() -> None:
    """Free one large block first, as a training process has long done: glibc's malloc serves
    large tensors by fresh mmaps, page faults each, until a freed one raises its threshold, which
    made a fresh process's first profile time a layer's backward 15% slower (49 against 43 ms,
    scripts/check_stage_costs.py's LLaMA); 30 MiB is under glibc's 32 MiB cap on that threshold."""
    block = torch.ones(30 << 20, dtype=torch.uint8)
    del block


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()}"
    return "CPU"


@contextlib.contextmanager
def _single_rank(device: torch.device) -> Iterator[None]:
    """A one-rank group and megatron-core parallel state (tp = pp = 1) unless present; torn down."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_bfpp.megatron import cpu

    cpu_redirects = device.type == "cpu" and not cpu.is_cpu_megatron_enabled()
    if cpu_redirects:
        cpu.enable_cpu_megatron()
    owned = not dist.is_initialized()
    if owned:
        from torch.distributed import HashStore  # type: ignore[attr-defined]

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=HashStore(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    mrandom.model_parallel_cuda_manual_seed(0)
    try:
        yield
    finally:
        if owned:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        if cpu_redirects:
            cpu.disable_cpu_megatron()


def _build_block(
    model: Model, num_layers: int, device: torch.device, dtype: torch.dtype, recompute: str = "none"
) -> torch.nn.Module:
    from megatron.core.transformer.transformer_block import TransformerBlock

    config, spec = _config_and_spec(model, num_layers, device, dtype, recompute)
    block: torch.nn.Module = TransformerBlock(config, spec=spec, post_layer_norm=False)
    return block.to(device=device, dtype=dtype)


def _config_and_spec(
    model: Model, num_layers: int, device: torch.device, dtype: torch.dtype, recompute: str = "none"
) -> tuple[Any, Any]:
    """The ``TransformerConfig`` and layer spec bfpp-train builds ``model`` with, initialised."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_bfpp.train.presets import transformer_config

    shape = dataclasses.replace(model.shape(tp=1), num_layers=num_layers)
    config = transformer_config(shape, tp=1, pp=1, vp=None, on_cpu=device.type == "cpu")
    config = dataclasses.replace(
        config,
        perform_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        hidden_dropout=0.1 if model.dropout else 0.0,
        attention_dropout=0.1 if model.dropout else 0.0,
        use_cpu_initialization=dtype == torch.float32,
        **_RECOMPUTE_FIELDS[recompute],
    )
    llama = model.arch == "llama"
    return config, get_gpt_layer_local_spec(normalization="RMSNorm" if llama else "LayerNorm")


class _EndStages:
    """The first stage's word embedding and the last stage's final norm, output layer and loss,
    taken from a one-layer ``GPTModel`` that holds both, so that they are megatron-core's own
    modules, built as bfpp-train and Megatron-LM build them (tied weights on GPT, rope on LLaMA).
    """

    def __init__(self, model: Model, device: torch.device, dtype: torch.dtype) -> None:
        from megatron.core.models.gpt import GPTModel

        config, spec = _config_and_spec(model, 1, device, dtype)
        llama = model.arch == "llama"
        self.model, self.device, self.dtype = model, device, dtype
        self.vocab = model.shape(tp=1).vocab_size
        self.gpt: Any = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=self.vocab,
            max_sequence_length=model.seq_length,
            pre_process=True,
            post_process=True,
            share_embeddings_and_output_weights=not llama,
            position_embedding_type="rope" if llama else "learned_absolute",
        ).to(device=device, dtype=dtype)

    def measure(self, micro_batch_size: int, warmup: int, iterations: int) -> tuple[float, float]:
        """Median seconds of each end's forward and backward at ``micro_batch_size``."""
        gpt, device, s = self.gpt, self.device, self.model.seq_length
        tokens = torch.randint(0, self.vocab, (micro_batch_size, s), device=device)
        positions = torch.arange(s, device=device).expand(micro_batch_size, s)
        share = gpt.share_embeddings_and_output_weights
        tied = gpt.shared_embedding_or_output_weight() if share else None
        shape = (s, micro_batch_size, self.model.hidden_size)

        def embedding() -> None:
            out = gpt.embedding(input_ids=tokens, position_ids=positions)
            torch.autograd.backward(out, torch.ones_like(out))

        def output() -> None:
            hidden = torch.randn(shape, device=device, dtype=self.dtype, requires_grad=True)
            logits, _ = gpt.output_layer(gpt.decoder.final_layernorm(hidden), weight=tied)
            loss = gpt.compute_language_model_loss(tokens, logits)
            torch.autograd.backward(loss.float().mean())

        times: list[tuple[float, float]] = []
        for step in range(warmup + iterations):
            for p in gpt.parameters():  # each end creates its gradients, as a step's first does
                p.grad = None
            pair = (_timed(device, embedding), _timed(device, output))
            if step >= warmup:
                times.append(pair)
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


# plan.memory.RECOMPUTE's names in megatron-core: selective reruns core attention, full each layer
_RECOMPUTE_FIELDS: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
}


@dataclasses.dataclass(frozen=True, slots=True)
class StoredActivations:
    """Bytes over ``weights`` a stage holds with k = 1..K micro-batches stored (``stored[k-1]``:
    the allocator's, on CPU autograd's distinct storages); ``peak``: backwards too (CUDA only)."""

    model: str
    recompute: str
    dtype: str
    num_layers: int
    micro_batch_size: int
    weights: int
    stored: tuple[int, ...]
    peak: int | None

    @property
    def per_microbatch(self) -> float:
        """Slope of stored bytes over k: a micro-batch's activations, not one-off leftovers."""
        k = len(self.stored)
        return float(self.stored[0]) if k == 1 else (self.stored[-1] - self.stored[0]) / (k - 1)


def measure_stored_activations(
    *,
    model: Model,
    num_layers: int,
    stored: int,
    micro_batch_size: int = 1,
    recompute: str = "none",
    device: str = "auto",
    dtype: str | None = None,
) -> StoredActivations:
    """Run ``stored`` forwards back to back, keeping each graph as a pipeline stage does (its
    output's data freed), count the bytes held after each, then run the backwards."""
    if recompute not in _RECOMPUTE_FIELDS:
        raise ScheduleError(
            f"recompute must be one of {', '.join(_RECOMPUTE_FIELDS)}, got {recompute!r}"
        )
    if stored < 1:
        raise ScheduleError(f"stored micro-batches must be >= 1, got {stored}")
    target, chosen = _device_and_dtype(device, dtype)
    torch_dtype = _DTYPES[chosen]
    from megatron.core.pipeline_parallel.schedules import custom_backward

    shape = (model.seq_length, micro_batch_size, model.hidden_size)
    cuda = target.type == "cuda"
    saved = _SavedStorages()
    held: list[int] = []
    graphs: list[tuple[torch.Tensor, torch.Tensor]] = []
    peak = None
    with warnings.catch_warnings(), _single_rank(target):
        warnings.simplefilter("ignore")
        block = _build_block(model, num_layers, target, torch_dtype, recompute)
        block.train()
        rotary = _rotary(block, model, target)
        if cuda:
            torch.cuda.synchronize(target)
            torch.cuda.empty_cache()
            weights = torch.cuda.memory_allocated(target)
            torch.cuda.reset_peak_memory_stats(target)
        else:
            weights = sum(p.numel() * p.element_size() for p in block.parameters())
        for _ in range(stored):
            hidden = torch.randn(shape, device=target, dtype=torch_dtype, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                out = block(hidden, attention_mask=None, rotary_pos_emb=rotary)
            # megatron-core frees a sent output's data, keeps its graph (deallocate_output_tensor)
            out.data = torch.empty((1,), device=target, dtype=out.dtype)
            graphs.append((hidden, out))
            if cuda:
                torch.cuda.synchronize(target)
                held.append(torch.cuda.memory_allocated(target) - weights)
            else:
                held.append(saved.live_bytes(extra=[h for h, _ in graphs]))
        while graphs:
            hidden, out = graphs.pop(0)
            custom_backward(out, torch.ones(shape, device=target, dtype=torch_dtype))
            del hidden, out
        if cuda:
            torch.cuda.synchronize(target)
            peak = torch.cuda.max_memory_allocated(target) - weights
    return StoredActivations(
        model=model.name,
        recompute=recompute,
        dtype=chosen,
        num_layers=num_layers,
        micro_batch_size=micro_batch_size,
        weights=weights,
        stored=tuple(held),
        peak=peak,
    )


class _SavedStorages:
    """The distinct storages autograd saved, by data pointer, and whether alive (allocator-free)."""

    def __init__(self) -> None:
        self._refs: dict[int, tuple[Any, int]] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter):
            self._add(tensor)
        return tensor

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        known = self._refs.get(key)
        if storage.nbytes() > 0 and (known is None or known[0]() is None):
            self._refs[key] = (weakref.ref(tensor), storage.nbytes())

    def live_bytes(self, *, extra: Sequence[torch.Tensor] = ()) -> int:
        """Bytes of live saved storages and ``extra`` (inputs kept for input grads), once each."""
        for tensor in extra:
            self._add(tensor)
        return sum(size for ref, size in self._refs.values() if ref() is not None)


def _measure(
    block: torch.nn.Module, model: Model, micro_batch_size: int, warmup: int, iterations: int
) -> Measurement:
    device, dtype = next(block.parameters()).device, next(block.parameters()).dtype
    shape = (model.seq_length, micro_batch_size, model.hidden_size)
    rotary = _rotary(block, model, device)
    parameters = [p for p in block.parameters() if p.requires_grad]

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        return hidden, block(hidden, attention_mask=None, rotary_pos_emb=rotary)

    deferred_wgrad.install([block])
    key = (0, 0)

    def split_backward() -> tuple[float, float]:
        """(I, W) seconds, through the code the V-shape schedules run."""
        store = deferred_wgrad.WeightGradStore()
        with deferred_wgrad.deferring(store):
            _, out = forward()
            grad = torch.ones_like(out)
            with store.collect(key):
                backward_input = _timed(device, lambda: torch.autograd.backward(out, grad))
            if not store.pending[key]:
                raise RuntimeError("profile: no weight GEMM was deferred; please report this bug")
            return backward_input, _timed(device, lambda: store.run(key))

    times: list[tuple[float, float, float, float]] = []  # F, B, I, W
    for step in range(warmup + iterations):
        hidden = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        f = _timed(
            device, functools.partial(block, hidden, attention_mask=None, rotary_pos_emb=rotary)
        )
        _, out = forward()
        b = _timed(device, functools.partial(torch.autograd.backward, out, torch.ones_like(out)))
        del out  # B's graph and output freed before I and W, as when B had its own frame
        for p in parameters:  # W then creates the gradients, as B did: no accumulation timed
            p.grad = None
        i, w = split_backward()
        for p in parameters:
            p.grad = None
        if step >= warmup:
            times.append((f, b, i, w))
    medians = [statistics.median([row[k] for row in times]) for k in range(4)]  # empty: raises
    return Measurement(micro_batch_size, *medians)  # its fields after the size: F, B, I, W


def _rotary(block: torch.nn.Module, model: Model, device: torch.device) -> Any:
    if model.arch != "llama":
        return None
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    config: Any = block.config
    rope = RotaryEmbedding(
        kv_channels=config.kv_channels, rotary_percent=1.0, use_cpu_initialization=True
    )
    return rope(model.seq_length).to(device)


def _timed(device: torch.device, work: Callable[[], Any]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
