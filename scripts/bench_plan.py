#!/usr/bin/env python3
"""Time ``bfpp-plan recommend``'s search: candidates evaluated, rejected, simulated, seconds.

Each case runs in a fresh process (no warm caches), timed as wall-clock and CPU seconds of the
search itself (the imports excluded), best of ``--repeat``. The issue's target: >= 2,000
candidates in < 10 s on a 2-core machine.

    python scripts/bench_plan.py            # the 52B / 64 x V100 cases of docs/planner.md, more
    python scripts/bench_plan.py --quick    # two cases
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = [
    ("gpt3-52b", 64, "v100-32gb", 16),
    ("gpt3-52b", 64, "v100-32gb", 64),
    ("gpt3-52b", 64, "v100-32gb", 512),
    ("gpt3-175b", 128, "a100-80gb", 256),
    ("llama-70b", 64, "h100-80gb", 128),
    ("llama-7b", 16, "a100-40gb", 64),
]

CHILD = """
import json, sys, time
from megatron_bfpp.plan.presets import get_gpu, get_model
from megatron_bfpp.plan.search import Cluster, SearchOptions, recommend
model, gpus, gpu, batch = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
wall, cpu = time.perf_counter(), time.process_time()
cluster = Cluster(gpus, 8, get_gpu(gpu))
options = SearchOptions(best_per_family=True)  # as bfpp-plan recommend's table runs it
r = recommend(model=get_model(model), cluster=cluster, global_batch_size=batch, options=options)
print(json.dumps(dict(evaluated=r.candidates_evaluated, rejected=r.rejected_out_of_memory,
    simulated=r.simulated, pruned=r.pruned, wall=time.perf_counter() - wall,
    cpu=time.process_time() - cpu)))
"""


def run(case: tuple[str, int, str, int]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, case)], capture_output=True, text=True, check=True
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cases = CASES[:2] if args.quick else CASES
    print(
        f"{'model':<10} {'GPUs':>4} {'gpu':<10} {'batch':>5} {'candidates':>10} {'OOM':>6} "
        f"{'simulated':>9} {'pruned':>6} {'wall s':>7} {'cpu s':>6}"
    )
    for case in cases:
        runs = [run(case) for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r["wall"])
        model, gpus, gpu, batch = case
        print(
            f"{model:<10} {gpus:>4} {gpu:<10} {batch:>5} {best['evaluated']:>10.0f} "
            f"{best['rejected']:>6.0f} {best['simulated']:>9.0f} {best['pruned']:>6.0f} "
            f"{best['wall']:>7.2f} {min(r['cpu'] for r in runs):>6.2f}"
        )


if __name__ == "__main__":
    main()
