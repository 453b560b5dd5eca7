"""How a schedule executes: the rules that the validator, the simulator and the passes share. Each
rank runs its program in order, under these rules:

* A send (SA, SG, EV, RS) is posted without waiting; its data leaves when its link is free.
* A receive (RA, RG, AC, LD) is posted without waiting; the rank waits for the data only at the
  action that consumes it: F for its input activation when the previous stage is on another
  rank, B / I for its output gradient when the next stage is, and also, once an LD has brought
  them back, for the evicted activations; RS for the activations its AC took in.
* Between two ranks the k-th receive posted matches the k-th send posted (NCCL and gloo match
  by posting order); the validator proves both sides post the same messages in the same order,
  so matching a receive to "its" message (the replay's way) is the same thing.
* Two waits only order, they cost no time: AC reads the eviction's size header before any later
  receive from the evictor, so it waits for the evict to be sent; and the first compute after an
  EV (RS) waits until the partner has posted the matching AC (LD), because the runtime releases
  the payload's buffer there (gloo sends are only known done once waited for).
* A compute-only schedule (no SA/RA/SG/RG) runs as if every compute action sent its result to
  the neighbour stage's rank the moment it finished, which is what ``add_communication`` adds.
* The composite rule: a composite (``OVERLAP_F_B``, ``3F5&1B2``) runs its parts as one compute
  action. It waits for everything each part waits for before it starts, runs them for the sum
  of their durations, less the all-to-all each hides under the other's compute if it is one of
  ``combined_pairs`` (``action_duration``, ``Timing.a2a``, ``Rules.hidden``), holds its
  forward's activations before its backward frees its own (the peak counts both:
  ``ir.stored_counts``), and what its parts send leaves after it (lowered: its SA / SG follow
  it; compute-only: at its end). Every other rule applies to each part as to that action alone.
* A rank that needs a message nobody has sent yet stops until it is sent. When every unfinished
  rank is stopped, the schedule deadlocks, and each stuck rank is marked where it waits.

``Rules`` holds them as tables, ``Wires`` drives a run's programs (linear in actions); ``replay``
times a run under ``Timing`` (sends occupy their directed link in posting order, GS / PS on one
data-parallel lane per rank), ``lockstep_replay`` on the lock-step channel, ``run_recorded`` runs
the validator's records without clocks (docs/architecture.md, "One interpreter")."""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cached_property, partial
from typing import Literal, NamedTuple, TypeVar

from megatron_bfpp.ir import (
    COMPUTE_KINDS,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    _kind_of,
    parts,
    paused_gc,
    primitives,
)
from megatron_bfpp.messages import (
    ACT,
    EVICT,
    EVICT_POSTED,
    GRAD,
    RESTORE,
    RESTORE_POSTED,
    WHAT,
    Message,
    has_communication,
)

__all__ = [
    "RS_DELAY",
    "TIMING_SCALARS",
    "Ends",
    "Event",
    "Lane",
    "Program",
    "Recorded",
    "Replay",
    "Rules",
    "Timeline",
    "Timing",
    "Transfer",
    "Wires",
    "action_duration",
    "combined_pairs",
    "compute_durations",
    "compute_ends",
    "describe_waits",
    "lockstep_replay",
    "match_channels",
    "planned_forwards",
    "replay",
    "run_recorded",
    "stage_durations",
    "transfer_durations",
]

K = ActionKind
T = TypeVar("T")
Number = TypeVar("Number", int, float)
Lane = Literal["compute", "p2p", "dp"]


@dataclass(frozen=True, slots=True)
class Timing:
    """Durations of one replay, already scaled to the stage (``CostModel.exact`` derives them):
    ``p2p`` one activation or gradient message on its link, ``transfer`` one BPipe evict or
    restore, ``grad_sync`` / ``param_sync`` one GS / PS on the data-parallel lane. The defaults
    (a forward 1, a backward 2 of which W is half, communication free) are ``CostModel``'s."""

    forward: float = 1.0
    backward: float = 2.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    p2p: float = 0.0
    transfer: float = 0.0
    grad_sync: float = 0.0
    param_sync: float = 0.0
    a2a: float = 0.0  # the expert all-to-all inside each F, B and I (combined pairs hide it)
    # Uneven stages: per global stage its (F, B, I, W) durations, in place of the four above
    # (``CostModel.exact`` with stage weights); empty: every stage takes those.
    stages: tuple[tuple[float, float, float, float], ...] = ()
    # Uneven stages: per global stage its ``transfer`` (what it stores, moved); empty: ``transfer``
    stage_transfers: tuple[float, ...] = ()


# Timing's one-number fields: all but its per-stage rows
TIMING_SCALARS = tuple(
    f.name for f in fields(Timing) if f.name not in ("stages", "stage_transfers")
)

RS_DELAY = 1  # lock-step ticks from an eviction to its return: its payload is in by its tick's end


def compute_durations(timing: Timing) -> dict[ActionKind, float]:
    """Each plain compute kind's duration under ``timing`` (a composite's: ``action_duration``)."""
    return {
        K.FORWARD: timing.forward,
        K.BACKWARD: timing.backward,
        K.BACKWARD_INPUT: timing.backward_input,
        K.BACKWARD_WEIGHT: timing.backward_weight,
    }


