#!/usr/bin/env python3
"""The planner's approximate step time against the full simulation, layout by layout.

Past ``EXACT_UP_TO`` periods a schedule whose steps lie on no exact line (BPipe under the
lock-step posting) is timed by ``plan.search._approximate``: the line through two shorter
schedules. The searches reach it with BPipe under the default lock-step model and V-Half under
``--p2p-model gloo`` (counted on recommend's 52B / 64 x V100 search at global batch 8,192).
This prints, for both at pp 4-16 with the planner's own costs of real models, the approximate
step, the full simulation of every micro-batch, their relative error and each one's CPU seconds.

    python scripts/bench_extrapolation.py            # 60 BPipe layouts, 12 V-Half
    python scripts/bench_extrapolation.py --quick    # every eighth
"""

from __future__ import annotations

import argparse
import time

from megatron_bfpp.plan.presets import get_gpu, get_model
from megatron_bfpp.plan.search import (
    EXACT_UP_TO,
    Candidate,
    Cluster,
    SearchOptions,
    _approximate,
    _cost_model,
    _size,
)
from megatron_bfpp.schedules.registry import build_schedule
from megatron_bfpp.sim import simulate

CLUSTERS = {
    "gpt3-52b": Cluster(64, 8, get_gpu("v100-32gb")),
    "llama-70b": Cluster(64, 8, get_gpu("h100-80gb")),
    "gpt3-175b": Cluster(512, 8, get_gpu("a100-80gb")),
}


def layouts() -> list[tuple[str, Candidate, int, str]]:
    """(model, candidate, micro-batches, p2p model): past the exact range, BPipe at pp 4, 8, 16
    under lock-step and V-Half at pp 4 and 8 under gloo."""
    found = []
    for model in CLUSTERS:
        for pp in (4, 8, 16):
            for m in (EXACT_UP_TO * pp + 1, EXACT_UP_TO * pp + pp // 2, 64 * pp + 3, 96 * pp):
                for tp in (4, 8):
                    bpipe = Candidate("bpipe", "optim", tp, pp, 1, 2, 1, "full")
                    found.append((model, bpipe, m, "lockstep"))
    found = found[:60]
    for model in CLUSTERS:
        for pp in (4, 8):
            for m in (EXACT_UP_TO * pp + 1, 64 * pp + 3):
                v_half = Candidate("v-half", "optim", 4, pp, 2, 2, 1, "full")
                found.append((model, v_half, m, "gloo"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cases = layouts()[:: 8 if args.quick else 1]
    header = f"{'model':<10} {'pp':>3} {'tp':>3} {'m':>5} {'error %':>9} {'approx s':>9}"
    print(f"{'schedule':<8} {header} {'full s':>8}")
    worst = 0.0
    for model_name, candidate, m, p2p in cases:
        model, cluster = get_model(model_name), CLUSTERS[model_name]
        batch = m * candidate.dp * candidate.micro_batch_size
        sized = _size(candidate, model, cluster, batch, SearchOptions(), force=True)
        assert sized is not None
        costs = _cost_model(sized.times)
        start = time.process_time()
        approx, _ = _approximate(candidate, m, costs, p2p, None, candidate.pp)
        approx_s = time.process_time() - start
        start = time.process_time()
        chunks = None if candidate.vp == 1 else candidate.vp
        built = build_schedule(
            candidate.schedule,
            num_ranks=candidate.pp,
            num_microbatches=m,
            num_chunks=chunks,
            validate=False,
        )
        full = simulate(built, costs, p2p=p2p).step_time
        full_s = time.process_time() - start
        error = (approx - full) / full
        worst = max(worst, abs(error))
        print(
            f"{candidate.schedule:<8} {model_name:<10} {candidate.pp:>3} {candidate.tp:>3} "
            f"{m:>5} {100 * error:>9.4f} {approx_s:>9.2f} {full_s:>8.2f}"
        )
    print(f"{len(cases)} layouts, largest error {100 * worst:.4f}%")


if __name__ == "__main__":
    main()
