"""Time a schedule: an event-driven run of every rank's program under validate.py's semantics.

Each rank runs its program in order on one compute lane. Sends (SA, SG, EV, RS) are posted without
blocking the rank; the message then occupies the directed link (sender, receiver) for ``t_p2p``
(``t_evict * stage_fraction`` for BPipe's EV / RS), one message at a time in posting order.
Receives are posted without blocking; a compute action (or an RS, for the activations its AC
took in) starts when the rank is free and every message it consumes has arrived
(``validate.consumed_messages``; the backward of an evicted micro-batch also waits for the
activations its LD takes back), and the first forward of a stage also waits for that stage's
parameter gather (PS) when the PS comes earlier in the program. GS / PS run on one
data-parallel lane per rank, in program order: an operation starts at the later of its position's
time on the rank and the lane becoming free. A rank ends when its compute and data-parallel lanes
are both done; the step time is the latest rank end.

A compute-only schedule (no SA/RA/SG/RG, e.g. a torch CSV) is timed as if every compute action
sent its result the moment it finished, which is what ``add_communication`` would insert.

The simulation is a worklist over ranks, linear in the number of actions: a rank runs until it
needs a message nobody has sent yet, and resumes when the sender posts it. Every link and lane is
owned by one rank's program, so the order in which ranks are advanced does not change any time.
"""

from __future__ import annotations

import gc
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple

from megatron_bfpp.ir import MEMORY_DELTA, ActionKind, Schedule, ScheduleError, format_schedule
from megatron_bfpp.sim.cost import CostModel
from megatron_bfpp.validate import has_communication

__all__ = ["Event", "Lane", "RankMetrics", "SimResult", "simulate"]

K = ActionKind
Lane = Literal["compute", "p2p", "dp"]

# Message kinds inside the engine's keys (rank receiving, what, stage, micro-batch); the same
# messages as ``validate.Message``: act of stage s, grad of stage s's input, evict / restore of
# the evictor's stage s.
_ACT, _GRAD, _EVICT, _RESTORE = 0, 1, 2, 3
_WHAT = ("act", "grad", "evict", "restore")
_MessageKey = tuple[int, int, int, int]


class Event(NamedTuple):
    """One busy interval on one lane of one rank.

    ``lane`` is ``compute`` (F/B/I/W, every one), ``p2p`` (a send occupying its link, drawn on
    the sender) or ``dp`` (GS / PS); communication that takes no time leaves no event.
    ``label`` is the action's text, e.g. ``3F5``. A named tuple rather than a dataclass: a
    large schedule produces hundreds of thousands of these, and a tuple is cheaper to build.
    """

    rank: int
    lane: Lane
    label: str
    stage: int
    microbatch: int | None
    kind: ActionKind
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class RankMetrics:
    """One rank's share of the step.

    ``busy_time`` sums its compute durations (communication is not busy time); ``bubble_fraction``
    is ``(step_time - busy_time) / step_time``; ``peak_activations`` is the program-order peak of
    ``Schedule.stored_activations`` in full-stage micro-batches; ``exposed_dp_comm_time`` is the
    time the rank waits on data-parallel communication: first forwards held back by their
    parameter gather, plus the tail between its last compute and its last GS / PS.
    """

    rank: int
    busy_time: float
    bubble_fraction: float
    peak_activations: float
    exposed_dp_comm_time: float
    compute_end: float
    end_time: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SimResult:
    """What ``simulate`` measured; ``to_dict`` is JSON-ready.

    ``bubble_fraction`` is the idle share of all ranks' time, ``sum(step - busy) / (p * step)``;
    ``exposed_dp_comm_time`` is the largest per-rank exposed data-parallel time.
    """

    schedule_name: str
    num_ranks: int
    num_chunks: int
    num_microbatches: int
    step_time: float
    bubble_fraction: float
    exposed_dp_comm_time: float
    per_rank: tuple[RankMetrics, ...]
    events: tuple[Event, ...] = field(repr=False)
    costs: CostModel = field(default_factory=CostModel)

    @property
    def peak_activations(self) -> tuple[float, ...]:
        return tuple(r.peak_activations for r in self.per_rank)

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
            "per_rank": [r.to_dict() for r in self.per_rank],
        }
        if include_events:
            result["events"] = [{**e._asdict(), "kind": e.kind.value} for e in self.events]
        return result