def stage_durations(timing: Timing, num_stages: int) -> dict[ActionKind, tuple[float, ...]]:
    """Each plain compute kind's duration on each global stage: ``Timing.stages`` where the
    stages differ, else the kind's one duration on every stage. Refuses rows that do not
    match the schedule's stages, since a stage without its own cost would be timed as another's."""
    if not timing.stages:
        return {kind: (d,) * num_stages for kind, d in compute_durations(timing).items()}
    if len(timing.stages) != num_stages:
        raise ScheduleError(
            f"the timing has costs for {len(timing.stages)} stages, the schedule has "
            f"{num_stages}: give one weight per global stage (pp x vp)"
        )
    return dict(zip(compute_durations(timing), zip(*timing.stages, strict=True), strict=True))


def transfer_durations(timing: Timing, num_stages: int) -> tuple[float, ...]:
    """Each global stage's BPipe evict / restore: ``Timing.stage_transfers`` where the stages
    store different amounts, else ``transfer`` on every stage; refuses rows of another length."""
    if not timing.stage_transfers:
        return (timing.transfer,) * num_stages
    if len(timing.stage_transfers) != num_stages:
        raise ScheduleError(
            f"the timing has transfers for {len(timing.stage_transfers)} stages, the schedule "
            f"has {num_stages}: give one per global stage (pp x vp)"
        )
    return timing.stage_transfers


def action_duration(
    durations: Mapping[ActionKind, Sequence[Number]], action: Action, a2a: Number = 0
) -> Number:
    """A compute's duration from each kind's on its stage (``stage_durations``). A composite (F,
    then B or I) runs on two streams, as DualPipe and megatron-core's combined 1F1B do: each
    part's all-to-all (``a2a``) hides under the other part's compute, never under its own; with
    ``a2a`` 0, the parts' sum."""
    if action.kind is not K.OVERLAP_F_B:
        return durations[action.kind][action.stage]
    f, b = (durations[p.kind][p.stage] - a2a for p in parts(action))  # each part's compute
    return f + b + max(0, a2a - b) + max(0, a2a - f)


def planned_forwards(program: Sequence[Action]) -> frozenset[tuple[int, int | None]]:
    """(stage, micro-batch) of the forwards a rank can run through megatron-core's schedule
    plans (``--overlap-moe-expert-parallel-comm``): those whose backward is a whole B. A plan
    runs its backward whole, so a forward whose backward is split (I, W) runs the plain way."""
    return frozenset(
        (a.stage, a.microbatch) for _, a in primitives(program) if a.kind is K.BACKWARD
    )


def combined_pairs(program: Sequence[Action]) -> frozenset[int]:
    """Positions of the overlapped pairs that run as megatron-core's combined forward-backward
    step, hiding each part's all-to-all under the other's compute: a forward of
    ``planned_forwards`` with a whole B. Any other pair runs F then B and hides nothing."""
    planned = planned_forwards(program)
    pairs = ((i, parts(a)) for i, a in enumerate(program) if a.kind is K.OVERLAP_F_B)
    return frozenset(
        i for i, (f, b) in pairs if b.kind is K.BACKWARD and (f.stage, f.microbatch) in planned
    )


class Event(NamedTuple):
    """One busy interval on one lane of one rank: ``compute`` (F/B/I/W, every one), ``p2p`` (a
    send occupying its link, drawn on the sender) or ``dp`` (GS / PS); communication that takes
    no time leaves none. ``label`` is the action's text, e.g. ``3F5``."""

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


class Replay(NamedTuple):
    """What ``replay`` found, in ``Timing``'s units (integers if its durations are): ``blocked``,
    each rank that cannot finish -> (position, awaited message); ``events``: from ``timeline``."""

    blocked: dict[int, tuple[int, Message]]
    timeline: Timeline
    compute_end: list[float]  # per rank: its clock after its last action
    dp_end: list[float]  # per rank: when its data-parallel lane is done
    busy: list[float]  # per rank: sum of compute durations
    gather_wait: list[float]  # per rank: time computes waited for their stage's PS

    @property
    def events(self) -> tuple[Event, ...]:
        return self.timeline.events()


@paused_gc()  # one tuple per event and message, none freed: see paused_gc
def replay(schedule: Schedule, timing: Timing = Timing()) -> Replay:
    """Run every program under the rules above with clocks and events (memory is counted in program
    order: ``ir.stored_counts``). Raises ``ScheduleError`` for an action naming a stage outside the
    layout (``validate_schedule`` says why); a message to a rank outside it reaches nobody."""
    run = _replayed(schedule, timing)
    timeline = Timeline(run.rules, timing, run.starts)
    return Replay(run.stuck(), timeline, run.clock, run.dp_free, run.busy, run.waited)


def _replayed(schedule: Schedule, timing: Timing, implicit: bool | None = None) -> Wires:
    """One run of ``replay``, again with ids for any micro-batch after an IndexError (a
    micro-batch past the count); a stage outside the layout is a ``ScheduleError``."""
    rules = Rules(schedule, implicit=implicit)
    for _ in range(2):
        try:
            run = Wires(rules, timing)
            run.run([_timed(run, rank) for rank in range(rules.num_ranks)])
            return run
        except IndexError:  # a micro-batch past the count, or a stage outside the layout
            rules = Rules(schedule, implicit=rules.implicit, any_microbatch=True)
    raise ScheduleError(
        f"{rules.schedule.name!r}: an action names a stage outside the layout; run "
        "validate_schedule for details"
    )


