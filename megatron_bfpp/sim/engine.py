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

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple

from megatron_bfpp.ir import (
    MEMORY_DELTA,
    ActionKind,
    Schedule,
    ScheduleError,
    format_schedule,
    paused_gc,
)
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
# A message: an integer for activations and gradients, a tuple otherwise (see _run).
_Key = int | tuple[int, int, int, int]


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


@paused_gc()  # one tuple per event and message, none freed: see paused_gc
def simulate(schedule: Schedule, costs: CostModel = CostModel()) -> SimResult:  # noqa: B008
    """Time ``schedule`` (one that ``validate_schedule`` accepts) under ``costs``.

    Raises ``ScheduleError`` showing the per-rank grid if the programs deadlock.
    """
    try:
        run = _run(schedule, costs)
    except IndexError as error:  # a stage outside the layout: validate would have said so
        raise ScheduleError(
            f"cannot simulate {schedule.name!r}: an action names a stage outside the layout "
            f"({error}); run validate_schedule for details"
        ) from None
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


class _Wires:
    """The point-to-point side of a run: when each directed link is next free, when each
    message arrives, which rank waits for which message, the ranks ready to continue, and the
    events drawn so far."""

    __slots__ = ("arrivals", "events", "link_free", "num_ranks", "ready", "waiting")

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.link_free: dict[int, float] = {}  # link src * num_ranks + dst -> free from
        self.arrivals: dict[_Key, float] = {}
        self.waiting: dict[_Key, int] = {}
        self.ready = deque(range(num_ranks))
        self.events: list[Event] = []

    def post(
        self,
        key: _Key,
        src: int,
        dst: int,
        posted: float,
        duration: float,
        stage: int,
        mb: int,
        kind: ActionKind,
    ) -> None:
        """Send ``key`` from ``src`` to ``dst`` at ``posted``: the implicit sends of a
        compute-only schedule (``kind`` SA / SG) and BPipe's EV / RS. SA / SG of a lowered
        schedule, the bulk, inline the same steps in ``_run``."""
        link = src * self.num_ranks + dst
        start = self.link_free.get(link, 0.0)
        if posted > start:
            start = posted
        arrival = start + duration
        self.link_free[link] = arrival
        self.arrivals[key] = arrival
        woken = self.waiting.pop(key, None)
        if woken is not None:
            self.ready.append(woken)
        if duration > 0:
            label = f"{stage}{kind.value}{mb}>{dst}"
            event = (src, "p2p", label, stage, mb, kind, start, arrival)
            self.events.append(_new_event(Event, event))


