"""Small shared pieces of the generators: input checks and program assembly."""

from __future__ import annotations

from collections.abc import Iterable

from megatron_bfpp.ir import Action, ActionKind, Schedule, ScheduleError, StageLayout

__all__ = ["backward", "check_counts", "forward", "make_schedule"]


def check_counts(schedule: str, **values: int) -> None:
    """Reject counts below 1 with the flag a user would change."""
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{schedule}: {key} must be a positive integer, got {value!r}")


def forward(stage: int, microbatch: int) -> Action:
    return Action(stage, ActionKind.FORWARD, microbatch)


def backward(stage: int, microbatch: int) -> Action:
    return Action(stage, ActionKind.BACKWARD, microbatch)


def make_schedule(
    name: str, layout: StageLayout, num_microbatches: int, programs: Iterable[Iterable[Action]]
) -> Schedule:
    return Schedule(
        layout=layout,
        num_microbatches=num_microbatches,
        per_rank=tuple(tuple(p) for p in programs),
        name=name,
    )
