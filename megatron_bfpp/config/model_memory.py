"""How much memory a ``bfpp-train`` model's weights, gradients and Adam state take per rank, from
its flags alone (4 + 4 + 8 / dp bytes per parameter held; 2 + 4 + 12 / dp with --bf16's fp32 main
weights, docs/train.md): a floor, activations come
on top, so a run it refuses cannot fit. On CPU this machine's ranks are checked against its RAM; on
GPUs each rank against its device, in the rank (CUDA must not start in the launcher that forks)."""

from __future__ import annotations

import contextlib
import dataclasses
import os

from megatron_bfpp.config.run_config import Layout, ModelShape
from megatron_bfpp.ir import Placement
from megatron_bfpp.schedules.registry import _gigabytes

__all__ = [
    "MemoryEstimate",
    "available_ram_bytes",
    "estimate",
    "expert_parameters",
    "layer_parameters",
    "memory_problem",
    "parameters_per_pipeline_rank",
    "parameters_per_stage",
]

WEIGHT_BYTES = 4  # fp32 weights (params_dtype float32); bf16: 2
GRAD_BYTES = 4  # megatron-core DDP's fp32 gradient buffer
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32, sharded over dp by the distributed optimizer
MAIN_BYTES = 4  # bf16: the optimizer's fp32 main weights, sharded as Adam's state