def lockstep_replay(rules: Rules, timing: Timing) -> Wires:
    """Every program under ``timing`` (integers, messages instant) on the lock-step channel, where
    messages match by id whoever they name and BPipe's transfers wait as the posting does
    (``Wires.transfer``): ``Wires.starts`` and the messages' arrivals are the posting's ticks."""
    run = Wires(rules, timing, lockstep=True)
    run.run([_timed(run, rank) for rank in range(rules.num_ranks)])
    return run


@paused_gc()
def compute_ends(schedule: Schedule, timing: Timing = Timing()) -> Ends:
    """When each compute action of a compute-only F / B / I / W schedule ends under ``replay``
    (per rank, in program order), and the ranks stuck: what a planning pass needs, cheaper.
    Raises ``ScheduleError`` for a lowered schedule or a stage outside the layout."""
    kinds: set[ActionKind] = set().union(*(map(_kind_of, actions) for actions in schedule.per_rank))
    if not kinds <= COMPUTE_KINDS:
        raise ScheduleError(
            "compute_ends takes a compute-only schedule of F, B, I and W; use replay for "
            f"{', '.join(sorted(kind.value for kind in kinds - COMPUTE_KINDS))}"
        )
    run = _replayed(schedule, timing, implicit=True)
    return Ends([_ends(run, rank) for rank in range(len(run.starts))], run.stuck())


def _ends(run: Wires, rank: int) -> list[float]:
    """A compute-only rank's compute ends from the starts ``_timed`` recorded: one per compute,
    each followed by its implicit send's when messages take time (``Timeline._rank_events``)."""
    timing, starts, sends_for = run.durations, run.starts[rank], run.rules.sends_for
    duration = run.computes
    actions = run.rules.schedule.per_rank[rank]
    if timing.p2p == 0:
        return [
            start + duration[a.kind][a.stage] for a, start in zip(actions, starts, strict=False)
        ]
    ends, at = [], 0
    for a in actions[: len(starts)]:
        if at >= len(starts):
            break
        ends.append(starts[at] + duration[a.kind][a.stage])
        at += 2 if sends_for[a.kind][a.stage] else 1
    return ends


class Ends(NamedTuple):
    """What ``compute_ends`` found: per rank its compute ends so far, and ``Replay.blocked``."""

    ends: list[list[float]]
    blocked: dict[int, tuple[int, Message]]


def describe_waits(blocked: dict[int, tuple[int, Message]]) -> dict[tuple[int, int], str]:
    """Grid marks for a deadlock: ``waits for act 3/5`` under each stuck action."""
    return {
        (rank, position): f"waits for {message.what} {message.stage}/{message.microbatch}"
        for rank, (position, message) in blocked.items()
    }


_F, _B, _I, _W = K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT
_SA, _RA, _SG, _RG = K.SEND_ACT, K.RECV_ACT, K.SEND_GRAD, K.RECV_GRAD
_EV, _AC, _RS, _LD = K.EVICT, K.ACCEPT, K.RESTORE, K.LOAD
_GS, _PS, _RL = K.GRAD_SYNC, K.PARAM_SYNC, K.RELEASE
_FB = K.OVERLAP_F_B


Program = Iterator[tuple[int, int]]  # a rank's program under way: see Wires.run


