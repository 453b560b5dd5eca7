"""The planner's memory model against megatron-core: a small GPT built and trained on CPU gloo
ranks holds exactly the parameter, gradient and Adam-state bytes ``plan.memory`` predicts per
rank, and the runtime's measured activation accounting (``ForwardBackwardFunc.last_memory``)
is within 10% of the predicted peak for 1F1B, breadth-first and BPipe."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.plan.memory import (
    peak_activation_bytes,
    peak_points,
    stage_activation_bytes,
    weights_bytes,
)
from megatron_bfpp.plan.presets import FP32, model_from_shape
from megatron_bfpp.plan.search import rank_parameters_of
from megatron_bfpp.schedules.registry import build_schedule
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

HIDDEN, HEADS, FFN, VOCAB, SEQ, MICRO = 64, 4, 256, 256, 64, 2  # vocab: 128 x tp, unpadded


def _planned_model(num_layers: int) -> Any:
    # The tests' tiny GPT (testing.models): fp32, no dropout, untied output (counted as the tied
    # output's copy, which has its size), learned positions up to SEQ.
    return model_from_shape(
        arch="gpt",
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        seq_length=SEQ,
        vocab_size=VOCAB,
        dropout=False,
    )


def _rank(schedule: str, options: dict[str, Any], num_layers: int, m: int) -> dict[str, Any]:
    """Build, run one measured step and one Adam step; report this rank's bytes."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_bfpp import get_forward_backward_func

    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = M.tiny_gpt_config(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        sequence_parallel=tp > 1,  # the planner's assumption with tensor parallelism
    )
    chunks = M.wrap_ddp(
        M.build_model_chunks(config, vocab_size=VOCAB, max_sequence_length=SEQ),
        use_distributed_optimizer=True,
    )
    parameters = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    gradients = sum(
        p.main_grad.numel() * p.main_grad.element_size() for c in chunks for p in c.parameters()
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), chunks
    )
    func = get_forward_backward_func(schedule, measure_memory=True, **options)
    batches = M.make_batches(m, micro_batch_size=MICRO, seq_len=SEQ, seed=1)
    iterators: Any = [iter(batches) for _ in chunks]
    func(
        forward_step_func=M.forward_step_func,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks,
        num_microbatches=m,
        seq_length=SEQ,
        micro_batch_size=MICRO,
    )
    optimizer.step()
    state = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for values in inner.optimizer.state.values():
            state += sum(
                t.numel() * t.element_size()
                for key, t in values.items()
                if key in ("exp_avg", "exp_avg_sq")
            )
    return {
        "rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "parameters": parameters,
        "gradients": gradients,
        "optimizer": state,
        "activations": func.last_memory.peak_activation_bytes,
    }


CASES = [
    # schedule, tp, pp, vp, dp, micro-batches
    ("1f1b", 1, 4, None, 1, 8),
    ("bpipe", 1, 4, None, 1, 8),
    ("breadth-first", 1, 2, 2, 1, 4),
    ("1f1b", 2, 2, None, 1, 4),  # tensor and sequence parallel
    ("breadth-first", 1, 2, 2, 2, 4),  # the distributed optimizer's shards over dp
]


@pytest.mark.parametrize(
    ("schedule", "tp", "pp", "vp", "dp", "m"),
    CASES,
    ids=[f"{c[0]}-tp{c[1]}-pp{c[2]}-dp{c[4]}" for c in CASES],
)
def test_memory_per_rank_matches_megatron_core(
    schedule: str, tp: int, pp: int, vp: int | None, dp: int, m: int
) -> None:
    num_layers = 2 * pp * (vp or 1)
    results = run_ranks(
        _rank, world_size=tp * pp * dp, tp=tp, pp=pp, vp=vp, args=(schedule, {}, num_layers, m)
    )
    model = _planned_model(num_layers)
    counts = rank_parameters_of(model, schedule=schedule, tp=tp, pp=pp, vp=vp or 1)
    stage = stage_activation_bytes(
        model,
        micro_batch_size=MICRO,
        tp=tp,
        layers_per_stage=num_layers // (pp * (vp or 1)),
        vocab_size=VOCAB,
        sequence_parallel=tp > 1,
        recompute="none",
        precision=FP32,
    )
    built = build_schedule(schedule, num_ranks=pp, num_microbatches=m, num_chunks=vp, lower=False)
    activations = peak_activation_bytes(peak_points(built), stage)
    for rank in range(pp):
        params, grads, state = weights_bytes(
            counts[rank], dp=dp, precision=FP32, sharded=False, gathered_fraction=1.0
        )
        mine = [r for r in results if r["rank"] == rank]
        assert {(r["parameters"], r["gradients"]) for r in mine} == {(params, grads)}
        # The distributed optimizer's shards: exact per rank at dp=1; at dp > 1 they add up
        # exactly over the data-parallel ranks of each tensor-parallel slice (where a shard
        # boundary falls is megatron-core's bucket layout, not modelled).
        by_dp: dict[int, int] = {}
        for r in mine:
            by_dp[r["dp_rank"]] = by_dp.get(r["dp_rank"], 0) + r["optimizer"]
        assert sum(by_dp.values()) == tp * state * dp
        if dp == 1:
            assert {r["optimizer"] for r in mine} == {state}
        for r in mine:
            assert r["activations"] == pytest.approx(activations[rank], rel=0.10), (
                rank,
                r["activations"],
                activations[rank],
            )
