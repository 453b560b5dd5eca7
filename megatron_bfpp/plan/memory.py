"""What one GPU holds: weights, gradients, optimizer state, and stored activations.

Activations: per tensor autograd keeps in megatron-core's layer (Korthikanti et al., MLSys 2023,
section 4; docs/planner.md), walked over the schedule, as end stages store more at other times."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache, partial

from megatron_bfpp.config.model_memory import (
    layer_parameters,
    parameters_per_pipeline_rank,
    parameters_per_stage,
)
from megatron_bfpp.config.run_config import Layout, layout_of
from megatron_bfpp.ir import (
    MEMORY_DELTA,
    Action,
    ActionKind,
    Placement,
    Schedule,
    ScheduleError,
    StageLayout,
    parts,
)
from megatron_bfpp.plan.presets import Model, Precision, moe_layers_per_stage

__all__ = [
    "RECOMPUTE",
    "MemoryBreakdown",
    "PeakPoints",
    "StageBytes",
    "full_buffer_peaks",
    "layer_activation_bytes",
    "moe_layer_parameters",
    "moe_layers_per_rank",
    "mtp_parameters",
    "peak_activation_bytes",
    "peak_points",
    "rank_parameters",
    "stage_activation_bytes",
    "stage_parameters",
    "weights_bytes",
]

RECOMPUTE = ("none", "selective", "full")
MASK_BYTES = 1  # a dropout mask is one byte per element (torch.bool)
STAT_BYTES = 4  # LayerNorm / RMSNorm keep fp32 statistics per token
INDEX_BYTES = 8  # int64 token / position / target indices
SOFTMAX_BYTES = 4  # attention_softmax_in_fp32 keeps the softmax output in fp32
# per routed copy of a token: three int64 routing indices and two fp32 probabilities (the
# router's top-k and the experts' weighting), measured on megatron-core's local MoE layer
ROUTED_COPY_BYTES = 40


def layer_activation_bytes(
    model: Model,
    *,
    micro_batch_size: int,
    tp: int,
    sequence_parallel: bool,
    recompute: str,
    precision: Precision,
    softmax_in_fp32: bool = True,
    moe: bool = False,
) -> int:
    """Bytes one layer keeps for the backward of one micro-batch on one tensor-parallel rank,
    as megatron-core's local layers keep them (docs/planner.md, "Memory"). ``selective``
    recomputes core attention (drops the scores and the mask); ``full`` keeps only the input."""
    if recompute not in RECOMPUTE:
        raise ScheduleError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    s, b, h, a = model.seq_length, micro_batch_size, model.hidden_size, model.num_attention_heads
    f, e = model.ffn_hidden_size, precision.activation_bytes
    tokens, replicated_divisor = s * b, tp if sequence_parallel else 1
    if recompute == "full":
        return tokens * h * e // replicated_divisor
    rotary = model.arch == "llama"
    norm_stats = 2 * (1 if rotary else 2) * STAT_BYTES
    replicated = tokens * (4 * h * e + norm_stats)
    if model.dropout:
        replicated += tokens * 2 * h * MASK_BYTES
    qkv = 5 * h if rotary and model.num_query_groups == a else 3 * h
    per = 5 if model.arch == "llama" else 2
    mlp = per * f * e
    if moe:  # per token: top-k dispatched copies, each expert's MLP tensors and the activation
        # weighted by its probability (one more f), and the shared expert's
        copy = (h + (per + 1) * model.moe_ffn_hidden_size) * e + ROUTED_COPY_BYTES
        shared = per * model.moe_shared_expert_intermediate_size * e
        mlp = model.moe_router_topk * copy + shared
    split = tokens * ((qkv + h) * e + mlp)
    per_microbatch = 4 * s * (h // a) * e if rotary else 0
    if recompute == "none":
        softmax = SOFTMAX_BYTES if softmax_in_fp32 else e
        probabilities = e if model.dropout or softmax != e else 0
        per_score = softmax + probabilities + (MASK_BYTES if model.dropout else 0)
        split += tokens * a * s * per_score
        per_microbatch += s * s * MASK_BYTES
    return replicated // replicated_divisor + split // tp + per_microbatch


@dataclass(frozen=True, slots=True)
class StageBytes:
    """One micro-batch's activation bytes at a stage: ``layers`` for its layers, ``first`` /
    ``last`` extra on the first stage (embedding inputs) and the last (norm, output layer, loss)."""

    layers: int
    first: int
    last: int


def stage_activation_bytes(
    model: Model,
    *,
    micro_batch_size: int,
    tp: int,
    layers_per_stage: int,
    vocab_size: int,
    sequence_parallel: bool,
    recompute: str,
    precision: Precision,
) -> StageBytes:
    """``StageBytes`` for stages of ``layers_per_stage`` layers; ``vocab_size`` as padded."""
    tokens = model.seq_length * micro_batch_size
    h, e = model.hidden_size, precision.activation_bytes
    per_layer = partial(
        layer_activation_bytes, model, micro_batch_size=micro_batch_size, tp=tp,
        sequence_parallel=sequence_parallel, recompute=recompute, precision=precision,
    )  # fmt: skip
    stages = model.num_layers // layers_per_stage
    moe = max(moe_layers_per_stage(model, stages), default=0) if model.num_experts else 0
    sparse = per_layer(moe=True) if moe else 0  # the stage with the most MoE layers
    hidden_divisor = tp if sequence_parallel else 1
    first = tokens * INDEX_BYTES * (1 if model.arch == "llama" else 2)
    if model.dropout:
        first += tokens * h * MASK_BYTES // hidden_divisor
    norm_stats = (1 if model.arch == "llama" else 2) * STAT_BYTES
    last = tokens * (2 * h * e // hidden_divisor + norm_stats)
    last += tokens * vocab_size // tp * 4 + tokens * (1 + INDEX_BYTES)
    if model.mtp_num_layers:  # each: its embedding lookup and two input norms, the 2h concat
        # into eh_proj, a layer of the last kind, and what the main output and loss keep
        kind = per_layer(moe=model.moe_layers[-1])
        mtp = kind + last + 5 * tokens * h * e // hidden_divisor
        last += model.mtp_num_layers * mtp
    layers = per_layer() * (layers_per_stage - moe) + sparse * moe
    return StageBytes(layers=layers, first=first, last=last)


@dataclass(frozen=True, slots=True)
class PeakPoints:
    """Per rank, the Pareto-maximal (stored stage-micro-batches, of which on the first stage, of
    which on the last) where its peak can lie: one schedule walk serves all ``StageBytes``."""

    per_rank: tuple[tuple[tuple[int, int, int], ...], ...]


def peak_points(schedule: Schedule, stage_layers: Sequence[int] = ()) -> PeakPoints:
    """Walk each rank's program once (``ir.MEMORY_DELTA``: F stores, B / W free, BPipe's
    transfers move micro-batches between ranks; an overlapped pair's parts in order). With
    ``stage_layers`` (uneven stages) the first count is of stored layer-micro-batches, each
    stage's weighing its layers: ``StageBytes.layers`` is then one layer's."""
    last_stage = schedule.num_stages - 1
    weights = tuple(stage_layers) or (1,) * schedule.num_stages
    return PeakPoints(
        tuple(
            tuple(_pareto(_rank_points(actions, last_stage, weights)))
            for actions in schedule.per_rank
        )
    )


_OVERLAP = ActionKind.OVERLAP_F_B


def _rank_points(
    actions: Sequence[Action], last_stage: int, weights: Sequence[int]
) -> set[tuple[int, int, int]]:
    """One rank's counts where a run of stores ends (before a free, or at the end): the run's last
    dominates every count within it, so the Pareto front is the same from far fewer tuples."""
    held = first = last = 0
    rising = False
    points: set[tuple[int, int, int]] = set()
    delta_of = MEMORY_DELTA.get
    for action in actions:
        kind = action.kind
        if kind is _OVERLAP:  # rarely: walk again with each overlapped pair's parts in order
            return _rank_points([part for a in actions for part in parts(a)], last_stage, weights)
        delta = delta_of(kind, 0)
        if not delta:
            continue
        if delta < 0:
            if rising:
                points.add((held, first, last))
                rising = False
        else:
            rising = True
        stage = action.stage
        held += delta * weights[stage]
        if stage == 0:
            first += delta
        if stage == last_stage:
            last += delta
    if rising:
        points.add((held, first, last))
    return points


def _pareto(points: set[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The points no other point is at least as large as in all three counts, largest first
    (a point is dominated exactly when an earlier kept one has as many first and last)."""
    kept: list[tuple[int, int, int]] = []
    fronts: list[tuple[int, int]] = []  # the kept points' (first, last)
    for point in sorted(points, reverse=True):
        _, first, last = point
        if not any(kept_first >= first and kept_last >= last for kept_first, kept_last in fronts):
            kept.append(point)
            fronts.append((first, last))
    return kept


