"""1F1B (PipeDream-Flush / DAPPLE), as megatron-core's non-interleaved schedule runs it.

Rank r warms up with min(p - r - 1, m) forwards, alternates one forward and one backward, then
drains the remaining backwards, so it never stores more than p - r micro-batches.
"""

from __future__ import annotations

from megatron_bfpp.ir import Action, ActionKind, Schedule, StageLayout, paused_gc, unchecked_action
from megatron_bfpp.schedules.common import check_counts, interleave_1f1b, make_schedule

__all__ = ["build_1f1b"]


def _one_f_one_b_program(*, rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    warmup = min(num_ranks - rank - 1, num_microbatches)
    f, b, action = ActionKind.FORWARD, ActionKind.BACKWARD, unchecked_action
    forwards = [action(rank, f, m) for m in range(num_microbatches)]
    backwards = [action(rank, b, m) for m in range(num_microbatches)]
    return interleave_1f1b(forwards, backwards, warmup)


@paused_gc()
def build_1f1b(*, num_ranks: int, num_microbatches: int) -> Schedule:
    check_counts("1f1b", num_ranks=num_ranks, num_microbatches=num_microbatches)
    programs = [
        _one_f_one_b_program(rank=r, num_ranks=num_ranks, num_microbatches=num_microbatches)
        for r in range(num_ranks)
    ]
    return make_schedule("1f1b", StageLayout.looped(num_ranks, 1), num_microbatches, programs)
