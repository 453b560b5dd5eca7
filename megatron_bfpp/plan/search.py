"""The configuration search: every (schedule, tp, pp, vp, dp, micro-batch, recomputation) a
cluster allows that fits, ranked by simulated step time; memory comes from closed forms and short
walks, and a candidate whose lower bound cannot reach the top ``k`` is never simulated."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache, partial
from typing import Any

from megatron_bfpp.config.run_config import layout_of
from megatron_bfpp.ir import (
    Placement,
    Schedule,
    ScheduleError,
    StageLayout,
    check_positive,
    paused_gc,
)
from megatron_bfpp.passes.eviction import bpipe_max_stored
from megatron_bfpp.plan.costs import (
    BuiltinCurve,
    Efficiency,
    StageTimes,
    model_flops_per_step,
    stage_times,
)
from megatron_bfpp.plan.memory import (
    RECOMPUTE,
    MemoryBreakdown,
    PeakPoints,
    StageBytes,
    full_buffer_peaks,
    layer_activation_bytes,
    moe_layer_parameters,
    moe_layers_per_rank,
    peak_activation_bytes,
    peak_points,
    rank_parameters,
    stage_activation_bytes,
    stage_parameters,
    weights_bytes,
)
from megatron_bfpp.plan.presets import (
    BF16_MIXED,
    Gpu,
    Model,
    Precision,
    moe_layers_per_stage,
    padded_vocab_size,
)
from megatron_bfpp.schedules.registry import (
    build_schedule,
    estimate_actions,
    get_spec,
    planned_schedules,
)
from megatron_bfpp.sim import CostModel
from megatron_bfpp.sim.cost import cost_fields
from megatron_bfpp.sim.simulator import DEFAULT_P2P_MODEL, simulated_step, steady_lengths

__all__ = [
    "MEGATRON_SCHEDULES",
    "ActionBudget",
    "Candidate",
    "Cluster",
    "OverBudget",
    "Plan",
    "SearchOptions",
    "SearchResult",
    "candidates",
    "estimate_of",
    "evaluate",
    "expert_sizes",
    "families",
    "grad_reduce_of",
    "lower_bound_of",
    "memory_of",
    "p2p_model_of",
    "partitions",
    "rank_parameters_of",
    "recommend",
    "stage_activation_shares",
    "stage_weights",
]

NS = 1e9  # the simulator runs in integer nanoseconds: exact, whatever its arithmetic


class OverBudget(ScheduleError):
    """A candidate's walk or simulation would overspend its :class:`ActionBudget`; none spent."""


