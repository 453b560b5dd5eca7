"""BPipe: each 1F1B *evictor* stage ``x < p // 2`` parks what it would store beyond ``cap``
micro-batches on its *acceptor* ``p - 1 - x`` (EV, AC) and gets it back before the backward (RS,
LD), so no rank stores more than ``cap``: docs/architecture.md, "BPipe's eviction pass"."""

from __future__ import annotations

import heapq
from bisect import bisect_right
from operator import attrgetter

from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    StageLayout,
    unchecked_action,
)
from megatron_bfpp.passes.grad_sync import _spliced
from megatron_bfpp.semantics import compute_ends

__all__ = ["add_eviction", "bpipe_max_stored"]

K = ActionKind
_TRANSFER_KINDS = frozenset({K.EVICT, K.ACCEPT, K.RESTORE, K.LOAD})
_MESSAGE_KINDS = frozenset({K.SEND_ACT, K.RECV_ACT, K.SEND_GRAD, K.RECV_GRAD})


def bpipe_max_stored(num_ranks: int) -> int:
    """BPipe's cap ``ceil((p + 2) / 2)``: the smallest one every evictor/acceptor pair fits in."""
    return (num_ranks + 3) // 2


def add_eviction(schedule: Schedule, *, max_stored: int | None = None) -> Schedule:
    """EV/AC/RS/LD so that no evictor stores more than ``max_stored`` (default: BPipe's cap, which
    the acceptors keep too); below it, an acceptor may hold more, up to the busiest rank's peak
    before (else an error). ``schedule`` itself when no rank exceeds the cap."""
    _check_input(schedule)
    num_ranks = schedule.num_ranks
    cap = bpipe_max_stored(num_ranks) if max_stored is None else max_stored
    if cap < 2:
        raise ScheduleError(
            f"add_eviction: max_stored={cap} leaves no room to load an evicted micro-batch back "
            f"while another is stored; use max_stored=2 or more (BPipe's default for p={num_ranks} "
            f"is {bpipe_max_stored(num_ranks)})"
        )
    result = _evict(schedule, cap)
    if result is schedule:
        return schedule
    if _acceptor_overflow(result, cap) is not None:
        limit = max(cap, max(schedule.peak_activations()))
        if (over := _acceptor_overflow(result, limit)) is not None:
            acceptor, held = over
            raise ScheduleError(
                f"add_eviction: max_stored={cap} is below what this schedule can balance: "
                f"acceptor rank {acceptor} would hold {held:g} micro-batches (its own plus rank "
                f"{num_ranks - 1 - acceptor}'s), more than the cap and more than any rank stores "
                f"without BPipe ({limit:g}); {_what_works(schedule, cap)}"
            )
    return result


def _check_input(schedule: Schedule) -> None:
    """Only compute-only F/B programs on ``StageLayout.looped(p, 1)`` are understood."""
    layout = schedule.layout
    if layout != StageLayout.looped(layout.num_ranks, 1):
        raise ScheduleError(
            f"add_eviction pairs whole 1F1B stages (rank x with rank p-1-x) and needs a "
            f"single-chunk looped layout, StageLayout.looped(p, 1); got a {layout.kind} layout "
            f"with {layout.num_chunks} chunks per rank. Use a 1F1B (or GPipe) schedule, or cap "
            "memory with the interleaved / breadth-first / V-shape schedules instead"
        )
    kinds = {a.kind for actions in schedule.per_rank for a in actions}
    if kinds & _MESSAGE_KINDS:
        raise ScheduleError(
            "add_eviction expects a compute-only schedule but this one already has SA/RA/SG/RG "
            "messages; run add_eviction before add_communication"
        )
    if kinds & _TRANSFER_KINDS:
        raise ScheduleError(
            "add_eviction: the schedule already has BPipe transfers (EV/AC/RS/LD); apply the "
            "pass once, to the compute-only schedule"
        )
    if other := kinds - {K.FORWARD, K.BACKWARD}:
        names = ", ".join(sorted(k.value for k in other))
        raise ScheduleError(
            f"add_eviction handles F and B only, got {names}: use full backwards (no I/W split) "
            "and add gradient/parameter sync (GS/PS) after add_eviction"
        )
    num_microbatches = schedule.num_microbatches
    for rank, actions in enumerate(schedule.per_rank):
        for position, action in enumerate(actions):
            mb = action.microbatch
            if action.stage != rank or mb is None or mb >= num_microbatches:
                raise ScheduleError(
                    f"add_eviction: rank {rank}, step {position}: {action} is not an action of "
                    f"rank {rank} for one of the {num_microbatches} micro-batches; check the "
                    "schedule with validate_schedule first"
                )


