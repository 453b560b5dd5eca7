#!/usr/bin/env python3
"""One V chunk's I and W against its whole backward B, at a realistic hidden size (issue 10).

The V-shape schedules save time only if I (input gradients, on the critical path) is well below
B and W (the deferred weight GEMMs, placed in bubbles) costs about what it saves: I + W close to
B. This times transformer layers of a model preset through the code the runtime runs
(``stage_timing.measure_stage``: B is megatron-core's backward, I the backward with the
local linear layers' weight GEMMs deferred by ``runtime.deferred_wgrad``, W those GEMMs), side by
side in one process, and prints the ratios.

    python scripts/bench_split_backward.py                                   # llama-7b, CPU
    python scripts/bench_split_backward.py --device cuda --seq-length 4096   # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_bfpp.plan.presets import MODELS, get_model
from megatron_bfpp.stage_timing import measure_stage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-7b", choices=sorted(MODELS))
    parser.add_argument("--seq-length", type=int, default=256, help="(default 256: CPU-sized)")
    parser.add_argument("--layers", type=int, default=1, help="layers in the chunk")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    model = dataclasses.replace(get_model(args.model), seq_length=args.seq_length)
    profile = measure_stage(
        model=model,
        num_layers=args.layers,
        micro_batch_sizes=args.micro_batch_sizes,
        device=args.device,
        warmup=args.warmup,
        iterations=args.iterations,
    )
    print(
        f"{args.model}: {args.layers} layer(s), hidden {model.hidden_size}, sequence "
        f"{model.seq_length}, {profile.dtype} on {profile.device} (medians of "
        f"{args.iterations})"
    )
    header = ("b", "F ms", "B ms", "I ms", "W ms", "I/B", "W/B", "(I+W)/B")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (3, 9, 9, 9, 9, 6, 6, 8), strict=True)))
    for m in profile.measurements:
        i, w, b = m.backward_input_s or 0.0, m.backward_weight_s or 0.0, m.backward_s
        print(
            f"{m.micro_batch_size:>3} {m.forward_s * 1e3:>9.1f} {b * 1e3:>9.1f} {i * 1e3:>9.1f} "
            f"{w * 1e3:>9.1f} {i / b:>6.3f} {w / b:>6.3f} {(i + w) / b:>8.3f}"
        )


if __name__ == "__main__":
    main()
