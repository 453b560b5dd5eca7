#!/usr/bin/env python3
"""``bfpp-sim``'s steady-state timing (``sim.simulate_steady``) against the whole step, layout by
layout, and each one's CPU seconds.

For every catalogue schedule at pp 4, 8 and 16, 6 and 16 micro-batches per rank, under three
cost models (the unit default; messages of a tenth of a forward; a data-parallel reduction and
gather per chunk) and the lock-step, megatron and gloo timing models where they apply, it prints
whether the steady state was read off three shorter steps or the step was timed whole, and
whether every figure (step time, bubble, every rank's row) equals the whole step's. The size
threshold is lowered to 0 here so that every layout tries the steady state.

    python scripts/bench_steady.py            # every layout (a few minutes)
    python scripts/bench_steady.py --quick    # pp 4 and 8 only
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable

from megatron_bfpp.ir import Schedule
from megatron_bfpp.schedules.registry import build_schedule
from megatron_bfpp.sim import CostModel, simulate
from megatron_bfpp.sim import simulator as sim

SCHEDULES = {  # name -> (chunks, options, p2p models)
    "gpipe": (None, {}, ("lockstep",)),
    "1f1b": (None, {}, ("lockstep", "megatron", "gloo")),
    "interleaved": (2, {}, ("lockstep", "megatron")),
    "breadth-first": (4, {}, ("lockstep", "gloo")),
    "breadth-first/group": (2, {"group_size": 0}, ("lockstep",)),
    "bpipe": (None, {}, ("lockstep",)),
    "v-min": (None, {}, ("lockstep",)),
    "v-half": (None, {}, ("lockstep", "gloo")),
    "v-zb": (None, {}, ("lockstep",)),
}
COSTS = {
    "unit": CostModel(),
    "p2p 0.1": CostModel(t_p2p=0.1),
    "dp 2+1": CostModel(t_grad_reduce=2.0, t_param_gather=1.0),
}


def builder(
    name: str, pp: int, chunks: int | None, options: dict[str, int]
) -> Callable[[int], Schedule]:
    schedule = name.split("/")[0]
    chosen = {key: value or pp for key, value in options.items()}  # group 0: one of pp

    def build(m: int) -> Schedule:
        return build_schedule(
            schedule, num_ranks=pp, num_microbatches=m, num_chunks=chunks, validate=False, **chosen
        )

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sim.STEADY_FROM_ACTIONS = 0
    sizes = (4, 8) if args.quick else (4, 8, 16)
    rows = steady = differ = 0
    cpu_whole = cpu_steady = 0.0
    print(
        f"{'schedule':<20} {'pp':>3} {'m':>4} {'costs':<8} {'model':<9} {'read off':<14} "
        "same  whole s  steady s"
    )
    for (name, (chunks, options, models)), pp, per_rank, (label, costs) in itertools.product(
        SCHEDULES.items(), sizes, (6, 16), COSTS.items()
    ):
        build = builder(name, pp, chunks, options)
        m = per_rank * pp
        schedule = build(m)
        for model in models:
            t = time.process_time()
            whole = simulate(schedule, costs, p2p=model)
            t_whole = time.process_time() - t
            t = time.process_time()
            fast = sim.simulate_steady(schedule, costs, shorter=build, period=pp, p2p=model)
            t_steady = time.process_time() - t
            same = (
                whole.step_time == fast.step_time
                and whole.bubble_fraction == fast.bubble_fraction
                and [r.to_dict() for r in whole.per_rank] == [r.to_dict() for r in fast.per_rank]
            )
            rows += 1
            steady += bool(fast.steady_from)
            differ += not same
            cpu_whole += t_whole
            cpu_steady += t_steady
            lengths = ",".join(map(str, fast.steady_from)) or "(whole)"
            print(
                f"{name:<20} {pp:>3} {m:>4} {label:<8} {model:<9} {lengths:<14} "
                f"{'yes' if same else 'NO':<5} {t_whole:>7.2f}  {t_steady:>8.2f}"
            )
    print(
        f"\n{rows} layouts: {steady} read off the steady state, {rows - steady} timed whole; "
        f"{differ} differ from the whole step. CPU: whole {cpu_whole:.1f} s, "
        f"steady {cpu_steady:.1f} s"
    )
    raise SystemExit(1 if differ else 0)


if __name__ == "__main__":
    main()