def simulate(schedule: Schedule, costs: CostModel = CostModel()) -> SimResult:  # noqa: B008
    """Time ``schedule`` (one that ``validate_schedule`` accepts) under ``costs``.

    Raises ``ScheduleError`` showing the per-rank grid if the programs deadlock.
    """
    # The run allocates one tuple per event and message and frees none of them, which makes the
    # cyclic garbage collector rescan the growing heap over and over (a third of the time on
    # large schedules); nothing here forms reference cycles, so pause it.
    collecting = gc.isenabled()
    gc.disable()
    try:
        run = _run(schedule, costs)
    except IndexError as error:  # a stage outside the layout: validate would have said so
        raise ScheduleError(
            f"cannot simulate {schedule.name!r}: an action names a stage outside the layout "
            f"({error}); run validate_schedule for details"
        ) from None
    finally:
        if collecting:
            gc.enable()
    events, clock, dp_free, busy, waited, peaks = run
    num_ranks = schedule.num_ranks
    ends = [max(clock[r], dp_free[r]) for r in range(num_ranks)]
    step_time = max(ends, default=0.0)
    per_rank = []
    for rank in range(num_ranks):
        exposed = waited[rank] + max(0.0, dp_free[rank] - clock[rank])
        bubble = (step_time - busy[rank]) / step_time if step_time > 0 else 0.0
        per_rank.append(
            RankMetrics(
                rank=rank,
                busy_time=busy[rank],
                bubble_fraction=bubble,
                peak_activations=peaks[rank] * schedule.layout.stage_fraction,
                exposed_dp_comm_time=exposed,
                compute_end=clock[rank],
                end_time=ends[rank],
            )
        )
    idle = sum(step_time - b for b in busy)
    return SimResult(
        schedule_name=schedule.name,
        num_ranks=num_ranks,
        num_chunks=schedule.num_chunks,
        num_microbatches=schedule.num_microbatches,
        step_time=step_time,
        bubble_fraction=idle / (num_ranks * step_time) if step_time > 0 else 0.0,
        exposed_dp_comm_time=max((r.exposed_dp_comm_time for r in per_rank), default=0.0),
        per_rank=tuple(per_rank),
        events=tuple(events),
        costs=costs,
    )


class _Run(NamedTuple):
    events: list[Event]
    compute_end: list[float]  # per rank: the rank's clock after its last action
    dp_end: list[float]  # per rank: when its data-parallel lane is done
    busy: list[float]  # per rank: sum of compute durations
    gather_wait: list[float]  # per rank: time first forwards waited for their PS
    peak: list[int]  # per rank: peak count of stored stage activations


_new_event = tuple.__new__  # Event(...) without the generated __new__'s extra Python frame