class Rules:
    """The rules of one schedule as per-stage tables of message ids of micro-batch 0 (``id``; add
    the micro-batch; 0: no message), read ``table[kind][stage]``: ``waits_for`` what an F (B / I)
    waits for from another rank, ``outputs`` what it sends to the neighbour stage's rank
    ``output_rank`` (-1: none), ``sends_for`` ``outputs`` where a compute-only schedule sends
    them without an SA / SG; ``base[what]``; ``transfers[kind]``: BPipe's (``Transfer``). A
    composite has no row: the composite rule applies them to each of its parts."""

    def __init__(
        self, schedule: Schedule, *, implicit: bool | None = None, any_microbatch: bool = False
    ) -> None:
        """``implicit``: whether the schedule is compute-only, when the caller already knows
        (finding out reads every action). ``any_microbatch``: ids for every micro-batch an
        action names, not only those below the count (which costs a pass over every action)."""
        s2r = schedule.layout.stage_to_rank
        num_stages = self.num_stages = len(s2r)
        self.schedule, self.num_ranks = schedule, len(schedule.per_rank)
        self.span = num_stages + 2  # message stages run from -1 to num_stages
        microbatches = schedule.num_microbatches
        if any_microbatch:
            named = (action.microbatch or 0 for actions in schedule.per_rank for action in actions)
            microbatches = max(max(named, default=0) + 1, microbatches)
        self.microbatches = max(microbatches, 1)
        # Activations and gradients have ids below ``limit``; BPipe's messages, whose partner is
        # free, are keyed ``id * num_ranks + rank`` (``addressed``), at or above it.
        self.limit = 2 * self.span * self.microbatches
        self.implicit = not has_communication(schedule) if implicit is None else implicit
        base = self.base = [[self.id(what, s, 0) for s in range(num_stages)] for what in range(6)]
        act_from, grad_from, act_to, grad_to, none = ([0] * num_stages for _ in range(5))
        act_rank, grad_rank, no_rank = ([-1] * num_stages for _ in range(3))
        for s in range(1, num_stages):
            if s2r[s - 1] != s2r[s]:
                act_from[s] = act_to[s - 1] = base[ACT][s - 1]
                grad_from[s - 1] = grad_to[s] = base[GRAD][s]
                act_rank[s - 1], grad_rank[s] = s2r[s], s2r[s - 1]
        self.waits_for = {_F: act_from, _B: grad_from, _I: grad_from, _W: none}
        self.outputs = {_F: act_to, _B: grad_to, _I: grad_to, _W: none}
        self.output_rank = {_F: act_rank, _B: grad_rank, _I: grad_rank, _W: no_rank}
        self.sends_for = self.outputs if self.implicit else dict.fromkeys(self.outputs, none)
        table = [*base, [-1] * num_stages]  # -1, the last row: nothing
        self.transfers = {
            kind: Transfer(table[waits], table[sends], table[awaits], sends in (EVICT, RESTORE))
            for kind, (waits, sends, awaits) in _TRANSFER_RULES.items()
        }

    def id(self, what: int, stage: int, microbatch: int) -> int:
        """A message's id: ``(what * span + stage + 1) * microbatches + microbatch``, the one
        integer form of a message. Both sides compute the same one, and ids sort as (kind code,
        stage, micro-batch) do, which is the canonical order of a batch's ops (``nccl``)."""
        return (what * self.span + stage + 1) * self.microbatches + microbatch

    def message(self, key: int, keyed: bool = False) -> Message:
        """The message of an id; ``keyed``: of a run's key (an id, or BPipe's addressed key)."""
        if keyed and key >= self.limit:
            key //= self.num_ranks
        rest, microbatch = divmod(key, self.microbatches)
        what, stage = divmod(rest, self.span)
        return Message(WHAT[what], stage - 1, microbatch)

    @cached_property
    def combined(self) -> list[frozenset[int]]:
        """Per rank, ``combined_pairs``: found once per schedule, read by every timing model."""
        return [combined_pairs(actions) for actions in self.schedule.per_rank]

    def hidden(self, rank: int, position: int, a2a: Number) -> Number:
        """The all-to-all the composite at ``position`` hides (``action_duration``'s ``a2a``):
        all of it in a combined pair; none in a pair the runtime runs as F then B."""
        return a2a if a2a and position in self.combined[rank] else 0

    def restored(self, rank: int, position: int) -> int:
        """The restore rule: the position in ``rank``'s program where the LD at ``position`` is
        waited for, -1 none: the next B / I of its stage and micro-batch (in a composite too)."""
        actions = self.schedule.per_rank[rank]
        key = (actions[position].stage, actions[position].microbatch)
        for later in range(position + 1, len(actions)):
            action = actions[later]
            if action.kind is _FB:
                action = parts(action)[-1]
            if action.kind in _RESTORED and (action.stage, action.microbatch) == key:
                return later
        return -1

    def transfer_waits(self, action: Action) -> Message | None:
        """What a transfer waits for: RS its payload, AC the size header; None for EV / LD."""
        base = self.transfers[action.kind].waits[action.stage]
        return None if base < 0 else self.message(base + (action.microbatch or 0))

    def awaits(self, action: Action) -> bool:
        """Whether the next compute after this transfer (EV / RS) waits until the partner has
        posted its receive (``Transfer.awaits``): the one statement of that BPipe rule."""
        return self.transfers[action.kind].awaits[action.stage] >= 0


def match_channels(sent: Sequence[T], received: Sequence[T]) -> Iterator[tuple[T, T | None]]:
    """Pair the messages of one channel (sender -> receiver): the k-th send posted matches the
    k-th receive posted, as NCCL and gloo match them; a send without its receive pairs with
    None. The one statement of that rule (the validator's and the NCCL model's)."""
    for k, item in enumerate(sent):
        yield item, received[k] if k < len(received) else None


class Transfer(NamedTuple):
    """What one kind of BPipe transfer does, per stage as message ids of micro-batch 0 (-1:
    nothing; a key adds the micro-batch and is addressed to a rank, ``Rules.message``): ``waits``
    for an evict (RS: to arrive; AC: its size header), ``sends`` its peer the payload (EV, RS)
    or the acknowledgement of a posted receive (AC, LD), ``awaits`` that acknowledgement before
    the next compute reuses the payload's buffer (EV, RS); all but ``sends`` on its own rank."""

    waits: list[int]
    sends: list[int]
    awaits: list[int]
    carries_data: bool


# kind -> what it (waits for, sends, awaits), -1 for nothing; see Transfer.
_TRANSFER_RULES = {
    _EV: (-1, EVICT, EVICT_POSTED),
    _AC: (EVICT, EVICT_POSTED, -1),
    _RS: (EVICT, RESTORE, RESTORE_POSTED),
    _LD: (-1, RESTORE_POSTED, -1),
}
_RESTORED = frozenset({_B, _I})  # what waits for an LD's restore


