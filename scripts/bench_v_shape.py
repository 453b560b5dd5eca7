#!/usr/bin/env python3
"""V-shape schedules against 1F1B on real megatron-core GPT chunks: measured activation bytes per
pipeline rank and step time, side by side.

Each schedule runs the same model (``--layers-per-stage`` layers per V stage, so twice that per
1F1B stage; hidden ``--hidden``, fp32, local layer spec) on CPU ranks over gloo, built in its own
placement (looped for 1F1B, V for the others: megatron_bfpp.megatron.chunks). Activation bytes
are the runtime's accounting (``measure_memory``: distinct storages held for pipelining, peak over
the step, per rank); the busiest rank is compared with 1F1B's rank 0 (which stores p micro-batches
of a full stage) and with the paper's fractions (V-Half (p/2+1)/p, V-Min ((p+4)//3)/p, V-ZB 1).
Step time is the median over ``--steps`` steps after a warm-up, the slowest rank's; on this
machine's few cores the ranks share CPUs, so it shows the schedules' relative cost here, not a
GPU's. For step time beside the simulator under emulated compute, see ``bench_fidelity.py``
(its V-shape rows).

    python scripts/bench_v_shape.py                 # pp 4 and 8, 3p micro-batches
    python scripts/bench_v_shape.py --pp 4 --hidden 128
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from megatron_bfpp.ir import Placement
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks

SCHEDULES = ("1f1b", "v-min", "v-half", "v-zb")
BOUNDS = {
    "1f1b": lambda p: 1.0,
    "v-min": lambda p: ((p + 4) // 3) / p,
    "v-half": lambda p: (p / 2 + 1) / p,
    "v-zb": lambda p: 1.0,
}


def rank_main(schedule: str, num_microbatches: int, layers: int, hidden: int, steps: int) -> Any:
    import torch

    from megatron_bfpp import get_forward_backward_func

    v_shape = schedule.startswith("v-")
    config = M.tiny_gpt_config(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=4 * hidden,
        num_attention_heads=4,
        **({"vp": 2} if v_shape else {}),
    )
    chunks = M.build_model_chunks(
        config, placement=Placement.V_SHAPE if v_shape else Placement.LOOPED
    )
    func = get_forward_backward_func(schedule, measure_memory=True)
    batches = M.make_batches(num_microbatches, seed=3)
    times, peak = [], 0
    for _ in range(steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        M.run_schedule(chunks, batches, forward_backward_func=func)
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
        peak = max(peak, func.last_memory.peak_activation_bytes)
        for chunk in chunks:
            chunk.zero_grad()
    return peak, times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--layers-per-stage", type=int, default=2, help="layers per V stage")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    for pp in args.pp:
        m = 3 * pp
        layers = 2 * pp * args.layers_per_stage
        print(f"\npp={pp}, m={m}, {layers} layers, hidden {args.hidden}")
        print(
            f"{'schedule':<8} {'busiest/1f1b r0':>15} {'paper bound':>11} {'step s':>7} "
            "activation MB per rank"
        )
        base = None
        for schedule in SCHEDULES:
            results = run_ranks(
                rank_main,
                world_size=pp,
                pp=pp,
                vp=2 if schedule.startswith("v-") else None,
                timeout=900,
                args=(schedule, m, layers, args.hidden, args.steps),
            )
            peaks = [r[0] for r in results]
            step = statistics.median(max(r[1][i] for r in results) for i in range(args.steps))
            base = base or peaks[0]
            print(
                f"{schedule:<8} {max(peaks) / base:>15.3f} {BOUNDS[schedule](pp):>11.3f} "
                f"{step:>7.3f} " + " ".join(f"{b / 2**20:.2f}" for b in peaks),
                flush=True,
            )


if __name__ == "__main__":
    main()
