"""GPipe: every forward, then every backward; the simplest reference and the most memory."""

from __future__ import annotations

from megatron_bfpp.ir import Schedule, StageLayout, paused_gc
from megatron_bfpp.schedules.common import backward, check_counts, forward, make_schedule

__all__ = ["build_gpipe"]


@paused_gc()
def build_gpipe(*, num_ranks: int, num_microbatches: int) -> Schedule:
    check_counts("gpipe", num_ranks=num_ranks, num_microbatches=num_microbatches)
    layout = StageLayout.looped(num_ranks, 1)
    programs = [
        [forward(r, m) for m in range(num_microbatches)]
        + [backward(r, m) for m in range(num_microbatches)]
        for r in range(num_ranks)
    ]
    return make_schedule("gpipe", layout, num_microbatches, programs)
