#!/usr/bin/env python3
"""Regenerate every picture in docs/schedules.md (and the README's) and print the numbers its
text quotes.

    python scripts/make_docs_figures.py                 # writes docs/images/*.png
    python scripts/make_docs_figures.py --out /tmp/img  # somewhere else

Everything comes from the package itself: ``build_schedule`` builds and validates each schedule,
``simulate`` times it under a ``CostModel``, ``render_png`` draws the timelines and
``Schedule.peak_activations`` / ``stored_activations`` give the memory charts. The output is
deterministic: the same package and matplotlib versions write the same bytes.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_bfpp.ir import ActionKind, Schedule
from megatron_bfpp.schedules import build_schedule
from megatron_bfpp.sim import CostModel, SimResult, render_png, simulate
from megatron_bfpp.sim.cost import cost_fields

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "images"
DPI = 90
WIDTH = 11.0  # inches

# One micro-batch through one full 1F1B stage: forward 1, backward 2 (of which weight grad 1).
COSTS = CostModel(t_forward=1, t_backward=2, t_weight=1)
# BPipe: a small eviction time so that the transfers show as strips (and cost nothing here).
BPIPE_COSTS = CostModel(t_forward=1, t_backward=2, t_weight=1, t_evict=0.5)

# The data-parallel overlap picture: pp=4, vp=4, m=16; one chunk's gradient reduction takes
# twice that chunk's backward of one micro-batch, i.e. 2 * (p * t_backward / vp).
DP_P, DP_V, DP_M = 4, 4, 16
DP_COSTS = CostModel(
    t_forward=1,
    t_backward=2,
    t_weight=1,
    t_grad_reduce=2 * (DP_P * 2 / DP_V),
    t_param_gather=0.5,
)


@dataclass(frozen=True)
class Case:
    """One schedule to build, simulate and draw."""

    stem: str  # file name without .png
    label: str  # how the picture's title names it
    name: str  # registry name
    num_ranks: int
    num_microbatches: int
    num_chunks: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    costs: CostModel = COSTS

    def build(self) -> Schedule:
        return build_schedule(
            self.name,
            num_ranks=self.num_ranks,
            num_microbatches=self.num_microbatches,
            num_chunks=self.num_chunks,
            **self.options,
        )

    def command(self, png: str) -> str:
        """The bfpp-sim command line that draws the same picture (at the CLI's default size)."""
        parts = [f"bfpp-sim --schedule {self.name} --pp {self.num_ranks}"]
        if self.num_chunks is not None:
            parts.append(f"--vp {self.num_chunks}")
        parts.append(f"--microbatches {self.num_microbatches}")
        for option, value in self.options.items():
            flag = {
                "group_size": "--group-size",
                "microbatch_group_size": "--group-size",
                "sharding": "--data-parallel-sharding-strategy",
            }.get(option, f"--{option.replace('_', '-')}")
            parts.append(f"{flag} {value}")
        default = CostModel()  # bfpp-sim's defaults: flags only for what differs
        for costs_field in cost_fields():
            name = costs_field.name
            value = getattr(self.costs, name)
            if value != getattr(default, name):
                parts.append(f"--{name.replace('_', '-')} {value:g}")
        parts.append(f"--png {png}")
        return " ".join(parts)


TIMELINES = [
    Case("timeline-gpipe", "gpipe", "gpipe", 4, 8),
    Case("timeline-1f1b", "1f1b", "1f1b", 4, 8),
    Case("timeline-interleaved", "interleaved, vp=2", "interleaved", 4, 8, 2),
    Case("timeline-breadth-first", "breadth-first, vp=2", "breadth-first", 4, 8, 2),
    Case(
        "timeline-breadth-first-g4",
        "breadth-first, vp=2, group size 4",
        "breadth-first",
        4,
        8,
        2,
        {"group_size": 4},
    ),
    Case("timeline-bpipe", "bpipe, t_evict=0.5", "bpipe", 4, 8, costs=BPIPE_COSTS),
    Case("timeline-v-min", "v-min", "v-min", 4, 8),
    Case("timeline-v-half", "v-half", "v-half", 4, 8),
    Case("timeline-v-zb", "v-zb", "v-zb", 4, 8),
    Case("timeline-dualpipe-v", "dualpipe-v", "dualpipe-v", 4, 8),
]

DP_OVERLAP = [
    Case(
        "dp-overlap-breadth-first",
        "breadth-first, vp=4",
        "breadth-first",
        DP_P,
        DP_M,
        DP_V,
        costs=DP_COSTS,
    ),
    Case(
        "dp-overlap-interleaved",
        "interleaved (depth-first), vp=4",
        "interleaved",
        DP_P,
        DP_M,
        DP_V,
        costs=DP_COSTS,
    ),
]

# Sharded parameters: each chunk's gather and reduction cost as much as 4 of its forwards.
SHARDED_COSTS = CostModel(t_forward=1, t_backward=2, t_weight=1, t_grad_reduce=1, t_param_gather=1)
SHARDED = [
    Case(
        "sharded-breadth-first",
        "breadth-first, vp=4, sharded parameters",
        "breadth-first",
        DP_P,
        DP_M,
        DP_V,
        {"sharding": "optim_grads_params"},
        costs=SHARDED_COSTS,
    ),
]

# The memory comparison at pp=8, m=16 (looped schedules at vp=2).
MEM_P, MEM_M = 8, 16
MEMORY = [
    Case("", "1f1b", "1f1b", MEM_P, MEM_M),
    Case("", "bpipe", "bpipe", MEM_P, MEM_M),
    Case("", "v-min", "v-min", MEM_P, MEM_M),
    Case("", "v-half", "v-half", MEM_P, MEM_M),
    Case("", "v-zb", "v-zb", MEM_P, MEM_M),
    Case("", "dualpipe-v", "dualpipe-v", MEM_P, MEM_M),
    Case("", "interleaved\nvp=2", "interleaved", MEM_P, MEM_M, 2),
    Case("", "breadth-first\nvp=2", "breadth-first", MEM_P, MEM_M, 2),
]


# The README's picture: 1F1B above breadth-first on one time axis, pp=4, m=8.
COMPARISON = [
    Case("", "1f1b", "1f1b", 4, 8),
    Case("", "breadth-first, vp=2", "breadth-first", 4, 8, 2),
]
COMPARISON_FILE = "readme-1f1b-vs-breadth-first.png"


def fmt_peaks(peaks: tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{p:g}" for p in peaks) + "]"


def title_for(case: Case, result: SimResult) -> str:
    shape = f"p={case.num_ranks}, m={case.num_microbatches}"
    stats = f"step {result.step_time:.4g}, bubble {result.bubble_fraction:.1%}"
    if result.exposed_dp_comm_time > 0:
        stats += f", exposed DP comm {result.exposed_dp_comm_time:.3g}"
    return f"{case.label} ({shape}): {stats}"


def draw_timeline(case: Case, out: Path) -> SimResult:
    schedule = case.build()
    result = simulate(schedule, case.costs)
    path = out / f"{case.stem}.png"
    render_png(result, path, title=title_for(case, result), dpi=DPI, width=WIDTH)
    print(
        f"{case.stem:28s} step {result.step_time:6.4g}  bubble {result.bubble_fraction:6.1%}  "
        f"exposed DP {result.exposed_dp_comm_time:5.3g}  "
        f"peak act. {fmt_peaks(schedule.peak_activations())}"
    )
    print(f"{'':28s} {case.command(case.stem + '.png')}")
    return result


def draw_comparison(out: Path) -> None:
    """The README's picture: the COMPARISON timelines stacked, drawn on the longest step's time
    axis so that widths compare; each row ends with the rank's peak activations."""
    import tempfile

    import numpy as np
    from matplotlib import image

    results = [(case, simulate(case.build(), case.costs)) for case in COMPARISON]
    span = max(result.step_time for _, result in results)
    parts = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, (case, result) in enumerate(results):
            path = Path(scratch) / f"{index}.png"
            title = title_for(case, result)
            render_png(replace(result, step_time=span), path, title=title, dpi=DPI, width=WIDTH)
            parts.append(image.imread(path))
            print(f"{COMPARISON_FILE:28s} {title}, peak act. {fmt_peaks(result.peak_activations)}")
    image.imsave(out / COMPARISON_FILE, np.vstack(parts))


def new_figure(height: float) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(WIDTH, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def draw_memory_bars(out: Path) -> None:
    """Per-rank peak activations of each schedule at pp=8, m=16: one group per schedule."""
    import numpy as np
    from matplotlib import colormaps

    peaks = [case.build().peak_activations() for case in MEMORY]
    print(f"\nper-rank peak activations, pp={MEM_P}, m={MEM_M} (full-stage micro-batches):")
    for case, values in zip(MEMORY, peaks, strict=True):
        print(f"  {case.label.replace(chr(10), ' '):24s} {fmt_peaks(values)}  max {max(values):g}")

    figure, axes = new_figure(4.2)
    colours = colormaps["tab10"](np.arange(len(MEMORY)))
    bar = 0.105
    group = bar * MEM_P + 0.25
    centres = []
    for index, values in enumerate(peaks):
        start = index * group
        xs = start + bar * np.arange(MEM_P)
        axes.bar(xs, values, width=bar * 0.9, color=colours[index], align="edge")
        centre = start + bar * MEM_P / 2
        centres.append(centre)
        axes.text(centre, max(values) + 0.3, f"max {max(values):g}", ha="center", fontsize=8)
    cap = math.ceil((MEM_P + 2) / 2)
    for level, style, text in (
        (MEM_P, "--", f"p = {MEM_P} (1F1B's rank 0)"),
        (cap, ":", f"⌈(p+2)/2⌉ = {cap} (BPipe's cap)"),
    ):
        axes.axhline(level, color="0.3", linestyle=style, linewidth=0.9, zorder=0, label=text)
    axes.legend(fontsize=8, loc="upper left", frameon=False)
    axes.set_xticks(centres, [case.label for case in MEMORY], fontsize=9)
    axes.set_xlim(-0.15, len(MEMORY) * group - 0.1)
    axes.set_ylim(0, max(max(v) for v in peaks) + 1.5)
    axes.set_ylabel("peak stored activations\n(micro-batches × full stage)")
    axes.set_title(
        f"Peak activation memory per rank (bars: rank 0 … {MEM_P - 1} left to right), "
        f"p={MEM_P}, m={MEM_M}",
        fontsize=11,
    )
    axes.grid(axis="y", linewidth=0.3, alpha=0.5)
    axes.set_axisbelow(True)
    figure.savefig(out / "memory-per-rank.png", dpi=DPI)


def draw_bpipe_profile(out: Path) -> None:
    """Rank 0's stored activations after each action of its program: 1F1B vs BPipe."""
    figure, axes = new_figure(3.6)
    cap = math.ceil((MEM_P + 2) / 2)
    for name, colour, width in (("bpipe", "tab:orange", 2.2), ("1f1b", "tab:blue", 1.2)):
        schedule = build_schedule(name, num_ranks=MEM_P, num_microbatches=MEM_M)
        profile = schedule.stored_activations(0)
        program = schedule.per_rank[0]
        xs = range(1, len(profile) + 1)
        axes.step(xs, profile, where="post", color=colour, label=name, linewidth=width)
        print(f"\nrank 0 stored activations, {name}: {len(program)} actions, peak {max(profile):g}")
        for kind, marker, text in (
            (ActionKind.EVICT, "v", "EV: evict to rank 7"),
            (ActionKind.LOAD, "^", "LD: load back"),
        ):
            hits = [i for i, a in enumerate(program) if a.kind is kind]
            if hits:
                axes.plot(
                    [i + 1 for i in hits],
                    [profile[i] for i in hits],
                    linestyle="none",
                    marker=marker,
                    markersize=5,
                    zorder=3,
                    color="black" if kind is ActionKind.EVICT else "tab:green",
                    label=f"{name} {text}",
                )
                print(
                    f"  {kind.value} at program positions {[i + 1 for i in hits]}: "
                    f"{[str(program[i]) for i in hits]}"
                )
    axes.axhline(MEM_P, color="0.35", linestyle="--", linewidth=0.8)
    axes.axhline(cap, color="0.35", linestyle=":", linewidth=0.8)
    axes.text(1, MEM_P + 0.1, f"p = {MEM_P}", fontsize=8, va="bottom", color="0.25")
    axes.text(1, cap + 0.1, f"BPipe cap ⌈(p+2)/2⌉ = {cap}", fontsize=8, va="bottom", color="0.25")
    axes.set_ylim(0, MEM_P + 1)
    axes.set_xlabel("position in rank 0's program (every action, sends and receives included)")
    axes.set_ylabel("stored activations")
    axes.set_title(
        f"Rank 0's stored activations in program order, 1F1B vs BPipe (p={MEM_P}, m={MEM_M})",
        fontsize=11,
    )
    axes.legend(fontsize=8, loc="upper right", frameon=False)
    axes.grid(linewidth=0.3, alpha=0.5)
    figure.savefig(out / "memory-bpipe-rank0.png", dpi=DPI)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    print(f"timelines, pp=4, m=8, {COSTS}:")
    for case in TIMELINES:
        draw_timeline(case, out)
    draw_comparison(out)
    bpipe = next(case for case in TIMELINES if case.name == "bpipe").build()
    steps = ", ".join(
        f"t_evict={t:g}: {simulate(bpipe, replace(BPIPE_COSTS, t_evict=t)).step_time:g}"
        for t in (0.5, 1.0, 2.0, 4.0)
    )
    print(f"{'':28s} bpipe step time vs eviction cost: {steps}")
    moves = [e.label for e in simulate(bpipe, BPIPE_COSTS).events if e.lane == "p2p"]
    print(f"{'':28s} bpipe transfers (sender's row): {moves}")
    draw_memory_bars(out)
    draw_bpipe_profile(out)
    print(f"\nsharded parameters, pp={DP_P}, vp={DP_V}, m={DP_M}, {SHARDED_COSTS}:")
    for case in SHARDED:
        result = draw_timeline(case, out)
        gathers = sum(a.kind.value == "PS" for a in case.build().per_rank[0])
        print(
            f"{'':28s} rank 0: {gathers} gathers; peak gathered parameters per rank "
            f"{fmt_peaks(result.peak_parameters)} of a full stage; exposed DP "
            f"{result.exposed_dp_comm_time:g}"
        )
    print(f"\ndata-parallel overlap, pp={DP_P}, vp={DP_V}, m={DP_M}, {DP_COSTS}:")
    no_dp = replace(DP_COSTS, t_grad_reduce=0.0, t_param_gather=0.0)
    for case in DP_OVERLAP:
        result = draw_timeline(case, out)
        exposed = ", ".join(f"{r.exposed_dp_comm_time:g}" for r in result.per_rank)
        print(f"{'':28s} exposed DP per rank: [{exposed}]")
        lane = ", ".join(
            f"{e.label} {e.start:g}-{e.end:g}"
            for e in result.events
            if e.rank == 0 and e.lane == "dp"
        )
        print(f"{'':28s} rank 0 DP lane: {lane}; compute ends {result.per_rank[0].compute_end:g}")
        alone = simulate(case.build(), no_dp).step_time
        print(f"{'':28s} same schedule without DP comm: step {alone:g}")
    sizes = sorted((p.name, p.stat().st_size) for p in out.glob("*.png"))
    print(f"\nwrote {len(sizes)} PNGs to {out}, {sum(s for _, s in sizes) / 1024:.0f} KiB:")
    for name, size in sizes:
        print(f"  {name:36s} {size / 1024:6.1f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