def _run(schedule: Schedule, costs: CostModel) -> _Run:
    """The worklist over ranks; see the module docstring for the rules it applies."""
    layout = schedule.layout
    s2r = layout.stage_to_rank
    last = layout.num_stages - 1
    fraction = layout.stage_fraction
    d_f = costs.t_forward * fraction
    d_b = costs.t_backward * fraction
    d_i = (costs.t_backward - costs.t_weight) * fraction
    d_w = costs.t_weight * fraction
    d_p2p = costs.t_p2p
    d_evict = costs.t_evict * fraction
    d_gs = costs.t_grad_reduce
    d_ps = costs.t_param_gather
    implicit = not has_communication(schedule)

    F, B, I, W = K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT  # noqa: E741
    SA, RA, SG, RG = K.SEND_ACT, K.RECV_ACT, K.SEND_GRAD, K.RECV_GRAD
    EV, RS, GS, PS = K.EVICT, K.RESTORE, K.GRAD_SYNC, K.PARAM_SYNC
    # Stored activations after each action, exactly as Schedule.stored_activations adds them:
    # integer counts here, scaled by the stage fraction once at the end (no rounding drift).
    mem = {kind: MEMORY_DELTA.get(kind, 0) for kind in ActionKind}
    mem_f, mem_b, mem_i, mem_w = mem[F], mem[B], mem[I], mem[W]

    programs = schedule.per_rank
    num_ranks = len(programs)
    cursor = [0] * num_ranks
    clock = [0.0] * num_ranks
    dp_free = [0.0] * num_ranks
    busy = [0.0] * num_ranks
    gather_wait = [0.0] * num_ranks
    held = [0] * num_ranks
    peak = [0] * num_ranks
    ps_done: list[dict[int, float]] = [{} for _ in range(num_ranks)]
    started: list[set[int]] = [set() for _ in range(num_ranks)]
    evicted: list[set[tuple[int, int]]] = [set() for _ in range(num_ranks)]
    arrivals: dict[_MessageKey, float] = {}
    waiting: dict[_MessageKey, int] = {}
    link_free: dict[int, float] = {}
    blocked: dict[int, tuple[int, _MessageKey]] = {}
    events: list[Event] = []
    append = events.append
    ready = deque(range(num_ranks))

    def post(key: _MessageKey, src: int, posted: float, duration: float, kind: ActionKind) -> None:
        """Send ``key`` from ``src`` at ``posted``: the implicit sends of a compute-only schedule
        and BPipe's EV / RS. SA / SG, the bulk of a lowered schedule, inline the same steps."""
        link = src * num_ranks + key[0]
        start = link_free.get(link, 0.0)
        if posted > start:
            start = posted
        arrival = start + duration
        link_free[link] = arrival
        arrivals[key] = arrival
        woken = waiting.pop(key, None)
        if woken is not None:
            ready.append(woken)
        if duration > 0:
            dst, _, stage, microbatch = key
            label = f"{stage}{kind.value}{microbatch}>{dst}"
            append(_new_event(Event, (src, "p2p", label, stage, microbatch, kind, start, arrival)))

    while ready:
        rank = ready.popleft()
        program = programs[rank]
        n = len(program)
        i = cursor[rank]
        t = clock[rank]
        busy_r = busy[rank]
        wait_r = gather_wait[rank]
        held_r = held[rank]
        peak_r = peak[rank]
        started_r = started[rank]
        evicted_r = evicted[rank]
        ps_r = ps_done[rank]
        link_base = rank * num_ranks
        need: _MessageKey | None = None
        while i < n:
            a = program[i]
            kind = a.kind
            s = a.stage
            mb: int = a.microbatch  # type: ignore[assignment]  # None only for GS / PS
            if kind is F:
                start = t
                if s and s2r[s - 1] != rank:
                    need = (rank, _ACT, s - 1, mb)
                    arrival = arrivals.get(need)
                    if arrival is None:
                        break
                    need = None
                    if arrival > start:
                        start = arrival
                if s not in started_r:
                    started_r.add(s)
                    gathered = ps_r.get(s)
                    if gathered is not None and gathered > start:
                        wait_r += gathered - start
                        start = gathered
                t = start + d_f
                busy_r += d_f
                held_r += mem_f
                if held_r > peak_r:
                    peak_r = held_r
                append(_new_event(Event, (rank, "compute", f"{s}F{mb}", s, mb, F, start, t)))
                if implicit and s != last:
                    dst = s2r[s + 1]
                    if dst != rank:
                        post((dst, _ACT, s, mb), rank, t, d_p2p, SA)
            elif kind is SA or kind is SG:
                peer: int = a.peer  # type: ignore[assignment]  # sends always name a peer
                key = (peer, _ACT if kind is SA else _GRAD, s, mb)
                link = link_base + peer
                start = link_free.get(link, 0.0)
                if t > start:
                    start = t
                arrival = start + d_p2p
                link_free[link] = arrival
                arrivals[key] = arrival
                woken = waiting.pop(key, None)
                if woken is not None:
                    ready.append(woken)
                if d_p2p > 0:
                    label = f"{s}{'SA' if kind is SA else 'SG'}{mb}>{peer}"
                    append(_new_event(Event, (rank, "p2p", label, s, mb, kind, start, arrival)))
            elif kind is RA or kind is RG:
                pass  # posted without blocking; the consumer waits for the data
            elif kind is B or kind is I:
                start = t
                if s != last and s2r[s + 1] != rank:
                    need = (rank, _GRAD, s + 1, mb)
                    arrival = arrivals.get(need)
                    if arrival is None:
                        break
                    need = None
                    if arrival > start:
                        start = arrival
                if evicted_r and (s, mb) in evicted_r:
                    need = (rank, _RESTORE, s, mb)
                    arrival = arrivals.get(need)
                    if arrival is None:
                        break
                    need = None
                    if arrival > start:
                        start = arrival
                if kind is B:
                    t = start + d_b
                    busy_r += d_b
                    held_r += mem_b
                    label = f"{s}B{mb}"
                else:
                    t = start + d_i
                    busy_r += d_i
                    held_r += mem_i
                    label = f"{s}I{mb}"
                append(_new_event(Event, (rank, "compute", label, s, mb, kind, start, t)))
                if implicit and s:
                    dst = s2r[s - 1]
                    if dst != rank:
                        post((dst, _GRAD, s, mb), rank, t, d_p2p, SG)
            elif kind is W:
                start = t
                t = start + d_w
                busy_r += d_w
                held_r += mem_w
                append(_new_event(Event, (rank, "compute", f"{s}W{mb}", s, mb, W, start, t)))
            elif kind is GS or kind is PS:
                start = dp_free[rank]
                if t > start:
                    start = t
                end = start + (d_gs if kind is GS else d_ps)
                dp_free[rank] = end
                if kind is PS:
                    ps_r[s] = end
                if end > start:
                    append(_new_event(Event, (rank, "dp", str(a), s, None, kind, start, end)))
            elif kind is RS:  # the acceptor returns what its AC took in: wait for it first
                need = (rank, _EVICT, s, mb)
                arrival = arrivals.get(need)
                if arrival is None:
                    break
                need = None
                if arrival > t:
                    t = arrival
                held_r += mem[kind]
                peer = a.peer  # type: ignore[assignment]
                post((peer, _RESTORE, s, mb), rank, t, d_evict, kind)
            elif kind is EV:
                evicted_r.add((s, mb))
                held_r += mem[kind]
                peer = a.peer  # type: ignore[assignment]
                post((peer, _EVICT, s, mb), rank, t, d_evict, kind)
            else:  # AC, LD: posted without blocking, and they take activations in
                held_r += mem[kind]
                if held_r > peak_r:
                    peak_r = held_r
            i += 1
        cursor[rank] = i
        clock[rank] = t
        busy[rank] = busy_r
        gather_wait[rank] = wait_r
        held[rank] = held_r
        peak[rank] = peak_r
        if need is not None:
            waiting[need] = rank
            blocked[rank] = (i, need)
        else:
            blocked.pop(rank, None)

    if blocked:
        marks = {
            (rank, position): f"waits for {_WHAT[what]} {stage}/{microbatch}"
            for rank, (position, (_, what, stage, microbatch)) in sorted(blocked.items())
        }
        raise ScheduleError(
            f"cannot simulate {schedule.name!r}: deadlock: ranks {sorted(blocked)} each wait for "
            f"a message that is never sent\n{format_schedule(schedule, marks=marks)}"
        )
    return _Run(events, clock, dp_free, busy, gather_wait, peak)