@dataclass(slots=True)
class ActionBudget:
    """How many schedule actions (``registry.estimate_actions``) a search may walk and simulate:
    a count, not a clock, charged even when cached: every rank and run stops at one candidate."""

    limit: int
    spent: int = 0

    def charge(self, *, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> None:
        """Spend a schedule's actions, or raise :class:`OverBudget` and spend nothing."""
        self.spent += self.require(
            num_ranks=num_ranks, stages_per_rank=stages_per_rank, lengths=(num_microbatches,)
        )

    def require(self, *, num_ranks: int, stages_per_rank: int, lengths: tuple[int, ...]) -> int:
        """The actions of schedules of ``lengths`` micro-batches; :class:`OverBudget` unless they
        fit in what is left. Spends nothing, so a timing that cannot finish does not start."""
        estimate = partial(estimate_actions, num_ranks=num_ranks, stages_per_rank=stages_per_rank)
        actions = sum(estimate(num_microbatches=m) for m in lengths)
        if self.spent + actions > self.limit:
            shown = " + ".join(map(str, lengths))
            raise OverBudget(
                f"pp={num_ranks} x {stages_per_rank} stage(s) per rank x {shown} "
                f"micro-batches ({actions:,} actions) exceeds what is left of {self.limit:,}"
            )
        return actions

    def part(self, most: int) -> ActionBudget:
        """A budget of at most ``most`` of what is left; whoever asked adds its ``spent`` back."""
        return ActionBudget(max(0, min(most, self.limit - self.spent)))


def families() -> tuple[tuple[str, str], ...]:
    """(schedule, sharding): the families the planner compares, as the catalogue declares them."""
    return tuple(
        (spec.name, sharding) for spec in planned_schedules() for sharding in spec.plan.shardings
    )


def family_name(schedule: str, sharding: str) -> str:
    return f"{schedule} (sharded)" if sharding == "optim_grads_params" else schedule


@dataclass(frozen=True, slots=True)
class Cluster:
    num_gpus: int
    gpus_per_node: int
    gpu: Gpu

    def __post_init__(self) -> None:
        check_positive({"--num-gpus": self.num_gpus, "--gpus-per-node": self.gpus_per_node})
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ScheduleError(
                f"--num-gpus {self.num_gpus} is not a whole number of nodes of "
                f"--gpus-per-node {self.gpus_per_node}"
            )


@dataclass(frozen=True, slots=True)
class SearchOptions:
    """What to search and under which assumptions; ``communication`` / ``optimizer`` /
    ``output_layer`` off leave those costs out, as the BPipe paper's estimate does."""

    schedules: tuple[str, ...] = ()  # empty: every family
    recompute: tuple[str, ...] = RECOMPUTE
    tensor_parallel: tuple[int, ...] = ()  # empty: 1, 2, 4, 8 within a node
    pipeline_parallel: tuple[int, ...] = ()  # empty: every divisor
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    top: int = 10
    memory_fraction: float = 0.9
    precision: Precision = BF16_MIXED
    distributed_optimizer: bool = True  # off: no --use-distributed-optimizer, all state per rank
    efficiency: Efficiency | None = None
    communication: bool = True
    optimizer: bool = True
    output_layer: bool = True
    best_per_family: bool = False  # also find each family's best (the plot, comparisons)
    sequence_parallel: bool = True  # --sequence-parallel at tp > 1; off: plain TP (2022 papers)
    p2p_model: str = DEFAULT_P2P_MODEL  # how the simulator times messages (sim.P2P_MODELS)
    megatron_baselines: bool = True  # 1f1b / interleaved rows as megatron-core posts them too
    # Megatron-LM's --overlap-p2p-communication for interleaved; off: batched (needs pp > 2)
    megatron_p2p_overlap: bool = True
    megatron_overlap_grad_reduce: bool = True  # its --overlap-grad-reduce; off: at the step's end
    # the job runs --overlap-moe-expert-parallel-comm: pairs it combines hide their all-to-alls
    # (recommend assumes it); off: every pair runs F then B and hides nothing (auto without it)
    moe_overlap: bool = True
    expert_parallel: tuple[int, ...] = ()  # empty: 1, 2, 4, ..., 64 (MoE models only)
    # recommend: each row also on the fastest of ``partitions`` (bfpp-plan recommend
    # --pipeline-model-parallel-layout auto); off: even stages
    partitions: bool = False


@dataclass(frozen=True, slots=True)
class Candidate:
    schedule: str
    sharding: str
    tp: int
    pp: int
    vp: int
    dp: int
    micro_batch_size: int
    recompute: str
    group_size: int | None = None  # breadth-first's memory-bounded groups (None: one group)
    plain_tensor_parallel: bool = False  # tp > 1 without sequence parallelism
    max_stored: int | None = None  # BPipe's cap (None: BPipe's own ceil((p+2)/2))
    ep: int = 1  # expert parallelism (Megatron-LM's --expert-model-parallel-size), within dp
    combined_1f1b: bool = False  # interleaved in megatron-core's combined 1F1B order
    # Uneven stages: each global stage's transformer layers in model order, the embedding on the
    # first, the output layer and loss on the last (timed in its weight); empty: even stages
    stage_layers: tuple[int, ...] = ()

    @property
    def family(self) -> str:
        return family_name(self.schedule, self.sharding)

    @property
    def options(self) -> dict[str, Any]:
        """Its generator options (registry names) that are not the schedule's defaults."""
        names = ("group_size", "max_stored", "combined_1f1b")
        return {n: v for n in names if (v := getattr(self, n)) is not None and v is not False}

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 and not self.plain_tensor_parallel


@dataclass(frozen=True, slots=True)
class Plan:
    """One configuration's prediction; ``to_dict`` is its JSON object in ``recommend --json``."""

    candidate: Candidate
    num_microbatches: int
    step_time_s: float
    tokens_per_s: float
    mfu: float
    memory: MemoryBreakdown
    bubble_fraction: float
    p2p_model: str = DEFAULT_P2P_MODEL  # the simulator's p2p timing model for this row
    megatron_grad_reduce: str | None = None  # sim.MEGATRON_GRAD_REDUCE's, for a megatron row

    def to_dict(self) -> dict[str, object]:
        c = self.candidate
        return {
            "schedule": c.schedule,
            "tensor_parallel": c.tp,
            "pipeline_parallel": c.pp,
            "virtual_stages": c.vp,
            "data_parallel": c.dp,
            "expert_parallel": c.ep,
            "micro_batch_size": c.micro_batch_size,
            "sharding": c.sharding,
            "recompute": c.recompute,
            "group_size": c.group_size,
            "max_stored": c.max_stored,
            "combined_1f1b": c.combined_1f1b,
            "stage_layers": list(c.stage_layers) or None,
            "pipeline_model_parallel_layout": layout_of(c.stage_layers) if c.stage_layers else None,
            "sequence_parallel": c.sequence_parallel,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "memory_per_gpu_bytes": self.memory.to_dict(),
            "p2p_model": self.p2p_model,
            "megatron_grad_reduce": self.megatron_grad_reduce,
        }


@dataclass(frozen=True, slots=True)
class SearchResult:
    candidates_evaluated: int
    rejected_out_of_memory: int
    simulated: int
    pruned: int
    plans: tuple[Plan, ...]  # best first, at most ``top``
    best_per_family: dict[str, Plan] = field(default_factory=dict)
    seconds: float = 0.0
    efficiency_source: str = ""
    p2p_model: str = DEFAULT_P2P_MODEL

    def to_dict(self) -> dict[str, object]:
        return {
            "p2p_model": self.p2p_model,
            "candidates_evaluated": self.candidates_evaluated,
            "rejected_out_of_memory": self.rejected_out_of_memory,
            "configs": [plan.to_dict() for plan in self.plans],
        }


def _divisors(n: int) -> list[int]:
    """In O(sqrt(n)) steps, since the command line allows a huge n."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def candidates(
    *, model: Model, cluster: Cluster, global_batch_size: int, options: SearchOptions
) -> Iterator[Candidate]:
    """Every configuration the shapes allow (tp dividing heads, groups and FFN in a node; pp the
    layers; dp x micro-batch the batch); sharding needs dp > 1, pp 1 only 1F1B."""
    searched = [f for f in families() if not options.schedules or f[0] in options.schedules]
    moe = options.megatron_baselines and model.num_experts > 0  # PlanGrid.overlapped too
    for tp, pp in _splits(model, cluster, options)[2]:
        dp = cluster.num_gpus // (tp * pp)
        if global_batch_size % dp:
            continue
        per_pipeline, plain = global_batch_size // dp, tp > 1 and not options.sequence_parallel
        for schedule, sharding in searched:
            if (sharding != "optim" and dp == 1) or (pp == 1 and schedule != "1f1b"):
                continue
            if schedule == "interleaved" and pp == 2 and not options.megatron_p2p_overlap:
                continue  # Megatron-LM refuses it: a batch would cross-match at pp 2
            spec = get_spec(schedule)
            if model.mtp_num_layers and spec.placement is Placement.V_SHAPE:
                continue  # the runtime refuses MTP on a V (plan.auto.MTP_ON_A_V)
            vps, _ = spec.planned_stages(model.num_layers // pp)
            eps = expert_sizes(model, dp, options) if sharding == "optim" else (1,)
            for vp, b in itertools.product(vps, options.micro_batch_sizes):
                m = per_pipeline // b
                if per_pipeline % b or spec.planned_microbatches_problem(pp, m) is not None:
                    continue
                grid = spec.plan.options(pp, m)
                grid += tuple(o for o in spec.plan.overlapped if moe and o not in grid)
                for recompute, chosen, ep in itertools.product(options.recompute, grid, eps):
                    yield Candidate(
                        schedule, sharding, tp, pp, vp, dp, b, recompute,
                        plain_tensor_parallel=plain, ep=ep, **chosen,
                    )  # fmt: skip


def expert_sizes(model: Model, dp: int, options: SearchOptions) -> tuple[int, ...]:
    """Expert-parallel sizes to try, as megatron-core allows them: dividing the experts and the
    data-parallel size (it carves the expert group out of dp x cp, with tp); 1 when dense."""
    if not model.num_experts:
        return (1,)
    tried = options.expert_parallel or tuple(2**i for i in range(7))
    return tuple(e for e in tried if model.num_experts % e == 0 and dp % e == 0)


def _splits(
    model: Model, cluster: Cluster, options: SearchOptions
) -> tuple[tuple[int, ...], list[int], list[tuple[int, int]]]:
    """TP sizes dividing heads, query groups and FFN; their (tp, pp), pp dividing GPUs, layers."""
    tps = options.tensor_parallel or tuple(t for t in (1, 2, 4, 8) if t <= cluster.gpus_per_node)
    dims = (
        model.num_attention_heads,
        model.num_query_groups,
        model.ffn_hidden_size,
        model.moe_ffn_hidden_size,
        model.moe_shared_expert_intermediate_size,
    )
    shaped = [t for t in tps if not any(d % t for d in dims)]
    n = cluster.num_gpus
    splits = [
        (t, p)
        for t in shaped
        if n % t == 0
        for p in options.pipeline_parallel or _divisors(n // t)
        if (n // t) % p == 0 and model.num_layers % p == 0
    ]
    return tps, shaped, splits


def memory_microbatches(pp: int, m: int) -> int:
    """Micro-batches to walk for activation peaks at m: they stop growing by 2pp whatever the
    schedule, chunks or BPipe cap (tests/unit/test_plan_search.py); 3pp is a multiple of pp."""
    return min(m, 3 * pp)


def _points(
    schedule: str,
    pp: int,
    vp: int,
    m: int,
    budget: ActionBudget | None = None,
    stage_layers: tuple[int, ...] = (),
    **options: int,
) -> PeakPoints:
    """GPipe's and breadth-first's peaks in closed form: all forwards of a group run before its
    backwards, so each rank holds the first group's micro-batches on each chunk (charged to
    ``budget`` as the walk this replaced, so decisions stay); the others' walked short. With
    ``stage_layers``, stored layer-micro-batches (``peak_points``)."""
    if schedule != "gpipe" and schedule != "breadth-first":
        length = memory_microbatches(pp, m)
        if budget is not None:
            budget.charge(num_ranks=pp, stages_per_rank=vp, num_microbatches=length)
        return _walked_points(schedule, pp, vp, length, stage_layers, **options)
    group = options.get("group_size")
    held = m if group is None else min(m, group)
    if group is not None and budget is not None:
        length = min(m, max(memory_microbatches(pp, m), group))
        budget.charge(num_ranks=pp, stages_per_rank=vp, num_microbatches=length)
    per_rank = [sum(stage_layers[r::pp]) if stage_layers else vp for r in range(pp)]
    return PeakPoints(
        tuple(
            ((held * n, held if r == 0 else 0, held if r == pp - 1 else 0),)
            for r, n in enumerate(per_rank)
        )
    )


@lru_cache(maxsize=4096)
def _walked_points(
    schedule: str, pp: int, vp: int, m: int, stage_layers: tuple[int, ...] = (), **options: int
) -> PeakPoints:
    """The generator's compute order, unvalidated (the tests' job): the walk needs no messages."""
    spec = get_spec(schedule)
    chunks = spec.chunks_for(None if spec.placement is Placement.SINGLE else vp)
    options |= {} if chunks is None else {"num_chunks": chunks}
    built = spec.generator(num_ranks=pp, num_microbatches=m, **options)
    return peak_points(built, stage_layers)


@lru_cache(maxsize=256)
def _schedule(schedule: str, pp: int, vp: int, m: int, sharding: str, **options: Any) -> Schedule:
    return build_schedule(
        schedule,
        num_ranks=pp,
        num_microbatches=m,
        num_chunks=None if get_spec(schedule).placement is Placement.SINGLE else vp,
        sharding=sharding,
        validate=False,  # the catalogue's own generators: the tests validate them
        **options,
    )


@lru_cache(maxsize=4096)
def rank_parameters_of(
    model: Model,
    *,
    schedule: str,
    tp: int,
    pp: int,
    vp: int,
    ep: int = 1,
    stage_layers: tuple[int, ...] = (),
) -> tuple[int, ...]:
    """Parameters per pipeline rank of ``model`` laid out for ``schedule`` (its placement)."""
    placement = get_spec(schedule).placement
    return tuple(
        rank_parameters(
            model, tp=tp, pp=pp, chunks=vp, placement=placement, ep=ep, stage_layers=stage_layers
        )
    )


def _parameters(c: Candidate, model: Model) -> tuple[int, ...]:
    """``rank_parameters_of`` the candidate's layout."""
    return rank_parameters_of(
        model, schedule=c.schedule, tp=c.tp, pp=c.pp, vp=c.vp, ep=c.ep, stage_layers=c.stage_layers
    )


