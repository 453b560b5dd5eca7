#!/usr/bin/env python3
"""BPipe against 1F1B: measured per-rank activation memory and step time, side by side.

1F1B stores up to p - r micro-batches of activations on rank r, so rank 0 needs the most memory
and the last rank the least; BPipe evicts activations from the busy early ranks to partner late
ranks so that no rank stores more than ceil((p + 2) / 2). This prints what the runtime measured
on real ranks for both schedules in one run: the same forked gloo ranks, GPT model (megatron-core
local layer spec, fp32, CPU), and data; steps alternate 1f1b / bpipe so drift affects both
equally. Peak bytes are the distinct storages a rank holds for pipelining (saved tensors, stage
inputs/outputs, eviction payloads), from each schedule's last step (BPipe's first step learns
the eviction payload sizes). Step time is the median over timed steps of the slowest rank.

    python scripts/bench_bpipe.py                      # pp=4 and pp=8
    python scripts/bench_bpipe.py --pp 4 --steps 5 --json bpipe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from megatron_bfpp.files import write_output
from megatron_bfpp.passes.eviction import bpipe_max_stored
from megatron_bfpp.testing.multirank import run_ranks

SCHEDULES = ("1f1b", "bpipe")
MIB = 1024 * 1024

# megatron-core's "Apex / Transformer Engine not installed" and deprecation notices (set before
# run_ranks imports megatron-core; the forked ranks inherit the filter).
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")


def rank_main(sizes: dict[str, int], warmup: int, steps: int) -> dict[str, Any]:
    """One rank: alternate the two schedules, ``warmup`` untimed then ``steps`` timed steps each;
    step times and the last step's memory report per schedule."""
    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.testing import models as M

    config = M.tiny_gpt_config(
        num_layers=sizes["layers"],
        hidden_size=sizes["hidden"],
        num_attention_heads=sizes["heads"],
        ffn_hidden_size=sizes["ffn"],
    )
    chunks = M.build_model_chunks(config, max_sequence_length=sizes["seq"])
    batches = M.make_batches(
        sizes["microbatches"],
        micro_batch_size=sizes["micro_batch_size"],
        seq_len=sizes["seq"],
        seed=0,
    )
    funcs = {name: get_forward_backward_func(name, measure_memory=True) for name in SCHEDULES}
    out: dict[str, Any] = {name: {"times": []} for name in SCHEDULES}
    for step in range(warmup + steps):
        for name, func in funcs.items():
            for chunk in chunks:
                chunk.zero_grad()
            torch.distributed.barrier()
            start = time.perf_counter()
            M.run_schedule(
                chunks,
                batches,
                forward_backward_func=func,
                seq_length=sizes["seq"],
                micro_batch_size=sizes["micro_batch_size"],
            )
            torch.distributed.barrier()
            if step >= warmup:
                out[name]["times"].append(time.perf_counter() - start)
    for name, func in funcs.items():
        memory = func.last_memory
        out[name].update(
            peak_activation_bytes=memory.peak_activation_bytes,
            peak_stored_microbatches=memory.peak_stored_microbatches,
            cuda_max_memory_allocated=memory.cuda_max_memory_allocated,
        )
    return out