def _split(size: int, tp: int) -> int:
    """A tensor-parallel slice (megatron-core requires even splits; round up, never under)."""
    return -(-size // tp)


def layer_parameters(shape: ModelShape, *, tp: int, ep: int = 1) -> int:
    """One transformer layer on one tensor-parallel rank (megatron-core's local layer spec): QKV and
    FC1 split by output, projection and FC2 by input; biases (GPT only, none with experts) and
    norms whole. With experts: the router (experts x h, whole) and experts / ep local experts."""
    h, heads = shape.hidden_size, shape.num_attention_heads
    kv = h // heads * (shape.num_query_groups or heads)
    llama, experts = shape.preset == "llama", shape.num_experts or 0
    attention = _split(h * (h + 2 * kv), tp) + _split(h * h, tp)
    attention += 0 if llama or experts else _split(h + 2 * kv, tp) + h
    norms = 2 * (h if llama else 2 * h)
    if not experts:
        return attention + _mlp(shape, shape.ffn, tp=tp) + norms
    return attention + h * experts + expert_parameters(shape, tp=tp, ep=ep) + norms


def expert_parameters(shape: ModelShape, *, tp: int, ep: int) -> int:
    """One MoE layer's experts on one rank (experts / ep, each split over tp): the parameters the
    distributed optimizer shards over the expert data-parallel group (dp / ep), not dp."""
    return (shape.num_experts or 0) // ep * _mlp(shape, shape.moe_ffn, tp=tp)


def _mlp(shape: ModelShape, ffn: int, *, tp: int) -> int:
    """An MLP of FFN size ``ffn`` on one tensor-parallel rank (biases: GPT without experts)."""
    h, llama = shape.hidden_size, shape.preset == "llama"
    fc1 = (2 if llama else 1) * ffn
    biases = 0 if llama or shape.num_experts else _split(fc1, tp) + h
    return _split(h * fc1, tp) + _split(ffn * h, tp) + biases


def parameters_per_pipeline_rank(shape: ModelShape, layout: Layout) -> list[int]:
    """Parameters of one tensor-parallel rank at each pipeline rank: its stages' layers (even:
    ``num_layers / pp``), the first stage's ends on rank 0, the last stage's on ``pp - 1``
    looped, 0 V-shape."""
    layers, last = _layers_per_rank(shape, layout)
    return _spread(shape, layout, layers, last=last)


def _layers_per_rank(shape: ModelShape, layout: Layout) -> tuple[list[int], int]:
    """Each pipeline rank's transformer layers, and the rank holding the last stage."""
    pp, v_shape = layout.pipeline_model_parallel_size, layout.placement is Placement.V_SHAPE
    if not layout.uneven_config():
        return [shape.num_layers // pp] * pp, 0 if v_shape else pp - 1
    per_stage = layout.layers_per_stage(shape.num_layers)
    ranks = [min(s, 2 * pp - 1 - s) if v_shape else s % pp for s in range(len(per_stage))]
    layers = [
        sum(n for n, r in zip(per_stage, ranks, strict=True) if r == rank) for rank in range(pp)
    ]
    return layers, ranks[-1]


def parameters_per_stage(shape: ModelShape, layout: Layout) -> list[int]:
    """The same per global (virtual) stage: a fully sharded chunk is gathered and released whole,
    so the planner weighs the chunks a schedule holds at once by these."""
    layers = layout.layers_per_stage(shape.num_layers)
    return _spread(shape, layout, layers, last=len(layers) - 1)


def _spread(shape: ModelShape, layout: Layout, layers: list[int], *, last: int) -> list[int]:
    """Each part's ``layers``, the word embedding (and GPT's positions) on part 0, the final norm
    and output layer on part ``last`` (GPT's tied one: a copy unless first and last stage are
    one chunk; megatron-core syncs it over the embedding group)."""
    h, tp = shape.hidden_size, layout.tensor_model_parallel_size
    llama = shape.preset == "llama"
    layer = layer_parameters(shape, tp=tp, ep=layout.expert_model_parallel_size)
    counts = [n * layer for n in layers]
    embedding = _split(shape.vocab_size * h, tp)
    stages = layout.pipeline_model_parallel_size * layout.num_virtual_stages_per_pipeline_rank
    output = embedding if llama or stages > 1 else 0  # a tied one is shared in one chunk only
    counts[0] += embedding + (0 if llama else shape.seq_length * h)
    counts[last] += (h if llama else 2 * h) + output
    return counts


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Weight, gradient and Adam state bytes: on the largest rank; summed on ``local_ranks``."""

    largest_rank_bytes: int
    largest_rank_parameters: int
    bytes_per_parameter: float
    local_ranks: int
    local_bytes: int


def estimate(
    shape: ModelShape, layout: Layout, *, local_ranks: int, bf16: bool = False
) -> MemoryEstimate:
    """For ``local_ranks`` ranks on one machine: all of the job's (bfpp-train's launcher: exact,
    each pipeline rank once per tp and dp rank) or some (torchrun, srun: each as the largest)."""
    dp, ep = layout.data_parallel_size, layout.expert_model_parallel_size
    state = ADAM_BYTES + MAIN_BYTES * bf16  # per parameter, sharded by the optimizer
    per_parameter = WEIGHT_BYTES // (1 + bf16) + GRAD_BYTES + state / dp
    counts = parameters_per_pipeline_rank(shape, layout)
    # experts' optimizer state is sharded over dp / ep ranks, not dp
    experts = expert_parameters(shape, tp=layout.tensor_model_parallel_size, ep=ep)
    extra = state * (ep / dp - 1 / dp) * experts
    layers, _ = _layers_per_rank(shape, layout)
    per_rank = [int(c * per_parameter + n * extra) for c, n in zip(counts, layers, strict=True)]
    replicas = layout.tensor_model_parallel_size * dp
    if local_ranks >= layout.world_size:
        local = sum(per_rank) * replicas
    else:
        local = max(per_rank) * local_ranks
    return MemoryEstimate(
        largest_rank_bytes=max(per_rank),
        largest_rank_parameters=max(counts),
        bytes_per_parameter=per_parameter,
        local_ranks=local_ranks,
        local_bytes=local,
    )


def available_ram_bytes() -> int | None:
    """Memory the kernel can give new work now (Linux ``MemAvailable``, else free pages) or None."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def memory_problem(
    shape: ModelShape,
    layout: Layout,
    *,
    local_ranks: int,
    gpu_bytes: int | None = None,
    ram_bytes: int | None = None,
    bf16: bool = False,
) -> str | None:
    """The line refusing a model that cannot fit: its largest rank against one GPU's ``gpu_bytes``,
    or its ``local_ranks`` together against ``ram_bytes``; None if it fits or nothing is known."""
    need = estimate(shape, layout, local_ranks=local_ranks, bf16=bf16)
    largest = (
        f"{need.largest_rank_parameters:,} parameters x {need.bytes_per_parameter:g} bytes on "
        "the largest rank"
    )
    if gpu_bytes is not None and need.largest_rank_bytes > gpu_bytes:
        what = (
            f"the largest rank needs about {_gigabytes(need.largest_rank_bytes)} for weights, "
            f"gradients and Adam state ({largest}), more than one GPU's {_gigabytes(gpu_bytes)}"
        )
    elif gpu_bytes is None and ram_bytes is not None and need.local_bytes > ram_bytes:
        plural = "s" if local_ranks > 1 else ""
        what = (
            f"the model needs about {_gigabytes(need.local_bytes)} of RAM for weights, gradients "
            f"and Adam state on this machine's {local_ranks} rank{plural} ({largest}), more than "
            f"the {_gigabytes(ram_bytes)} available"
        )
    else:
        return None
    return (
        f"{what}; use more ranks (tensor or pipeline parallel) or a smaller model, or "
        "--no-memory-check if the estimate is wrong"
    )
