#!/usr/bin/env python3
"""Time build, validate and simulate of pp=64 schedules against the 2 s target (issue 11).

"build" is the registry's generator and the lowering passes (``add_communication``,
``add_grad_sync``); "validate" is ``validate_schedule`` on the result (``build_schedule`` runs
both); "simulate" is ``simulate`` under bfpp-sim's default costs, events not read. Each phase is
timed ``--repeat`` times and the minimum kept: the machines this runs on are shared and noisy.

    python scripts/bench_sim_speed.py              # interleaved, breadth-first, 1f1b
    python scripts/bench_sim_speed.py --repeat 5
"""

from __future__ import annotations

import argparse
import time

from megatron_bfpp.ir import Placement, Schedule
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.schedules.registry import get_spec
from megatron_bfpp.sim import CostModel, simulate
from megatron_bfpp.validate import validate_schedule

TARGET_S = 2.0  # interleaved pp=64 vp=4 m=1024: build + validate + simulate
CASES = [
    ("interleaved", 64, 4, 1024),  # the target case
    ("breadth-first", 64, 4, 1024),
    ("1f1b", 64, 1, 1024),
]


def build(name: str, p: int, v: int, m: int) -> Schedule:
    spec = get_spec(name)
    chunks = {"num_chunks": v} if spec.placement is Placement.LOOPED else {}
    return add_grad_sync(
        add_communication(spec.generator(num_ranks=p, num_microbatches=m, **chunks))
    )


def run(name: str, p: int, v: int, m: int, repeat: int) -> tuple[list[float], int, float]:
    """Minimum seconds of (build, validate, simulate), actions, step time."""
    best = [float("inf")] * 3
    actions, step = 0, 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        schedule = build(name, p, v, m)
        built = time.perf_counter()
        validate_schedule(schedule)
        validated = time.perf_counter()
        result = simulate(schedule, CostModel())
        simulated = time.perf_counter()
        phases = (built - start, validated - built, simulated - validated)
        best = [min(b, t) for b, t in zip(best, phases, strict=True)]
        actions, step = schedule.num_actions, result.step_time
    return best, actions, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (minimum kept)")
    args = parser.parse_args()
    print(
        f"{'schedule':<14} {'pp':>3} {'vp':>2} {'m':>5} {'actions':>9} {'build':>7} "
        f"{'validate':>8} {'simulate':>8} {'total s':>8}  step time"
    )
    for name, p, v, m in CASES:
        (built, validated, simulated), actions, step = run(name, p, v, m, args.repeat)
        total = built + validated + simulated
        verdict = ""
        if (name, p, v, m) == CASES[0]:
            verdict = f"  {'<' if total < TARGET_S else '>='} {TARGET_S:g} s target"
        print(
            f"{name:<14} {p:>3} {v:>2} {m:>5} {actions:>9} {built:>7.3f} {validated:>8.3f} "
            f"{simulated:>8.3f} {total:>8.3f}  {step:g}{verdict}",
            flush=True,
        )


if __name__ == "__main__":
    main()
