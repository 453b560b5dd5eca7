"""Timelines of a simulated step: Chrome trace-event JSON (Perfetto, chrome://tracing) and a PNG
(matplotlib imported only inside ``render_png``, so the rest works without it)."""

from __future__ import annotations

import io
import json
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_bfpp.files import write_output
from megatron_bfpp.ir import ActionKind
from megatron_bfpp.sim.simulator import Event, SimResult

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes

__all__ = [
    "MAX_PNG_RANKS",
    "PNG_SECONDS_PER_RANK",
    "chrome_trace",
    "dump_chrome_trace",
    "figure_bytes",
    "render_png",
]

# Measured PNG drawing time per rank (docs/architecture.md); bfpp-sim refuses past about 20 s of it.
PNG_SECONDS_PER_RANK = 0.0095
MAX_PNG_RANKS = 2048

K = ActionKind
_LANES = ("compute", "p2p", "dp")
_COLUMNS = ("start", "end", "rank")


def chrome_trace(result: SimResult, *, us_per_unit: float = 1000.0) -> dict[str, Any]:
    """Chrome trace-event JSON as a dict; ``us_per_unit`` microseconds per cost-model unit."""
    if not us_per_unit > 0:
        raise ValueError(f"us_per_unit must be > 0, got {us_per_unit}")
    trace: list[dict[str, Any]] = []
    for rank in range(result.num_ranks):
        trace.append(_meta("process_name", rank, 0, {"name": f"rank {rank}"}))
        trace.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
        for tid, lane in enumerate(_LANES):
            trace.append(_meta("thread_name", rank, tid, {"name": lane}))
            trace.append(_meta("thread_sort_index", rank, tid, {"sort_index": tid}))
    tids = {lane: tid for tid, lane in enumerate(_LANES)}
    for event in result.events:
        args: dict[str, Any] = {"stage": event.stage, "kind": event.kind.value}
        if event.microbatch is not None:
            args["microbatch"] = event.microbatch
        trace.append(
            {
                "name": event.label,
                "cat": event.lane,
                "ph": "X",
                "pid": event.rank,
                "tid": tids[event.lane],
                "ts": event.start * us_per_unit,
                "dur": (event.end - event.start) * us_per_unit,
                "args": args,
            }
        )
    summary = {k: v for k, v in result.to_dict().items() if k not in ("per_rank", "costs")}
    summary.update({f"cost_{k}": v for k, v in result.to_dict()["costs"].items()})
    summary["us_per_unit"] = us_per_unit
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": summary}


def dump_chrome_trace(result: SimResult, path: str | Path, *, us_per_unit: float = 1000.0) -> None:
    """Write ``chrome_trace(result)`` to ``path``; open it in https://ui.perfetto.dev."""
    text = json.dumps(chrome_trace(result, us_per_unit=us_per_unit), separators=(",", ":"))
    write_output(path, text.encode())


