"""Breadth-first pipeline parallelism (Lamy-Poirier, MLSys 2023): each rank runs every
micro-batch through chunk 0, then chunk 1, ..., then the backwards in reverse chunk order, in
micro-batch order (megatron-core's accumulation order: bitwise equal gradients), so the first
chunk's gradient reduction overlaps the rest; ``group_size`` bounds memory (Fast-LLM's split)."""

from __future__ import annotations

from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    StageLayout,
    paused_gc,
    unchecked_action,
)
from megatron_bfpp.schedules.common import check_counts, make_schedule

__all__ = ["build_breadth_first"]


@paused_gc()
def build_breadth_first(
    *, num_ranks: int, num_microbatches: int, num_chunks: int, group_size: int | None = None
) -> Schedule:
    check_counts(
        "breadth-first",
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
    )
    if num_chunks < 2:
        raise ScheduleError(
            "breadth-first needs a virtual pipeline size (--vp / num_chunks) of at least 2; "
            "with one chunk per rank it is gpipe"
        )
    group = num_microbatches if group_size is None else group_size
    if not isinstance(group, int) or not 1 <= group <= num_microbatches:
        raise ScheduleError(
            f"breadth-first group size must be in [1, num_microbatches={num_microbatches}], "
            f"got {group!r}"
        )
    layout = StageLayout.looped(num_ranks, num_chunks)
    groups = [
        range(start, min(start + group, num_microbatches))
        for start in range(0, num_microbatches, group)
    ]
    f, b, action = ActionKind.FORWARD, ActionKind.BACKWARD, unchecked_action
    programs = []
    for rank in range(num_ranks):
        stages = layout.stages_of(rank)
        program: list[Action] = []
        for microbatches in groups:
            program += [action(s, f, m) for s in stages for m in microbatches]
            program += [action(s, b, m) for s in reversed(stages) for m in microbatches]
        programs.append(program)
    name = "breadth-first" if group == num_microbatches else f"breadth-first(g={group})"
    return make_schedule(name, layout, num_microbatches, programs)