def summarize(pp: int, results: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per-rank figures and the cross-rank summary of one pipeline size."""
    summary: dict[str, Any] = {"pp": pp, "max_stored_cap": bpipe_max_stored(pp), "ranks": []}
    for rank, result in enumerate(results):
        summary["ranks"].append({"rank": rank, **{name: dict(result[name]) for name in SCHEDULES}})
    for name in SCHEDULES:
        peaks = [r[name]["peak_activation_bytes"] for r in results]
        stored = [r[name]["peak_stored_microbatches"] for r in results]
        step_times = [max(r[name]["times"][i] for r in results) for i in range(steps)]
        summary[name] = {
            "max_peak_bytes": max(peaks),
            "min_peak_bytes": min(peaks),
            "max_stored_microbatches": max(stored),
            "median_step_s": statistics.median(step_times),
            "step_times_s": step_times,
        }
    return summary


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def print_summary(s: dict[str, Any]) -> None:
    a, b = s["1f1b"], s["bpipe"]
    print(f"{'rank':>4} {'1f1b peak MiB':>14} {'bpipe peak MiB':>15} {'bpipe/1f1b':>11}")
    for r in s["ranks"]:
        x, y = r["1f1b"]["peak_activation_bytes"], r["bpipe"]["peak_activation_bytes"]
        print(f"{r['rank']:>4} {x / MIB:>14.2f} {y / MIB:>15.2f} {_ratio(y, x):>11.3f}")
    print(
        f"max over ranks: 1f1b {a['max_peak_bytes'] / MIB:.2f} MiB, "
        f"bpipe {b['max_peak_bytes'] / MIB:.2f} MiB "
        f"({_ratio(b['max_peak_bytes'], a['max_peak_bytes']):.3f})"
    )
    print(
        f"spread max/min: 1f1b {_ratio(a['max_peak_bytes'], a['min_peak_bytes']):.2f}, "
        f"bpipe {_ratio(b['max_peak_bytes'], b['min_peak_bytes']):.2f}"
    )
    print(
        f"step time: 1f1b {a['median_step_s']:.3f} s, bpipe {b['median_step_s']:.3f} s, "
        f"bpipe/1f1b = {_ratio(b['median_step_s'], a['median_step_s']):.3f}"
    )
    stored = {
        name: " ".join(str(r[name]["peak_stored_microbatches"]) for r in s["ranks"])
        for name in SCHEDULES
    }
    print(
        f"most micro-batches stored at once, per rank: 1f1b [{stored['1f1b']}], "
        f"bpipe [{stored['bpipe']}]; bpipe cap ceil((p+2)/2) = {s['max_stored_cap']} "
        f"({'within' if b['max_stored_microbatches'] <= s['max_stored_cap'] else 'OVER'})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--layers-per-stage", type=int, default=2, help="model layers = this * pp")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument(
        "--microbatches-per-stage", type=int, default=2, help="micro-batches = this * pp"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per schedule")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per schedule")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pp run")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (BPipe's first step learns the payload sizes)")
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    print(
        f"GPT {args.layers_per_stage} layers/stage, hidden {args.hidden}, {args.heads} heads, "
        f"ffn {args.ffn}, seq {args.seq}, micro-batch size {args.micro_batch_size}, "
        f"{args.microbatches_per_stage}*pp micro-batches; {args.warmup} warm-up + "
        f"{args.steps} timed steps per schedule, alternating"
    )
    runs = []
    for pp in args.pp:
        sizes = {
            "layers": args.layers_per_stage * pp,
            "hidden": args.hidden,
            "heads": args.heads,
            "ffn": args.ffn,
            "seq": args.seq,
            "micro_batch_size": args.micro_batch_size,
            "microbatches": args.microbatches_per_stage * pp,
        }
        start = time.perf_counter()
        results = run_ranks(
            rank_main,
            world_size=pp,
            pp=pp,
            timeout=args.timeout,
            args=(sizes, args.warmup, args.steps),
        )
        summary = summarize(pp, results, args.steps)
        summary["sizes"] = sizes
        summary["wall_s"] = time.perf_counter() - start
        runs.append(summary)
        print(
            f"\npp={pp}: {sizes['layers']} layers, {sizes['microbatches']} micro-batches "
            f"({summary['wall_s']:.1f} s wall)"
        )
        print_summary(summary)
    print(
        "\nnote: on CPU the eviction transfers are local memcpy over gloo TCP and compute runs "
        "one thread per rank on shared cores, so the step-time ratio is not a GPU figure; the "
        "peak bytes are the runtime's own accounting and carry over."
    )
    if args.json is not None:
        payload = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
        payload["runs"] = runs
        write_output(args.json, (json.dumps(payload, indent=2) + "\n").encode())
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
