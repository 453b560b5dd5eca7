#!/usr/bin/env python3
"""Time generation, lowering + validation, and simulation of large realistic schedules.

Prints one row per case with seconds per phase and microseconds per action, so the claim "cost
grows about linearly in the number of actions" can be read off the last column across sizes.

    python scripts/bench_schedules.py            # the issue's largest cases plus smaller ones
    python scripts/bench_schedules.py --quick    # small cases only
"""

from __future__ import annotations

import argparse
import time

from megatron_bfpp.ir import Placement
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.schedules.registry import get_spec
from megatron_bfpp.sim import CostModel, simulate
from megatron_bfpp.validate import validate_schedule

LARGE = [
    ("interleaved", 64, 4, 1024),
    ("breadth-first", 64, 4, 1024),
    ("v-zb", 16, 2, 512),
    ("v-half", 16, 2, 512),
    ("v-min", 16, 2, 512),
    ("bpipe", 64, 1, 1024),
    ("1f1b", 64, 1, 1024),
]
SMALL = [
    ("interleaved", 16, 4, 256),
    ("breadth-first", 16, 4, 256),
    ("interleaved", 32, 4, 512),
    ("v-zb", 8, 2, 128),
]


def run(name: str, p: int, v: int, m: int) -> tuple[float, float, float, int]:
    spec = get_spec(name)
    chunks = {"num_chunks": v} if spec.placement is Placement.LOOPED else {}
    start = time.perf_counter()
    compute = spec.generator(num_ranks=p, num_microbatches=m, **chunks)
    generated = time.perf_counter()
    schedule = add_grad_sync(add_communication(compute))
    validate_schedule(schedule)
    validated = time.perf_counter()
    simulate(schedule, CostModel(t_p2p=0.05, t_grad_reduce=1.0, t_param_gather=0.5))
    simulated = time.perf_counter()
    return generated - start, validated - generated, simulated - validated, schedule.num_actions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small cases only")
    args = parser.parse_args()
    cases = SMALL if args.quick else SMALL + LARGE
    print(
        f"{'schedule':<14} {'pp':>3} {'vp':>2} {'m':>5} {'actions':>9} {'generate':>9} "
        f"{'lower+val':>9} {'simulate':>9} {'total s':>8} {'us/action':>9}"
    )
    for name, p, v, m in cases:
        gen, val, sim, actions = run(name, p, v, m)
        total = gen + val + sim
        print(
            f"{name:<14} {p:>3} {v:>2} {m:>5} {actions:>9} {gen:>9.2f} {val:>9.2f} "
            f"{sim:>9.2f} {total:>8.2f} {1e6 * total / actions:>9.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
