#!/usr/bin/env python3
"""Where uneven stages pay: the planner's predicted step per schedule on even stages, on the
best of Megatron-LM's own uneven-stage flags, and on ``--pipeline-model-parallel-layout auto``'s
partition (issue 42, item 4). Predictions of ``--pipeline-schedule auto``'s model, not
measurements: the output layer with its loss in the last stage's time, the embedding left out.

For each model (LLaMA-2 7B and 70B at a 32k vocabulary, an 8B model at 128k), 64 and 512
H100s, and 0.25, 1 and 8 samples per GPU, at a fixed tensor x pipeline split per model:

* even: even stages planned as stages (first = last = an even rank's layers), so the output
  layer is in the last stage's time as in the other two;
* Megatron's best: the fastest of ``--account-for-embedding-in-pipeline-split``,
  ``--account-for-loss-in-pipeline-split``, both, and ``--decoder-first-pipeline-num-layers`` /
  ``--decoder-last-pipeline-num-layers`` up to two layers lighter than an even rank's (the
  middle ranks' share must come out whole), per schedule;
* ours: ``--pipeline-model-parallel-layout auto``, per schedule.

    python scripts/uneven_layouts.py                 # the table (a few minutes)
    python scripts/uneven_layouts.py --json out.json
    python scripts/uneven_layouts.py --quick         # one case
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from collections.abc import Iterator
from functools import partial

from megatron_bfpp.config.run_config import UnevenStages, layout_of
from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.plan import auto
from megatron_bfpp.plan.auto import AutoRequest, hardware
from megatron_bfpp.plan.presets import GiB, Model, get_model
from megatron_bfpp.plan.search import SearchOptions, estimate_of, evaluate, lower_bound_of

LLAMA2_7B = dataclasses.replace(get_model("llama-7b"), name="llama2-7b", seq_length=4096)
LLAMA2_70B = dataclasses.replace(get_model("llama-70b"), name="llama2-70b")
LLAMA_8B_128K = dataclasses.replace(
    LLAMA2_7B, name="8b-128k-vocab", num_query_groups=8, ffn_hidden_size=14336, vocab_size=128256
)
SPLITS = {LLAMA2_7B.name: (4, 4), LLAMA_8B_128K.name: (4, 4), LLAMA2_70B.name: (8, 8)}
RECOMPUTE = {LLAMA2_70B.name: "selective"}  # 70B at tp 8, pp 8 holds 96 GiB without it
MODELS = (LLAMA2_7B, LLAMA2_70B, LLAMA_8B_128K)
CLUSTERS = (64, 512)
PER_GPU = (0.25, 1.0, 8.0)
HW = hardware(device_name=None, device_memory=None, gpu_flag="h100-80gb")
BUDGET = SearchOptions().memory_fraction * 80 * GiB  # auto's budget on an H100 80GB


def megatron_options(model: Model, pp: int) -> Iterator[UnevenStages]:
    """Megatron-LM's own uneven-stage flags worth trying: the account flags and lighter ends."""
    yield UnevenStages(account_for_embedding_in_pipeline_split=True)
    yield UnevenStages(account_for_loss_in_pipeline_split=True)
    yield UnevenStages(
        account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True
    )
    even = model.num_layers // pp
    for first, last in itertools.product(range(even - 2, even + 1), repeat=2):
        if (first, last) != (even, even):
            yield UnevenStages(
                decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last
            )