class Wires:
    """One run under ``Rules``: its messages (which are sent, when they arrive, which rank waits
    for which), the ranks ready to continue, BPipe's per-rank state, and per rank its clock,
    links, data-parallel lane and events. ``run`` drives the ranks' programs."""

    def __init__(self, rules: Rules, timing: Timing, *, lockstep: bool = False) -> None:
        """``lockstep``: the lock-step channel, for ``lockstep_replay``."""
        num_ranks = rules.num_ranks
        self.rules, self.lockstep = rules, lockstep
        self.arrivals: dict[int, float] = {}  # message key -> arrival time
        self.waiting: dict[int, int] = {}  # message key -> the rank stopped for it
        self.at = [0] * num_ranks  # where each stopped rank waits: a position in its program
        self.ready = deque(range(num_ranks))
        # Per rank: position -> the restore a backward there waits for (``Rules.restored``).
        self.restores: list[dict[int, int]] = [{} for _ in range(num_ranks)]
        self.awaiting: list[list[int]] = [[] for _ in range(num_ranks)]  # see transfer
        self.acked: list[float] = [0] * num_ranks  # the latest acknowledgement's arrival
        # Lock-step: BPipe's transfers (acknowledgement key -> payload key, earliest, rank) and
        # posted receives (acknowledgement key -> tick) each waiting for the other (``_meet``).
        self.offered: dict[int, tuple[int, float, int]] = {}
        self.posted: dict[int, float] = {}
        self.delay = RS_DELAY if lockstep else 0  # from an eviction to the RS returning it
        self.durations = timing
        self.transfers = transfer_durations(timing, rules.num_stages)
        # Activations and gradients index ``flow``, their arrival times (None: not sent).
        self.flow: list[float | None] = [None] * rules.limit
        waits, sends, to = rules.waits_for, rules.sends_for, rules.output_rank
        # per kind, one lookup: duration; per stage what it waits for, sends (0: none) and to whom
        self.computes = stage_durations(timing, rules.num_stages)
        self.compute = {
            kind: (duration, waits[kind], sends[kind], to[kind])
            for kind, duration in self.computes.items()
        }
        # What an SA / SG sends, per stage: (its id of micro-batch 0, the one rank it can reach).
        self.sends = {_SA: (rules.base[ACT], to[_F]), _SG: (rules.base[GRAD], to[_B])}
        self.link_free: dict[int, float] = {}  # src * num_ranks + dst -> free from
        # no-time messages / transfers, integer units (CostModel.exact): no link clocks in _timed
        self.instant = (
            timing.p2p == 0
            and not any(self.transfers)
            and all(type(getattr(timing, name)) is int for name in TIMING_SCALARS)
            and all(type(d) is int for row in timing.stages for d in row)
        )
        # Clocks start at integer 0, so integer durations (CostModel.exact) stay integers.
        self.clock: list[float] = [0] * num_ranks
        self.dp_free: list[float] = [0] * num_ranks
        self.busy: list[float] = [0] * num_ranks
        self.waited: list[float] = [0] * num_ranks  # for gathers
        self.ps_done: list[dict[int, float]] = [{} for _ in range(num_ranks)]
        self.starts: list[list[float]] = [[] for _ in range(num_ranks)]  # see Timeline

    def _occupy(self, rank: int, dst: int, posted: float, duration: float) -> float:
        """Arrival over link ``rank`` -> ``dst``, one at a time from ``posted``; start noted."""
        link = rank * self.rules.num_ranks + dst
        start = max(self.link_free.get(link, 0), posted)
        arrival = self.link_free[link] = start + duration
        if duration > 0:
            self.starts[rank].append(start)
        return arrival

    def run(self, programs: list[Program]) -> None:
        """Resume ranks while any can move. A program is a generator of (position, message key)
        that it yields when its action at ``position`` needs a message nobody has sent; the
        rank is resumed once the message is sent (whoever sends it wakes it: ``signal``)."""
        ready, waiting, at = self.ready, self.waiting, self.at
        while ready:
            rank = ready.popleft()
            stopped = next(programs[rank], None)
            if stopped is not None:
                at[rank], key = stopped
                waiting[key] = rank

    def stuck(self) -> dict[int, tuple[int, Message]]:
        """Each rank that cannot finish: (position in its program, the message it waits for)."""
        message, at = self.rules.message, self.at
        stuck = ((rank, (at[rank], message(key, True))) for key, rank in self.waiting.items())
        return dict(sorted(stuck))

    def signal(self, key: int, arrival: float = 0.0) -> None:
        self.arrivals[key] = arrival
        woken = self.waiting.pop(key, None)
        if woken is not None:
            self.ready.append(woken)

    def unacknowledged(self, rank: int) -> int:
        """The first acknowledgement a compute action on ``rank`` still waits for, else -1
        (and then none is awaited any more: ``acked`` holds the latest's arrival)."""
        awaiting, arrivals = self.awaiting[rank], self.arrivals
        for key in awaiting:
            if key not in arrivals:
                return key
        if self.lockstep:  # the latest tick (gloo's acknowledgements cost no time)
            self.acked[rank] = max(self.acked[rank], *map(arrivals.__getitem__, awaiting))
        awaiting.clear()
        return -1

    def unfinished(self) -> list[int]:
        """The ranks stopped, or (lock-step) with a transfer whose partner never posts."""
        return sorted({*self.waiting.values(), *(rank for _, _, rank in self.offered.values())})

    def transfer(self, rank: int, position: int, t: float) -> tuple[float, int]:
        """BPipe's EV / AC / RS / LD at ``position`` under ``Rules.transfers``: (the rank's clock
        after it, the message key it waits for, or -1 once done). What is sent to a rank outside
        the layout reaches nobody. Lock-step: keys name no rank (messages match by id, whoever
        they name, as the posting pairs them), AC posts without reading the header (the posting
        puts it in the eviction's batch), and EV / RS meet their AC / LD (``_meet``)."""
        rules, action = self.rules, self.rules.schedule.per_rank[rank][position]
        s, mb, kind = action.stage, action.microbatch or 0, action.kind
        if s >= rules.num_stages or mb >= rules.microbatches:
            raise IndexError(s)  # reported like any stage outside the layout
        peer: int = action.peer  # type: ignore[assignment]  # point-to-point: never None
        rule, num_ranks, lockstep = rules.transfers[kind], rules.num_ranks, self.lockstep
        here = 0 if lockstep else rank
        earliest = t
        if (base := rule.waits[s]) >= 0 and (not lockstep or rule.carries_data):
            arrival = self.arrivals.get(evict := (base + mb) * num_ranks + here)
            if arrival is None:
                return t, evict
            if rule.carries_data and (arrival := arrival + self.delay) > t:
                earliest = arrival  # RS: once the payload it returns is in
        if lockstep:
            self._meet(rule, s, mb, earliest, rank)
        elif peer < num_ranks:
            key = (rule.sends[s] + mb) * num_ranks + peer
            if rule.carries_data:  # EV / RS: the payload occupies its link (_occupy)
                self.signal(key, self._occupy(rank, peer, earliest, self.transfers[s]))
            else:
                self.signal(key)
        if (base := rule.awaits[s]) >= 0:
            self.awaiting[rank].append((base + mb) * num_ranks + here)
        if kind is _LD and (later := rules.restored(rank, position)) >= 0:
            self.restores[rank][later] = (rules.base[RESTORE][s] + mb) * num_ranks + here
        return (t if lockstep else earliest), -1

    def _meet(self, rule: Transfer, stage: int, microbatch: int, at: float, rank: int) -> None:
        """Lock-step: an EV / RS (its payload) or its partner's AC / LD posted at tick ``at``
        (keys name no rank). The payload goes, and is acknowledged, at the later of the two's
        ticks once both are posted: the next compute waits for that (``unacknowledged``)."""
        num_ranks = self.rules.num_ranks
        sent = (rule.sends[stage] + microbatch) * num_ranks
        if not rule.carries_data:  # AC / LD: ``sent`` acknowledges
            if (offer := self.offered.pop(sent, None)) is None:
                self.posted[sent] = at
                return
            acknowledgement, payload, at = sent, offer[0], max(offer[1], at)
        else:
            acknowledgement, payload = (rule.awaits[stage] + microbatch) * num_ranks, sent
            if (posted := self.posted.pop(acknowledgement, None)) is None:
                self.offered[acknowledgement] = (payload, at, rank)
                return
            at = max(at, posted)
        self.signal(payload, at)
        self.signal(acknowledgement, at)


