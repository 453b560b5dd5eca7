"""The planner (pure: no torch): what a configuration should cost before anyone runs it.

``recommend`` searches the configurations of a model on a cluster and ranks them by the simulated
step time (docs/planner.md); ``bpipe_speedup_estimate`` is the BPipe re-evaluation's eq. 4."""

from __future__ import annotations

from megatron_bfpp.plan.bpipe import Estimate, bpipe_speedup_estimate, pipeline_factor, pipeline_mfu
from megatron_bfpp.plan.presets import GPUS, MODELS, get_gpu, get_model, model_from_shape
from megatron_bfpp.plan.search import (
    Candidate,
    Cluster,
    Plan,
    SearchOptions,
    SearchResult,
    evaluate,
    recommend,
)

__all__ = [
    "GPUS",
    "MODELS",
    "Candidate",
    "Cluster",
    "Estimate",
    "Plan",
    "SearchOptions",
    "SearchResult",
    "bpipe_speedup_estimate",
    "evaluate",
    "get_gpu",
    "get_model",
    "model_from_shape",
    "pipeline_factor",
    "pipeline_mfu",
    "recommend",
]
