#!/usr/bin/env python3
"""Runtime overhead: our schedules against megatron-core's native functions, side by side.

Same ranks, same GPT model (megatron-core local layer spec, fp32, CPU/gloo), same data; steps
alternate native / ours so drift affects both equally. Prints the median step time of each and
the ratio ours / native (target: within 5%).

With ``--emulation`` it also times each of our schedules on plain gloo and under the test
support's emulation of NCCL's point-to-point rules (one Work per batch, batches in order, sends
waiting for their receiver), in separate ranks: what the emulation costs the tests, and that
every schedule completes under NCCL's rules.

    python scripts/bench_runtime.py                       # pp=2: 1f1b, and interleaved with vp=2
    python scripts/bench_runtime.py --hidden 512 --steps 8
    python scripts/bench_runtime.py --emulation --pp 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from megatron_bfpp.schedules.registry import get_spec
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks


def _model(schedule: str, sizes: dict[str, int]) -> tuple[list[Any], list[Any]]:
    """This rank's chunks of the benchmark GPT, in the schedule's placement, and the batches."""
    torch.set_num_threads(1)
    config = M.tiny_gpt_config(
        num_layers=sizes["layers"],
        hidden_size=sizes["hidden"],
        num_attention_heads=sizes["heads"],
        ffn_hidden_size=4 * sizes["hidden"],
    )
    placement = get_spec(schedule).placement
    chunks = M.build_model_chunks(config, max_sequence_length=sizes["seq"], placement=placement)
    return chunks, M.make_batches(sizes["microbatches"], seq_len=sizes["seq"], seed=0)


def _step_time(chunks: list[Any], batches: list[Any], func: Any, seq: int) -> float:
    for chunk in chunks:
        chunk.zero_grad()
    torch.distributed.barrier()
    start = time.perf_counter()
    M.run_schedule(chunks, batches, forward_backward_func=func, seq_length=seq)
    torch.distributed.barrier()
    return time.perf_counter() - start


def rank_main(schedule: str, sizes: dict[str, int], steps: int) -> tuple[list[float], list[float]]:
    from megatron.core.pipeline_parallel import get_forward_backward_func as native_func

    from megatron_bfpp import get_forward_backward_func

    chunks, batches = _model(schedule, sizes)
    ours = get_forward_backward_func(schedule)
    native = native_func()
    timings: dict[str, list[float]] = {"native": [], "ours": []}
    for step in range(2 * steps + 2):
        which = "native" if step % 2 == 0 else "ours"
        func = native if which == "native" else ours
        elapsed = _step_time(chunks, batches, func, sizes["seq"])
        if step >= 2:  # one warm-up step each
            timings[which].append(elapsed)
    return timings["native"], timings["ours"]


def emulated_main(
    schedule: str, vp: int | None, sizes: dict[str, int], steps: int, emulate: bool
) -> list[float]:
    """Step times of one of our schedules, under the NCCL emulation or on plain gloo."""
    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.testing import nccl_emulation

    if emulate:
        nccl_emulation.install()
    else:
        nccl_emulation.uninstall()
    chunks, batches = _model(schedule, sizes)
    func = get_forward_backward_func(schedule)
    times = [_step_time(chunks, batches, func, sizes["seq"]) for _ in range(steps + 1)]
    return times[1:]  # after one warm-up step


EMULATED = (
    ("gpipe", None),
    ("1f1b", None),
    ("interleaved", 2),
    ("breadth-first", 2),
    ("bpipe", None),
    ("v-min", 2),
    ("v-half", 2),
    ("v-zb", 2),
)


def compare_emulation(pp: int, sizes: dict[str, int], steps: int) -> None:
    print(f"\nour schedules, pp={pp}: plain gloo against NCCL's rules emulated on gloo")
    print(f"{'schedule':<14} {'gloo s':>9} {'emulated s':>10} {'emulated/gloo':>13}")
    for schedule, vp in EMULATED:
        medians = []
        for emulate in (False, True):
            results = run_ranks(
                emulated_main,
                world_size=pp,
                pp=pp,
                vp=vp,
                timeout=900,
                args=(schedule, vp, sizes, steps, emulate),
            )
            medians.append(statistics.median(max(r[i] for r in results) for i in range(steps)))
        gloo, emulated = medians
        print(f"{schedule:<14} {gloo:>9.4f} {emulated:>10.4f} {emulated / gloo:>13.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--emulation",
        action="store_true",
        help="also time every schedule on plain gloo and under the NCCL emulation",
    )
    args = parser.parse_args()
    sizes = {
        "hidden": args.hidden,
        "layers": args.layers,
        "heads": 8,
        "seq": args.seq,
        "microbatches": args.microbatches,
    }
    print(
        f"pp={args.pp} GPT {args.layers} layers hidden {args.hidden} seq {args.seq} "
        f"micro-batches {args.microbatches}; {args.steps} timed steps each, alternating"
    )
    print(f"{'schedule':<12} {'vp':>2} {'native s':>9} {'ours s':>9} {'ours/native':>11}")
    for schedule, vp in (("1f1b", None), ("interleaved", 2)):
        results = run_ranks(
            rank_main,
            world_size=args.pp,
            pp=args.pp,
            vp=vp,
            timeout=900,
            args=(schedule, sizes, args.steps),
        )
        native = statistics.median(max(r[0][i] for r in results) for i in range(args.steps))
        ours = statistics.median(max(r[1][i] for r in results) for i in range(args.steps))
        print(
            f"{schedule:<12} {vp or 1:>2} {native:>9.4f} {ours:>9.4f} {ours / native:>11.3f}",
            flush=True,
        )
    if args.emulation:
        compare_emulation(args.pp, sizes, args.steps)


if __name__ == "__main__":
    main()
