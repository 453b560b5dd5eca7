"""bfpp-train's memory estimate and the check before start: bytes per parameter, the machine's
share of ranks, and one line naming the estimate and what there is."""

from __future__ import annotations

from typing import Any

import pytest

from megatron_bfpp.cli import train as cli_train
from megatron_bfpp.config import model_memory
from megatron_bfpp.config.run_config import Layout, ModelShape, run_config
from megatron_bfpp.ir import Placement


def _shape(preset: str = "gpt", layers: int = 8, hidden: int = 64) -> ModelShape:
    return ModelShape(preset, layers, hidden, 4, None, None, 32, 256)


def test_gpt_layer_is_the_standard_12h2_plus_13h() -> None:
    """Narayanan et al. 2021: a GPT layer holds 12h^2 + 13h parameters."""
    h = 1024
    assert model_memory.layer_parameters(_shape(hidden=h), tp=1) == 12 * h * h + 13 * h


def test_one_rank_holds_the_whole_model_once() -> None:
    """Measured on megatron-core's own GPTModel (tests/multirank/test_model_memory.py checks
    split layouts): 8 layers, hidden 64, 4 heads, 32 positions, 256 tokens."""
    single = Layout(1, 1, 1, Placement.SINGLE, 1, 1)
    assert model_memory.parameters_per_pipeline_rank(_shape(), single) == [418_432]


def test_v_shape_puts_both_ends_on_rank_0() -> None:
    looped = Layout(1, 4, 2, Placement.LOOPED, 1, 4)
    v_shape = Layout(1, 4, 2, Placement.V_SHAPE, 1, 4)
    a = model_memory.parameters_per_pipeline_rank(_shape(), looped)
    b = model_memory.parameters_per_pipeline_rank(_shape(), v_shape)
    assert sum(a) == sum(b) and b[0] == a[0] + a[3] - a[1] and b[3] == b[1]


def test_bytes_per_parameter_shard_adam_over_data_parallel_ranks() -> None:
    one = model_memory.estimate(_shape(), Layout(1, 2, 1, Placement.SINGLE, 1, 2), local_ranks=2)
    four = model_memory.estimate(_shape(), Layout(1, 2, 1, Placement.SINGLE, 4, 8), local_ranks=8)
    assert one.bytes_per_parameter == 16 and four.bytes_per_parameter == 10
    # the local launcher's machine holds every rank: each pipeline rank once per dp replica
    counts = model_memory.parameters_per_pipeline_rank(
        _shape(), Layout(1, 2, 1, Placement.SINGLE, 4, 8)
    )
    assert four.local_bytes == 4 * sum(int(c * 10) for c in counts)
    some = model_memory.estimate(_shape(), Layout(1, 2, 1, Placement.SINGLE, 4, 8), local_ranks=2)
    assert some.local_bytes == 2 * some.largest_rank_bytes  # torchrun: a node's share


def _parse(*flags: str) -> Any:
    return cli_train.build_parser().parse_args(list(flags))


def test_a_model_larger_than_ram_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine's CI too
    monkeypatch.setattr(model_memory, "available_ram_bytes", lambda: 8 * 10**9)
    args = _parse("--hidden-size", "8192", "--num-layers", "16", "--num-attention-heads", "8")
    line = cli_train.memory_problem(args, 4, launched=False) or ""
    assert line.startswith("the model needs about 206.3 GB of RAM for weights, gradients and "), (
        line
    )
    assert "on this machine's 4 ranks (3,224,272,896 parameters x 16 bytes" in line
    assert "more than the 8.0 GB available" in line and line.endswith(
        "--no-memory-check if the estimate is wrong"
    )
    skipped = _parse("--hidden-size", "8192", "--num-layers", "16", "--no-memory-check")
    assert cli_train.memory_problem(skipped, 4, launched=False) is None
    assert cli_train.memory_problem(_parse(), 4, launched=False) is None


def test_on_gpus_the_largest_rank_must_fit_one_gpu() -> None:
    args = _parse("--hidden-size", "8192", "--num-layers", "32", "--num-attention-heads", "8")
    run = run_config(args, 4)
    line = model_memory.memory_problem(run.model, run.layout, local_ranks=1, gpu_bytes=80 * 10**9)
    assert (line or "").startswith(
        "the largest rank needs about 103.1 GB for weights, gradients and Adam state "
        "(6,445,924,352 parameters x 16 bytes on the largest rank), more than one GPU's 80.0 GB;"
    ), line
    smaller = run_config(_parse("--hidden-size", "8192", "--num-layers", "16"), 4)
    assert (
        model_memory.memory_problem(
            smaller.model, smaller.layout, local_ranks=1, gpu_bytes=80 * 10**9
        )
        is None
    )


def test_experts_adam_state_is_sharded_over_the_expert_data_parallel_ranks() -> None:
    """megatron-core's distributed optimizer shards an expert's Adam state over dp / ep ranks (the
    expert data-parallel group), the rest over dp: at ep = dp = 2 each rank keeps its experts'
    whole. Worked by hand: a llama layer at h 64, 4 experts of FFN 32, top 2 on 2 ranks."""
    shape = ModelShape("llama", 4, 64, 4, None, None, 32, 256, 4, 2, 32)
    experts_per_layer = 2 * (64 * 2 * 32 + 32 * 64)  # 2 local experts: fc1 (gated) and fc2
    assert model_memory.expert_parameters(shape, tp=1, ep=2) == experts_per_layer == 12_288
    layout = Layout(1, 2, 1, Placement.SINGLE, 2, 4, expert_model_parallel_size=2)
    counts = model_memory.parameters_per_pipeline_rank(shape, layout)
    experts = 2 * experts_per_layer  # 2 layers per pipeline rank
    want = [(c - experts) * (4 + 4 + 8 / 2) + experts * (4 + 4 + 8) for c in counts]
    estimate = model_memory.estimate(shape, layout, local_ranks=1)
    assert estimate.largest_rank_bytes == int(max(want))


def test_bf16_keeps_two_byte_weights_and_sharded_fp32_main_weights() -> None:
    """--bf16 as Megatron-LM's: 2-byte weights, the fp32 gradient buffer, and the optimizer's fp32
    main weights sharded with Adam's moments: 2 + 4 + (8 + 4) / dp bytes per parameter (18 at
    dp 1, 9 at dp 4); experts' state over dp / ep as in fp32."""
    layout = Layout(1, 2, 1, Placement.SINGLE, 4, 8)
    assert (
        model_memory.estimate(_shape(), layout, local_ranks=8, bf16=True).bytes_per_parameter == 9
    )
    one = Layout(1, 2, 1, Placement.SINGLE, 1, 2)
    assert model_memory.estimate(_shape(), one, local_ranks=2, bf16=True).bytes_per_parameter == 18
    shape = ModelShape("llama", 4, 64, 4, None, None, 32, 256, 4, 2, 32)
    moe = Layout(1, 2, 1, Placement.SINGLE, 2, 4, expert_model_parallel_size=2)
    counts = model_memory.parameters_per_pipeline_rank(shape, moe)
    experts = 2 * 12_288  # as above: 2 layers per pipeline rank, 2 local experts each
    want = [(c - experts) * (2 + 4 + 12 / 2) + experts * (2 + 4 + 12) for c in counts]
    estimate = model_memory.estimate(shape, moe, local_ranks=1, bf16=True)
    assert estimate.largest_rank_bytes == int(max(want))
    parsed = _parse("--bf16", "--no-memory-check")
    assert run_config(parsed, 4).training.bf16 and not run_config(_parse(), 4).training.bf16