def _run(schedule: Schedule, costs: CostModel) -> _Run:
    """The worklist over ranks; see the module docstring for the rules it applies.

    Activation and gradient messages, the bulk, are keyed by one integer,
    ``((microbatch * stride + stage) * 4 + what) * num_ranks + destination``, which is unique
    while stage < stride and destination < num_ranks; the rare messages outside that range (only
    in a schedule validate_schedule rejects) and BPipe's evict / restore messages are keyed by
    the tuple ``(destination, what, stage, microbatch)``.
    """
    layout = schedule.layout
    s2r = layout.stage_to_rank
    num_stages = layout.num_stages
    last = num_stages - 1
    stride = num_stages + 1
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
    # Labels: formatting integers dominates an f-string, so format each number once.
    num_texts = max(stride, schedule.num_microbatches, num_ranks)
    text = [str(n) for n in range(num_texts)]
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
    wires = _Wires(num_ranks)
    arrivals, waiting, link_free = wires.arrivals, wires.waiting, wires.link_free
    ready, events = wires.ready, wires.events
    append, post = events.append, wires.post
    blocked: dict[int, tuple[int, _Key]] = {}

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
        need: _Key | None = None
        key: _Key
        while i < n:
            a = program[i]
            kind = a.kind
            s = a.stage
            mb: int = a.microbatch  # type: ignore[assignment]  # None only for GS / PS
            if kind is F:
                start = t
                if s and s2r[s - 1] != rank:
                    need = (((mb * stride + s - 1) << 2) + _ACT) * num_ranks + rank
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
                label = f"{text[s]}F{text[mb]}" if mb < num_texts else f"{s}F{mb}"
                append(_new_event(Event, (rank, "compute", label, s, mb, F, start, t)))
                if implicit and s != last:
                    dst = s2r[s + 1]
                    if dst != rank:
                        key = (((mb * stride + s) << 2) + _ACT) * num_ranks + dst
                        post(key, rank, dst, t, d_p2p, s, mb, SA)
            elif kind is SA or kind is SG:
                peer: int = a.peer  # type: ignore[assignment]  # sends always name a peer
                what = _ACT if kind is SA else _GRAD
                link = link_base + peer
                start = link_free.get(link, 0.0)
                if t > start:
                    start = t
                arrival = start + d_p2p
                link_free[link] = arrival
                if s < stride and peer < num_ranks and mb < num_texts:
                    key = (((mb * stride + s) << 2) + what) * num_ranks + peer
                    if d_p2p > 0:
                        sa_sg = "SA" if kind is SA else "SG"
                        label = f"{text[s]}{sa_sg}{text[mb]}>{text[peer]}"
                else:  # outside the layout: a message no consumer can match
                    key = (peer, what, s, mb)
                    label = str(a)
                arrivals[key] = arrival
                woken = waiting.pop(key, None)
                if woken is not None:
                    ready.append(woken)
                if d_p2p > 0:
                    append(_new_event(Event, (rank, "p2p", label, s, mb, kind, start, arrival)))
            elif kind is RA or kind is RG:
                pass  # posted without blocking; the consumer waits for the data
            elif kind is B or kind is I:
                start = t
                if s != last and s2r[s + 1] != rank:
                    need = (((mb * stride + s + 1) << 2) + _GRAD) * num_ranks + rank
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
                    label = f"{text[s]}B{text[mb]}" if mb < num_texts else f"{s}B{mb}"
                else:
                    t = start + d_i
                    busy_r += d_i
                    held_r += mem_i
                    label = f"{text[s]}I{text[mb]}" if mb < num_texts else f"{s}I{mb}"
                append(_new_event(Event, (rank, "compute", label, s, mb, kind, start, t)))
                if implicit and s:
                    dst = s2r[s - 1]
                    if dst != rank:
                        key = (((mb * stride + s) << 2) + _GRAD) * num_ranks + dst
                        post(key, rank, dst, t, d_p2p, s, mb, SG)
            elif kind is W:
                start = t
                t = start + d_w
                busy_r += d_w
                held_r += mem_w
                # W is the one compute action whose stage no lookup above has bounded.
                in_range = s < num_texts and mb < num_texts
                label = f"{text[s]}W{text[mb]}" if in_range else f"{s}W{mb}"
                append(_new_event(Event, (rank, "compute", label, s, mb, W, start, t)))
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
                post((peer, _RESTORE, s, mb), rank, peer, t, d_evict, s, mb, kind)
            elif kind is EV:
                evicted_r.add((s, mb))
                held_r += mem[kind]
                peer = a.peer  # type: ignore[assignment]
                post((peer, _EVICT, s, mb), rank, peer, t, d_evict, s, mb, kind)
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
        raise _deadlock(schedule, blocked, stride, num_ranks)
    return _Run(events, clock, dp_free, busy, gather_wait, peak)


def _deadlock(
    schedule: Schedule, blocked: dict[int, tuple[int, _Key]], stride: int, num_ranks: int
) -> ScheduleError:
    marks = {
        (rank, position): "waits for " + _describe(need, stride, num_ranks)
        for rank, (position, need) in sorted(blocked.items())
    }
    return ScheduleError(
        f"cannot simulate {schedule.name!r}: deadlock: ranks {sorted(blocked)} each wait for "
        f"a message that is never sent\n{format_schedule(schedule, marks=marks)}"
    )


def _describe(key: _Key, stride: int, num_ranks: int) -> str:
    """``act 3/5`` for a message key: what, stage, micro-batch."""
    if isinstance(key, tuple):
        _, what, stage, microbatch = key
    else:
        rest = key // num_ranks
        what = rest & 3
        stage, microbatch = (rest >> 2) % stride, (rest >> 2) // stride
    return f"{_WHAT[what]} {stage}/{microbatch}"
