"""Time a schedule: ``semantics.replay`` under a cost model, summed up per rank.

The rules (who waits for what, when a rank is stuck) and the clocks are ``semantics``': its
``Rules`` and ``Wires``, which the validator applies too; see its docstring. Here a ``CostModel``
becomes the replay's ``Timing``: compute times scale with the stage's share of a full 1F1B stage
(``StageLayout.stage_fraction``), as does BPipe's transfer time ``t_evict``; ``t_p2p`` is one
activation or gradient message, ``t_grad_reduce`` / ``t_param_gather`` one GS / PS. A rank ends
when its compute and data-parallel lanes are both done; the step time is the latest rank end.

A compute-only schedule (no SA/RA/SG/RG, e.g. a torch CSV) is timed as if every compute action
sent its result the moment it finished, which is what ``add_communication`` would insert.

The replay runs in integer units (``CostModel.exact``) and every reported time is divided back
once here, so results are exact up to that one rounding. Events are drawn only when read
(``SimResult.events``, ``semantics.Timeline``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from operator import attrgetter, countOf
from typing import Any

from megatron_bfpp.ir import ActionKind, Schedule, ScheduleError, format_schedule
from megatron_bfpp.semantics import Event, Lane, Replay, Timeline, describe_waits, replay
from megatron_bfpp.sim.cost import CostModel

__all__ = ["UNITS", "Event", "Lane", "RankMetrics", "SimResult", "simulate"]

# The one unit of stored activations, parameters and gradients everywhere (bfpp-sim's table and
# JSON, bfpp-train's metrics, the planner): a full 1F1B stage, i.e. a rank's share of the layers
# (1/p of them). A breadth-first chunk at vp=4 is 0.25 of it, a V-shape chunk 0.5.
UNITS = {
    "peak_activations": "micro-batches through one full 1F1B stage (a rank's 1/p of the layers)",
    "peak_parameters": "gathered parameters of full 1F1B stages (sharded: the 1/d shard on top)",
    "peak_gradients": "full gradient buffers of 1F1B stages (sharded: the 1/d shard on top)",
}


@dataclass(frozen=True, slots=True)
class RankMetrics:
    """One rank's share of the step.

    ``busy_time`` sums its compute durations (communication is not busy time); ``bubble_fraction``
    is ``(step_time - busy_time) / step_time``; ``peak_activations`` is the program-order peak of
    ``Schedule.stored_activations`` in full-stage micro-batches; ``peak_parameters`` that of
    ``Schedule.resident_parameters``, gathered parameters in full stages (with sharded
    parameters, at most ``max_resident`` chunks; else all of the rank's); ``peak_gradients`` that
    of ``Schedule.resident_gradients``, full gradient buffers in full stages (fully sharded: from
    a backward until the reduction of its run of backwards lands; else all of the rank's);
    ``grad_syncs`` / ``param_syncs`` count its GS (gradient reductions) and PS (parameter
    gathers, or megatron-core's ``param_sync_func`` calls) per step: fully sharded
    breadth-first reduces each chunk once per group of micro-batches;
    ``exposed_dp_comm_time``
    is the time the rank waits on data-parallel communication: computes held back by their
    parameter gather, plus the tail between its last compute and its last GS / PS.
    """

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
    """What ``simulate`` measured; ``to_dict`` is JSON-ready.

    ``bubble_fraction`` is the idle share of all ranks' time, ``sum(step - busy) / (p * step)``;
    ``exposed_dp_comm_time`` is the largest per-rank exposed data-parallel time. ``events``
    (rank by rank, each in program order) are built from ``timeline`` on first use.
    """

    schedule_name: str
    num_ranks: int
    num_chunks: int
    num_microbatches: int
    step_time: float
    bubble_fraction: float
    exposed_dp_comm_time: float
    per_rank: tuple[RankMetrics, ...]
    timeline: Timeline = field(repr=False, compare=False)
    costs: CostModel = field(default_factory=CostModel)

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
            "num_ranks": self.num_ranks,
            "num_chunks": self.num_chunks,
            "num_microbatches": self.num_microbatches,
            "step_time": self.step_time,
            "bubble_fraction": self.bubble_fraction,
            "exposed_dp_comm_time": self.exposed_dp_comm_time,
            "costs": asdict(self.costs),
            "units": dict(UNITS),
            "per_rank": [r.to_dict() for r in self.per_rank],
        }
        if include_events:
            result["events"] = [{**e._asdict(), "kind": e.kind.value} for e in self.events]
        return result


def simulate(schedule: Schedule, costs: CostModel = CostModel()) -> SimResult:  # noqa: B008
    """Time ``schedule`` (one that ``validate_schedule`` accepts) under ``costs``.

    Raises ``ScheduleError`` showing the per-rank grid if the programs deadlock.
    """
    exact = costs.exact(schedule.layout.exact_stage_fraction)
    try:
        run = replay(schedule, exact.timing)
    except ScheduleError as error:  # a stage outside the layout
        raise ScheduleError(f"cannot simulate {error}") from None
    if run.blocked:
        raise _deadlock(schedule, run)
    return _result(schedule, costs, run, exact.per_unit)


def _result(schedule: Schedule, costs: CostModel, run: Replay, per_unit: int) -> SimResult:
    """The metrics from the replay's integer times, each divided by ``per_unit`` once."""
    clock, dp_free, busy = run.compute_end, run.dp_end, run.busy
    num_ranks = schedule.num_ranks
    ends = [max(clock[r], dp_free[r]) for r in range(num_ranks)]
    step = max(ends, default=0)
    per_rank = []
    for rank in range(num_ranks):
        exposed = run.gather_wait[rank] + max(0, dp_free[rank] - clock[rank])
        per_rank.append(
            RankMetrics(
                rank=rank,
                busy_time=_user(busy[rank], per_unit),
                bubble_fraction=_ratio(step - busy[rank], step),
                peak_activations=run.peak[rank] * schedule.layout.stage_fraction,
                peak_parameters=_peak_parameters(schedule, rank, sharded=run.released[rank]),
                peak_gradients=_peak_gradients(schedule, rank, sharded=run.released[rank]),
                grad_syncs=_count(schedule, rank, ActionKind.GRAD_SYNC),
                param_syncs=_count(schedule, rank, ActionKind.PARAM_SYNC),
                exposed_dp_comm_time=_user(exposed, per_unit),
                compute_end=_user(clock[rank], per_unit),
                end_time=_user(ends[rank], per_unit),
            )
        )
    return SimResult(
        schedule_name=schedule.name,
        num_ranks=num_ranks,
        num_chunks=schedule.num_chunks,
        num_microbatches=schedule.num_microbatches,
        step_time=_user(step, per_unit),
        bubble_fraction=_ratio(sum(step - b for b in busy), num_ranks * step),
        exposed_dp_comm_time=max((r.exposed_dp_comm_time for r in per_rank), default=0.0),
        per_rank=tuple(per_rank),
        timeline=run.timeline.scaled(per_unit),
        costs=costs,
    )


def _count(schedule: Schedule, rank: int, kind: ActionKind) -> int:
    """How many ``kind`` actions the rank's program has (at C speed: 1.6 M actions in ms)."""
    return countOf(map(_KIND, schedule.per_rank[rank]), kind)


_KIND = attrgetter("kind")


def _peak_gradients(schedule: Schedule, rank: int, *, sharded: bool) -> float:
    """The peak of ``Schedule.resident_gradients`` (all chunks without sharding)."""
    if sharded:
        return max(schedule.resident_gradients(rank), default=0.0)
    if not schedule.per_rank[rank]:
        return 0.0
    return schedule.num_chunks * schedule.layout.stage_fraction


def _peak_parameters(schedule: Schedule, rank: int, *, sharded: bool) -> float:
    """The peak of ``Schedule.resident_parameters``: without an RL (the replay saw none) every
    chunk stays gathered, which needs no second walk over the program."""
    if sharded:
        return max(schedule.resident_parameters(rank), default=0.0)
    if not schedule.per_rank[rank]:
        return 0.0
    return schedule.num_chunks * schedule.layout.stage_fraction


def _user(time: float, per_unit: int) -> float:
    """A replay time in the cost model's unit, rounded once; ``inf`` past the float range (the
    CLI reports such costs as overflowing)."""
    try:
        return time / per_unit
    except OverflowError:
        return math.inf


def _ratio(part: float, whole: float) -> float:
    """``part / whole`` of two replay times (0 when ``whole`` is), correctly rounded even when
    both are integers too large for floats."""
    return part / whole if whole > 0 else 0.0


def _deadlock(schedule: Schedule, run: Replay) -> ScheduleError:
    marks = describe_waits(run.blocked)
    return ScheduleError(
        f"cannot simulate {schedule.name!r}: deadlock: ranks {sorted(run.blocked)} each wait for "
        f"a message that is never sent\n{format_schedule(schedule, marks=marks)}"
    )
