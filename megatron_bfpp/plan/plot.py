"""The breadth-first paper's two pictures, predicted: throughput per GPU against batch size per
GPU for each schedule family (its Figure 3), and training time against cost (its Figure 4).

Figure 4 uses the paper's empirical model (seed breadth-first-pp-slides.txt): the samples needed
to reach a loss grow as ``1 + B / B_crit`` with the batch size B, so with ``N`` GPUs at
``tokens_per_s`` a run of ``S_min`` minimum samples takes ``S_min (1 + B/B_crit) / samples_per_s``
and costs ``N`` times that in GPU-seconds. Both axes are per minimum sample, so only the critical
batch size is an input. matplotlib is imported only when drawing (the ``plot`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.plan.presets import Model
from megatron_bfpp.plan.search import Cluster, SearchOptions, SearchResult, recommend

__all__ = ["SweepPoint", "batch_sweep", "default_batch_sizes", "render_plot", "time_and_cost"]


@dataclass(frozen=True, slots=True)
class SweepPoint:
    global_batch_size: int
    result: SearchResult


def default_batch_sizes(num_gpus: int) -> tuple[int, ...]:
    """Batch sizes per GPU from 1/8 to 16 (the range of the paper's Figure 3), as whole global
    batches."""
    sizes = {max(1, round(num_gpus * beta)) for beta in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16)}
    return tuple(sorted(sizes))


def batch_sweep(
    *,
    model: Model,
    cluster: Cluster,
    options: SearchOptions,
    batch_sizes: Sequence[int],
) -> list[SweepPoint]:
    """One search per global batch size; only each family's best is needed, so ``top`` is 1."""
    quick = replace(options, top=1)
    return [
        SweepPoint(b, recommend(model=model, cluster=cluster, global_batch_size=b, options=quick))
        for b in batch_sizes
    ]


def time_and_cost(
    *, samples_per_s: float, global_batch_size: int, num_gpus: int, critical_batch_size: float
) -> tuple[float, float]:
    """(seconds, GPU-seconds) per minimum sample: ``(1 + B/B_crit) / samples_per_s`` and N x it."""
    if critical_batch_size <= 0:
        raise ScheduleError(f"--critical-batch-size must be positive, got {critical_batch_size}")
    seconds = (1.0 + global_batch_size / critical_batch_size) / samples_per_s
    return seconds, seconds * num_gpus


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
    for point in sweep:
        for family, plan in point.result.best_per_family.items():
            families.setdefault(family, []).append(
                (point.global_batch_size, plan.tokens_per_s, plan.mfu)
            )
    panels = 2 if critical_batch_size else 1
    figure = Figure(figsize=(6.0 * panels, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, panels, squeeze=False)[0]
    n = cluster.num_gpus
    seq = model.seq_length
    for family, rows in sorted(families.items()):
        rows.sort()
        beta = [b / n for b, _, _ in rows]
        axes[0].plot(beta, [t / n for _, t, _ in rows], marker="o", label=family)
        if critical_batch_size:
            points = [
                time_and_cost(
                    samples_per_s=t / seq,
                    global_batch_size=b,
                    num_gpus=n,
                    critical_batch_size=critical_batch_size,
                )
                for b, t, _ in rows
            ]
            axes[1].plot([c for _, c in points], [s for s, _ in points], marker="o", label=family)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("batch size per GPU (samples)")
    axes[0].set_ylabel("predicted tokens/s per GPU")
    axes[0].set_title(f"{model.name} on {n} x {cluster.gpu.name}")
    axes[0].grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    if critical_batch_size:
        axes[1].set_xscale("log")
        axes[1].set_yscale("log")
        axes[1].set_xlabel("cost: GPU-seconds per minimum sample")
        axes[1].set_ylabel("time: seconds per minimum sample")
        axes[1].set_title(f"time vs cost, samples ~ 1 + B/{critical_batch_size:g}")
        axes[1].grid(True, alpha=0.3, which="both")
        axes[1].legend(fontsize=7)
    target = Path(path)
    figure.savefig(target)
    return target
