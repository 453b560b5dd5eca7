"""Time a schedule under a cost model by one of the p2p timing models (``P2P_MODELS``), in the
integer units of ``CostModel.exact``, each reported time divided back once: exact up to that one
rounding (docs/simulator.md, "Timing models"; docs/design-notes.md, "Simulator")."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from itertools import pairwise
from operator import attrgetter, countOf
from typing import Any

from megatron_bfpp.ir import ActionKind, Schedule, ScheduleError, format_schedule, stored_counts
from megatron_bfpp.messages import has_communication
from megatron_bfpp.native_posting import (
    P2POptions,
    megatron_lm_grad_sync,
    megatron_lm_options,
    megatron_posting,
)
from megatron_bfpp.nccl import Posting, PostingRun, lockstep_posting, posting_timer
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.semantics import (
    Event,
    Lane,
    Replay,
    Timeline,
    Timing,
    _user,
    describe_waits,
    replay,
)
from megatron_bfpp.sim.cost import CostModel

__all__ = [
    "DEFAULT_MEGATRON_GRAD_REDUCE",
    "DEFAULT_P2P_MODEL",
    "MEGATRON_GRAD_REDUCE",
    "P2P_MODELS",
    "UNITS",
    "Event",
    "Lane",
    "PostingTimeline",
    "RankMetrics",
    "SimResult",
    "simulate",
    "simulate_steady",
    "simulated_step",
    "steady_lengths",
    "with_stage_memory",
]

# The p2p timing models, each with what it times (bfpp-sim --p2p-model's help, the reports).
P2P_MODELS = {
    "lockstep": "the runtime's lock-step NCCL posting: one batch per tick, FIFO per rank, "
    "a batch done when both halves of each op are posted",
    "megatron": "megatron-core's own p2p for its 1f1b / interleaved as Megatron-LM runs them: "
    "one call per pipeline step, batched and waited at once (interleaved: non-batched, overlapped)",
    "megatron-blocking": "megatron-core's own p2p for its 1f1b / interleaved with p2p overlap "
    "off: every call batched and waited at once (Megatron-LM before p2p overlap, the 2022 "
    "papers' baseline)",
    "gloo": "gloo's rules: sends never block, a receiver waits only where it consumes "
    "(not what runs on NCCL; for comparison)",
}
DEFAULT_P2P_MODEL = "lockstep"
# How Megatron's own schedules start their data-parallel gradient reductions, under the megatron
# p2p models (bfpp-sim / bfpp-plan --megatron-grad-reduce's help): native_posting's rules.
MEGATRON_GRAD_REDUCE = {
    "overlap": "Megatron-LM's --overlap-grad-reduce (aligned across the pipeline: its default "
    "without --no-align-grad-reduce): each chunk's reduction starts where megatron-core starts "
    "it (1f1b: after the last backward on the first pipeline rank, after the cool-down on the "
    "others; interleaved: pipeline-rank backwards after the chunk's last one) and overlaps the "
    "rest of the step",
    "at-end": "without --overlap-grad-reduce: every chunk's reduction in finalize_model_grads "
    "after the schedule's last message, overlapping nothing",
}
DEFAULT_MEGATRON_GRAD_REDUCE = "overlap"
# The megatron-core whose posting ``megatron`` times (0.18 on: forward sends waited at once).
MEGATRON_CORE_VERSION = (0, 19)

# The one unit of stored activations, parameters and gradients everywhere (bfpp-sim, bfpp-train's
# metrics, the planner): a full 1F1B stage (a breadth-first chunk at vp=4 is 0.25 of it).
UNITS = {
    "peak_activations": "micro-batches through one full 1F1B stage (a rank's 1/p of the layers)",
    "peak_parameters": "gathered parameters of full 1F1B stages (sharded: the 1/d shard on top)",
    "peak_gradients": "full gradient buffers of 1F1B stages (sharded: the 1/d shard on top)",
}


@dataclass(frozen=True, slots=True)
class RankMetrics:
    """One rank's share of the step (docs/simulator.md, "Output"): program-order peaks of
    ``Schedule.stored_activations`` / ``resident_parameters`` / ``resident_gradients`` (``UNITS``);
    ``exposed_dp_comm_time``: computes held back by a gather plus the tail from the last compute."""

    rank: int
    busy_time: float
    bubble_fraction: float
    peak_activations: float
    peak_parameters: float
    peak_gradients: float
    grad_syncs: int
    param_syncs: int
    exposed_dp_comm_time: float
    compute_end: float
    end_time: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SimResult:
    """What ``simulate`` measured under ``p2p_model``; ``to_dict``: JSON-ready; ``events``: lazy."""

    schedule_name: str
    num_ranks: int
    num_chunks: int
    num_microbatches: int
    step_time: float
    bubble_fraction: float
    exposed_dp_comm_time: float
    per_rank: tuple[RankMetrics, ...]
    timeline: Timeline | PostingTimeline = field(repr=False, compare=False)
    costs: CostModel = field(default_factory=CostModel)
    p2p_model: str = DEFAULT_P2P_MODEL
    megatron_grad_reduce: str | None = None  # MEGATRON_GRAD_REDUCE's, under a megatron model
    # ``simulate_steady``: the shorter steps whose line gave the clocks; () when timed whole
    steady_from: tuple[int, ...] = ()
    # ``with_stage_memory``'s weights: the memory columns weigh each stage's layers; (): even
    stage_memory: tuple[float, ...] = ()

    @property
    def events(self) -> tuple[Event, ...]:
        return self.timeline.events()

    @property
    def peak_activations(self) -> tuple[float, ...]:
        return tuple(r.peak_activations for r in self.per_rank)

    @property
    def peak_parameters(self) -> tuple[float, ...]:
        return tuple(r.peak_parameters for r in self.per_rank)

    @property
    def peak_gradients(self) -> tuple[float, ...]:
        return tuple(r.peak_gradients for r in self.per_rank)

    def to_dict(self, *, include_events: bool = False) -> dict[str, Any]:
        result: dict[str, Any] = {
            "schedule": self.schedule_name,
            "p2p_model": self.p2p_model,
            "megatron_grad_reduce": self.megatron_grad_reduce,
            "num_ranks": self.num_ranks,
            "num_chunks": self.num_chunks,
            "num_microbatches": self.num_microbatches,
            "step_time": self.step_time,
            "bubble_fraction": self.bubble_fraction,
            "exposed_dp_comm_time": self.exposed_dp_comm_time,
            "steady_from": list(self.steady_from),
            "costs": asdict(self.costs),
            "stage_memory": list(self.stage_memory),
            "units": dict(UNITS),
            "per_rank": [r.to_dict() for r in self.per_rank],
        }
        if include_events:
            result["events"] = [{**e._asdict(), "kind": e.kind.value} for e in self.events]
        return result


def simulate(
    schedule: Schedule,
    costs: CostModel = CostModel(),  # noqa: B008
    *,
    p2p: str = DEFAULT_P2P_MODEL,
    posting: Posting | None = None,
    megatron_grad_reduce: str | None = None,
) -> SimResult:
    """Time ``schedule`` (one ``validate_schedule`` accepts) under ``costs`` by the p2p timing model
    ``p2p``; ``posting`` replaces the lock-step posting, ``megatron_grad_reduce``: where a megatron
    model starts each chunk's reduction. A deadlock raises ``ScheduleError`` with the grid."""
    grad_reduce = _grad_reduce(p2p, megatron_grad_reduce, posting)
    times, per_unit, timeline = _clocks(schedule, costs, p2p, posting, grad_reduce)
    return _result(schedule, costs, times, per_unit, p2p, timeline, grad_reduce)