def timed(model: Model, gpus: int, per_gpu: float, uneven: UnevenStages) -> dict[str, tuple]:
    """Each schedule's fastest fitting candidate among those auto generates for ``uneven``
    (``plan.auto._candidates``: every one timed here, none pruned): (seconds, what it ran)."""
    tp, pp = SPLITS[model.name]
    request = AutoRequest(
        model=model,
        tp=tp,
        pp=pp,
        dp=gpus // (tp * pp),
        micro_batch_size=1,
        global_batch_size=int(gpus * per_gpu),
        hardware=HW,
        uneven=uneven,
        recompute=RECOMPUTE.get(model.name, "none"),
    )
    judge = auto._Judge.of(request)
    try:
        auto._check_request(request)
    except ScheduleError:
        return {}
    candidates = auto._candidates(request)[0]
    short = request.num_microbatches <= auto.EVERY_PARTITION_UP_TO * pp
    if uneven.partition and not short:  # as auto does: the best expected (a short step: all)
        common = dict(
            model=judge.model, cluster=judge.cluster, options=judge.options,
            global_batch_size=request.global_batch_size,
        )  # fmt: skip
        bound = partial(lower_bound_of, **common)
        bounded = [(bound(c), bound(c), i, c) for i, c in enumerate(candidates)]
        expected = partial(estimate_of, **common)
        candidates = [c for *_, c in auto._best_partitions(bounded, expected)]
    best: dict[str, tuple] = {}
    for c in candidates:
        try:
            plan = evaluate(
                c,
                model=judge.model,
                cluster=judge.cluster,
                global_batch_size=request.global_batch_size,
                options=judge.options,
            )
        except ScheduleError:
            continue
        if plan.memory.total > BUDGET:
            continue
        shown = auto.label(c) + (f" {layout_of(c.stage_layers)}" if c.stage_layers else "")
        if c.schedule not in best or plan.step_time_s < best[c.schedule][0]:
            best[c.schedule] = (plan.step_time_s, shown)
    return best


def case(model: Model, gpus: int, per_gpu: float) -> dict[str, dict[str, object]]:
    """Per schedule: even, Megatron's best flags and ours, each (seconds, what ran)."""
    _, pp = SPLITS[model.name]
    share = model.num_layers // pp  # even, yet planned as stages (the output layer in the last)
    modes = {
        "even": [UnevenStages(decoder_first_pipeline_num_layers=share,
                              decoder_last_pipeline_num_layers=share)],
        "megatron": list(megatron_options(model, pp)),
        "ours": [UnevenStages(pipeline_model_parallel_layout="auto")],
    }  # fmt: skip
    table: dict[str, dict[str, object]] = {}
    for mode, options in modes.items():
        for uneven in options:
            for schedule, (step, shown) in timed(model, gpus, per_gpu, uneven).items():
                row = table.setdefault(schedule, {})
                kept = row.get(mode)
                if kept is None or step < kept[0]:  # type: ignore[index]
                    flags = uneven.given() if mode == "megatron" else ""
                    row[mode] = (step, f"{shown} {flags}".strip())
    return table


def markdown(model: Model, gpus: int, per_gpu: float, table: dict[str, dict[str, object]]) -> str:
    tp, pp = SPLITS[model.name]
    m = int(gpus * per_gpu) // (gpus // (tp * pp))
    lines = [
        f"**{model.name}, {gpus} x H100, {per_gpu:g} samples per GPU** (tp {tp}, pp {pp}, m {m})",
        "",
        "| schedule | even | Megatron's best uneven | ours (layout auto) | ours vs even |",
        "|---|---|---|---|---|",
    ]
    for schedule, row in sorted(table.items()):
        cells = []
        for mode in ("even", "megatron", "ours"):
            value = row.get(mode)
            cells.append("—" if value is None else f"{value[0]:.3f} s")  # type: ignore[index]
        even, ours = row.get("even"), row.get("ours")
        gain = "—"
        if even is not None and ours is not None:
            gain = f"{100 * (1 - ours[0] / even[0]):+.1f}%"  # type: ignore[index]
        lines.append(f"| {schedule} | {' | '.join(cells)} | {gain} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write every case as JSON")
    parser.add_argument("--quick", action="store_true", help="one case")
    args = parser.parse_args()
    cases = list(itertools.product(MODELS, CLUSTERS, PER_GPU))
    if args.quick:
        cases = [(LLAMA_8B_128K, 64, 1.0)]
    out = []
    start = time.process_time()
    for model, gpus, per_gpu in cases:
        table = case(model, gpus, per_gpu)
        print(markdown(model, gpus, per_gpu, table) + "\n", flush=True)
        out.append({"model": model.name, "gpus": gpus, "per_gpu": per_gpu, "table": table})
    print(f"{len(cases)} cases in {time.process_time() - start:.0f} s of CPU")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=1)


if __name__ == "__main__":
    main()