class Recorded(NamedTuple):
    """One rank's program recorded rather than run (the validator's way, see ``run_recorded``):
    ``ops`` in program order, ``key`` to send a message and ``~key`` to wait for one (ids and
    addressed keys, ``Rules.message``), and ``wait_at``, each wait's program position, unboxed."""

    ops: list[int]
    wait_at: array[int]


def run_recorded(rules: Rules, programs: list[Recorded]) -> dict[int, tuple[int, Message]]:
    """``Wires.run`` for recorded programs, without clocks: which ranks cannot finish, as
    ``Wires.stuck`` (docs/architecture.md, "Performance of the shared rules", says why)."""
    limit = rules.limit  # activations and gradients: a flag each, BPipe's messages in a set
    sent = bytearray(limit)
    sent_beyond: set[int] = set()  # BPipe's messages
    waiting: dict[int, int] = {}
    # each rank's ops as one iterator, left where it stopped: it is woken once that is sent
    rest = [iter(program.ops) for program in programs]
    ready = deque(range(len(programs)))
    while ready:
        rank = ready.popleft()
        for op in rest[rank]:
            if op >= 0:
                if op < limit:
                    sent[op] = 1
                else:
                    sent_beyond.add(op)
                if op in waiting:
                    ready.append(waiting.pop(op))
            elif (need := ~op) < limit:
                if not sent[need]:
                    waiting[need] = rank
                    break
            elif need not in sent_beyond:
                waiting[need] = rank
                break
    stuck = {}
    for key, rank in waiting.items():
        ops = programs[rank].ops
        # Where the rank stopped: its first wait for the key (messages are never unsent).
        waits_before = sum(1 for op in ops[: ops.index(~key)] if op < 0)
        stuck[rank] = (programs[rank].wait_at[waits_before], rules.message(key, True))
    return dict(sorted(stuck.items()))