def peak_activation_bytes(points: PeakPoints, stage: StageBytes) -> tuple[int, ...]:
    """Each rank's peak stored activation bytes."""
    return tuple(
        max((n * stage.layers + f * stage.first + la * stage.last for n, f, la in rank), default=0)
        for rank in points.per_rank
    )


def rank_parameters(
    model: Model,
    *,
    tp: int,
    pp: int,
    chunks: int,
    placement: Placement,
    ep: int = 1,
    stage_layers: Sequence[int] = (),
) -> list[int]:
    """Per pipeline rank, one tensor-parallel rank's parameters, MoE layers included (uneven
    stages: ``stage_layers`` per global stage): the dense shape's count plus each MoE layer's
    extra, on the rank that holds it."""
    layout = _layout(model, tp, pp, chunks, placement, stage_layers)
    counts = parameters_per_pipeline_rank(model.shape(tp=tp), layout)
    extra = moe_layer_parameters(model, tp=tp, ep=ep)[0]
    moe = moe_layers_per_rank(
        model, pp=pp, vp=chunks, placement=placement, stage_layers=tuple(stage_layers)
    )
    counts = [n + extra * k for n, k in zip(counts, moe, strict=True)]
    counts[0 if placement is Placement.V_SHAPE else pp - 1] += mtp_parameters(
        model, tp=tp, ep=ep, stages=pp * chunks
    )
    return counts