def simulated_step(
    schedule: Schedule, costs: CostModel, *, p2p: str, megatron_grad_reduce: str | None = None
) -> tuple[float, float]:
    """``simulate``'s step time and bubble fraction alone (the planner's): no memory, no ranks."""
    grad_reduce = _grad_reduce(p2p, megatron_grad_reduce, None)
    (clock, dp_end, busy, _), per_unit, _ = _clocks(schedule, costs, p2p, None, grad_reduce)
    step = max(map(max, clock, dp_end), default=0)
    return _user(per_unit, step), _bubble(step, busy)


def with_stage_memory(result: SimResult, schedule: Schedule, weights: Sequence[float]) -> SimResult:
    """``result`` with each rank's peak activations, parameters and gradients weighed per stage
    (``weights``: each global stage's layers against an even stage's, ``CostModel.
    stage_activations``), for uneven stages: the same program-order walks, a stage counting its
    weight instead of 1."""
    if not weights:
        return result
    fraction = schedule.layout.stage_fraction

    def peak(held: Iterable[set[int]]) -> float:
        return max((sum(weights[s] for s in stages) for stages in held), default=0.0)

    per_rank = []
    for m in result.per_rank:
        rank, program = m.rank, schedule.per_rank[m.rank]
        if ActionKind.RELEASE in map(_KIND, program):  # sharded: gathered and held chunks
            parameters = peak(schedule.held_parameter_chunks(rank))
            gradients = peak(schedule.held_gradient_chunks(rank))
        else:
            parameters = gradients = peak([set(schedule.layout.stages_of(rank))] if program else [])
        activations = max(0, max(stored_counts(program, weights), default=0))
        per_rank.append(
            replace(
                m,
                peak_activations=activations * fraction,
                peak_parameters=parameters * fraction,
                peak_gradients=gradients * fraction,
            )
        )
    return replace(result, per_rank=tuple(per_rank), stage_memory=tuple(weights))


