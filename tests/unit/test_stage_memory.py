"""The planner's activation model (``plan.memory.layer_activation_bytes``) against stored
activations measured: on an H100 (the shipped docs/measurements/h100-stage-memory.json, written by
scripts/bench_stage_memory.py) and here on CPU (``stage_timing.measure_stored_activations``)."""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path

import pytest

from megatron_bfpp.plan.memory import stage_activation_bytes
from megatron_bfpp.plan.presets import BF16_MIXED, FP32, get_model, model_from_shape

PROFILE = Path(__file__).resolve().parents[2] / "docs" / "measurements" / "h100-stage-memory.json"


def _rows() -> list[dict[str, object]]:
    record = json.loads(PROFILE.read_text())
    assert record["format"] == "bfpp-stage-memory"
    rows: list[dict[str, object]] = record["rows"]
    return rows


@pytest.mark.parametrize("row", _rows(), ids=lambda r: f"{r['model']}-{r['recompute']}")
def test_the_planner_predicts_an_h100_stage_within_a_tenth_of_a_percent(
    row: dict[str, object],
) -> None:
    """Each shipped measurement: the bytes one stored micro-batch adds on the GPU (the slope over
    1..8 stored) equal the planner's count within 0.1%; docs/planner.md quotes these rows."""
    model = get_model(str(row["model"]))
    predicted = stage_activation_bytes(
        model,
        micro_batch_size=int(row["micro_batch_size"]),  # type: ignore[call-overload]
        tp=1,
        layers_per_stage=int(row["layers"]),  # type: ignore[call-overload]
        vocab_size=model.vocab_size,
        sequence_parallel=False,
        recompute=str(row["recompute"]),
        precision=BF16_MIXED,
    ).layers
    stored = row["stored_bytes"]
    assert isinstance(stored, list) and len(stored) == 8
    slope = (stored[-1] - stored[0]) / (len(stored) - 1)
    assert slope == row["measured_per_microbatch"]
    assert slope == pytest.approx(predicted, rel=1e-3)
    # the stored bytes grow by the same amount with every micro-batch (nothing accumulates)
    steps = [b - a for a, b in itertools.pairwise(stored)]
    assert max(steps) - min(steps) <= 1024


def _cpu_difference(arch: str, dropout: bool, recompute: str, seq: int, h: int, a: int) -> int:
    """What megatron-core keeps on CPU beyond what it keeps on a GPU, per layer of one sequence
    (micro-batch size 1): dropout masks
    as fp32 (torch's CPU dropout multiplies by a float noise tensor, CUDA keeps a bool mask),
    and RMSNorm unfused (it also keeps the normalised input, h per token per norm)."""
    extra = 0
    if recompute == "full":
        return 0
    if dropout:
        masked = 2 * h + (a * seq if recompute == "none" else 0)  # hidden + attention scores
        extra += (FP32.activation_bytes - 1) * masked * seq
    if arch == "llama":
        extra += 2 * h * FP32.activation_bytes * seq
    return extra


@pytest.mark.parametrize(
    ("arch", "dropout"), [("gpt", False), ("gpt", True), ("llama", False)], ids=str
)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_planner_counts_what_a_cpu_stage_holds(
    arch: str, dropout: bool, recompute: str
) -> None:
    """On CPU (fp32): equal to the byte (16 bytes a layer under selective recomputation), once
    the two CPU-only differences are added."""
    pytest.importorskip("megatron.core")
    from megatron_bfpp.stage_timing import measure_stored_activations

    model = model_from_shape(
        arch=arch,
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=128,
        dropout=dropout,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = measure_stored_activations(
            model=model, num_layers=2, stored=3, recompute=recompute, device="cpu"
        )
    predicted = stage_activation_bytes(
        model,
        micro_batch_size=1,
        tp=1,
        layers_per_stage=2,
        vocab_size=128,
        sequence_parallel=False,
        recompute=recompute,
        precision=FP32,
    ).layers
    expected = predicted + 2 * _cpu_difference(arch, dropout, recompute, 32, 64, 4)
    # selective recomputation's checkpoint keeps a scalar or two per layer besides its inputs
    assert measured.per_microbatch == pytest.approx(expected, abs=2 * 16)
    assert (
        measured.stored == tuple(k * measured.stored[0] for k in (1, 2, 3)) or recompute == "full"
    )
