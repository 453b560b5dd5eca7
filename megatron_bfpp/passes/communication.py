"""Insert the point-to-point messages a compute order implies: sends right after the compute
that produced the data, receives right before the one that consumes it, hoisted where needed so
two ranks post them in send order (NCCL's and gloo's matching order)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    parts,
    paused_gc,
    unchecked_action,
)
from megatron_bfpp.messages import ACT, GRAD, MESSAGE_TABLE, has_communication

__all__ = ["add_communication"]

K = ActionKind
# Point-to-point kinds a compute-only schedule may already hold (BPipe's): (is a send, what).
_TRANSFERS = {k: (k.is_send, MESSAGE_TABLE[k][0]) for k in (K.EVICT, K.ACCEPT, K.RESTORE, K.LOAD)}
_Note = Callable[[object], None]
_Channels = dict[tuple[int, int], tuple[list[object], list[object]]]
# A compute's receive: peer (-1: none), note, slot (a key less ``mb * per_mb``); then its send's.
_Plan = tuple[int, _Note, int, int, _Note, int]


@dataclass(eq=False, repr=False)  # a dict: its own equality and repr
class _RankPlans(dict[int, _Plan]):
    """One rank's ``_Plan`` per stage for its forwards (or its backwards), made on first use and
    only for its own stages (docs/architecture.md, "Hot-path choices")."""

    rank: int
    sources: list[int]
    targets: list[int]
    step: int
    slots: list[int]
    channels: _Channels
    discard: _Note

    def __missing__(self, stage: int) -> _Plan:
        """Receive from ``sources[stage]``, send to ``targets[stage]`` (-1: this rank, or none)."""
        rank, slots, previous = self.rank, self.slots, stage + self.step
        source, target = self.sources[stage], self.targets[stage]
        source = -1 if source == rank else source
        target = -1 if target == rank else target
        # Slots only where there is a message: a stray stage past the layout has no neighbour.
        plan = self[stage] = (
            source,
            self._note(source, rank, 1),
            slots[previous] if source >= 0 else -1,
            target,
            self._note(rank, target, 0),
            slots[stage] if target >= 0 else -1,
        )
        return plan

    def _note(self, src: int, dst: int, side: int) -> _Note:
        """Where a message on the channel src -> dst is noted: its sends (side 0) or receives."""
        if src < 0 or dst < 0:
            return self.discard
        return self.channels.setdefault((src, dst), ([], []))[side].append


@paused_gc()
def add_communication(schedule: Schedule) -> Schedule:
    """SA/RA/SG/RG around every compute action whose neighbour stage lives on another rank."""
    if has_communication(schedule):
        raise ScheduleError(
            "add_communication expects a compute-only schedule; this one "
            "already has activation/gradient messages"
        )
    stage_to_rank = schedule.layout.stage_to_rank
    # per stage, one past the end too (for a stray action): its input's and output's rank (-1: none)
    input_rank, output_rank = [-1, *stage_to_rank], [*stage_to_rank[1:], -1, -1]
    # Each channel's messages in posting order, keyed ``mb * per_mb + what * span + stage`` for
    # any micro-batch (compared only, so no ``Rules.id``, which needs their count): sends, receives.
    span = len(stage_to_rank) + 1
    per_mb = 4 * span
    slots = [[what * span + stage for stage in range(span)] for what in range(4)]
    channels: _Channels = {}
    forward, full, split = K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT
    recv_act, send_act, recv_grad, send_grad = K.RECV_ACT, K.SEND_ACT, K.RECV_GRAD, K.SEND_GRAD
    new = unchecked_action  # the fields below are right by construction
    discard: list[object] = []
    drop = discard.append  # where a message with no channel is noted
    programs: list[list[Action]] = []
    for rank, actions in enumerate(schedule.per_rank):
        forwards = _RankPlans(rank, input_rank, output_rank, -1, slots[ACT], channels, drop)
        backwards = _RankPlans(rank, output_rank, input_rank, 1, slots[GRAD], channels, drop)
        program: list[Action] = []
        append = program.append
        peer: int
        mb: int
        for action in actions:
            kind = action.kind
            if kind is forward:
                plan = forwards[action.stage]
                receive, send = recv_act, send_act
            elif kind is full or kind is split:
                plan = backwards[action.stage]
                receive, send = recv_grad, send_grad
            elif kind is K.OVERLAP_F_B:
                program += _around(action, forwards, backwards, per_mb)
                continue
            else:
                append(action)
                transfer = _TRANSFERS.get(kind)
                if transfer is not None:  # BPipe's EV / AC / RS / LD travel on channels too
                    is_send, what = transfer
                    peer = action.peer  # type: ignore[assignment]  # p2p: never None
                    src, dst, side = (rank, peer, 0) if is_send else (peer, rank, 1)
                    stage, mb = action.stage, action.microbatch or 0
                    # A stage past the layout (validation rejects it): a tuple, unequal to any key.
                    in_range = stage < span
                    message = mb * per_mb + slots[what][stage] if in_range else (what, stage, mb)
                    channels.setdefault((src, dst), ([], []))[side].append(message)
                continue
            source, note_in, slot_in, target, note_out, slot_out = plan
            stage = action.stage
            mb = action.microbatch  # type: ignore[assignment]  # compute: never None
            if source >= 0:
                append(new(stage, receive, mb, source))
                note_in(mb * per_mb + slot_in)
            append(action)
            if target >= 0:
                append(new(stage, send, mb, target))
                note_out(mb * per_mb + slot_out)
        programs.append(program)
    # Commonly none: every channel already receives in send order.
    mismatched = {channel: sides for channel, sides in channels.items() if sides[0] != sides[1]}
    for (source, rank), (sends, receives) in sorted(mismatched.items()):
        program = programs[rank]
        send_index = {message: index for index, message in enumerate(sends)}
        positions = [
            position
            for position, action in enumerate(program)
            if action.peer == source and action.kind.is_recv
        ]
        indices = [send_index.get(message, -1) for message in receives]
        programs[rank] = _reorder_rank(program, positions, indices)
    return schedule.with_programs(programs)


def _around(
    composite: Action, forwards: _RankPlans, backwards: _RankPlans, per_mb: int
) -> list[Action]:
    """An overlapped pair: its parts' receives before it, sends after, noted on their channels."""
    before: list[Action] = []
    after: list[Action] = []
    for part in parts(composite):
        stage, mb = part.stage, part.microbatch or 0
        if part.kind is K.FORWARD:
            plans, receive, send = forwards, K.RECV_ACT, K.SEND_ACT
        else:
            plans, receive, send = backwards, K.RECV_GRAD, K.SEND_GRAD
        source, note_in, slot_in, target, note_out, slot_out = plans[stage]
        if source >= 0:
            before.append(unchecked_action(stage, receive, mb, source))
            note_in(mb * per_mb + slot_in)
        if target >= 0:
            after.append(unchecked_action(stage, send, mb, target))
            note_out(mb * per_mb + slot_out)
    return [*before, composite, *after]


def _reorder_rank(program: list[Action], positions: list[int], indices: list[int]) -> list[Action]:
    """Hoist receives from one source (at ``positions``; ``indices``: each one's send, -1: none)
    into send order: a receive moves only earlier, just before the one that must follow it."""
    if all(a < b for a, b in pairwise(indices)):
        return program  # nothing to hoist on this channel
    *earlier, last = (position for _, position in sorted(zip(indices, positions, strict=True)))
    key, before = (last, 0), dict[int, list[int]]()  # anchor (not hoisted): its hoisted, last first
    for position in reversed(earlier):
        key = (position, 0) if position < key[0] else (key[0], key[1] - 1)
        if key[0] != position:
            before.setdefault(key[0], []).append(position)
    gone = {position for hoisted in before.values() for position in hoisted}
    result, start = [], 0
    for cut in sorted(gone | before.keys()):
        result += program[start:cut] + [program[p] for p in reversed(before.get(cut, []))]
        start = cut + (cut in gone)
    return result + program[start:]