def _bubble(step: float, busy: Sequence[float]) -> float:
    """The idle share of every rank's step: the one definition, for ``simulate`` and the planner."""
    return _ratio(sum(step - b for b in busy), len(busy) * step)


def _clocks(
    schedule: Schedule, costs: CostModel, p2p: str, posting: Posting | None, grad_reduce: str | None
) -> tuple[_Run4, int, Timeline | PostingTimeline]:
    """The model's integer clocks of ``schedule`` (``_Run4``), their unit (``CostModel.exact``)
    and the events drawn on demand: ``simulate`` less the memory and the summing up."""
    exact = costs.exact(schedule.layout.exact_stage_fraction)
    if p2p == "gloo":
        run = _replay(schedule, exact.timing)
        times = (run.compute_end, run.dp_end, run.busy, run.gather_wait)
        return times, exact.per_unit, run.timeline.scaled(exact.per_unit)
    try:
        timed = _timer(schedule, p2p, posting, grad_reduce)(exact.timing)
    except (ScheduleError, IndexError, KeyError) as error:
        _replay(schedule, exact.timing)  # a deadlock or a stage outside the layout, explained
        raise ScheduleError(f"cannot simulate {schedule.name!r} under {p2p}: {error}") from None
    times = (timed.clock, timed.dp_end, timed.busy, timed.gather_wait)
    return times, exact.per_unit, PostingTimeline(timed.events, exact.per_unit)


# ``simulate_steady`` times a step whole below this many actions (a few seconds of CPU above)
STEADY_FROM_ACTIONS = 200_000


def steady_lengths(m: int, period: int) -> tuple[tuple[int, int, int], ...]:
    """The shorter steps whose clocks may lie on one line through the step of m micro-batches:
    three lengths ``period`` apart and congruent to m (a whole number of periods short of it),
    from about one period, else two, else two-period steps from two; those shorter than m. Not
    from three periods: a fill that long may lie on a line and bend later (docs/simulator.md)."""
    attempts = (
        (period, period + m % period),
        (period, 2 * period + m % period),
        (2 * period, 2 * period + m % (2 * period)),
    )
    return tuple(
        (first, first + step, first + 2 * step) for step, first in attempts if m > first + 2 * step
    )


