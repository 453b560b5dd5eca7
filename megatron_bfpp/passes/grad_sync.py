"""Mark where each chunk's data-parallel parameter gather and gradient reduction start.

A chunk's parameters are gathered (PS) at the start of the step, in the order the chunks first
run, so later chunks' gathers overlap earlier chunks' forwards; its gradient reduction (GS) starts
right after its last backward, so it overlaps the backward of every chunk that finishes later.
This is where breadth-first wins: its first chunk to finish does so long before the step ends.
"""

from __future__ import annotations

from operator import attrgetter

from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    paused_gc,
    unchecked_action,
)

__all__ = ["add_grad_sync"]

K = ActionKind


@paused_gc()
def add_grad_sync(schedule: Schedule) -> Schedule:
    get_kind = attrgetter("kind")
    if not all(_CHUNK_LEVEL.isdisjoint(map(get_kind, actions)) for actions in schedule.per_rank):
        raise ScheduleError("add_grad_sync: the schedule already has GS/PS actions")
    programs = []
    for rank, actions in enumerate(schedule.per_rank):
        stages = schedule.layout.stages_of(rank)
        first_forward = _first_forwards(actions, stages)
        last_grad = _last_grads(actions, stages)
        gathers = [
            unchecked_action(s, K.PARAM_SYNC) for s in sorted(stages, key=first_forward.__getitem__)
        ]
        after: dict[int, list[Action]] = {}
        for stage in stages:
            position = last_grad[stage]
            if position >= 0:
                # After the backward's own gradient send: that send is on the upstream rank's
                # critical path, the reduction is not.
                while position + 1 < len(actions) and actions[position + 1].kind is K.SEND_GRAD:
                    position += 1
                after.setdefault(position, []).append(unchecked_action(stage, K.GRAD_SYNC))
        # Splice by slices: a handful of insertion points in a program of many actions.
        program = gathers
        start = 0
        for position in sorted(after):
            program += actions[start : position + 1]
            program += after[position]
            start = position + 1
        program += actions[start:]
        programs.append(program)
    return schedule.with_programs(programs)


_CHUNK_LEVEL = frozenset({K.GRAD_SYNC, K.PARAM_SYNC})


def _first_forwards(actions: tuple[Action, ...], stages: tuple[int, ...]) -> dict[int, int]:
    """Position of each stage's first forward (len(actions) if none), scanning from the front
    only until every stage has one."""
    first = dict.fromkeys(stages, len(actions))
    missing = set(stages)
    forward = K.FORWARD
    for position, action in enumerate(actions):
        if action.kind is forward and action.stage in missing:
            first[action.stage] = position
            missing.discard(action.stage)
            if not missing:
                break
    return first


def _last_grads(actions: tuple[Action, ...], stages: tuple[int, ...]) -> dict[int, int]:
    """Position of each stage's last B or W (-1 if none), scanning from the back only until
    every stage has one."""
    last = dict.fromkeys(stages, -1)
    missing = set(stages)
    full, weight = K.BACKWARD, K.BACKWARD_WEIGHT
    for position in range(len(actions) - 1, -1, -1):
        action = actions[position]
        kind = action.kind
        if (kind is full or kind is weight) and action.stage in missing:
            last[action.stage] = position
            missing.discard(action.stage)
            if not missing:
                break
    return last