def sharded_walk_length(m: int, group: int | None) -> int:
    """Micro-batches of the short breadth-first schedule (groups of one) whose fully sharded walk
    holds what ``m`` in groups of ``group`` hold: a first, a middle and a last group is all."""
    return min(-(-m // (group or m)), 3)


@lru_cache(maxsize=4096)
def _full_buffers(
    model: Model, tp: int, pp: int, vp: int, groups: int, stage_layers: tuple[int, ...] = ()
) -> tuple[tuple[int, int], ...]:
    """Fully sharded breadth-first's (gathered, accumulated) parameter peaks per rank."""
    walked = _schedule("breadth-first", pp, vp, groups, "optim_grads_params", group_size=1)
    looped = Placement.LOOPED
    stages = stage_parameters(
        model, tp=tp, pp=pp, chunks=vp, placement=looped, stage_layers=stage_layers
    )
    return full_buffer_peaks(walked, stages)


@dataclass(frozen=True, slots=True)
class _Sized:
    candidate: Candidate
    m: int
    memory: MemoryBreakdown
    times: StageTimes
    lower_bound: float
    estimate: float


def _weights(
    c: Candidate, m: int, model: Model, precision: Precision, distributed: bool = True
) -> list[tuple[int, int, int]]:
    """(parameters, gradients, optimizer) bytes per pipeline rank (``distributed``: optimizer state
    sharded over dp); fully sharded, plus the full buffers the schedule walk holds at once."""
    counts = _parameters(c, model)
    if c.sharding != "optim_grads_params":
        dp, ep = (c.dp, c.ep) if distributed else (1, 1)
        per_layer = moe_layer_parameters(model, tp=c.tp, ep=c.ep)[1]
        placement = get_spec(c.schedule).placement
        moe = moe_layers_per_rank(
            model, pp=c.pp, vp=c.vp, placement=placement, stage_layers=c.stage_layers
        )
        return [
            weights_bytes(
                n, dp=dp, precision=precision, sharded=False, experts=k * per_layer, ep=ep
            )
            for n, k in zip(counts, moe, strict=True)
        ]
    if c.schedule != "breadth-first":
        raise ScheduleError(f"the planner shards breadth-first only, not {c.schedule!r}")
    walked = sharded_walk_length(m, c.group_size)
    full = _full_buffers(model, c.tp, c.pp, c.vp, walked, c.stage_layers)
    return [
        weights_bytes(n, dp=c.dp, precision=precision, sharded=True, gathered=g, accumulated=a)
        for n, (g, a) in zip(counts, full, strict=True)
    ]


def _memory(
    c: Candidate,
    m: int,
    model: Model,
    precision: Precision,
    weights: list[tuple[int, int, int]],
    budget: ActionBudget | None = None,
) -> tuple[MemoryBreakdown, StageBytes]:
    stage = _stage_bytes(c, model, precision)
    stored, per = _stored_weights(c, model, precision, stage)
    points = _points(c.schedule, c.pp, c.vp, m, budget, stored, **c.options)
    activations = peak_activation_bytes(points, per)
    transient = 0
    if c.recompute == "full":  # the layer being recomputed holds its full activations
        transient = layer_activation_bytes(
            model,
            micro_batch_size=c.micro_batch_size,
            tp=c.tp,
            sequence_parallel=c.sequence_parallel,
            recompute="none",
            precision=precision,
            moe=bool(model.num_experts),
        )
    breakdowns = [
        MemoryBreakdown(p, g, o, activations[rank] + transient)
        for rank, (p, g, o) in enumerate(weights)
    ]
    return max(breakdowns, key=lambda b: b.total), stage


def _stored_weights(
    c: Candidate, model: Model, precision: Precision, stage: StageBytes
) -> tuple[tuple[int, ...], StageBytes]:
    """What the memory walk weighs each stage's stored micro-batch by, and the ``StageBytes``
    its count is in: even stages, 1 and a stage's bytes; uneven, its layers and one layer's;
    uneven MoE (dense and MoE layers store differently), its bytes and one byte."""
    if not c.stage_layers:
        return (), stage
    one = _stage_bytes(c, model, precision, layers=1)
    if not model.num_experts:
        return c.stage_layers, one
    dense, sparse = (
        layer_activation_bytes(
            model, micro_batch_size=c.micro_batch_size, tp=c.tp,
            sequence_parallel=c.sequence_parallel, recompute=c.recompute, precision=precision,
            moe=moe,
        )
        for moe in (False, True)
    )  # fmt: skip
    moe = moe_layers_per_stage(model, len(c.stage_layers), c.stage_layers)
    stored = tuple((n - k) * dense + k * sparse for n, k in zip(c.stage_layers, moe, strict=True))
    return stored, replace(one, layers=1)


def _stage_bytes(
    c: Candidate, model: Model, precision: Precision, layers: int | None = None
) -> StageBytes:
    """What one stage (of ``layers`` layers, else an even one) stores per micro-batch."""
    return stage_activation_bytes(
        model,
        micro_batch_size=c.micro_batch_size,
        tp=c.tp,
        layers_per_stage=layers or max(1, model.num_layers // (c.pp * c.vp)),
        vocab_size=padded_vocab_size(model.vocab_size, tp=c.tp),
        sequence_parallel=c.sequence_parallel,
        recompute=c.recompute,
        precision=precision,
    )


def _cost_model(
    times: StageTimes, weights: tuple[float, ...] = (), stored: tuple[float, ...] = ()
) -> CostModel:
    """Each ``t_<name>`` of the simulator's costs: ``times.<name>`` in whole nanoseconds; uneven
    stages' compute ``weights`` and ``stored`` activations (``stage_activation_shares``)."""
    ns = {f.name: max(0, round(getattr(times, f.name[2:]) * NS)) for f in cost_fields()}
    # W runs the weight GEMMs I deferred (runtime/deferred_wgrad.py)
    ns["t_weight"] = min(ns["t_weight"], ns["t_backward"])
    ns["t_a2a"] = min(ns["t_a2a"], ns["t_forward"], ns["t_backward"] - ns["t_weight"])
    return CostModel(**ns, stage_weights=weights, stage_activations=stored)


def stage_activation_shares(c: Candidate, model: Model, precision: Precision) -> tuple[float, ...]:
    """``CostModel.stage_activations`` of uneven stages: each stage's stored bytes per
    micro-batch against an even stage's (the walk's ``_stored_weights``), what BPipe's evict and
    restore of it move (``times.evict`` moves an even stage's). Even stages: none."""
    if not c.stage_layers:
        return ()
    even = _stage_bytes(c, model, precision)
    stored, unit = _stored_weights(c, model, precision, even)
    return tuple(round(n * unit.layers / even.layers, 6) for n in stored)


def _simulated_ns(
    c: Candidate,
    m: int,
    costs: CostModel,
    p2p: str,
    grad_reduce: str | None = None,
    budget: ActionBudget | None = None,
) -> tuple[float, float]:
    """(step, bubble) of ``c`` at m micro-batches, ns: off the line of three short steps when on one
    (a steady state repeats), else whole up to ``EXACT_UP_TO`` periods, past that approximated."""
    # A breadth-first group of g micro-batches repeats every g (the planner's g is pp).
    p = c.pp if c.group_size is None else max(c.pp, c.group_size)
    timed_at = cache(lambda n: _step(c, n, costs, p2p, grad_reduce, budget))  # shared lengths
    least = get_spec(c.schedule).plan.least_microbatches_per_pp * c.pp  # dualpipe-v's 2p
    # bfpp-sim's lengths (sim.simulate_steady), congruent to m, those the schedule can run
    # uneven stages: timed whole (their short steps' lines can bend later: sim.simulate_steady)
    attempts = (
        () if costs.stage_weights else tuple(a for a in steady_lengths(m, p) if a[0] >= least)
    )
    whole = not attempts or m <= sum(attempts[0])
    if budget is not None:  # the cheapest timing: attempt 1's three lengths, else the whole
        budget.require(num_ranks=c.pp, stages_per_rank=c.vp, lengths=(m,) if whole else attempts[0])
    for lengths in () if whole else attempts:
        timed = [timed_at(length) for length in lengths]
        line = [step for step, _ in timed]
        # on one line: exactly with integer durations, else within float rounding (1/vp shares)
        if abs(line[2] - line[1] - (line[1] - line[0])) <= 1e-9 * line[2]:
            return _extended(timed[0], timed[1], (m - lengths[0]) // (lengths[1] - lengths[0]))
    if m > EXACT_UP_TO * p:
        return _approximate(c, m, costs, p2p, grad_reduce, p, budget)
    return _step(c, m, costs, p2p, grad_reduce, budget)


def _step(
    c: Candidate,
    m: int,
    costs: CostModel,
    p2p: str,
    grad_reduce: str | None,
    budget: ActionBudget | None,
) -> tuple[float, float]:
    """``c`` at m micro-batches simulated: (step, bubble), charged to ``budget`` first."""
    if budget is not None:
        budget.charge(num_ranks=c.pp, stages_per_rank=c.vp, num_microbatches=m)
    built = _schedule(c.schedule, c.pp, c.vp, m, c.sharding, **c.options)
    return simulated_step(built, costs, p2p=p2p, megatron_grad_reduce=grad_reduce)


EXACT_UP_TO = 48  # periods (the pipeline size, or the group) simulated whole at most
_APPROX_FROM, _APPROX_SPAN = 8, 32  # periods: where the approximating line starts, its length


def _approximate(
    c: Candidate,
    m: int,
    costs: CostModel,
    p2p: str,
    grad_reduce: str | None,
    period: int,
    budget: ActionBudget | None = None,
) -> tuple[float, float]:
    """``_simulated_ns`` past ``EXACT_UP_TO`` periods without an exact line: the line through
    the steps at two lengths ``_APPROX_SPAN`` periods apart, congruent to m, from
    ``_APPROX_FROM`` periods (past the fill and drain, whose cost it keeps exactly)."""
    first = _APPROX_FROM * period + m % period
    last = first + _APPROX_SPAN * period
    timed = [_step(c, n, costs, p2p, grad_reduce, budget) for n in (first, last)]
    return _extended(timed[0], timed[1], (m - first) / (last - first))


def _extended(
    first: tuple[float, float], second: tuple[float, float], periods: float
) -> tuple[float, float]:
    """(step, bubble) ``periods`` times the second timed length's step past the first: the step and
    each rank's busy time (host time per compute part included) grow alike per period, so the bubble
    follows. (Counting actions would miss a schedule splitting only some backwards: dualpipe-v.)"""
    (step_a, bubble_a), (step_b, bubble_b) = first, second
    busy_a, busy_b = step_a * (1 - bubble_a), step_b * (1 - bubble_b)
    step, busy = step_a + periods * (step_b - step_a), busy_a + periods * (busy_b - busy_a)
    return step, (step - busy) / step if step > 0 else 0.0


MEGATRON_SCHEDULES = frozenset({"1f1b", "interleaved"})  # what Megatron-LM itself runs


def p2p_model_of(candidate: Candidate, options: SearchOptions) -> str:
    """A row's p2p model: the search's, or megatron-core's for Megatron baselines if it is ours."""
    if (
        options.megatron_baselines
        and options.p2p_model == DEFAULT_P2P_MODEL
        and candidate.schedule in MEGATRON_SCHEDULES
        and candidate.sharding == "optim"
    ):
        return "megatron" if options.megatron_p2p_overlap else "megatron-blocking"
    return options.p2p_model


def grad_reduce_of(p2p: str, options: SearchOptions) -> str | None:
    """How a megatron row starts its gradient reductions; None (the schedule's GS) for others."""
    if not p2p.startswith("megatron"):
        return None
    return "overlap" if options.megatron_overlap_grad_reduce else "at-end"


def _simulate(
    sized: _Sized,
    model: Model,
    cluster: Cluster,
    global_batch_size: int,
    options: SearchOptions,
    budget: ActionBudget | None = None,
) -> Plan:
    c = sized.candidate
    p2p = p2p_model_of(c, options)
    weights = stage_weights(c, model, sized.times)
    stored = stage_activation_shares(c, model, options.precision)
    grad_reduce, costs = grad_reduce_of(p2p, options), _cost_model(sized.times, weights, stored)
    simulated_ns, bubble = _simulated_ns(c, sized.m, costs, p2p, grad_reduce, budget)
    output = sized.m * sized.times.output * (not weights)  # uneven: in the last stage's weight
    step = simulated_ns / NS + output + sized.times.optimizer
    flops = model_flops_per_step(model, global_batch_size=global_batch_size)
    tokens_per_s = global_batch_size * model.seq_length / step
    mfu = flops / (step * cluster.num_gpus * cluster.gpu.peak_flops)
    return Plan(c, sized.m, step, tokens_per_s, mfu, sized.memory, bubble, p2p, grad_reduce)


def _size(
    c: Candidate,
    model: Model,
    cluster: Cluster,
    global_batch_size: int,
    options: SearchOptions,
    force: bool = False,
) -> _Sized | None:
    """Memory, durations and bounds of one candidate (None if it does not fit, unless ``force``)."""
    m = global_batch_size // (c.dp * c.micro_batch_size)
    budget = options.memory_fraction * cluster.gpu.memory_bytes
    weights = _weights(c, m, model, options.precision, options.distributed_optimizer)
    if not force and max(sum(w) for w in weights) > budget:
        return None  # the weights alone do not fit: no need to walk the schedule
    memory, stage = _memory(c, m, model, options.precision, weights)
    if memory.total > budget and not force:
        return None
    return _Sized(c, m, memory, *_timing(c, m, model, cluster, options, stage))


def _timing(
    c: Candidate,
    m: int,
    model: Model,
    cluster: Cluster,
    options: SearchOptions,
    stage: StageBytes,
    grouped: bool = True,
) -> tuple[StageTimes, float, float]:
    """Durations, unbeatable step and simulation order of a candidate (closed forms, no walk)."""
    parameters = max(_parameters(c, model))
    times = stage_times(c, model, cluster, options, parameters, stage.layers * c.vp)
    # each rank runs an F and a B at least per micro-batch and chunk, each paying the host's time
    # (uneven stages: the busiest rank's stages, the output layer in the last one's weight)
    weights = stage_weights(c, model, times)
    busiest, low = _rank_weight(c, weights), min(weights, default=1.0)
    busy = m * (busiest * (times.forward + times.backward) + 2 * c.vp * times.host)
    extra = m * times.output * (not weights) + times.optimizer
    # no schedule beats this: the first F crosses p-1 stages; whole backwards (not V) cross back
    hops = c.pp - 1
    fill = hops * (low * times.forward / c.vp + times.host + times.p2p)
    if get_spec(c.schedule).placement is not Placement.V_SHAPE:
        fill += hops * (low * times.backward / c.vp + times.host + times.p2p)
    # Order of simulation: the bound plus the data-parallel collectives; BPipe's evictions
    estimate = busy + fill + extra + c.vp * (times.grad_reduce + times.param_gather)
    if c.schedule == "bpipe" and times.evict > 0:
        shares = stage_activation_shares(c, model, options.precision)
        estimate = max(estimate, fill + extra + _eviction_time(c, m, times.evict, shares))
    idle = 0.0
    if grouped and c.schedule == "breadth-first" and c.group_size is not None:
        # Grouped breadth-first's rank 0 idles at every group's turn: its first micro-batch
        # crosses the p - 1 later stages and back while rank 0 has g - 1 other forwards to run.
        forward, backward = low * times.forward / c.vp, low * times.backward / c.vp
        full, rest = divmod(m, c.group_size)
        sizes = [c.group_size] * full + ([rest] if rest else [])
        crossing = hops * (forward + backward)
        idle = sum(max(0.0, crossing - (g - 1) * (forward + times.host)) for g in sizes)
    return times, busy + max(fill, idle) + extra, estimate


def _eviction_time(c: Candidate, m: int, evict: float, shares: tuple[float, ...]) -> float:
    """BPipe's busiest link, an ordering estimate (not a bound): stage x < p/2, with w = p - x
    micro-batches in flight under 1F1B and a cap of k, evicts about m (w - k) / (w - 2) of them,
    one after another to its partner, each moving its stage's share (the generator's counts:
    within 3% at p 4-32, m 4p-16p, every cap tried, then the fill's few fewer)."""
    cap = c.max_stored or bpipe_max_stored(c.pp)
    rates = (
        min(1.0, (c.pp - x - cap) / max(c.pp - x - 2, 1)) * (shares[x] if shares else 1.0)
        for x in range(c.pp // 2)
        if c.pp - x > cap
    )
    return m * evict * max(rates, default=0.0)


def stage_weights(c: Candidate, model: Model, times: StageTimes) -> tuple[float, ...]:
    """``CostModel.stage_weights`` of uneven stages: each stage's layers against an even stage's,
    the last also its output layer and loss (``times.output``, forward and backward, against an
    even stage's forward and backward), the first its embedding (``times.embedding``: measured
    by a profile, else 0). Even stages: none (the output layer is added as m x its time,
    ``_simulate``; the embedding is left out there)."""
    if not c.stage_layers:
        return ()
    even = model.num_layers / (c.pp * c.vp)
    per_stage = (times.forward + times.backward) / c.vp
    weights = [n / even for n in c.stage_layers]
    if model.num_experts and per_stage > 0:  # a MoE layer weighs its own time, not a layer's
        dense, sparse = times.layer
        moe = moe_layers_per_stage(model, len(c.stage_layers), c.stage_layers)
        weights = [
            ((n - k) * dense + k * sparse) / per_stage
            for n, k in zip(c.stage_layers, moe, strict=True)
        ]
    if per_stage > 0:
        weights[-1] += times.output / per_stage
        weights[0] += times.embedding / per_stage
    return tuple(round(w, 6) for w in weights)  # decimals: small exact units (CostModel.exact)


def _rank_weight(c: Candidate, weights: tuple[float, ...]) -> float:
    """The busiest pipeline rank's stages, in even ranks' work (1: even)."""
    if not weights:
        return 1.0
    v = get_spec(c.schedule).placement is Placement.V_SHAPE
    layout = StageLayout.v_shape(c.pp) if v else StageLayout.looped(c.pp, c.vp)
    return max(sum(weights[s] for s in layout.stages_of(r)) / c.vp for r in range(c.pp))


def evaluate(
    candidate: Candidate,
    *,
    model: Model,
    cluster: Cluster,
    global_batch_size: int,
    options: SearchOptions = SearchOptions(),
    budget: ActionBudget | None = None,
) -> Plan:
    """One configuration simulated, fitting or not (``Plan.memory`` says), charged to ``budget``."""
    sized = _size(candidate, model, cluster, global_batch_size, options, force=True)
    assert sized is not None  # force=True always sizes
    return _simulate(sized, model, cluster, global_batch_size, options, budget)


def lower_bound_of(
    candidate: Candidate,
    *,
    model: Model,
    cluster: Cluster,
    global_batch_size: int,
    options: SearchOptions = SearchOptions(),
    grouped: bool = True,
) -> float:
    """Seconds no schedule of ``candidate``'s shape can beat (:func:`recommend`'s pruning
    bound), in closed form. ``grouped=False``: without breadth-first's group idle, the order
    ``--pipeline-schedule auto`` times in, so its action budget reaches the same candidates."""
    return _timings(candidate, model, cluster, global_batch_size, options, grouped)[0]


def estimate_of(
    candidate: Candidate,
    *,
    model: Model,
    cluster: Cluster,
    global_batch_size: int,
    options: SearchOptions = SearchOptions(),
) -> float:
    """Seconds :func:`recommend` expects (its order of simulation, not a bound): the partitions
    of ``--pipeline-model-parallel-layout auto`` are timed in this order."""
    return _timings(candidate, model, cluster, global_batch_size, options, True)[1]


def _timings(
    c: Candidate,
    model: Model,
    cluster: Cluster,
    global_batch_size: int,
    options: SearchOptions,
    grouped: bool,
) -> tuple[float, float]:
    m = global_batch_size // (c.dp * c.micro_batch_size)
    stage = _stage_bytes(c, model, options.precision)
    return _timing(c, m, model, cluster, options, stage, grouped)[1:]


def memory_of(
    candidate: Candidate,
    *,
    model: Model,
    global_batch_size: int,
    options: SearchOptions = SearchOptions(),
    budget: ActionBudget | None = None,
) -> MemoryBreakdown:
    """The busiest rank's bytes per GPU (:func:`recommend`'s filter); walk charged to ``budget``."""
    m = global_batch_size // (candidate.dp * candidate.micro_batch_size)
    weights = _weights(candidate, m, model, options.precision, options.distributed_optimizer)
    return _memory(candidate, m, model, options.precision, weights, budget)[0]


PARTITION_SHIFT = 4  # layers the first and the last stage may each give up (partitions)
PARTITIONS_KEPT = 3  # of each candidate's partitions, those of the best bounds are simulated
# ... unless the step is short (m up to this x pp): there every partition is, the bound being
# loosest where the fill weighs most (the best bounds alone missed Megatron's first / last
# sizes by 1.5-4% at 4 micro-batches, docs/uneven-layouts.md)
EVERY_PARTITION_UP_TO = 4


def partitions(num_layers: int, stages: int) -> tuple[tuple[int, ...], ...]:
    """The layers per stage ``--pipeline-model-parallel-layout auto`` tries: the first and the
    last stage (the embedding; the output layer and loss) lighter by up to ``PARTITION_SHIFT``
    layers each than an even share, the rest spread as evenly as it goes (the earlier stages one
    more); even stages among them. Two stages: the first from 4 lighter to 4 heavier."""
    base = num_layers // stages
    if stages == 1:
        return ((num_layers,),)
    found: dict[tuple[int, ...], None] = {}
    shifts = list(range(PARTITION_SHIFT + 1))  # the most even first (``_best_partitions``)
    if stages == 2:
        shifts = sorted(range(-PARTITION_SHIFT, PARTITION_SHIFT + 1), key=abs)
    for a in shifts:
        for b in shifts if stages > 2 else (0,):
            first, last = base - a, base - b
            if stages == 2:
                last = num_layers - first
            middle = num_layers - first - last
            if min(first, last, middle) < 0 or (stages == 2 and middle):
                continue
            share, extra = divmod(middle, stages - 2) if stages > 2 else (0, 0)
            inner = [share + (i < extra) for i in range(stages - 2)]
            found[(first, *inner, last)] = None
    return tuple(found)


@paused_gc()  # as plan.auto.decide: millions of objects from its simulations, no cycles
def recommend(
    *,
    model: Model,
    cluster: Cluster,
    global_batch_size: int,
    options: SearchOptions = SearchOptions(),
) -> SearchResult:
    """Rank every configuration that fits by predicted step time (best first)."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
        raise ScheduleError(f"--global-batch-size must be an integer, got {global_batch_size!r}")
    if global_batch_size < 1:
        raise ScheduleError(f"--global-batch-size must be positive, got {global_batch_size}")
    start = time.perf_counter()
    found = candidates(
        model=model, cluster=cluster, global_batch_size=global_batch_size, options=options
    )
    sizes = [_size(c, model, cluster, global_batch_size, options) for c in found]
    fitting = [sized for sized in sizes if sized is not None]
    fitting.sort(key=lambda s: s.estimate)  # stable: ties keep the enumeration order
    top: list[tuple[float, int, Plan]] = []  # max-heap of the best ``top`` by -step time
    family_best: dict[str, Plan] = {}
    simulated = 0
    for index, sized in enumerate(fitting):
        family = sized.candidate.family
        kth = -top[0][0] if len(top) >= options.top else math.inf
        best = family_best.get(family)
        if sized.lower_bound >= kth and (
            not options.best_per_family
            or (best is not None and sized.lower_bound >= best.step_time_s)
        ):
            continue
        plan = _simulate(sized, model, cluster, global_batch_size, options)
        simulated += 1
        if best is None or plan.step_time_s < best.step_time_s:
            family_best[family] = plan
        heapq.heappush(top, (-plan.step_time_s, -index, plan))
        if len(top) > options.top:
            heapq.heappop(top)
    plans = tuple(p for _, _, p in sorted(top, key=lambda t: (-t[0], -t[1])))
    if options.partitions:
        partitioned = partial(
            _best_partition, model=model, cluster=cluster, global_batch_size=global_batch_size,
            options=options,
        )  # fmt: skip
        # a family's best is often a top row too: each plan is partitioned once
        tried = {id(p): partitioned(p) for p in (*plans, *family_best.values())}
        plans = tuple(sorted((tried[id(p)][0] for p in plans), key=lambda p: p.step_time_s))
        family_best = {family: tried[id(p)][0] for family, p in family_best.items()}
        simulated += sum(n for _, n in tried.values())
    return SearchResult(
        candidates_evaluated=len(sizes),
        rejected_out_of_memory=len(sizes) - len(fitting),
        simulated=simulated,
        pruned=len(fitting) - simulated,
        plans=plans,
        best_per_family=dict(sorted(family_best.items(), key=lambda kv: kv[1].step_time_s)),
        seconds=time.perf_counter() - start,
        efficiency_source=(options.efficiency or BuiltinCurve(cluster.gpu)).source,
        p2p_model=options.p2p_model,
    )


def _best_partition(
    plan: Plan, *, model: Model, cluster: Cluster, global_batch_size: int, options: SearchOptions
) -> tuple[Plan, int]:
    """``plan`` on the partition of its layers (``partitions``) predicted fastest: of those that
    fit, the ``PARTITIONS_KEPT`` lowest estimates (all, for a short step) are timed, each whose
    bound is below the best step so far; even stages stay when nothing beats them. With the
    count of simulations."""
    c = plan.candidate
    if c.pp == 1:
        return plan, 0
    found = (
        _size(replace(c, stage_layers=layers), model, cluster, global_batch_size, options)
        for layers in partitions(model.num_layers, c.pp * c.vp)
        if len(set(layers)) > 1
    )
    kept = PARTITIONS_KEPT if plan.num_microbatches > EVERY_PARTITION_UP_TO * c.pp else None
    best, simulated = plan, 0
    for sized in sorted((s for s in found if s is not None), key=lambda s: s.estimate)[:kept]:
        if sized.lower_bound >= best.step_time_s:
            continue
        timed = _simulate(sized, model, cluster, global_batch_size, options)
        simulated += 1
        best = timed if timed.step_time_s < best.step_time_s else best
    return best, simulated


def no_candidates_reason(
    *, model: Model, cluster: Cluster, global_batch_size: int, options: SearchOptions
) -> str:
    """Why :func:`candidates` yields nothing (no tp x pp x dp of the GPUs, not memory), and the
    nearest GPU counts that yield something (pp dividing the layers, dp the batch)."""
    n, gpn = cluster.num_gpus, cluster.gpus_per_node
    tps, shaped, splits = _splits(model, cluster, options)
    rule = (
        f"with tp in {', '.join(map(str, tps))} dividing the {model.num_attention_heads} heads "
        f"and pp the {model.num_layers} layers"
    )
    dps = sorted({n // (t * p) for t, p in splits})
    head = f"{n} x {cluster.gpu.name} cannot be split into tp x pp x dp"
    if not splits:
        why = f"{rule}, no tp x pp divides {n}"
    elif all(global_batch_size % dp for dp in dps):
        shown = ", ".join(map(str, dps[:4])) + (", ..." if len(dps) > 4 else "")
        why = (
            f"{rule}, every split leaves a data parallel size ({shown}) that does not divide "
            "the global batch"
        )
    else:
        head = f"the chosen schedules run on no split of {n} x {cluster.gpu.name}"
        why = (
            "all but 1f1b need pp >= 2, interleaved a multiple of pp micro-batches, the "
            "V-shapes an even number of layers per rank, sharded ones dp >= 2 (micro-batch "
            f"sizes {', '.join(map(str, options.micro_batch_sizes))})"
        )
    counts = {
        t * p * d
        for t in shaped
        for p in options.pipeline_parallel or _divisors(model.num_layers)
        for d in _divisors(global_batch_size)
        if t * p * d <= gpn or (t * p * d) % gpn == 0  # whole nodes, as Cluster requires
    }

    def searchable(count: int) -> bool:
        other = Cluster(count, gpn, cluster.gpu)
        found = candidates(
            model=model, cluster=other, global_batch_size=global_batch_size, options=options
        )
        return next(found, None) is not None

    below = next((c for c in sorted(counts, reverse=True) if c < n and searchable(c)), None)
    above = next((c for c in sorted(counts) if c > n and searchable(c)), None)
    near = " and ".join(str(c) for c in (below, above) if c is not None)
    return f"{head} for {model.name} at global batch {global_batch_size}: {why}; " + (
        f"the nearest GPU counts that can: {near}"
        if near
        else "no GPU count can; change the global batch or the schedules"
    )
