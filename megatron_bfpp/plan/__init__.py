"""Planning arithmetic: what a schedule should buy before anyone runs it (pure: no torch)."""

from __future__ import annotations

from megatron_bfpp.plan.bpipe import (
    Estimate,
    bpipe_speedup_estimate,
    pipeline_factor,
    pipeline_mfu,
)

__all__ = [
    "Estimate",
    "bpipe_speedup_estimate",
    "pipeline_factor",
    "pipeline_mfu",
]
