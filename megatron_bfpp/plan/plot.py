"""The breadth-first paper's two pictures, predicted: throughput per GPU against batch size per
GPU for each schedule family (its Figure 3), and training time against cost (its Figure 4, by
the paper's model: samples needed grow as ``1 + B / B_crit``). matplotlib only when drawing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_bfpp.files import write_output
from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.plan.presets import Model
from megatron_bfpp.plan.search import Cluster, SearchOptions, SearchResult, recommend
from megatron_bfpp.sim.export import figure_bytes

__all__ = [
    "SweepPoint",
    "batch_sweep",
    "default_batch_sizes",
    "render_plot",
    "time_and_cost",
    "trade_off",
]


@dataclass(frozen=True, slots=True)
class SweepPoint:
    global_batch_size: int
    result: SearchResult


def default_batch_sizes(num_gpus: int) -> tuple[int, ...]:
    """Batch sizes per GPU from 1/8 to 8 (the paper's Figure 3 range), as whole global batches."""
    sizes = {max(1, round(num_gpus * beta)) for beta in (0.125, 0.25, 0.5, 1, 2, 4, 8)}
    return tuple(sorted(sizes))


def batch_sweep(
    *, model: Model, cluster: Cluster, options: SearchOptions, batch_sizes: Sequence[int]
) -> list[SweepPoint]:
    """One search per global batch size, for each family's best (``top`` 1)."""
    quick = replace(options, top=1, best_per_family=True)
    return [
        SweepPoint(b, recommend(model=model, cluster=cluster, global_batch_size=b, options=quick))
        for b in batch_sizes
    ]


_CLUSTER_SCALES = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


def time_and_cost(
    *,
    samples_per_s_per_gpu: float,
    batch_per_gpu: float,
    num_gpus: float,
    critical_batch_size: float,
) -> tuple[float, float]:
    """(seconds, GPU-seconds) per minimum sample: ``(1 + beta N / B_crit) / u``, that / N."""
    if critical_batch_size <= 0:
        raise ScheduleError(f"--critical-batch-size must be positive, got {critical_batch_size}")
    cost = (1.0 + batch_per_gpu * num_gpus / critical_batch_size) / samples_per_s_per_gpu
    return cost / num_gpus, cost


def trade_off(
    rows: Sequence[tuple[float, float]], *, num_gpus: int, critical_batch_size: float
) -> list[tuple[float, float]]:
    """The (cost, time) frontier of one family: ``rows`` are (beta, samples/s per GPU); each cluster
    size in ``_CLUSTER_SCALES`` x ``num_gpus``; the points none beats on both axes, by cost."""
    points = []
    for beta, rate in rows:
        for scale in _CLUSTER_SCALES:
            time_s, cost = time_and_cost(
                samples_per_s_per_gpu=rate,
                batch_per_gpu=beta,
                num_gpus=num_gpus * scale,
                critical_batch_size=critical_batch_size,
            )
            points.append((cost, time_s))
    points.sort()
    frontier: list[tuple[float, float]] = []
    for cost, time_s in points:
        if not frontier or time_s < frontier[-1][1]:
            frontier.append((cost, time_s))
    return frontier


def render_plot(
    sweep: Sequence[SweepPoint],
    path: str | Path,
    *,
    model: Model,
    cluster: Cluster,
    critical_batch_size: float | None,
) -> Path:
    """Draw both panels into one PNG (the second only with a critical batch size)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    families: dict[str, list[tuple[int, float, float]]] = {}
    # the families standing for Megatron's own (p2p as megatron-core posts it)
    megatron: set[str] = set()
    for point in sweep:
        for family, plan in point.result.best_per_family.items():
            families.setdefault(family, []).append(
                (point.global_batch_size, plan.tokens_per_s, plan.mfu)
            )
            if plan.p2p_model.startswith("megatron"):
                megatron.add(family)
    panels = 2 if critical_batch_size else 1
    figure = Figure(figsize=(6.0 * panels, 4.5), dpi=90, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, panels, squeeze=False)[0]
    n, seq = cluster.num_gpus, model.seq_length
    for family, rows in sorted(families.items()):
        rows.sort()
        beta = [b / n for b, _, _ in rows]
        label = family + (" [M]" if family in megatron else "")
        axes[0].plot(beta, [t / n for _, t, _ in rows], marker="o", label=label)
        if critical_batch_size:
            points = [(b / n, t / seq / n) for b, t, _ in rows]
            frontier = trade_off(points, num_gpus=n, critical_batch_size=critical_batch_size)
            axes[1].plot([c for c, _ in frontier], [t for _, t in frontier], label=family)
    axes[0].set_xscale("log", base=2)
    axes[0].set(xlabel="batch size per GPU (samples)", ylabel="predicted tokens/s per GPU")
    timing = sweep[0].result.p2p_model if sweep else "lockstep"
    marked = "; [M]: Megatron's own, p2p as megatron-core posts it" if megatron else ""
    axes[0].set_title(
        f"{model.name} on {n} x {cluster.gpu.name}\np2p timing: {timing}{marked}", fontsize=9
    )
    axes[0].grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    if critical_batch_size:
        axes[1].set(xscale="log", yscale="log", xlabel="cost: GPU-seconds per minimum sample")
        axes[1].set_ylabel("time: seconds per minimum sample")
        axes[1].set_title(
            f"time vs cost over cluster sizes, samples ~ 1 + B/{critical_batch_size:g}"
        )
        axes[1].grid(True, alpha=0.3, which="both")
        axes[1].legend(fontsize=7)
    target = Path(path)
    write_output(target, figure_bytes(figure, target))
    return target
