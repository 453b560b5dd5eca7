"""1F1B (PipeDream-Flush / DAPPLE), as megatron-core's non-interleaved schedule runs it: rank r
warms up with min(p - r - 1, m) forwards, so it never stores more than p - r micro-batches."""

from __future__ import annotations

from megatron_bfpp.ir import ActionKind, Schedule, StageLayout, paused_gc, unchecked_action
from megatron_bfpp.schedules.common import check_counts, interleave_1f1b, make_schedule

__all__ = ["build_1f1b"]


@paused_gc()
def build_1f1b(*, num_ranks: int, num_microbatches: int) -> Schedule:
    check_counts("1f1b", num_ranks=num_ranks, num_microbatches=num_microbatches)
    f, b, action = ActionKind.FORWARD, ActionKind.BACKWARD, unchecked_action
    programs = [
        interleave_1f1b(
            [action(r, f, m) for m in range(num_microbatches)],
            [action(r, b, m) for m in range(num_microbatches)],
            min(num_ranks - r - 1, num_microbatches),
        )
        for r in range(num_ranks)
    ]
    return make_schedule("1f1b", StageLayout.looped(num_ranks, 1), num_microbatches, programs)