def _timed(run: Wires, rank: int) -> Program:
    """``rank``'s program under ``Wires.run``, keeping its clock: the hot loop of ``replay``."""
    rules, record = run.rules, run.starts[rank].append
    program, flow, waiting = rules.schedule.per_rank[rank], run.flow, run.waiting
    ready, link_free, compute, d_p2p = run.ready, run.link_free, run.compute, run.durations.p2p
    (act_keys, act_peers), (grad_keys, grad_peers) = run.sends[_SA], run.sends[_SG]
    microbatches, num_ranks = rules.microbatches, rules.num_ranks
    link_base = rank * num_ranks
    restores_r, awaiting_r, arrivals = run.restores[rank], run.awaiting[rank], run.arrivals
    ps_r, t, busy_r, wait_r = run.ps_done[rank], run.clock[rank], run.busy[rank], run.waited[rank]
    instant, blind = run.instant, run.lockstep  # lock-step: sends match by id, whoever they name
    key: int | None
    peer: int
    for i, a in enumerate(program):
        kind = a.kind
        if kind is _RA or kind is _RG:
            continue  # posted without waiting: the consumer waits (the next third of them)
        s = a.stage
        mb: int = a.microbatch  # type: ignore[assignment]  # None only for GS / PS
        if kind is _SA:  # sends first: no lookup for a third of the actions
            peer = a.peer  # type: ignore[assignment]  # sends always name a peer
            if peer >= num_ranks and not blind:
                continue  # a rank outside the layout: the message reaches nobody
            if mb >= microbatches:
                raise IndexError(mb)  # past the count: _replayed runs again for any
            key = act_keys[s] + mb if peer == act_peers[s] or blind else None
        elif kind is _SG:
            peer = a.peer  # type: ignore[assignment]
            if peer >= num_ranks and not blind:
                continue
            if mb >= microbatches:
                raise IndexError(mb)
            key = grad_keys[s] + mb if peer == grad_peers[s] or blind else None
        elif (spec := compute.get(kind)) is not None:  # F, B, I, W on the compute lane
            start = t
            if awaiting_r:
                while (need := run.unacknowledged(rank)) >= 0:
                    yield i, need
                if run.acked[rank] > start:
                    start = run.acked[rank]
            durations_row, waits_row, sends_row, peers_row = spec
            if mb >= microbatches:
                raise IndexError(mb)
            duration = durations_row[s]
            if need := waits_row[s]:
                if (arrival := flow[need := need + mb]) is None:
                    yield i, need
                    arrival = flow[need]
                if arrival > start:  # type: ignore[operator]  # sent: not None
                    start = arrival  # type: ignore[assignment]
            if restores_r and (need := restores_r.get(i, -1)) >= 0:
                if (arrival := arrivals.get(need)) is None:
                    yield i, need
                    arrival = arrivals[need]
                if arrival > start:
                    start = arrival
            if ps_r and (gathered := ps_r.pop(s, None)) is not None and gathered > start:
                wait_r += gathered - start  # the stage's first compute after its gather (PS)
                start = gathered
            t = start + duration
            busy_r += duration
            record(start)
            if not (key := sends_row[s]):
                continue
            # A compute-only schedule: send the result as its SA / SG would.
            key, peer = key + mb, peers_row[s]
        elif kind is _GS or kind is _PS:  # on the data-parallel lane, in program order, from t
            start = run.dp_free[rank]
            if t > start:
                start = t
            end = start + (run.durations.grad_sync if kind is _GS else run.durations.param_sync)
            run.dp_free[rank] = end
            if kind is _PS:
                ps_r[s] = end
            record(start)  # every GS / PS: Timeline draws those that take time
            continue
        elif kind is _RL:  # frees memory at once, which takes no time
            continue
        elif kind is _FB:  # the composite rule, on this rank's clock (_overlapped)
            run.clock[rank], run.busy[rank], run.waited[rank] = t, busy_r, wait_r
            yield from _overlapped(run, rank, i, a)
            t, busy_r, wait_r = run.clock[rank], run.busy[rank], run.waited[rank]
            continue
        else:  # BPipe's EV / AC / RS / LD
            while (moved := run.transfer(rank, i, t))[1] >= 0:
                yield i, moved[1]
            t = moved[0]
            continue
        if instant:
            if key is not None:
                flow[key] = t
                if key in waiting:
                    ready.append(waiting.pop(key))
            continue
        # its message occupies its link from the clock; one not to the neighbour's (None) is lost
        link = link_base + peer
        start = link_free.get(link, 0)
        if t > start:
            start = t
        link_free[link] = start + d_p2p
        if key is not None:
            flow[key] = start + d_p2p
            if key in waiting:
                ready.append(waiting.pop(key))
        if d_p2p > 0:
            record(start)
    run.clock[rank], run.busy[rank], run.waited[rank] = t, busy_r, wait_r


