#!/usr/bin/env python3
"""Time ``--pipeline-schedule auto``'s decision: CPU seconds of one core, peak memory, choice.

Each case runs in a fresh process (no warm caches: what a rank pays once, before it builds its
model), timed as CPU seconds of ``plan.auto.decide`` itself (imports excluded) and measured as
the process's peak resident set (VmHWM, else ``ru_maxrss``) with the part the decision added
after the imports. The issue's target (41.3): under 2 s of CPU and 1 GiB.

    python scripts/bench_auto.py                   # 4 cases, best of --repeat
    python scripts/bench_auto.py --grid            # every layout of the where-schedules-win grid

``--grid`` takes, for every cell (model x GPUs x samples per GPU x GPU), the layout
``recommend``'s search picks (``--families``: also each schedule family's best), as a user who
asked the planner would run it, plus pp 64 with 512 layers at global batch 8192, and decides
each once. H100 cells read the shipped stage profiles, as ``where_schedules_win.py`` does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# (model, tp, pp, dp, micro-batch, global batch, recompute, GPU)
CASES = [
    ("gpt3-175b", 8, 16, 32, 1, 1536, "selective", "h100-80gb"),  # 4,096 GPUs
    ("gpt3-175b", 8, 32, 16, 1, 1024, "selective", "a100-80gb"),  # 4,096 GPUs, deep pipeline
    ("gpt3-52b", 8, 8, 1, 1, 64, "none", "v100-32gb"),  # activations bind
    ("llama-70b", 8, 8, 8, 1, 512, "selective", "h100-80gb"),  # 512 GPUs
]
GRID_GPUS = ("v100-32gb", "a100-80gb", "h100-80gb")
GRID_MODELS = ("gpt3-6.7b", "llama-7b", "llama-70b", "gpt3-175b")
GRID_CLUSTERS = (64, 512, 4096)
GRID_PER_GPU = (0.25, 0.5, 1.0, 4.0)
TARGET_CPU_S = 2.0
TARGET_RSS = 2**30
# pp 64 with 512 layers at global batch 8192: GPT-3 175B's shape at 512 layers (8 per rank),
# tp 8 within a node, on 512 GPUs (dp 1, m 8192: only full recomputation fits 80 GB) and on
# 4,096 (dp 8, m 1024, selective recomputation).
DEEP = [
    {"base": "gpt3-175b", "num_layers": 512, "tp": 8, "pp": 64, "dp": dp, "mbs": 1,
     "gbs": 8192, "recompute": recompute, "sharding": "optim", "gpu": gpu}
    for dp, recompute in ((1, "full"), (8, "selective"))
    for gpu in ("a100-80gb", "h100-80gb")
]  # fmt: skip

# The child's peak resident set: VmHWM, its own address space's high-water mark, where Linux
# has it; ``ru_maxrss`` survives exec and would start at the parent's peak (the grid's parent
# has run 144 searches).
CHILD = """
import dataclasses, json, resource, sys, time
def peak():
    try:
        with open("/proc/self/status") as status:
            line = next(l for l in status if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.plan import auto
from megatron_bfpp.plan.auto import AutoRequest, decide, hardware
from megatron_bfpp.plan.presets import get_model
case = json.loads(sys.argv[1])
auto.AUTO_ACTION_BUDGET = case.get("budget") or auto.AUTO_ACTION_BUDGET
model = get_model(case["base"])
if case.get("num_layers"):
    model = dataclasses.replace(model, name=f"{model.name}-{case['num_layers']}l",
                                num_layers=case["num_layers"])
hw = hardware(device_name=None, device_memory=None, gpu_flag=case["gpu"],
              profile_path=case.get("profile"))
request = AutoRequest(model=model, tp=case["tp"], pp=case["pp"], dp=case["dp"],
                      micro_batch_size=case["mbs"], global_batch_size=case["gbs"], hardware=hw,
                      recompute=case["recompute"], sharding=case.get("sharding", "optim"))
rss_imports = peak()
start = time.process_time()
try:
    decision = decide(request)
    out = {"simulations": decision.simulations, "candidates": len(decision.rows),
           "untimed": decision.untimed, "actions": decision.actions_spent,
           "line": decision.line()}
except ScheduleError as error:
    out = {"simulations": None, "candidates": None, "untimed": None, "actions": None,
           "line": "refused: " + str(error).splitlines()[0]}
out["cpu_s"] = time.process_time() - start
out["rss"] = peak()
out["rss_decide"] = out["rss"] - rss_imports
print(json.dumps(out))
"""


def run_child(case: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(case)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def profile_of(gpu: str, model: str) -> str | None:
    """The shipped stage profile an H100 cell reads (``where_schedules_win.cell``'s rule)."""
    path = ROOT / "docs" / "profiles" / f"h100-{model}.json"
    return str(path) if gpu.startswith("h100") and path.exists() else None


def cell_layouts(
    gpu: str, model: str, n: int, per_gpu: float, families: bool
) -> list[dict[str, Any]]:
    """The layouts ``recommend`` picks for one cell: its best (and each family's best)."""
    from megatron_bfpp.plan.costs import ProfileCurve
    from megatron_bfpp.plan.presets import get_gpu, get_model
    from megatron_bfpp.plan.profile import load_profile
    from megatron_bfpp.plan.search import Cluster, SearchOptions, recommend

    profile = profile_of(gpu, model)
    efficiency = None
    if profile is not None:
        efficiency = ProfileCurve.from_profile(load_profile(profile), get_gpu(gpu))
    gbs = max(1, round(per_gpu * n))
    result = recommend(
        model=get_model(model),
        cluster=Cluster(n, 8, get_gpu(gpu)),
        global_batch_size=gbs,
        options=SearchOptions(best_per_family=families, efficiency=efficiency, top=1),
    )
    plans = list(result.plans) + (list(result.best_per_family.values()) if families else [])
    layouts: dict[tuple[object, ...], dict[str, Any]] = {}
    for plan in plans:
        c = plan.candidate
        case = {"base": model, "tp": c.tp, "pp": c.pp, "dp": c.dp, "mbs": c.micro_batch_size,
                "gbs": gbs, "recompute": c.recompute, "sharding": c.sharding, "gpu": gpu,
                "profile": profile, "cell": f"{gpu} {model} {n} x {per_gpu:g}",
                "picked": f"{c.schedule} vp={c.vp}"}  # fmt: skip
        if c.pp < 2:  # auto has nothing to choose without a pipeline
            case["skipped"] = f"recommend picks pp 1 ({layout_text(case)})"
        key = (c.tp, c.pp, c.dp, c.micro_batch_size, c.recompute, c.sharding)
        layouts.setdefault(key, case)
    if not plans:
        cell = f"{gpu} {model} {n} x {per_gpu:g}"
        return [{"cell": cell, "skipped": "recommend finds no feasible plan"}]
    return list(layouts.values())


def grid_layouts(path: Path | None, families: bool) -> list[dict[str, Any]]:
    """Every cell's layouts, read from ``path`` when it exists (written there otherwise)."""
    if path is not None and path.exists():
        cached: list[dict[str, Any]] = json.loads(path.read_text())
        return cached
    cases: list[dict[str, Any]] = []
    for gpu in GRID_GPUS:
        for model in GRID_MODELS:
            for n in GRID_CLUSTERS:
                for per_gpu in GRID_PER_GPU:
                    found = cell_layouts(gpu, model, n, per_gpu, families)
                    print(f"# {found[0]['cell']}: {len(found)} layout(s)", file=sys.stderr)
                    cases += found
    for case in DEEP:
        cases.append({**case, "cell": f"{case['gpu']} pp 64, 512 layers, gbs 8192"})
    if path is not None:
        path.write_text(json.dumps(cases, indent=1) + "\n")
    return cases


def layout_text(case: dict[str, Any]) -> str:
    text = f"tp {case['tp']} pp {case['pp']} dp {case['dp']} b {case['mbs']} {case['recompute']}"
    m = case["gbs"] // (case["mbs"] * case["dp"])
    return text + f" m {m}" + (" sharded" if case.get("sharding", "optim") != "optim" else "")


def grid(args: argparse.Namespace) -> None:
    cases = [{**case, "budget": args.budget} for case in grid_layouts(args.layouts, args.families)]
    skipped = [c for c in cases if c.get("skipped")]
    runnable = [c for c in cases if not c.get("skipped")]
    with ThreadPoolExecutor(max_workers=max(1, min(2, args.jobs))) as pool:
        results = list(pool.map(run_child, runnable))
    print("| cell | layout | choice | candidates | simulated | CPU s | peak RSS MiB | decide MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for case, r in zip(runnable, results, strict=True):
        choice = r["line"].split(" (")[0].removeprefix("auto: ")
        print(
            f"| {case['cell']} | {layout_text(case)} | {choice} | {r['candidates']} | "
            f"{r['simulations']} | {r['cpu_s']:.2f} | {r['rss'] / 2**20:.0f} | "
            f"{r['rss_decide'] / 2**20:.0f} |"
        )
    for case in skipped:
        print(f"# {case['cell']}: skipped, {case['skipped']}")
    over_cpu = [r for r in results if r["cpu_s"] > TARGET_CPU_S]
    over_rss = [r for r in results if r["rss"] > TARGET_RSS]
    worst_cpu = max(range(len(results)), key=lambda i: results[i]["cpu_s"])
    worst_rss = max(range(len(results)), key=lambda i: results[i]["rss"])
    print(
        f"{len(results)} layouts decided ({len(skipped)} skipped): max CPU "
        f"{results[worst_cpu]['cpu_s']:.2f} s ({runnable[worst_cpu]['cell']}, "
        f"{layout_text(runnable[worst_cpu])}), max peak RSS "
        f"{results[worst_rss]['rss'] / 2**20:.0f} MiB (decide's own "
        f"{max(r['rss_decide'] for r in results) / 2**20:.0f} MiB at most); "
        f"{len(over_cpu)} over {TARGET_CPU_S:g} s, {len(over_rss)} over 1 GiB"
    )
    if args.json:
        rows = [{**case, **r} for case, r in zip(runnable, results, strict=True)]
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


def cases(args: argparse.Namespace) -> None:
    for name, tp, pp, dp, mbs, gbs, recompute, gpu in CASES:
        case = {"base": name, "tp": tp, "pp": pp, "dp": dp, "mbs": mbs, "gbs": gbs,
                "recompute": recompute, "gpu": gpu, "budget": args.budget}  # fmt: skip
        best = min((run_child(case) for _ in range(args.repeat)), key=lambda r: r["cpu_s"])
        print(
            f"{name} tp={tp} pp={pp} dp={dp} ({tp * pp * dp} GPUs, {gpu}): "
            f"{best['cpu_s']:.2f} s CPU, {best['rss'] / 2**20:.0f} MiB peak "
            f"({best['rss_decide'] / 2**20:.0f} MiB in decide), {best['simulations']} "
            f"simulations of {best['candidates']} candidates, {best['actions'] or 0:,} actions "
            f"charged\n  {best['line']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--grid", action="store_true", help="the where-schedules-win grid")
    parser.add_argument("--families", action="store_true", help="--grid: each family's best too")
    parser.add_argument("--layouts", type=Path, help="--grid: read the layouts here, or save them")
    parser.add_argument("--json", type=Path, help="--grid: every row as JSON")
    parser.add_argument("--jobs", type=int, default=1, help="--grid: processes at once (1 or 2)")
    parser.add_argument("--budget", type=int, help="AUTO_ACTION_BUDGET instead of the shipped one")
    args = parser.parse_args()
    grid(args) if args.grid else cases(args)


if __name__ == "__main__":
    main()
