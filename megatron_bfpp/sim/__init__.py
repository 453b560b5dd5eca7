"""Time a schedule and count its memory: cost model, event simulator, timeline export.
Pure Python: no torch, no megatron; matplotlib only when ``render_png`` is called."""

from megatron_bfpp.sim.cost import CostModel
from megatron_bfpp.sim.export import (
    MAX_PNG_RANKS,
    PNG_SECONDS_PER_RANK,
    chrome_trace,
    dump_chrome_trace,
    render_png,
)
from megatron_bfpp.sim.simulator import Event, Lane, RankMetrics, SimResult, simulate

__all__ = [
    "MAX_PNG_RANKS",
    "PNG_SECONDS_PER_RANK",
    "CostModel",
    "Event",
    "Lane",
    "RankMetrics",
    "SimResult",
    "chrome_trace",
    "dump_chrome_trace",
    "render_png",
    "simulate",
]