def simulate_steady(
    schedule: Schedule,
    costs: CostModel,
    *,
    shorter: Callable[[int], Schedule],
    period: int,
    p2p: str = DEFAULT_P2P_MODEL,
    megatron_grad_reduce: str | None = None,
) -> SimResult:
    """``simulate``'s figures off the exact clocks of shorter steps (``shorter(n)``, a period apart)
    where they lie on lines, else timed whole; memory from ``schedule``'s own program."""
    grad_reduce = _grad_reduce(p2p, megatron_grad_reduce, None)
    # Uneven stages are timed whole: their shorter steps can lie on lines that the long step
    # leaves later (tests/unit/test_stage_weights.py, docs/simulator.md#uneven-stages).
    even = len(set(costs.stage_weights)) <= 1 and len(set(costs.stage_activations)) <= 1
    if schedule.num_actions >= STEADY_FROM_ACTIONS and even:
        line = _steady_clocks(schedule, costs, shorter, period, p2p, grad_reduce)
        if line is not None:
            lengths, fields = line
            per_unit = costs.exact(schedule.layout.exact_stage_fraction).per_unit
            rerun = partial(simulate, schedule, costs, p2p=p2p, megatron_grad_reduce=grad_reduce)
            timeline = PostingTimeline(lambda: list(rerun().events))  # in user units already
            result = _result(schedule, costs, fields, per_unit, p2p, timeline, grad_reduce)
            return replace(result, steady_from=lengths)
    return simulate(schedule, costs, p2p=p2p, megatron_grad_reduce=grad_reduce)


_Run4 = tuple[list[Any], list[Any], list[Any], list[Any]]  # compute / dp end, busy, gather wait


def _on_lines(runs: list[_Run4], periods: int) -> tuple[tuple[list[Any], ...], bool] | None:
    """The clock fields ``periods`` periods past the first of ``runs`` (steps a period apart),
    when every value is an integer on a line through them, and whether each rank's compute end
    grows by exactly the busiest rank's compute per period; else None."""
    fields = []
    for values in zip(*runs, strict=True):  # one field of every run
        first, second = values[0], values[1]
        for rank in range(len(first)):
            points = [run[rank] for run in values]
            step = points[1] - points[0]
            if any(type(v) is not int for v in points) or any(
                later - earlier != step for earlier, later in pairwise(points)
            ):
                return None
        fields.append([x + periods * (y - x) for x, y in zip(first, second, strict=True)])
    compute = [y - x for x, y in zip(runs[0][2], runs[1][2], strict=True)]
    grows = [y - x for x, y in zip(runs[0][0], runs[1][0], strict=True)]
    return tuple(fields), bool(compute) and all(g == max(compute) for g in grows)


