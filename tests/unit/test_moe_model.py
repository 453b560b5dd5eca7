"""The planner's Mixture-of-Experts model (docs/planner.md, "Mixture of Experts"): parameters and
FLOPs worked out by hand, the expert-parallel all-to-all's bytes and time inside and across nodes,
megatron-core's constraints on ep, a search that tries ep, and every front end describing the
same MoE model alike. Dense models' figures are the recorded fixture's (test_model_differential)."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest

from megatron_bfpp.cli import plan as plan_cli
from megatron_bfpp.ir import Placement, ScheduleError
from megatron_bfpp.megatron.auto import bridge_request, megatron_request, resolve_bridge_auto
from megatron_bfpp.plan.auto import AutoRequest, decide, hardware
from megatron_bfpp.plan.costs import (
    INTER_NODE_LATENCY_S,
    INTRA_NODE_LATENCY_S,
    all_to_all_time,
    layer_forward_flops,
    stage_times,
)
from megatron_bfpp.plan.memory import moe_layer_parameters, rank_parameters
from megatron_bfpp.plan.presets import get_gpu, get_model, model_description
from megatron_bfpp.plan.search import Candidate, Cluster, SearchOptions, expert_sizes, recommend

MIXTRAL = get_model("mixtral-8x7b")
H100 = get_gpu("h100-80gb")


def test_mixtral_has_46_7b_parameters_of_which_12_9b_active() -> None:
    h, f, layers = 4096, 14336, 32
    expert = 3 * h * f  # SwiGLU: fc1 (two matrices) and fc2, no biases
    attention = h * (h + 2 * 1024) + h * h  # 8 groups of 128: K and V 1024 wide
    per_layer = attention + 8 * expert + h * 8 + 2 * h  # experts, router, two RMSNorms
    by_hand = layers * per_layer + 2 * 32000 * h + h  # embedding, output layer, final norm
    total = sum(rank_parameters(MIXTRAL, tp=1, pp=1, chunks=1, placement=Placement.SINGLE))
    assert total == by_hand
    assert total == pytest.approx(46.7e9, rel=0.01)
    active = total - layers * (8 - 2) * expert
    assert active == pytest.approx(12.9e9, rel=0.01)
    # ep=8: each rank keeps one expert per layer, tp=2 halves each expert's matrices
    extra, experts = moe_layer_parameters(MIXTRAL, tp=2, ep=8)
    assert experts == expert // 2 and extra == h * 8 + expert // 2 - expert // 2


def test_a_moe_layers_flops_count_the_active_experts_and_the_router() -> None:
    b, s, h = 1, 4096, 4096
    attention = 8 * h * h + 4 * s * h
    mlp = 6 * h * (2 * 14336) + 2 * h * 8  # top-2 SwiGLU experts, router
    assert layer_forward_flops(MIXTRAL, micro_batch_size=b, tp=2, moe=True) == pytest.approx(
        b * s * (attention + mlp) / 2, rel=1e-12
    )
    deepseek = get_model("deepseek-v3")
    assert deepseek.moe_layers[:4] == (False, False, False, True) and sum(deepseek.moe_layers) == 58
    # its dense FFN (18432) is 8 routed + 1 shared expert of 2048: the same FLOPs but the router
    dense = layer_forward_flops(deepseek, micro_batch_size=1, tp=1)
    sparse = layer_forward_flops(deepseek, micro_batch_size=1, tp=1, moe=True)
    assert sparse - dense == pytest.approx(4096 * 2 * 7168 * 256, rel=1e-9)


def _candidate(ep: int, tp: int = 2) -> Candidate:
    return Candidate("1f1b", "optim", tp, 4, 1, 16, 1, "none", ep=ep)


@pytest.mark.parametrize(("ep", "intra"), [(4, True), (8, False)])
def test_the_all_to_all_per_moe_layer_inside_and_across_nodes(ep: int, intra: bool) -> None:
    # tokens on the rank (sequence parallel: s / tp) x top-k x h x 2 bytes, (ep-1)/ep of it leave
    nbytes = 4096 // 2 * 2 * 4096 * 2
    assert nbytes == 33_554_432
    if intra:  # ep x tp = 8 ranks: one node's NVLink
        expected = 3 / 4 * nbytes / 450e9 + INTRA_NODE_LATENCY_S
    else:  # 16 ranks span two nodes: InfiniBand
        expected = 7 / 8 * nbytes / 50e9 + INTER_NODE_LATENCY_S
    link = (450e9, INTRA_NODE_LATENCY_S) if intra else (50e9, INTER_NODE_LATENCY_S)
    assert all_to_all_time(nbytes, ep, link) == pytest.approx(expected, rel=1e-12)
    cluster, options = Cluster(128, 8, H100), SearchOptions()
    times = [stage_times(_candidate(e), MIXTRAL, cluster, options, 10**9, 0) for e in (1, ep)]
    # 8 MoE layers per stage, dispatch and combine in the forward, the same two in the backward
    for name in ("forward", "backward"):
        added = getattr(times[1], name) - getattr(times[0], name)
        assert added == pytest.approx(8 * 2 * expected, rel=1e-9)
    # the part an overlapped pair may hide (CostModel.t_a2a); none without expert parallelism
    assert times[0].a2a == 0 and times[1].a2a == pytest.approx(8 * 2 * expected, rel=1e-9)


def test_expert_parallel_sizes_follow_megatron_cores_constraints() -> None:
    options = SearchOptions()
    assert expert_sizes(MIXTRAL, 16, options) == (1, 2, 4, 8)  # not past the 8 experts
    assert expert_sizes(MIXTRAL, 12, options) == (1, 2, 4)  # ep divides dp
    assert expert_sizes(get_model("llama-70b"), 64, options) == (1,)  # dense
    request = AutoRequest(
        model=MIXTRAL, tp=1, pp=4, dp=6, micro_batch_size=1, global_batch_size=48,
        hardware=hardware(device_name=None, device_memory=None), ep=4,
    )  # fmt: skip
    with pytest.raises(ScheduleError, match=r"^--expert-model-parallel-size 4 must divide"):
        decide(request)
    dense = dataclasses.replace(request, model=get_model("llama-7b"), dp=8, global_batch_size=64)
    with pytest.raises(ScheduleError, match=r"--num-experts \(0\)"):
        decide(dense)


def test_recommend_considers_expert_parallelism_for_mixtral_on_64_h100() -> None:
    result = recommend(model=MIXTRAL, cluster=Cluster(64, 8, H100), global_batch_size=256)
    assert result.plans and any(plan.candidate.ep > 1 for plan in result.plans)
    assert all(c["expert_parallel"] >= 1 for c in result.to_dict()["configs"])  # type: ignore[attr-defined,index]
    dense = recommend(
        model=get_model("gpt3-6.7b"), cluster=Cluster(8, 8, H100), global_batch_size=8
    )
    assert {plan.candidate.ep for plan in dense.plans} == {1}


# One small MoE model (SwiGLU, 8 experts top-2, a shared expert, the first layer dense) as each
# front end spells it.
SHAPE = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128}
MOE = {
    "moe_router_topk": 2, "moe_ffn_hidden_size": 128, "moe_shared_expert_intermediate_size": 64,
}  # fmt: skip
EXPECTED = model_description(
    **SHAPE, gated=True, ffn_default="megatron-lm", ffn_hidden_size=512, vocab_size=1000,
    dropout=False, moe={"num_experts": 8, **MOE, "moe_layer_freq": (0, 1, 1, 1)},
)  # fmt: skip
HW = hardware(device_name=None, device_memory=None)


def test_megatron_lm_arguments_describe_the_moe_model() -> None:
    args = argparse.Namespace(
        **SHAPE, **MOE, num_experts=8, moe_layer_freq=[0, 1, 1, 1], swiglu=True,
        ffn_hidden_size=512, vocab_size=1000, hidden_dropout=0.0, attention_dropout=0.0,
        micro_batch_size=1, global_batch_size=8, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=2, expert_model_parallel_size=2,
    )  # fmt: skip
    request = megatron_request(args, world_size=4, env={}, hw=HW, sharding=None)
    assert request.model == EXPECTED and request.ep == 2 and not request.moe_overlap
    args.overlap_moe_expert_parallel_comm = True  # auto then plans pairs megatron-core combines
    assert megatron_request(args, world_size=4, env={}, hw=HW, sharding=None).moe_overlap
    assert EXPECTED.num_experts == 8 and EXPECTED.moe_layers == (False, True, True, True)


def test_bridge_config_describes_the_moe_model() -> None:
    config = SimpleNamespace(
        model=SimpleNamespace(
            **SHAPE, **MOE, num_moe_experts=8, moe_layer_freq=[0, 1, 1, 1], gated_linear_unit=True,
            ffn_hidden_size=512, vocab_size=1000, hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
        ),
        train=SimpleNamespace(micro_batch_size=1, global_batch_size=8),
        optimizer=SimpleNamespace(optimizer="adam", use_distributed_optimizer=True),
    )  # fmt: skip
    request = bridge_request(config, options={}, sharding="optim", env={"WORLD_SIZE": "4"}, hw=HW)
    assert request.model == EXPECTED and request.ep == 2 and not request.moe_overlap
    config.model.overlap_moe_expert_parallel_comm = True
    request = bridge_request(config, options={}, sharding="optim", env={"WORLD_SIZE": "4"}, hw=HW)
    assert request.moe_overlap
    # auto under the flag (no longer refused): a schedule with pairs, and its options for
    # use_schedule (interleaved's combined_1f1b too)
    name, options, _ = resolve_bridge_auto(
        config, {}, env={"WORLD_SIZE": "4"}, device=(None, None), gpu="h100-80gb"
    )
    assert (name, options.get("combined_1f1b")) in (("dualpipe-v", None), ("interleaved", True))


def test_bfpp_plan_flags_describe_the_moe_model() -> None:
    sizes = [f"--{key.replace('_', '-')}={value}" for key, value in {**SHAPE, **MOE}.items()]
    args = plan_cli.build_parser().parse_args(
        ["auto", "--arch", "llama", "--num-gpus", "4", "--gpu", "h100-80gb",
         "--global-batch-size", "8", "--pipeline-model-parallel-size", "2", *sizes,
         "--ffn-hidden-size=512", "--vocab-size=1000", "--num-experts=8",
         "--moe-layer-freq=([0]*1+[1]*3)", "--expert-model-parallel-size=2"]
    )  # fmt: skip
    assert plan_cli._model_from_args(args) == EXPECTED
    assert args.expert_model_parallel_size == 2 and not args.overlap_moe_expert_parallel_comm
    with pytest.raises(SystemExit):
        plan_cli.build_parser().parse_args(["recommend", "--moe-layer-freq", "[0]*x"])


def test_expert_gradients_reduce_over_the_expert_data_parallel_group() -> None:
    """megatron-core reduces (and gathers) expert parameters over dp / ep ranks, the rest over
    dp: each ring's time, worked out from the candidate's parameter counts."""
    from megatron_bfpp.plan.costs import _ring_collective_time

    cluster, options = Cluster(128, 8, H100), SearchOptions()
    c = Candidate("1f1b", "optim", 2, 4, 1, 16, 1, "none", ep=4)  # dp 16, expert dp 4
    params = 10**10
    experts = 8 * moe_layer_parameters(MIXTRAL, tp=2, ep=4)[1]  # 8 MoE layers on the rank
    assert 0 < experts < params
    times = stage_times(c, MIXTRAL, cluster, options, params, 0)
    link = (H100.inter_node_bandwidth, INTER_NODE_LATENCY_S)  # tp x dp = 32 ranks: two nodes
    size = options.precision.grad_bytes
    expected = _ring_collective_time((params - experts) * size, 16, link)
    expected += _ring_collective_time(experts * size, 4, link)
    assert times.grad_reduce == pytest.approx(expected, rel=1e-12)
    dense = stage_times(c, get_model("llama-7b"), cluster, options, params, 0)
    assert dense.grad_reduce == pytest.approx(_ring_collective_time(params * size, 16, link))