def _evict(schedule: Schedule, cap: int) -> Schedule:
    """The schedule with transfers for every evictor that exceeds ``cap``, or ``schedule``."""
    num_ranks, per_rank = schedule.num_ranks, schedule.per_rank
    plans = {
        x: _plan_evictor(x, per_rank[x], cap, num_ranks - 1 - x) for x in range(num_ranks // 2)
    }
    if not any(transfers for transfers in plans.values()):
        return schedule
    # How the compute order would run (F = 1, B = 2, instant messages): times the transfers.
    ends, blocked = compute_ends(schedule)
    if blocked:
        raise ScheduleError(
            f"add_eviction: the compute order cannot run to the end (ranks {sorted(blocked)} "
            "wait forever); validate_schedule(schedule, require_communication=False) shows where"
        )
    programs = list(schedule.per_rank)
    for evictor, transfers in plans.items():
        if not transfers:
            continue
        acceptor = num_ranks - 1 - evictor
        inserts: dict[int, list[Action]] = {}  # before compute i: gap i's transfers, in order
        for gap, action in transfers:
            inserts.setdefault(gap, []).append(action)
        programs[evictor] = _spliced(schedule.per_rank[evictor], inserts)
        # Gap i sits before compute i, from when compute i-1 ends; each AC / RS goes in the
        # acceptor's last gap that starts no later than its EV / LD's (RS first on ties).
        gap_time = [0.0, *ends[evictor]]
        timed = sorted(
            (bisect_right(ends[acceptor], gap_time[gap]), gap_time[gap], action.kind != K.LOAD, seq)
            for seq, (gap, action) in enumerate(transfers)
        )
        placed: dict[int, list[Action]] = {}
        for gap, _, _, seq in timed:  # the acceptor's half: AC for an EV, RS for an LD
            action = transfers[seq][1]
            kind = K.ACCEPT if action.kind == K.EVICT else K.RESTORE
            made = unchecked_action(action.stage, kind, action.microbatch, evictor)
            placed.setdefault(gap, []).append(made)
        programs[acceptor] = _spliced(schedule.per_rank[acceptor], placed)
    return schedule.with_programs(programs)


def _plan_evictor(
    stage: int, program: tuple[Action, ...], cap: int, acceptor: int
) -> list[tuple[int, Action]]:
    """(gap, action) per EV/LD of the evictor, gap i before compute i, at most ``cap`` resident."""
    # Plain lists: the planner touches every action, and attribute lookups would dominate.
    forward = [a.kind is K.FORWARD for a in program]
    microbatch: list[int] = list(map(attrgetter("microbatch"), program))  # never None: checked
    count = len(forward)
    backward_at = {mb: i for i, mb in enumerate(microbatch) if not forward[i]}
    resident: set[int] = set()
    parked: set[int] = set()
    latest_first: list[tuple[int, int]] = []  # (-backward position, mb); stale entries skipped
    transfers: list[tuple[int, Action]] = []

    def evict_down_to(gap: int, size: int) -> None:
        while len(resident) > size:
            _, victim = heapq.heappop(latest_first)
            if victim in resident:
                resident.remove(victim)
                parked.add(victim)
                transfers.append((gap, unchecked_action(stage, K.EVICT, victim, acceptor)))

    def load(gap: int, mb: int) -> None:
        parked.remove(mb)
        resident.add(mb)
        heapq.heappush(latest_first, (-backward_at[mb], mb))
        transfers.append((gap, unchecked_action(stage, K.LOAD, mb, acceptor)))

    for index in range(count):
        mb, ahead = microbatch[index], None
        if parked and index + 1 < count and not forward[index + 1]:
            following = microbatch[index + 1]
            ahead = following if following in parked else None
        if forward[index]:
            # Loading before this forward peaks no higher than loading after it, so make room.
            evict_down_to(index, cap - 1 if ahead is None else cap - 2)
            if ahead is not None:
                load(index, ahead)
            resident.add(mb)
            heapq.heappush(latest_first, (-backward_at.get(mb, count), mb))
        else:
            if mb in parked:
                evict_down_to(index, cap - 1)
                load(index, mb)
            if mb not in resident:
                raise ScheduleError(
                    f"add_eviction: rank {stage} runs {stage}B{mb} before its forward; check "
                    "the schedule with validate_schedule first"
                )
            # Loading before this backward needs one slot more than after it: only if free.
            if ahead is not None and len(resident) < cap:
                load(index, ahead)
            resident.remove(mb)
    return transfers


def _acceptor_overflow(schedule: Schedule, limit: float) -> tuple[int, float] | None:
    """(acceptor, peak) of the first acceptor storing more than ``limit``, if any."""
    num_ranks = schedule.num_ranks
    for acceptor in range(num_ranks - num_ranks // 2, num_ranks):
        if K.ACCEPT not in map(attrgetter("kind"), schedule.per_rank[acceptor]):
            continue
        if (peak := max(schedule.stored_activations(acceptor), default=0.0)) > limit:
            return acceptor, peak
    return None


def _what_works(schedule: Schedule, cap: int) -> str:
    """The smallest larger cap that balances this schedule, as advice: a binary search (a larger
    cap parks fewer micro-batches) up to the schedule's own peak, which needs no eviction."""
    original = int(max(schedule.peak_activations()))
    low, high = cap + 1, original  # high always works
    while low < high:
        middle = (low + high) // 2
        if _acceptor_overflow(_evict(schedule, middle), max(middle, original)) is None:
            high = middle
        else:
            low = middle + 1
    if high >= original:
        return f"max_stored={original} works (no eviction is needed there)"
    return f"max_stored={high} works for this schedule"