def _steady_clocks(
    schedule: Schedule,
    costs: CostModel,
    shorter: Callable[[int], Schedule],
    period: int,
    p2p: str,
    grad_reduce: str | None,
) -> tuple[tuple[int, ...], tuple[list[Any], ...]] | None:
    """``simulate_steady``'s lines: the lengths and the four clock fields at m, or None."""
    m, runs = schedule.num_microbatches, {}

    def clocks_at(n: int) -> _Run4 | None:
        if n not in runs:
            try:  # a length the schedule's options refuse, or one that cannot run
                short = shorter(n)
                if short.layout != schedule.layout:
                    return None
                runs[n] = _clocks(short, costs, p2p, None, grad_reduce)[0]
            except ScheduleError:
                return None
        return runs[n]

    attempts = steady_lengths(m, period)
    if not attempts or m <= sum(attempts[0]):  # timing it whole is no dearer
        return None
    for lengths in attempts:
        step, points = lengths[1] - lengths[0], [clocks_at(n) for n in lengths]
        if any(point is None for point in points):  # too short to run (dualpipe-v's m < 2p)
            continue
        line = _on_lines(points, (m - lengths[0]) // step)  # type: ignore[arg-type]
        if line is None:
            continue
        fields, compute_bound = line
        if compute_bound:
            return lengths, fields
        fourth = lengths[-1] + step  # bound by messages or the lanes: one more point first
        if fourth < m and (point := clocks_at(fourth)) is not None:
            line = _on_lines([*points, point], (m - lengths[0]) // step)  # type: ignore[list-item]
            if line is not None:
                return (*lengths, fourth), line[0]
    return None


def _replay(schedule: Schedule, timing: Timing) -> Replay:
    """The gloo replay, refusing a schedule that deadlocks or names a stage outside the layout."""
    try:
        run = replay(schedule, timing)
    except ScheduleError as error:  # a stage outside the layout
        raise ScheduleError(f"cannot simulate {error}") from None
    if run.blocked:
        raise ScheduleError(
            f"cannot simulate {schedule.name!r}: deadlock: ranks {sorted(run.blocked)} each wait "
            "for a message that is never sent\n"
            + format_schedule(schedule, marks=describe_waits(run.blocked))
        )
    return run


def _grad_reduce(p2p: str, grad_reduce: str | None, posting: Posting | None) -> str | None:
    """The megatron models' ``MEGATRON_GRAD_REDUCE`` setting, else None; checks ``p2p`` first."""
    if p2p not in P2P_MODELS:
        raise ScheduleError(
            f"unknown p2p timing model {p2p!r}; choose one of {', '.join(P2P_MODELS)}"
        )
    megatron = p2p.startswith("megatron") and posting is None
    if grad_reduce is None:
        return DEFAULT_MEGATRON_GRAD_REDUCE if megatron else None
    if grad_reduce not in MEGATRON_GRAD_REDUCE:
        raise ScheduleError(
            f"unknown megatron grad reduce {grad_reduce!r}; choose one of "
            f"{', '.join(MEGATRON_GRAD_REDUCE)}"
        )
    if not megatron:
        raise ScheduleError(
            "megatron_grad_reduce applies to the megatron p2p models (Megatron's own 1f1b / "
            "interleaved, posted by megatron-core); the others start each reduction at the "
            "schedule's GS"
        )
    return grad_reduce


# The timers of the last schedules timed by their lock-step posting, by identity (the planner
# times each of its cached schedules under many costs; hashing a schedule reads all of it).
_TIMERS: dict[tuple[int, str, str | None], tuple[Schedule, Callable[[Timing], PostingRun]]] = {}
_TIMERS_KEPT = 64


def _timer(
    schedule: Schedule, p2p: str, posting: Posting | None, grad_reduce: str | None
) -> Callable[[Timing], PostingRun]:
    """The timer of ``posting``, or of the posting ``p2p`` names for ``schedule`` lowered."""
    if posting is not None:
        return posting_timer(schedule, posting)
    key = (id(schedule), p2p, grad_reduce)
    if (kept := _TIMERS.get(key)) is not None and kept[0] is schedule:
        return kept[1]
    lowered = schedule if has_communication(schedule) else add_communication(schedule)
    grad_sync = megatron_lm_grad_sync(overlap_grad_reduce=grad_reduce == "overlap")
    if p2p.startswith("megatron"):  # megatron-blocking: Megatron-LM with p2p overlap off
        options = P2POptions(overlap_p2p=False, batch_p2p=True)
        if p2p == "megatron":
            options = megatron_lm_options(lowered, core_version=MEGATRON_CORE_VERSION)
        posting = megatron_posting(lowered, options, grad_sync)
    else:
        posting = lockstep_posting(lowered)
    timer = posting_timer(lowered, posting)
    if len(_TIMERS) >= _TIMERS_KEPT:
        del _TIMERS[next(iter(_TIMERS))]
    _TIMERS[key] = (schedule, timer)
    return timer


class PostingTimeline:
    """A timed posting's events, built and scaled on first read: ``Timeline``'s interface."""

    __slots__ = ("_events", "_raw", "per_unit")

    def __init__(self, raw: Callable[[], list[Event]], per_unit: int = 1) -> None:
        self._raw, self.per_unit = raw, per_unit
        self._events: tuple[Event, ...] | None = None

    def events(self) -> tuple[Event, ...]:
        if self._events is None:
            per_unit = self.per_unit
            self._events = tuple(
                e._replace(start=_user(per_unit, e.start), end=_user(per_unit, e.end))
                for e in self._raw()
            )
        return self._events


def _result(
    schedule: Schedule,
    costs: CostModel,
    times: Sequence[list[Any]],
    per_unit: int,
    p2p: str,
    timeline: Timeline | PostingTimeline,
    grad_reduce: str | None,
) -> SimResult:
    """The metrics from the model's integer clocks (``_Run4``), each divided by ``per_unit`` once;
    memory counted in program order (``ir.stored_counts``: no run counts it)."""
    clock, dp_free, busy, gather_wait = times
    peak = [max(0, max(stored_counts(actions), default=0)) for actions in schedule.per_rank]
    num_ranks = schedule.num_ranks
    ends = [max(clock[r], dp_free[r]) for r in range(num_ranks)]
    step = max(ends, default=0)
    per_rank = []
    for rank in range(num_ranks):
        exposed = gather_wait[rank] + max(0, dp_free[rank] - clock[rank])
        kinds = list(map(_KIND, schedule.per_rank[rank]))  # C speed: 1.6 M actions in ms
        sharded = _RL in kinds
        per_rank.append(
            RankMetrics(
                rank=rank,
                busy_time=_user(per_unit, busy[rank]),
                bubble_fraction=_ratio(step - busy[rank], step),
                peak_activations=peak[rank] * schedule.layout.stage_fraction,
                peak_parameters=_peak(schedule.resident_parameters, schedule, rank, sharded),
                peak_gradients=_peak(schedule.resident_gradients, schedule, rank, sharded),
                grad_syncs=countOf(kinds, ActionKind.GRAD_SYNC),
                param_syncs=countOf(kinds, ActionKind.PARAM_SYNC),
                exposed_dp_comm_time=_user(per_unit, exposed),
                compute_end=_user(per_unit, clock[rank]),
                end_time=_user(per_unit, ends[rank]),
            )
        )
    return SimResult(
        schedule_name=schedule.name,
        num_ranks=num_ranks,
        num_chunks=schedule.num_chunks,
        num_microbatches=schedule.num_microbatches,
        step_time=_user(per_unit, step),
        bubble_fraction=_bubble(step, busy),
        exposed_dp_comm_time=max((r.exposed_dp_comm_time for r in per_rank), default=0.0),
        per_rank=tuple(per_rank),
        timeline=timeline,
        costs=costs,
        p2p_model=p2p,
        megatron_grad_reduce=grad_reduce,
    )


_KIND = attrgetter("kind")
_RL = ActionKind.RELEASE


def _peak(
    resident: Callable[[int], tuple[float, ...]], schedule: Schedule, rank: int, sharded: bool
) -> float:
    """The peak of ``Schedule.resident_parameters`` / ``resident_gradients``: without an RL (the
    replay saw none) every chunk stays resident, which needs no walk over the program."""
    if sharded:
        return max(resident(rank), default=0.0)
    if not schedule.per_rank[rank]:
        return 0.0
    return schedule.num_chunks * schedule.layout.stage_fraction


def _ratio(part: float, whole: float) -> float:
    """``part / whole`` (0 when ``whole`` is), correctly rounded for integers beyond floats."""
    return part / whole if whole > 0 else 0.0
