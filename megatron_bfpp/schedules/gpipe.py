"""GPipe: every forward, then every backward; the simplest reference and the most memory."""

from __future__ import annotations

from megatron_bfpp.ir import ActionKind, Schedule, StageLayout, paused_gc, unchecked_action
from megatron_bfpp.schedules.common import check_counts, make_schedule

__all__ = ["build_gpipe"]


@paused_gc()
def build_gpipe(*, num_ranks: int, num_microbatches: int) -> Schedule:
    check_counts("gpipe", num_ranks=num_ranks, num_microbatches=num_microbatches)
    f, b, action = ActionKind.FORWARD, ActionKind.BACKWARD, unchecked_action
    programs = (
        [action(r, kind, m) for kind in (f, b) for m in range(num_microbatches)]
        for r in range(num_ranks)
    )
    return make_schedule("gpipe", StageLayout.looped(num_ranks, 1), num_microbatches, programs)
