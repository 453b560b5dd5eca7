"""Mark where each chunk's data-parallel parameter gather and gradient reduction start.

A chunk's parameters are gathered (PS) at the start of the step, in the order the chunks first
run, so later chunks' gathers overlap earlier chunks' forwards; its gradient reduction (GS) starts
right after its last backward, so it overlaps the backward of every chunk that finishes later.
This is where breadth-first wins: its first chunk to finish does so long before the step ends.
"""

from __future__ import annotations

from megatron_bfpp.ir import Action, ActionKind, Schedule, ScheduleError

__all__ = ["add_grad_sync"]

K = ActionKind
_GRAD_DONE = (K.BACKWARD, K.BACKWARD_WEIGHT)


def add_grad_sync(schedule: Schedule) -> Schedule:
    if any(a.kind.is_chunk_level for _, _, a in schedule.iter_actions()):
        raise ScheduleError("add_grad_sync: the schedule already has GS/PS actions")
    programs = []
    for rank, actions in enumerate(schedule.per_rank):
        stages = schedule.layout.stages_of(rank)
        first_forward = {s: _first(actions, s, (K.FORWARD,)) for s in stages}
        last_grad = {s: _last(actions, s, _GRAD_DONE) for s in stages}
        gathers = [Action(s, K.PARAM_SYNC) for s in sorted(stages, key=first_forward.__getitem__)]
        after: dict[int, list[Action]] = {}
        for stage, position in last_grad.items():
            if position >= 0:
                # After the backward's own gradient send: that send is on the upstream rank's
                # critical path, the reduction is not.
                while position + 1 < len(actions) and actions[position + 1].kind is K.SEND_GRAD:
                    position += 1
                after.setdefault(position, []).append(Action(stage, K.GRAD_SYNC))
        program = list(gathers)
        for position, action in enumerate(actions):
            program.append(action)
            program.extend(after.get(position, []))
        programs.append(program)
    return schedule.with_programs(programs)


def _first(actions: tuple[Action, ...], stage: int, kinds: tuple[ActionKind, ...]) -> int:
    return next(
        (i for i, a in enumerate(actions) if a.stage == stage and a.kind in kinds), len(actions)
    )


def _last(actions: tuple[Action, ...], stage: int, kinds: tuple[ActionKind, ...]) -> int:
    return max(
        (i for i, a in enumerate(actions) if a.stage == stage and a.kind in kinds), default=-1
    )