def figure_bytes(figure: Any, path: str | Path, **savefig: Any) -> bytes:
    """A matplotlib figure as the bytes of the file ``path`` names (format from its suffix), for
    :func:`megatron_bfpp.files.write_output`: matplotlib would truncate a file it cannot finish."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format=Path(path).suffix[1:] or None, **savefig)
    return buffer.getvalue()


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


# PNG: compute boxes fill most of a rank's row; data-parallel operations are a thin dark strip
# under them and p2p transfers a thin grey strip above: communication never reads as busy time.

_BOX = (-0.34, 0.30)  # compute box, relative to the row centre (y grows downwards)
_LABEL: dict[str, Any] = {"ha": "center", "va": "center", "color": "black", "clip_on": True}
_P2P = (-0.45, -0.38)
# The communication strips: lane, rows, colour, legend text.
_COMM = (
    ("p2p", _P2P, "0.6", "p2p transfer"),
    ("bpipe", _P2P, "#c0392b", "BPipe evict / restore"),
    ("dp", (0.34, 0.45), "0.15", "DP sync (GS/PS)"),
)
_STYLE: dict[ActionKind, tuple[float, str | None, str]] = {
    # kind: (shade: < 0 darkens, > 0 mixes towards white; hatch; legend text)
    K.FORWARD: (0.0, None, "F forward"),
    K.BACKWARD: (-0.35, "///", "B backward"),
    K.BACKWARD_INPUT: (0.4, "///", "I input grad"),
    K.BACKWARD_WEIGHT: (0.65, "...", "W weight grad"),
    K.OVERLAP_F_B: (-0.15, "xx", "F&B overlapped pair"),
}


def render_png(
    result: SimResult,
    path: str | Path,
    *,
    title: str | None = None,
    dpi: int = 100,
    width: float = 14.0,
    max_labels: int = 3000,
) -> Path:
    """Draw the step as one row per rank (colour: micro-batch; shade and hatch: compute kind;
    labels where boxes are wide enough, up to ``max_labels``) and write a PNG to ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure

    num_ranks = max(result.num_ranks, 1)
    row_inches = 0.42 if num_ranks <= 16 else max(0.16, 7.0 / num_ranks)
    figure = Figure(figsize=(width, 1.7 + row_inches * num_ranks), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    font = max(5.0, min(9.0, row_inches * 72 * 0.45))
    span = result.step_time if result.step_time > 0 else 1.0
    axes_px = width * dpi * 0.85  # approximate drawing width in pixels

    compute: dict[ActionKind, list[Event]] = {kind: [] for kind in _STYLE}
    comm: dict[str, list[Event]] = {lane: [] for lane, *_ in _COMM}
    for event in result.events:
        if event.lane == "compute":
            compute[event.kind].append(event)
        elif event.kind in (K.EVICT, K.RESTORE):  # BPipe's activation transfers, apart
            comm["bpipe"].append(event)
        else:
            comm[event.lane].append(event)

    char_px = font * 0.62 * dpi / 72
    labelled = _draw_compute(axes, compute, span, axes_px, char_px, result.num_chunks > 1)
    for lane, where, colour, _ in _COMM:
        if comm[lane]:  # thin white edges keep back-to-back operations (queued reductions) apart
            boxes = _boxes(*_columns(comm[lane]), where)
            axes.add_collection(
                PolyCollection(boxes, facecolors=colour, edgecolors="white", linewidths=0.6)
            )
    if len(labelled) <= max_labels:
        for x, y, text in labelled:
            axes.text(x, y + (_BOX[0] + _BOX[1]) / 2, text, fontsize=font, **_LABEL)
    ranks = range(result.num_ranks)
    axes.set(xlim=(0, span), ylim=(len(ranks) - 0.5, -0.5), xlabel="time (cost-model units)")
    axes.set_yticks(ranks, [f"rank {r}" for r in ranks], fontsize=font)
    axes.grid(axis="x", linewidth=0.3, alpha=0.5)
    axes.set_axisbelow(True)
    transform = axes.get_yaxis_transform()  # x in axes fraction, y in data
    style: dict[str, Any] = dict(transform=transform, fontsize=font, ha="left", clip_on=False)
    column = [(-0.5, "peak act.", "bottom")]
    column += [(m.rank, f"{m.peak_activations:.3g}", "center") for m in result.per_rank]
    for y, text, va in column:
        axes.text(1.005, y, text, va=va, **style)
    if not title:
        shape = f"p={result.num_ranks}, v={result.num_chunks}, m={result.num_microbatches}"
        title = f"{result.schedule_name} ({shape}): step {result.step_time:.4g}, bubble "
        title += f"{result.bubble_fraction:.1%}"
        if result.exposed_dp_comm_time > 0:
            title += f", exposed DP {result.exposed_dp_comm_time:.3g}"
    axes.set_title(title, fontsize=11)
    handles = _legend_handles(
        [kind for kind, events in compute.items() if events], comm, with_stage=result.num_chunks > 1
    )
    figure.legend(
        handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False
    )
    out = Path(path)
    write_output(out, figure_bytes(figure, out, dpi=dpi))
    return out


def _draw_compute(
    axes: Axes,
    compute: dict[ActionKind, list[Event]],
    span: float,
    axes_px: float,
    char_px: float,
    with_stage: bool,
) -> list[tuple[float, float, str]]:
    """One collection per compute kind; returns the labels of the boxes wide enough for one."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.collections import PolyCollection

    # 18 colours, strong first, so neighbouring micro-batches differ; no greys (communication's)
    tab20 = colormaps["tab20"]
    paired = np.delete(tab20(np.arange(tab20.N))[:, :3], [14, 15], axis=0)
    palette = np.concatenate([paired[0::2], paired[1::2]])
    columns = {
        kind: (*_columns(events), np.fromiter((e.microbatch or 0 for e in events), int))
        for kind, events in compute.items()
        if events
    }
    widths = [(ends - starts) / span * axes_px for starts, ends, _, _ in columns.values()]
    # hatches and outlines help only wide boxes, and hatching slivers makes Agg slow: drop both
    detailed = bool(widths) and float(np.median(np.concatenate(widths))) >= 5.0
    labelled: list[tuple[float, float, str]] = []
    for (kind, (starts, ends, rows, mbs)), width_px in zip(columns.items(), widths, strict=True):
        shade, hatch, _ = _STYLE[kind]
        colours = _shade(palette[mbs % len(palette)], shade)
        axes.add_collection(
            PolyCollection(
                _boxes(starts, ends, rows, _BOX),
                facecolors=colours,
                edgecolors=_shade(colours, -0.45),
                linewidths=0.3 if detailed else 0.0,
                hatch=hatch if detailed else None,
            )
        )
        # several chunks: the stage tells them apart ("4F3"), alone if narrow ("4"); colour: the mb
        digits = np.floor(np.log10(np.maximum(mbs, 1))) + 1
        text_px = char_px * (1.6 + digits + (2.0 if with_stage else 0.0))
        stages = np.fromiter((e.stage for e in compute[kind]), int, len(compute[kind]))
        stage_px = char_px * (0.8 + np.floor(np.log10(np.maximum(stages, 1))) + 1)
        for index in np.flatnonzero(width_px > text_px):
            event = compute[kind][int(index)]
            composite = kind is K.OVERLAP_F_B  # "3F5&1B2": its parts say what it runs
            text = event.label if with_stage or composite else f"{kind.value}{event.microbatch}"
            labelled.append(((event.start + event.end) / 2, event.rank, text))
        if with_stage:
            for index in np.flatnonzero((width_px <= text_px) & (width_px > stage_px)):
                event = compute[kind][int(index)]
                labelled.append(((event.start + event.end) / 2, event.rank, str(event.stage)))
    return labelled


def _columns(events: list[Event]) -> tuple[Any, Any, Any]:
    """The events' starts, ends and rows (ranks) as float arrays."""
    import numpy as np

    starts, ends, rows = (np.fromiter(map(attrgetter(n), events), float) for n in _COLUMNS)
    return starts, ends, rows


def _legend_handles(
    present: list[ActionKind], comm: dict[str, list[Event]], *, with_stage: bool = False
) -> list[Any]:
    import numpy as np
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    grey = np.array([[0.55, 0.55, 0.55]])
    handles: list[Any] = [
        Patch(facecolor=_shade(grey, shade)[0], edgecolor="0.2", hatch=hatch, label=text)
        for shade, hatch, text in (_STYLE[k] for k in present)
    ]
    handles += [
        Line2D([], [], color=colour, linewidth=3, label=label)
        for lane, _, colour, label in _COMM
        if comm[lane]
    ]
    notes = ["colour = micro-batch", *(["4F3 = stage 4, micro-batch 3"] if with_stage else [])]
    return handles + [Patch(facecolor="none", edgecolor="none", label=note) for note in notes]


def _boxes(starts: Any, ends: Any, rows: Any, where: tuple[float, float]) -> Any:
    """(N, 4, 2) rectangle vertices for PolyCollection."""
    import numpy as np

    top, bottom = rows + where[0], rows + where[1]
    corners = [starts, top, ends, top, ends, bottom, starts, bottom]
    return np.stack(corners, axis=1).reshape(-1, 4, 2)


def _shade(rgb: Any, amount: float) -> Any:
    """Darken (amount < 0) or lighten (amount > 0) an (N, 3|4) colour array."""
    rgb = rgb[:, :3]
    return rgb * (1 + amount) if amount < 0 else rgb + (1 - rgb) * amount
