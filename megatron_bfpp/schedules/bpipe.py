"""BPipe (Kim et al., ICML 2023): 1F1B whose early stages park activations on their partner
(``passes.eviction``), so every rank stays under ceil((p+2)/2) instead of rank 0 holding p."""

from __future__ import annotations

from megatron_bfpp.ir import Schedule, paused_gc
from megatron_bfpp.passes.eviction import add_eviction
from megatron_bfpp.schedules.common import make_schedule
from megatron_bfpp.schedules.one_f_one_b import build_1f1b

__all__ = ["build_bpipe"]


@paused_gc()
def build_bpipe(
    *, num_ranks: int, num_microbatches: int, max_stored: int | None = None
) -> Schedule:
    base = build_1f1b(num_ranks=num_ranks, num_microbatches=num_microbatches)
    evicted = add_eviction(base, max_stored=max_stored)
    return make_schedule("bpipe", evicted.layout, num_microbatches, evicted.per_rank)
