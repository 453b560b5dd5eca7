#!/usr/bin/env python3
"""One pipeline stage's stored activations, measured, next to the planner's activation model.

For each model and recomputation, runs 1..K forwards of one stage (``--layers`` transformer
layers of megatron-core's local spec, the layers bfpp-train builds) back to back, keeping each
micro-batch's graph as a stage does until its backward, and counts the bytes held after each
(``stage_timing.measure_stored_activations``: ``torch.cuda.memory_allocated`` on a GPU, the
distinct saved storages on CPU). Prints, per row, the measured bytes per stored micro-batch (the
slope over k), the planner's (``plan.memory.stage_activation_bytes``, a middle stage's layers),
their ratio, and the peak above the weights with K stored (backwards included). ``--json FILE``
writes the rows for docs/measurements (read by tests/unit/test_stage_memory.py).

    python scripts/bench_stage_memory.py                       # GPU: gpt3-6.7b, llama-7b, bf16
    python scripts/bench_stage_memory.py --models gpt3-6.7b --layers 4 --stored 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_bfpp.files import write_output
from megatron_bfpp.plan.memory import RECOMPUTE, stage_activation_bytes
from megatron_bfpp.plan.presets import BF16_MIXED, FP32, Model, get_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt3-6.7b,llama-7b")
    parser.add_argument("--layers", type=int, default=4, help="layers in the stage")
    parser.add_argument("--stored", type=int, default=8, help="most micro-batches stored (K)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--recompute", default=",".join(RECOMPUTE))
    parser.add_argument("--seq-length", type=int, default=None, help="override the preset's")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--breakdown", action="store_true", help="list the tensors one layer saves, per model"
    )
    args = parser.parse_args()

    import torch

    from megatron_bfpp.compat import megatron_core_version
    from megatron_bfpp.stage_timing import measure_stored_activations

    rows = []
    for name in args.models.split(","):
        model = _model(name, args.seq_length)
        for recompute in args.recompute.split(","):
            result = measure_stored_activations(
                model=model,
                num_layers=args.layers,
                stored=args.stored,
                micro_batch_size=args.micro_batch_size,
                recompute=recompute,
                device=args.device,
            )
            precision = BF16_MIXED if result.dtype != "fp32" else FP32
            predicted = stage_activation_bytes(
                model,
                micro_batch_size=args.micro_batch_size,
                tp=1,
                layers_per_stage=args.layers,
                vocab_size=model.vocab_size,
                sequence_parallel=False,
                recompute=recompute,
                precision=precision,
            ).layers
            row = {
                "model": name,
                "recompute": recompute,
                "dtype": result.dtype,
                "layers": args.layers,
                "micro_batch_size": args.micro_batch_size,
                "weights_bytes": result.weights,
                "stored_bytes": list(result.stored),
                "peak_bytes": result.peak,
                "measured_per_microbatch": result.per_microbatch,
                "planner_per_microbatch": predicted,
            }
            rows.append(row)
            peak = "-" if result.peak is None else f"{result.peak / 2**30:.2f}"
            print(
                f"{name:10s} {recompute:9s} measured {result.per_microbatch / 2**20:9.1f} MiB/mb"
                f"  planner {predicted / 2**20:9.1f} MiB/mb  ratio "
                f"{result.per_microbatch / predicted:.3f}  peak with {args.stored} stored "
                f"{peak} GiB  weights {result.weights / 2**30:.2f} GiB",
                flush=True,
            )
    if args.breakdown:
        for name in args.models.split(","):
            _breakdown(_model(name, args.seq_length), args.micro_batch_size, args.device)
    if args.json:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        record = {
            "format": "bfpp-stage-memory",
            "version": 1,
            "device": device,
            "torch_version": torch.__version__,
            "megatron_core_version": ".".join(map(str, megatron_core_version())),
            "rows": rows,
        }
        write_output(args.json, (json.dumps(record, indent=2) + "\n").encode())
    return 0


def _model(name: str, seq_length: int | None) -> Model:
    model = get_model(name)
    return model if seq_length is None else model.with_seq_length(seq_length)


def _breakdown(model: object, micro_batch_size: int, device: str) -> None:
    """Each distinct storage one layer saves for its backward: shape, dtype, bytes and the op
    that made it, to tell which tensors the activation model misses or over-counts."""
    import warnings

    import torch

    from megatron_bfpp import stage_timing

    target = stage_timing._device(device)
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    seen: dict[int, tuple[tuple[int, ...], str, int, str]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            maker = type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else "leaf/none"
            seen.setdefault(
                storage.data_ptr(),
                (tuple(tensor.shape), str(tensor.dtype), storage.nbytes(), maker),
            )
        return tensor

    with warnings.catch_warnings(), stage_timing._single_rank(target):
        warnings.simplefilter("ignore")
        block = stage_timing._build_block(model, 1, target, dtype)  # type: ignore[arg-type]
        rotary = stage_timing._rotary(block, model, target)  # type: ignore[arg-type]
        shape = (model.seq_length, micro_batch_size, model.hidden_size)  # type: ignore[attr-defined]
        hidden = torch.randn(shape, device=target, dtype=dtype, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = block(hidden, attention_mask=None, rotary_pos_emb=rotary)
        total = sum(entry[2] for entry in seen.values())
        print(f"{model.name}: one layer saves {total / 2**20:.1f} MiB:")  # type: ignore[attr-defined]
        for shape_, dtype_, size, maker in seen.values():
            print(f"    {size / 2**20:9.2f} MiB  {dtype_:15s} {shape_!s:24s} {maker}")
        del out


if __name__ == "__main__":
    sys.exit(main())
