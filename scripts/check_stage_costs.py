#!/usr/bin/env python3
"""The simulator's uneven stage costs against megatron-core's stages timed (issue 42, item 4).

bfpp-sim weighs each stage of a ``--pipeline-model-parallel-layout`` by its layers, the
embedding ``E`` and the output layer with its loss ``L`` (``config.run_config.
layout_stage_weights``, with ``--embedding-weight`` / ``--loss-weight``). This script takes those
weights from an independent calibration, ``bfpp-plan profile``'s measurement (one transformer
layer, and the embedding and output layer of a one-layer GPTModel, timed apart), predicts each
stage's forward + backward seconds as its weight times an even stage's time, and then times the
real thing: each stage of the layout built as megatron-core builds it for that pipeline rank (a
``GPTModel`` with its layers, ``pre_process`` where it holds E, ``post_process`` and the loss
where it holds L), forward from token ids or a received hidden state and backward, medians of
``--iterations``. It prints, per stage, predicted and measured milliseconds and the error.

CPU seconds on a shared machine move between runs: compare within one run, and rerun a case
whose error is far from its neighbours'. The figures in docs/simulator.md#uneven-stages come from

    python scripts/check_stage_costs.py            # about seven minutes of CPU
    python scripts/check_stage_costs.py --quick    # a tiny model (the test keeping it working)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from megatron_bfpp import stage_timing
from megatron_bfpp.config.run_config import layout_stage_weights, layout_stages
from megatron_bfpp.plan.presets import Model


@dataclass(frozen=True)
class Case:
    model: Model
    pp: int
    layout: str


def _model(arch: str, layers: int, hidden: int, vocab: int, seq: int) -> Model:
    """A LLaMA (SwiGLU, 8/3 h) or GPT (4 h) shape with heads of 32."""
    ffn = int(hidden * 8 / 3) // 64 * 64 if arch == "llama" else 4 * hidden
    return Model(
        name=f"{arch}-{layers}x{hidden}-v{vocab}",
        arch=arch,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=hidden // 32,
        num_query_groups=hidden // 32,
        ffn_hidden_size=ffn,
        seq_length=seq,
        vocab_size=vocab,
        dropout=False,
    )


CASES = (
    Case(_model("llama", 8, 512, 32000, 256), 4, "Et|ttt|ttt|tL"),
    Case(_model("llama", 8, 512, 32000, 256), 4, "Ett|ttt|tt|L"),
    Case(_model("gpt", 8, 512, 16000, 256), 4, "Et|ttt|ttt|tL"),
    Case(_model("llama", 8, 512, 32000, 256), 4, "Et|ttt|ttt|tmL"),  # an MTP layer: m
)
QUICK = (Case(_model("llama", 4, 64, 1000, 32), 2, "Et|tttmL"),)


def time_stages(
    model: Model, layout: str, *, micro_batch_size: int, warmup: int, iterations: int
) -> list[float]:
    """Forward + backward seconds of each stage of ``layout``, as megatron-core builds it."""
    from megatron.core.models.gpt import GPTModel

    device, dtype = torch.device("cpu"), torch.float32
    seconds = []
    for stage in layout_stages(layout):
        layers, first, last = stage.count("t"), "E" in stage, "L" in stage
        config, spec = stage_timing._config_and_spec(model, max(layers, 1), device, dtype)
        if not layers:  # megatron-core's empty decoder: a stage of only E or L
            config.num_layers = 0
        mtp = {}
        if stage.count("m"):  # MTP layers after the decoder (one rank: it is the last stage)
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            config.mtp_num_layers = stage.count("m")
            mtp["mtp_block_spec"] = get_gpt_mtp_block_spec(
                config, spec, use_transformer_engine=False
            )
        llama = model.arch == "llama"
        gpt: Any = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=model.shape(tp=1).vocab_size,
            max_sequence_length=model.seq_length,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope" if llama else "learned_absolute",
            **mtp,
        )
        step = functools.partial(_stage_step, gpt, model, micro_batch_size, first, last, bool(mtp))
        times = []
        for i in range(warmup + iterations):
            for p in gpt.parameters():
                p.grad = None
            t = stage_timing._timed(device, step)
            if i >= warmup:
                times.append(t)
        seconds.append(statistics.median(times))
    return seconds


def _stage_step(
    gpt: Any, model: Model, micro_batch_size: int, first: bool, last: bool, mtp: bool = False
) -> None:
    """One micro-batch through a stage: from token ids where it holds E, else from a received
    hidden state; to the loss where it holds L (backward from its mean), else to the hidden
    state it sends (backward from a gradient of its shape). MTP layers read the token ids too."""
    s, b, h = model.seq_length, micro_batch_size, model.hidden_size
    tokens = torch.randint(0, model.vocab_size, (b, s))
    if not first:
        gpt.set_input_tensor(torch.randn(s, b, h, requires_grad=True))
    ids = first or mtp
    out = gpt(
        input_ids=tokens if ids else None,
        position_ids=torch.arange(s).expand(b, s) if ids else None,
        attention_mask=None,
        labels=tokens if last else None,
    )
    if last:
        torch.autograd.backward(out.float().mean())
    else:
        torch.autograd.backward(out, torch.ones_like(out))


def check(
    case: Case, *, micro_batch_size: int, warmup: int, iterations: int, rounds: int = 1
) -> list[str]:
    """``rounds`` alternations of the profile and the stages' timing; each stage's prediction and
    measurement are the medians over the rounds (one slow moment then moves neither much)."""
    model, layout = case.model, case.layout
    stages = layout_stages(layout)
    even = sum(stage.count("t") for stage in stages) / len(stages)
    layers, ends_seen, predictions, measurements = [], [], [], []
    for _ in range(rounds):
        profile = stage_timing.measure_stage(
            model=model,
            num_layers=1,
            micro_batch_sizes=(micro_batch_size,),
            device="cpu",
            warmup=warmup,
            iterations=iterations,
        )
        row = profile.measurements[0]
        ends = row.end_weights(profile.num_layers)
        if ends is None:
            raise SystemExit("the profile did not time the embedding and output layer")
        weights = layout_stage_weights(layout, case.pp, embedding=ends[0], loss=ends[1])
        layer = row.forward_s + row.backward_s
        layers.append(layer)
        ends_seen.append(ends)
        predictions.append([w * even * layer for w in weights])
        with warnings.catch_warnings(), stage_timing._single_rank(torch.device("cpu")):
            warnings.simplefilter("ignore")
            measurements.append(
                time_stages(
                    model,
                    layout,
                    micro_batch_size=micro_batch_size,
                    warmup=warmup,
                    iterations=iterations,
                )
            )
    predicted = [statistics.median(column) for column in zip(*predictions, strict=True)]
    measured = [statistics.median(column) for column in zip(*measurements, strict=True)]
    layer = statistics.median(layers)
    e, loss = (statistics.median(column) for column in zip(*ends_seen, strict=True))
    weights = layout_stage_weights(layout, case.pp, embedding=e, loss=loss)
    lines = [
        f"{model.name} b={micro_batch_size}, layout {layout}: a layer {1e3 * layer:.2f} ms, "
        f"E {e:.3f} layers, L {loss:.3f} layers (the profile; medians of {rounds} round(s))",
        f"  {'stage':<8} {'weight':>7} {'predicted ms':>13} {'measured ms':>12} {'error':>7}",
    ]
    for stage, w, p, m in zip(stages, weights, predicted, measured, strict=True):
        lines.append(f"  {stage:<8} {w:>7.3f} {1e3 * p:>13.2f} {1e3 * m:>12.2f} {p / m - 1:>+7.1%}")
    worst = max(abs(p / m - 1) for p, m in zip(predicted, measured, strict=True))
    lines.append(f"  largest error {worst:.1%}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny case")
    parser.add_argument("--first-case", type=int, default=0, help="skip the cases before it")
    parser.add_argument(
        "--rounds", type=int, default=3, help="profile and stages timed in turn, medians"
    )
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one rank's share of a CPU node; steadier medians
    for case in QUICK if args.quick else CASES[args.first_case :]:
        for line in check(
            case,
            micro_batch_size=args.micro_batch_size,
            warmup=args.warmup,
            iterations=args.iterations,
            rounds=args.rounds,
        ):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
