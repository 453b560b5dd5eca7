"""Fuse a forward and a backward of another micro-batch on one rank into an overlapped pair
(``ir.Composite``, torch's ``OVERLAP_F_B``), so a GPU can hide one part's communication behind the
other's compute: docs/architecture.md, "Composite actions: overlapped pairs"."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise

from megatron_bfpp.ir import Action, ActionKind, Composite, Schedule, ScheduleError
from megatron_bfpp.validate import validate_deadlock_free

__all__ = ["fuse_overlapped", "overlap_pairs"]

K = ActionKind
Pair = tuple[Action, Action]  # (forward, backward)


def overlap_pairs(schedule: Schedule) -> list[Pair]:
    """The pairs ``fuse_overlapped`` fuses by default: from the front, each forward directly
    followed by a backward (B, or I) of another micro-batch on its rank, kept only if the schedule
    with it and the pairs before it still runs (a pair can close a cycle of waits)."""
    candidates: list[Pair] = []
    for actions in schedule.per_rank:
        neighbours = pairwise([action for action in actions if action.kind.is_compute])
        for first, then in neighbours:
            if (
                first.kind is K.FORWARD
                and (then.kind is K.BACKWARD or then.kind is K.BACKWARD_INPUT)
                and type(first) is type(then) is Action
                and first.microbatch != then.microbatch
            ):
                candidates.append((first, then))
                next(neighbours, None)  # ``then`` is taken: the next pair starts after it
    kept: list[Pair] = []
    for pair in candidates:
        try:
            validate_deadlock_free(fuse_overlapped(schedule, [*kept, pair]))
        except ScheduleError:
            continue
        kept.append(pair)
    return kept


def fuse_overlapped(schedule: Schedule, pairs: Iterable[Pair] | None = None) -> Schedule:
    """``schedule`` with each (forward, backward) of ``pairs`` (default: ``overlap_pairs``), on one
    rank with no compute between them, run as one pair at the earlier's place, receives and
    gathers (PS) between them before it, the rest after; it may deadlock where the two would not."""
    chosen = overlap_pairs(schedule) if pairs is None else list(pairs)
    by_rank: dict[int, list[tuple[int, int]]] = {}
    where = {  # (rank, position) of every plain forward and backward (B or I)
        action: (rank, position)
        for rank, actions in enumerate(schedule.per_rank)
        for position, action in enumerate(actions)
        if action.kind in _FUSABLE
    }
    used: set[Action] = set()
    for forward, backward in chosen:
        composite = Composite(forward, backward)  # checks the kinds and micro-batches
        if forward in used or backward in used:
            raise ScheduleError(f"fuse_overlapped: {composite}: each action fuses once")
        used.update((forward, backward))
        text = f"fuse_overlapped: {forward}&{backward}"
        if missing := [str(a) for a in (forward, backward) if a not in where]:
            raise ScheduleError(
                f"{text}: {' and '.join(missing)} not in the schedule (as a plain action)"
            )
        (rank, at), (other, then) = where[forward], where[backward]
        if rank != other:
            raise ScheduleError(
                f"{text}: {forward} runs on rank {rank} and {backward} on rank {other}; an "
                "overlapped pair runs on one rank"
            )
        first, last = sorted((at, then))
        actions = schedule.per_rank[rank]
        between = next((p for p in range(first + 1, last) if actions[p].kind.is_compute), None)
        if between is not None:
            raise ScheduleError(
                f"{text}: {actions[between]} runs between them on rank {rank} (step {between}); "
                "fuse computes that run one after the other"
            )
        by_rank.setdefault(rank, []).append((first, last))
    programs = [
        _fused(actions, by_rank.get(rank, [])) for rank, actions in enumerate(schedule.per_rank)
    ]
    return schedule.with_programs(programs)


_FUSABLE = frozenset({K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT})


def _fused(actions: tuple[Action, ...], spans: list[tuple[int, int]]) -> list[Action]:
    """One rank's program with each (first, last) span's computes fused in place of the first;
    the actions between them that the pair consumes go before it, the rest after it."""
    if not spans:
        return list(actions)
    starts = dict(spans)
    program: list[Action] = []
    position = 0
    while position < len(actions):
        last = starts.get(position)
        if last is None:
            program.append(actions[position])
            position += 1
            continue
        ends = (actions[position], actions[last])
        forward, backward = ends if ends[0].kind is K.FORWARD else ends[::-1]
        between = actions[position + 1 : last]
        # What the pair may need before it runs: a receive it consumes, a gather.
        before = [a for a in between if a.kind.is_recv or a.kind is K.PARAM_SYNC]
        program += [*before, Composite(forward, backward)]
        program += [a for a in between if a not in before]
        position = last + 1
    return program