def stage_parameters(
    model: Model,
    *,
    tp: int,
    pp: int,
    chunks: int,
    placement: Placement,
    ep: int = 1,
    stage_layers: Sequence[int] = (),
) -> list[int]:
    """Parameters of one tensor-parallel rank at each global stage."""
    layout = _layout(model, tp, pp, chunks, placement, stage_layers)
    extra = moe_layer_parameters(model, tp=tp, ep=ep)[0]
    moe = moe_layers_per_stage(model, pp * chunks, stage_layers)
    counts = parameters_per_stage(model.shape(tp=tp), layout)
    counts = [n + extra * k for n, k in zip(counts, moe, strict=True)]
    counts[-1] += mtp_parameters(model, tp=tp, ep=ep, stages=pp * chunks)
    return counts


def mtp_parameters(model: Model, *, tp: int, ep: int = 1, stages: int = 1) -> int:
    """One tensor-parallel rank's parameters of the MTP block, on the last stage: per MTP layer
    a layer of the decoder's last kind, its two input norms and final norm, and ``eh_proj``
    (2h -> h, split by output); and, unless the last stage is also the first, the word embedding
    it looks up (GPT's positions too), a copy as megatron-core builds it (``mtp_process``)."""
    if not model.mtp_num_layers:
        return 0
    shape, h, llama = model.shape(tp=tp), model.hidden_size, model.arch == "llama"
    layer = layer_parameters(shape, tp=tp)
    if model.moe_layers[-1]:
        layer += moe_layer_parameters(model, tp=tp, ep=ep)[0]
    per_layer = layer + 3 * (h if llama else 2 * h) + 2 * h * -(-h // tp)
    embedding = 0
    if stages > 1:
        embedding = -(-shape.vocab_size * h // tp) + (0 if llama else model.seq_length * h)
    return model.mtp_num_layers * per_layer + embedding


def _layout(
    model: Model, tp: int, pp: int, chunks: int, placement: Placement, stage_layers: Sequence[int]
) -> Layout:
    uneven = layout_of(stage_layers) if stage_layers else None
    return Layout(tp, pp, chunks, placement, 1, tp * pp, pipeline_model_parallel_layout=uneven)


@lru_cache(maxsize=1024)
def moe_layers_per_rank(
    model: Model, *, pp: int, vp: int, placement: Placement, stage_layers: tuple[int, ...] = ()
) -> tuple[int, ...]:
    """MoE layers on each pipeline rank: its stages' (V-shape: ranks hold stages r, 2p-1-r;
    ``stage_layers``: uneven stages' layers)."""
    v = placement is Placement.V_SHAPE
    layout = StageLayout.v_shape(pp) if v else StageLayout.looped(pp, vp)
    per_stage = moe_layers_per_stage(model, layout.num_stages, stage_layers)
    return tuple(sum(per_stage[s] for s in layout.stages_of(r)) for r in range(pp))


def moe_layer_parameters(model: Model, *, tp: int, ep: int) -> tuple[int, int]:
    """(a MoE layer's parameters on one rank beyond the dense layer's the shape counts, of them
    its experts'): the router (h x experts, whole), experts/ep routed experts and the shared one
    (each split over tp, megatron-core's expert TP default), less the dense MLP; (0, 0) if dense."""
    if not model.num_experts:
        return 0, 0
    h, gated = model.hidden_size, model.arch == "llama"

    def mlp(f: int) -> int:
        biases = 0 if gated else -(-f // tp) + h
        return -(-h * (2 if gated else 1) * f // tp) + -(-f * h // tp) + biases if f else 0

    experts = model.num_experts // ep * mlp(model.moe_ffn_hidden_size)
    extra = h * model.num_experts + experts + mlp(model.moe_shared_expert_intermediate_size)
    return extra - mlp(model.ffn_hidden_size), experts


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes one GPU holds at its peak (the busiest pipeline rank's)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def full_buffer_peaks(
    schedule: Schedule, stage_parameters: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    """Per rank (parameters, gradients): most parameters whose full parameter / gradient buffers
    the rank holds at once in its program; every stage whole all step if it has no RL."""
    result = []
    for rank in range(schedule.num_ranks):
        walks: tuple[Iterable[Iterable[int]], ...] = ((schedule.layout.stages_of(rank),),) * 2
        if any(a.kind is ActionKind.RELEASE for a in schedule.per_rank[rank]):
            walks = (schedule.held_parameter_chunks(rank), schedule.held_gradient_chunks(rank))
        parameters, gradients = (
            max((sum(stage_parameters[s] for s in held) for held in walk), default=0)
            for walk in walks
        )
        result.append((parameters, gradients))
    return tuple(result)


def weights_bytes(
    parameters: int,
    *,
    dp: int,
    precision: Precision,
    sharded: bool,
    gathered: int = 0,
    accumulated: int = 0,
    experts: int = 0,
    ep: int = 1,
) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer) bytes of a rank holding ``parameters``, optimizer over
    ``dp``; fully sharded, 1/dp of parameters and gradients plus the full buffers of ``gathered`` /
    ``accumulated`` (``full_buffer_peaks``); ``experts``' optimizer over dp/ep."""
    if sharded:
        kept = -(-parameters // dp)
        params = (kept + gathered) * precision.param_bytes
        grads = (kept + accumulated) * precision.grad_bytes
    else:
        params = parameters * precision.param_bytes
        grads = parameters * precision.grad_bytes
    optimizer = -(-(parameters - experts) * precision.optimizer_bytes // dp)
    optimizer += -(-experts * precision.optimizer_bytes * ep // dp)
    return params, grads, optimizer
