#!/usr/bin/env python3
"""CPU seconds of the execution model at the sizes users plan: the one-program issue's targets.

Each case runs in a fresh process (no warm caches, as a user's command meets it) and reports
the CPU seconds of the work itself (imports excluded) and, for the commands, of the whole
process:

* ``bfpp-sim`` at pp 64, vp 4, m 1,024 under the default timing model (lock-step), in-process
  (``cli.sim.main`` with ``--json``) and as a command;
* the NCCL proof (``validate_schedule`` with ``nccl=True``) at that size;
* ``bfpp-plan recommend`` for GPT-3 52B on 64 x V100 at global batch 16, 64, 1,024 and 8,192;
* the floor under bfpp-sim's figure: building the full step and its gloo checks, per action.

Targets (issue 41): bfpp-sim under 1 s in-process and 1.5 s as a command; the proof under 2 s;
recommend under 10 s. Wall time is printed too, but the machines this runs on are shared: read
the CPU column.

    python scripts/bench_model.py            # everything (several minutes)
    python scripts/bench_model.py --quick    # bfpp-sim breadth-first and recommend at 64
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence

SIM = ["--pp", "64", "--microbatches", "1024", "--json"]
SIM_CASES = {"breadth-first": ["--vp", "4"], "interleaved": ["--vp", "4"], "v-zb": [], "bpipe": []}
PLAN = ["--model", "gpt3-52b", "--num-gpus", "64", "--gpu", "v100-32gb", "--top", "3"]
PLAN_BATCHES = [16, 64, 1024, 8192]

CHILD = """
import contextlib, io, json, sys, time
kind, args = sys.argv[1], json.loads(sys.argv[2])
if kind == "sim":
    from megatron_bfpp.cli.sim import main
elif kind == "plan":
    from megatron_bfpp.cli.plan import main
elif kind == "floor":  # what bfpp-sim pays before it times anything: build and gloo checks
    from megatron_bfpp.schedules.registry import build_schedule
    from megatron_bfpp.validate import validate_schedule
    name, chunks = args[0], args[1]
    cpu = time.process_time()
    schedule = build_schedule(name, num_ranks=64, num_microbatches=1024, num_chunks=chunks,
                              validate=False)
    built = time.process_time()
    validate_schedule(schedule, nccl=False)
    print(json.dumps({"actions": schedule.num_actions, "build": built - cpu,
                      "validate": time.process_time() - built}))
    sys.exit()
else:
    from megatron_bfpp.schedules.registry import build_schedule
    from megatron_bfpp.validate import validate_schedule
    schedule = build_schedule(args[0], num_ranks=64, num_microbatches=1024, num_chunks=4,
                              validate=False)
    main = lambda _: validate_schedule(schedule, nccl=True) or 0
cpu, wall = time.process_time(), time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()):
    if main(args):
        sys.exit(f"{kind} {args} failed")
print(json.dumps({"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}))
"""


def in_process(kind: str, args: Sequence[object]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, kind, json.dumps(args)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def as_command(command: list[str]) -> dict[str, float]:
    """CPU seconds of a child process, start-up and imports included."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    subprocess.run(command, capture_output=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu": cpu, "wall": time.perf_counter() - wall}


def row(name: str, figures: dict[str, float], target: float) -> None:
    verdict = "meets" if figures["cpu"] < target else "misses"
    print(f"{name:<44} {figures['cpu']:>8.2f} {figures['wall']:>8.2f}   {verdict} < {target:g} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sims = list(SIM_CASES)[:1] if args.quick else list(SIM_CASES)
    batches = [64] if args.quick else PLAN_BATCHES
    print(f"{'case':<44} {'cpu s':>8} {'wall s':>8}")
    for name in sims:
        sim = ["--schedule", name, *SIM, *SIM_CASES[name]]
        row(f"bfpp-sim {name} (in-process)", in_process("sim", sim), 1.0)
        command = [sys.executable, "-m", "megatron_bfpp.cli.sim", *sim]
        row(f"bfpp-sim {name} (command)", as_command(command), 1.5)
    if not args.quick:
        print("\nfloor (bfpp-sim builds and checks the full step before timing it):")
        for name in sims:
            chunks = int(SIM_CASES[name][1]) if SIM_CASES[name] else None
            f = in_process("floor", [name, chunks])
            per = 1e6 * (f["build"] + f["validate"]) / f["actions"]
            print(
                f"  {name:<14} {f['actions']:>9,} actions: build {f['build']:.2f} s, gloo "
                f"checks {f['validate']:.2f} s ({per:.1f} us per action)"
            )
        print()
        for name in ("breadth-first", "interleaved"):
            row(f"NCCL proof {name} (in-process)", in_process("proof", [name]), 2.0)
    for batch in batches:
        plan = ["recommend", *PLAN, "--global-batch-size", str(batch)]
        row(f"bfpp-plan recommend 52B / 64 V100, batch {batch}", in_process("plan", plan), 10.0)


if __name__ == "__main__":
    main()
