"""Insert the point-to-point messages a compute order implies.

Sends go right after the compute that produced the data; receives go right before the compute
that consumes it, then move earlier where needed so that, between any two ranks, receives are
posted in the order the sender posts the sends (the order NCCL and gloo match messages by).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

from megatron_bfpp.ir import Action, ActionKind, Schedule, ScheduleError
from megatron_bfpp.validate import Message, has_communication, message_of

__all__ = ["add_communication", "order_receives_like_sends"]

K = ActionKind


def add_communication(schedule: Schedule) -> Schedule:
    """SA/RA/SG/RG around every compute action whose neighbour stage lives on another rank."""
    if has_communication(schedule):
        raise ScheduleError(
            "add_communication expects a compute-only schedule; this one "
            "already has activation/gradient messages"
        )
    stage_to_rank = schedule.layout.stage_to_rank
    last = len(stage_to_rank) - 1
    programs: list[list[Action]] = []
    for rank, actions in enumerate(schedule.per_rank):
        program: list[Action] = []
        append = program.append
        for action in actions:
            kind, stage, mb = action.kind, action.stage, action.microbatch
            if kind is K.FORWARD:
                prev_rank = stage_to_rank[stage - 1] if stage > 0 else rank
                if prev_rank != rank:
                    append(Action(stage, K.RECV_ACT, mb, prev_rank))
                append(action)
                next_rank = stage_to_rank[stage + 1] if stage < last else rank
                if next_rank != rank:
                    append(Action(stage, K.SEND_ACT, mb, next_rank))
            elif kind is K.BACKWARD or kind is K.BACKWARD_INPUT:
                next_rank = stage_to_rank[stage + 1] if stage < last else rank
                if next_rank != rank:
                    append(Action(stage, K.RECV_GRAD, mb, next_rank))
                append(action)
                prev_rank = stage_to_rank[stage - 1] if stage > 0 else rank
                if prev_rank != rank:
                    append(Action(stage, K.SEND_GRAD, mb, prev_rank))
            else:
                append(action)
        programs.append(program)
    return order_receives_like_sends(schedule.with_programs(programs))


def order_receives_like_sends(schedule: Schedule) -> Schedule:
    """Move receives earlier (never later) until each channel's receive order is its send order.

    Moving a receive earlier only posts it sooner; the wait still happens at its consumer.
    """
    send_rank: dict[tuple[int, int, Message], int] = {}
    counters: dict[tuple[int, int], int] = defaultdict(int)
    for rank, _, action in schedule.iter_actions():
        if action.kind.is_send:
            assert action.peer is not None
            channel = (rank, action.peer)
            send_rank[(*channel, message_of(action))] = counters[channel]
            counters[channel] += 1
    programs = [list(actions) for actions in schedule.per_rank]
    for rank, program in enumerate(programs):
        programs[rank] = _reorder_rank(program, rank, send_rank)
    return schedule.with_programs(programs)


def _in_send_order(indices: list[int]) -> bool:
    return all(a < b for a, b in pairwise(indices))


def _reorder_rank(
    program: list[Action], rank: int, send_rank: dict[tuple[int, int, Message], int]
) -> list[Action]:
    """Give each receive a sort key no later than the key of the receive that must follow it.

    Keys are (anchor position, offset): untouched actions keep (position, 0); a hoisted receive
    sits just before its successor, so the sort moves receives earlier and nothing else.
    """
    by_source: dict[int, list[int]] = defaultdict(list)
    for position, action in enumerate(program):
        if action.kind.is_recv:
            assert action.peer is not None
            by_source[action.peer].append(position)
    keys: dict[int, tuple[int, int]] = {}
    for source, positions in by_source.items():
        indices = [send_rank.get((source, rank, message_of(program[p])), -1) for p in positions]
        if _in_send_order(indices):
            continue  # the common case: nothing to hoist on this channel
        if not keys:
            keys = {position: (position, 0) for position in range(len(program))}
        order = dict(zip(positions, indices, strict=True))
        in_send_order = sorted(positions, key=order.__getitem__)
        for earlier, later in reversed(list(pairwise(in_send_order))):
            anchor, offset = keys[later]
            keys[earlier] = min(keys[earlier], (anchor, offset - 1))
    if not keys:
        return program
    return [program[p] for p in sorted(keys, key=lambda p: (keys[p], p))]
