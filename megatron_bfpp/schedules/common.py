"""Small shared pieces of the generators: input checks and program assembly."""

from __future__ import annotations

from collections.abc import Iterable

from megatron_bfpp.ir import Action, Schedule, StageLayout, check_positive

__all__ = ["check_counts", "interleave_1f1b", "make_schedule"]


def check_counts(schedule: str, **values: int) -> None:
    """Reject counts below 1 with the flag a user would change."""
    check_positive(values, prefix=f"{schedule}: ")


def interleave_1f1b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then one forward one backward, then the remaining backwards, by list
    slicing (fast for millions of actions); ``forwards`` and ``backwards`` are equally long."""
    steady_count = len(forwards) - warmup
    steady: list[Action] = [*forwards[warmup:], *backwards[:steady_count]]
    steady[0::2], steady[1::2] = forwards[warmup:], backwards[:steady_count]
    return forwards[:warmup] + steady + backwards[steady_count:]


def make_schedule(
    name: str, layout: StageLayout, num_microbatches: int, programs: Iterable[Iterable[Action]]
) -> Schedule:
    return Schedule(layout, num_microbatches, tuple(map(tuple, programs)), name)