def _overlapped(run: Wires, rank: int, i: int, composite: Action) -> Program:
    """A composite at ``i`` under the composite rule, run as ``_timed`` runs a compute."""
    flow, compute = run.flow, run.compute
    while run.awaiting[rank] and (need := run.unacknowledged(rank)) >= 0:
        yield i, need
    start = max(run.clock[rank], run.acked[rank])
    for part in parts(composite):
        mb: int = part.microbatch  # type: ignore[assignment]  # compute: never None
        if mb >= run.rules.microbatches:
            raise IndexError(mb)  # past the count: _replayed runs again for any
        if need := compute[part.kind][1][part.stage]:
            if (arrival := flow[need := need + mb]) is None:
                yield i, need
                arrival = flow[need]
            start = max(start, arrival)  # type: ignore[type-var, assignment]  # sent: not None
    if (need := run.restores[rank].get(i, -1)) >= 0:  # its backward's (the last part)
        if (arrival := run.arrivals.get(need)) is None:
            yield i, need
            arrival = run.arrivals[need]
        start = max(start, arrival)
    for part in parts(composite):
        gathered = run.ps_done[rank].pop(part.stage, None)
        if gathered is not None and gathered > start:
            run.waited[rank] += gathered - start
            start = gathered
    run.starts[rank].append(start)
    duration = action_duration(
        run.computes, composite, run.rules.hidden(rank, i, run.durations.a2a)
    )
    t = start + duration
    run.busy[rank] += duration
    run.clock[rank] = t
    for part in parts(composite):  # a compute-only schedule: each part's result, sent now
        _, _, sends_row, peers_row = compute[part.kind]
        if key := sends_row[part.stage]:  # as ``_timed`` sends: over its link unless instant
            key += part.microbatch  # type: ignore[operator]  # compute: never None
            dst = peers_row[part.stage]
            flow[key] = t if run.instant else run._occupy(rank, dst, t, run.durations.p2p)
            if key in run.waiting:
                run.ready.append(run.waiting.pop(key))


class Timeline:
    """The events of one ``replay``, drawn when first asked for (most callers never read them)
    from the start of each busy interval the replay keeps per rank, in program order, with every
    time divided by ``per_unit`` (``CostModel.exact``; past the float range: ``inf``)."""

    __slots__ = ("_events", "per_unit", "rules", "starts", "timing")

    def __init__(
        self, rules: Rules, timing: Timing, starts: list[list[float]], per_unit: int = 1
    ) -> None:
        self.rules, self.timing, self.starts, self.per_unit = rules, timing, starts, per_unit
        self._events: tuple[Event, ...] | None = None

    def scaled(self, per_unit: int) -> Timeline:
        return Timeline(self.rules, self.timing, self.starts, per_unit)

    def events(self) -> tuple[Event, ...]:
        if self._events is None:
            self._events = tuple(
                event for rank in range(len(self.starts)) for event in self._rank_events(rank)
            )
        return self._events

    def _rank_events(self, rank: int) -> Iterator[Event]:
        """``rank``'s events from ``_timed``'s starts, until they run out (deadlock)."""
        rules, timing, starts = self.rules, self.timing, iter(self.starts[rank])
        num_ranks, implicit, sends_for = rules.num_ranks, rules.implicit, rules.sends_for
        computes = stage_durations(timing, rules.num_stages)
        lanes = {_GS: timing.grad_sync, _PS: timing.param_sync}
        transfers = transfer_durations(timing, rules.num_stages)
        sent = {_SA: timing.p2p, _SG: timing.p2p}
        user = partial(_user, self.per_unit)
        for i, a in enumerate(rules.schedule.per_rank[rank]):
            kind, s, mb = a.kind, a.stage, a.microbatch
            if kind in computes or kind is _FB:
                if (start := next(starts, None)) is None:
                    return
                end = start + action_duration(computes, a, rules.hidden(rank, i, timing.a2a))
                yield Event(rank, "compute", str(a), s, mb, kind, user(start), user(end))
                if not (implicit and timing.p2p > 0):
                    continue
                for part in parts(a):  # a composite's parts each send theirs, after it
                    kind, s, mb = part.kind, part.stage, part.microbatch
                    if sends_for[kind][s]:
                        send = _SA if kind is _F else _SG
                        start = next(starts)  # recorded with the compute, no wait between
                        label = f"{s}{send.value}{mb}>{rules.output_rank[kind][s]}"
                        end = start + timing.p2p
                        yield Event(rank, "p2p", label, s, mb, send, user(start), user(end))
                continue
            if kind in lanes:
                if (start := next(starts, None)) is None:
                    return
                if (end := start + lanes[kind]) > start:
                    yield Event(rank, "dp", str(a), s, None, kind, user(start), user(end))
                continue
            duration = transfers[s] if kind is _EV or kind is _RS else sent.get(kind, 0)
            if duration > 0 and a.peer is not None and a.peer < num_ranks:
                if (start := next(starts, None)) is None:
                    return
                end = start + duration
                yield Event(rank, "p2p", str(a), s, mb, kind, user(start), user(end))


def _user(per_unit: int, time: float) -> float:
    """A replay time in the cost model's unit, rounded once; ``inf`` past the float range."""
    try:
        return time / per_unit
    except OverflowError:  # an integer time beyond any float
        return math.inf
