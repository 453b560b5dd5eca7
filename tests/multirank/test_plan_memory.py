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

HIDDEN, HEADS, FFN, VOCAB, SEQ, MICRO = 64, 4, 256, 128, 64, 2


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

    config = M.tiny_gpt_config(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN
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
        "parameters": parameters,
        "gradients": gradients,
        "optimizer": state,
        "activations": func.last_memory.peak_activation_bytes,
    }


CASES = [
    ("1f1b", 4, None, {}, 8),
    ("bpipe", 4, None, {}, 8),
    ("breadth-first", 2, 2, {}, 4),
]


@pytest.mark.parametrize(("schedule", "pp", "vp", "options", "m"), CASES, ids=[c[0] for c in CASES])
def test_memory_per_rank_matches_megatron_core(
    schedule: str, pp: int, vp: int | None, options: dict[str, Any], m: int
) -> None:
    num_layers = 2 * pp * (vp or 1)
    measured = {
        r["rank"]: r
        for r in run_ranks(
            _rank, world_size=pp, tp=1, pp=pp, vp=vp, args=(schedule, options, num_layers, m)
        )
    }
    model = _planned_model(num_layers)
    counts = rank_parameters_of(model, schedule=schedule, tp=1, pp=pp, vp=vp or 1)
    stage = stage_activation_bytes(
        model,
        micro_batch_size=MICRO,
        tp=1,
        layers_per_stage=num_layers // (pp * (vp or 1)),
        vocab_size=VOCAB,
        sequence_parallel=False,
        recompute="none",
        precision=FP32,
    )
    built = build_schedule(schedule, num_ranks=pp, num_microbatches=m, num_chunks=vp, lower=False)
    activations = peak_activation_bytes(peak_points(built), stage)
    for rank in range(pp):
        params, grads, state = weights_bytes(
            counts[rank], dp=1, precision=FP32, sharded=False, gathered_fraction=1.0
        )
        got = measured[rank]
        assert (got["parameters"], got["gradients"], got["optimizer"]) == (params, grads, state)
        assert got["activations"] == pytest.approx(activations[rank], rel=0.10), (
            rank,
            got["activations"],
            activations[rank],
        )
