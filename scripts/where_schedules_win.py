#!/usr/bin/env python3
"""Where each schedule wins: the planner's best configuration per schedule family over GPU,
model, cluster size and batch per GPU, under the models that run (our schedules timed by the
runtime's lock-step posting, Megatron's own 1f1b / interleaved by megatron-core's posting).

For every cell (GPU, model, GPUs, samples per GPU) it runs ``bfpp-plan recommend``'s search with
each family's best kept, and records the winner, its margin over the runner-up family and over
the best of Megatron's own schedules (1f1b, interleaved). H100 cells read the shipped stage
profiles (docs/profiles/h100-<model>.json) instead of the built-in efficiency curve.

    python scripts/where_schedules_win.py --json out.json --png where.png     # the full grid
    python scripts/where_schedules_win.py --moe --json moe.json --png moe.png # MoE models
    python scripts/where_schedules_win.py --quick                             # 4 cells

The MoE grid (Mixtral 8x7B and Qwen3-30B-A3B on A100 and H100, 64 and 512 GPUs) searches expert
parallelism too; its Megatron baselines include megatron-core's combined 1F1B where the
catalogue has it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megatron_bfpp.files import write_output
from megatron_bfpp.plan.costs import ProfileCurve
from megatron_bfpp.plan.presets import get_gpu, get_model
from megatron_bfpp.plan.profile import load_profile
from megatron_bfpp.plan.search import Cluster, SearchOptions, recommend
from megatron_bfpp.sim.export import figure_bytes

ROOT = Path(__file__).resolve().parents[1]
GPUS = ("v100-32gb", "a100-80gb", "h100-80gb")
MODELS = ("gpt3-6.7b", "llama-70b", "gpt3-175b")
CLUSTERS = (64, 512, 4096)
PER_GPU = (0.25, 1.0, 8.0)
MOE_GPUS = ("a100-80gb", "h100-80gb")
MOE_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b")
MOE_CLUSTERS = (64, 512)
MEGATRON = ("1f1b", "interleaved")


def cell(gpu_name: str, model_name: str, num_gpus: int, per_gpu: float) -> dict[str, object]:
    """One search; the families' best step times and the winner's margins."""
    gpu = get_gpu(gpu_name)
    model = get_model(model_name)
    efficiency = None
    source = "built-in curve"
    profile = ROOT / "docs" / "profiles" / f"h100-{model_name}.json"
    if gpu_name.startswith("h100") and profile.exists():
        efficiency = ProfileCurve.from_profile(load_profile(profile), gpu)
        source = profile.name
    global_batch = max(1, round(per_gpu * num_gpus))
    started = time.process_time()
    result = recommend(
        model=model,
        cluster=Cluster(num_gpus, 8, gpu),
        global_batch_size=global_batch,
        options=SearchOptions(best_per_family=True, efficiency=efficiency, top=1),
    )
    seconds = time.process_time() - started
    families = {
        name: {
            "step_time_s": plan.step_time_s,
            "tokens_per_s_per_gpu": plan.tokens_per_s / num_gpus,
            "p2p_model": plan.p2p_model,
            "memory_gib": plan.memory.total / 2**30,
            "layout": _layout(plan.candidate),
        }
        for name, plan in result.best_per_family.items()
    }
    ranked = sorted(families, key=lambda name: families[name]["step_time_s"])  # type: ignore[arg-type,return-value]
    row: dict[str, object] = {
        "gpu": gpu_name,
        "model": model_name,
        "num_gpus": num_gpus,
        "samples_per_gpu": per_gpu,
        "global_batch_size": global_batch,
        "efficiency": source,
        "search_cpu_s": seconds,
        "families": families,
        "winner": ranked[0] if ranked else None,
    }
    if len(ranked) >= 2:
        row["runner_up"] = ranked[1]
        row["margin_over_runner_up"] = _margin(families, ranked[0], ranked[1])
    megatron = [name for name in ranked if name.split(" ")[0] in MEGATRON]
    if ranked and megatron:
        row["megatron_best"] = megatron[0]
        row["margin_over_megatron"] = _margin(families, ranked[0], megatron[0])
    return row


def _layout(c: object) -> str:
    parts = [f"tp={c.tp}", f"pp={c.pp}", f"vp={c.vp}", f"dp={c.dp}", f"b={c.micro_batch_size}"]  # type: ignore[attr-defined]
    if c.group_size:  # type: ignore[attr-defined]
        parts.append(f"g={c.group_size}")  # type: ignore[attr-defined]
    if c.ep > 1:  # type: ignore[attr-defined]
        parts.append(f"ep={c.ep}")  # type: ignore[attr-defined]
    if c.combined_1f1b:  # type: ignore[attr-defined]
        parts.append("combined-1f1b")
    return " ".join(parts) + f" {c.recompute}"  # type: ignore[attr-defined]


def _margin(families: dict[str, dict[str, object]], best: str, other: str) -> float:
    """How much slower ``other`` is than ``best`` (0.05: 5%)."""
    return float(families[other]["step_time_s"]) / float(families[best]["step_time_s"]) - 1  # type: ignore[arg-type]


def draw(
    rows: list[dict[str, object]],
    path: Path,
    gpus: tuple[str, ...] = GPUS,
    models: tuple[str, ...] = MODELS,
    clusters: tuple[int, ...] = CLUSTERS,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    winners = sorted({str(r["winner"]) for r in rows if r["winner"]})
    colours = {name: plt.get_cmap("tab10")(i) for i, name in enumerate(winners)}
    fig, axes = plt.subplots(
        len(models), len(gpus), figsize=(4.2 * len(gpus), 3.2 * len(models)), squeeze=False
    )
    for i, model in enumerate(models):
        for j, gpu in enumerate(gpus):
            ax = axes[i][j]
            for r in rows:
                if r["model"] != model or r["gpu"] != gpu:
                    continue
                x = PER_GPU.index(float(r["samples_per_gpu"]))  # type: ignore[arg-type]
                y = clusters.index(int(r["num_gpus"]))  # type: ignore[call-overload]
                name = r["winner"]
                if not name:
                    ax.text(x, y, "nothing\nfits", ha="center", va="center", fontsize=7)
                    continue
                ax.add_patch(
                    plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color=colours[str(name)], alpha=0.55)
                )
                margin = r.get("margin_over_megatron")
                label = f"{name}\n+{float(margin) * 100:.0f}% vs Megatron" if margin else str(name)  # type: ignore[arg-type]
                ax.text(x, y, label, ha="center", va="center", fontsize=6)
            ax.set_xlim(-0.5, len(PER_GPU) - 0.5)
            ax.set_ylim(-0.5, len(clusters) - 0.5)
            ax.set_xticks(range(len(PER_GPU)), [str(v) for v in PER_GPU])
            ax.set_yticks(range(len(clusters)), [str(v) for v in clusters])
            ax.set_title(f"{model} on {gpu}", fontsize=9)
            if i == len(models) - 1:
                ax.set_xlabel("samples per GPU")
            if j == 0:
                ax.set_ylabel("GPUs")
    fig.suptitle(
        "Fastest schedule family per cell (bfpp-plan, lock-step timing;\nMegatron's own 1f1b / "
        "interleaved timed as megatron-core posts)",
        fontsize=10,
    )
    fig.tight_layout()
    write_output(path, figure_bytes(fig, path, dpi=110))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="4 cells, to check the script")
    parser.add_argument("--moe", action="store_true", help="the MoE models' grid")
    args = parser.parse_args()
    axes = (MOE_GPUS, MOE_MODELS, MOE_CLUSTERS) if args.moe else (GPUS, MODELS, CLUSTERS)
    grid = [
        (gpu, model, n, b) for gpu in axes[0] for model in axes[1] for n in axes[2] for b in PER_GPU
    ]
    if args.quick:
        grid = [g for g in grid if g[1] == "gpt3-6.7b" and g[2] == 64 and g[3] in (0.25, 8.0)][:4]
    rows = []
    for gpu, model, n, b in grid:
        row = cell(gpu, model, n, b)
        rows.append(row)
        margin = row.get("margin_over_megatron")
        print(
            f"{gpu:10s} {model:10s} {n:5d} GPUs {b:5.2f}/GPU: {row['winner']} "
            f"(+{float(row.get('margin_over_runner_up', 0)) * 100:.1f}% over "  # type: ignore[arg-type]
            f"{row.get('runner_up')}; "
            + (
                f"+{float(margin) * 100:.1f}% over Megatron's {row['megatron_best']}"
                if margin is not None
                else "no Megatron schedule fits"
            )  # type: ignore[arg-type]
            + f") [{row['search_cpu_s']:.1f} s]",
            flush=True,
        )
    if args.json:
        write_output(args.json, (json.dumps({"rows": rows}, indent=1) + "\n").encode())
    if args.png:
        draw(rows, args.png, *axes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
