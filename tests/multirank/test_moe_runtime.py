"""Mixture-of-Experts through the runtime: a small LLaMA-shaped MoE GPT (every layer's MLP SwiGLU
experts, top-2 of 4) on CPU gloo ranks with expert parallelism 1 and 2 (megatron-core's
all-to-all token dispatcher). The V-shapes (dualpipe-v's pairs, and v-zb's split backward) give
1F1B's losses and gradients, and so do the pairs run as megatron-core's combined step
(``--overlap-moe-expert-parallel-comm``); each rank holds exactly the parameter and gradient
bytes ``plan.memory`` predicts, and with every token routed to every expert (the even routing
the planner assumes) its measured activation peak is within 10% of the planner's walk."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron.core.transformer.moe import moe_utils

from megatron_bfpp.ir import Placement
from megatron_bfpp.plan.memory import peak_activation_bytes, peak_points, stage_activation_bytes
from megatron_bfpp.plan.presets import BF16_MIXED, FP32, model_from_shape
from megatron_bfpp.plan.search import rank_parameters_of
from megatron_bfpp.schedules.registry import build_schedule, get_spec
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks
from tests.multirank.test_native_posting import (
    SHAPE,
    _first_difference,
    _merged_waits,
    _recorder,
    model_events,
)

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not hasattr(moe_utils, "te_general_gemm"),
        reason="this megatron-core (0.16.1) routes MoE tokens through te_general_gemm, which it "
        "defines only with Transformer Engine; 0.17 on run MoE without it",
    ),
]

HIDDEN, HEADS, FFN, VOCAB, SEQ, MICRO = 64, 4, 256, 256, 64, 2
EXPERTS, TOPK, EXPERT_FFN = 4, 2, 128


def _planned_model(num_layers: int, topk: int) -> Any:
    moe = {
        "num_experts": EXPERTS, "moe_router_topk": topk, "moe_ffn_hidden_size": EXPERT_FFN
    }  # fmt: skip
    return model_from_shape(
        arch="llama", num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
        ffn_hidden_size=FFN, seq_length=SEQ, vocab_size=VOCAB, dropout=False, moe=moe,
    )  # fmt: skip


def _rank(
    schedule: str,
    num_layers: int,
    m: int,
    topk: int = TOPK,
    bf16: bool = False,
    options: dict[str, Any] | None = None,
    record: tuple[bool, bool] | None = None,
    layout: str | None = None,
) -> dict[str, Any]:
    """Build the MoE chunks, run one measured step; report this rank's bytes, losses and
    gradients (by global parameter name). ``bf16``: in bf16, and with megatron-core's all-to-all
    overlap where the schedule has pairs for it (counted: the combined steps that ran).
    ``record`` (batch_p2p_comm, overlap_p2p_comm): also what the step posted, ran and waited
    for (``test_native_posting``'s record: F at its forward step, B after a combined step's
    backward, peers as pipeline ranks)."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import combined_1f1b
    from megatron.core.utils import get_attr_wrapped_model

    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.train.presets import gpt_chunks, init_by_global_names

    config = M.tiny_gpt_config(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, num_moe_experts=EXPERTS, moe_router_topk=topk,
        moe_ffn_hidden_size=EXPERT_FFN,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
        **(dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16) if bf16
           else {}),
        overlap_moe_expert_parallel_comm=bf16 and schedule != "1f1b",
        batch_p2p_comm=bool(record and record[0]),
        overlap_p2p_comm=bool(record and record[1]),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        **({"pipeline_model_parallel_layout": layout} if layout else {}),
    )  # fmt: skip
    combined: list[tuple[bool, bool]] = []  # (forward, backward) of each combined step
    step = combined_1f1b.combined_forward_backward_step

    events: list[Any] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        combined.append((args[2] is not None, args[6] is not None))
        result = step(*args, **kwargs)
        if args[6] is not None:
            events.append(("B",))
        return result

    combined_1f1b.combined_forward_backward_step = counted
    spec = get_gpt_layer_local_spec(
        num_experts=EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm"
    )
    built = gpt_chunks(
        config, layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        share_embeddings_and_output_weights=False, position_embedding_type="rope",
        init=functools.partial(init_by_global_names, seed=0, draw=M._draw),
        placement=get_spec("interleaved" if schedule == "megatron" else schedule).placement,
    )  # fmt: skip
    if bf16:  # every parameter, as Megatron-LM's Float16Module casts them (norms too)
        built = [chunk.bfloat16() for chunk in built]
    chunks = M.wrap_ddp(built, use_distributed_optimizer=False)
    parameters = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    gradients = sum(
        p.main_grad.numel() * p.main_grad.element_size() for c in chunks for p in c.parameters()
    )
    if schedule == "megatron":  # megatron-core's own interleaved schedule (combined 1F1B)
        from megatron.core.pipeline_parallel import get_forward_backward_func as megatrons

        func = megatrons()
        func.last_memory = SimpleNamespace(peak_activation_bytes=0)
    else:
        func = get_forward_backward_func(schedule, measure_memory=True, **(options or {}))
    batches = M.make_batches(m, micro_batch_size=MICRO, seq_len=SEQ, vocab=VOCAB, seed=1)
    iterators: Any = [iter(batches) for _ in chunks]
    pp, pp_rank = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    forwards: dict[int, int] = {}

    def forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> Any:
        stage = (get_attr_wrapped_model(model, "vp_stage") or 0) * pp + pp_rank
        forwards[stage] = forwards.get(stage, -1) + 1
        events.append(("F", stage, forwards[stage]))
        return M.forward_step_func(data_iterator, model, return_schedule_plan)

    undo = _recorder(events) if record is not None else lambda: None
    try:
        losses = func(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks,
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=MICRO,
        )
    finally:
        undo()
    return {
        "events": _merged_waits(_as_pipeline_ranks(events)) if record is not None else None,
        "combined": combined,
        "rank": parallel_state.get_pipeline_model_parallel_rank(),
        "ep_rank": parallel_state.get_expert_model_parallel_rank(),
        "parameters": parameters,
        "gradients": gradients,
        "activations": func.last_memory.peak_activation_bytes,
        "losses": [x for reported in losses for x in reported["lm loss"].flatten().tolist()],
        "grads": {name: shard.tensor for name, shard in M.grad_shards(chunks).items()},
    }


def _with_shape(events: list[Any], shape: tuple[int, ...], as_: tuple[int, ...]) -> list[Any]:
    """The record with every message's ``shape`` (checked) written ``as_`` the model writes it."""

    def message(shape_seen: tuple[int, ...]) -> tuple[int, ...]:
        assert shape_seen == shape
        return as_

    return [
        (e[0], e[1], message(e[2])) if e[0] in ("isend", "irecv")
        else ("batch", tuple((op, peer, message(s)) for op, peer, s in e[1])) if e[0] == "batch"
        else e
        for e in events
    ]  # fmt: skip


def _as_pipeline_ranks(events: list[Any]) -> list[Any]:
    """Peers as pipeline ranks (megatron-core posts to global ranks; ep makes them differ)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    out = []
    for event in events:
        if event[0] in ("isend", "irecv"):
            event = (event[0], ranks.index(event[1]), *event[2:])
        elif event[0] == "batch":
            event = ("batch", tuple((op, ranks.index(peer), shape) for op, peer, shape in event[1]))
        out.append(event)
    return out


# schedule, pp, ep, m, bf16 (dualpipe-v's pairs then run as megatron-core's combined step)
CASES = [
    ("1f1b", 2, 1, 4, False),
    ("1f1b", 2, 2, 4, False),
    ("dualpipe-v", 2, 2, 4, False),
    ("dualpipe-v", 2, 2, 6, True),
]


@pytest.mark.parametrize(
    ("schedule", "pp", "ep", "m", "bf16"),
    CASES,
    ids=[f"{c[0]}-ep{c[2]}{'-combined' if c[4] else ''}" for c in CASES],
)
def test_moe_memory_per_rank_matches_megatron_core(
    schedule: str, pp: int, ep: int, m: int, bf16: bool
) -> None:
    vp = 2 if get_spec(schedule).placement is Placement.V_SHAPE else 1
    num_layers = 2 * pp * vp
    results = run_ranks(
        _rank, world_size=pp * ep, pp=pp, vp=vp if vp > 1 else None, ep=ep,
        args=(schedule, num_layers, m, EXPERTS, bf16),
    )  # fmt: skip
    assert all(bool(r["combined"]) is bf16 for r in results)
    precision = BF16_MIXED if bf16 else FP32
    # every token to every expert: the planner's even routing, exactly (imbalance: not modelled)
    model = _planned_model(num_layers, EXPERTS)
    counts = rank_parameters_of(model, schedule=schedule, tp=1, pp=pp, vp=vp, ep=ep)
    stage = stage_activation_bytes(
        model, micro_batch_size=MICRO, tp=1, layers_per_stage=num_layers // (pp * vp),
        vocab_size=VOCAB, sequence_parallel=False, recompute="none", precision=precision,
    )  # fmt: skip
    built = build_schedule(schedule, num_ranks=pp, num_microbatches=m, num_chunks=vp, lower=False)
    activations = peak_activation_bytes(peak_points(built), stage)
    for rank in range(pp):
        mine = [r for r in results if r["rank"] == rank]
        expected = (precision.param_bytes * counts[rank], precision.grad_bytes * counts[rank])
        assert {(r["parameters"], r["gradients"]) for r in mine} == {expected}
        for r in mine:
            assert r["activations"] == pytest.approx(activations[rank], rel=0.10)


UNEVEN = [  # schedule, pp, vp, ep, m, layout (4 MoE layers): lighter or heavier ends
    ("1f1b", 2, 1, 2, 4, "Et|t*3L"),
    ("interleaved", 2, 2, 1, 4, "Et*2|t|t|L"),
]


@pytest.mark.parametrize(
    ("schedule", "pp", "vp", "ep", "m", "layout"), UNEVEN, ids=[c[0] for c in UNEVEN]
)
def test_moe_memory_on_uneven_stages_matches_megatron_core(
    schedule: str, pp: int, vp: int, ep: int, m: int, layout: str
) -> None:
    """A MoE model on uneven stages (auto plans it so): each rank holds exactly the parameters the
    planner counts from its stages' MoE layers, and its measured activation peak is within 10% of
    the planner's walk weighing each stored micro-batch by its stage's bytes."""
    from dataclasses import replace

    from megatron_bfpp.config.run_config import UnevenStages
    from megatron_bfpp.plan.search import Candidate, _stored_weights

    results = run_ranks(
        _rank, world_size=pp * ep, pp=pp, vp=vp if vp > 1 else None, ep=ep,
        args=(schedule, 4, m, EXPERTS, False, None, None, layout),
    )  # fmt: skip
    model = _planned_model(4, EXPERTS)
    layers = UnevenStages(pipeline_model_parallel_layout=layout).stage_layers(4, pp, vp)
    counts = rank_parameters_of(
        model, schedule=schedule, tp=1, pp=pp, vp=vp, ep=ep, stage_layers=layers
    )
    c = Candidate(schedule, "optim", 1, pp, vp, 1, MICRO, "none", ep=ep, stage_layers=layers)
    stage = stage_activation_bytes(
        model, micro_batch_size=MICRO, tp=1, layers_per_stage=1, vocab_size=VOCAB,
        sequence_parallel=False, recompute="none", precision=FP32,
    )  # fmt: skip
    stored, per = _stored_weights(c, model, FP32, replace(stage, layers=0))
    built = build_schedule(schedule, num_ranks=pp, num_microbatches=m, num_chunks=vp, lower=False)
    activations = peak_activation_bytes(peak_points(built, stored), per)
    assert per.layers == 1 and stored == tuple(n * stage.layers for n in layers)
    for rank in range(pp):
        mine = [r for r in results if r["rank"] == rank]
        expected = (FP32.param_bytes * counts[rank], FP32.grad_bytes * counts[rank])
        assert {(r["parameters"], r["gradients"]) for r in mine} == {expected}
        for r in mine:
            assert r["activations"] == pytest.approx(activations[rank], rel=0.10), (
                rank, r["activations"], activations[rank],
            )  # fmt: skip


@pytest.mark.parametrize("schedule", ["dualpipe-v", "v-zb"])
def test_v_shapes_give_1f1bs_losses_and_gradients_with_expert_parallelism(schedule: str) -> None:
    """pp 2, ep 2, 8 layers: the same global parameters, micro-batches and routing."""
    pp, ep, m, layers = 2, 2, 4, 8
    ours = run_ranks(_rank, world_size=pp * ep, pp=pp, vp=2, ep=ep, args=(schedule, layers, m))
    base = run_ranks(_rank, world_size=pp * ep, pp=pp, ep=ep, args=("1f1b", layers, m))

    def losses(results: list[dict[str, Any]]) -> list[float]:
        return [x for r in results if r["ep_rank"] == 0 for x in r["losses"]]

    assert losses(ours) == pytest.approx(losses(base), rel=1e-6, abs=0) and len(losses(base)) >= m
    for ep_rank in range(ep):  # each one's experts and its data-parallel share, all stages

        def grads(results: list[dict[str, Any]], ep_rank: int = ep_rank) -> dict[str, Any]:
            return {k: v for r in results if r["ep_rank"] == ep_rank for k, v in r["grads"].items()}

        assert len(grads(base)) > 8 * 4  # every layer's experts, router, attention and norms
        M.assert_tensors_close(grads(ours), grads(base), rel=1e-6)


@pytest.mark.parametrize(
    ("schedule", "options"), [("dualpipe-v", {}), ("interleaved", {"combined_1f1b": True})]
)
def test_pairs_run_as_megatron_cores_combined_step_with_1f1bs_losses(
    schedule: str, options: dict[str, Any]
) -> None:
    """--overlap-moe-expert-parallel-comm (bf16, ep 2): every forward whose backward is whole runs
    as a schedule plan, every pair of ``combined_pairs`` as one combined step (counted), the rest
    plainly; the losses and gradients are 1F1B's, which runs every action plainly."""
    from megatron_bfpp.semantics import combined_pairs, planned_forwards

    pp, ep, m, layers = 2, 2, 6, 8
    ours = run_ranks(
        _rank, world_size=pp * ep, pp=pp, vp=2, ep=ep,
        args=(schedule, layers, m, TOPK, True, options),
    )  # fmt: skip
    base = run_ranks(_rank, world_size=pp * ep, pp=pp, ep=ep, args=("1f1b", layers, m, TOPK, True))
    built = build_schedule(
        schedule, num_ranks=pp, num_microbatches=m, num_chunks=2, lower=False, **options
    )
    for r in ours:
        program = built.per_rank[r["rank"]]
        pairs, planned = len(combined_pairs(program)), len(planned_forwards(program))
        assert pairs > 0 and planned >= pairs
        assert r["combined"].count((True, True)) == pairs
        assert r["combined"].count((True, False)) == r["combined"].count((False, True))
        assert r["combined"].count((True, False)) == planned - pairs
    assert all(r["combined"] == [] for r in base)

    def losses(results: list[dict[str, Any]]) -> list[float]:
        return [x for r in results if r["ep_rank"] == 0 for x in r["losses"]]

    assert losses(ours) == losses(base) and len(losses(base)) == 2 * m  # (sum, tokens) each
    for ep_rank in range(ep):

        def grads(results: list[dict[str, Any]], ep_rank: int = ep_rank) -> dict[str, Any]:
            return {k: v for r in results if r["ep_rank"] == ep_rank for k, v in r["grads"].items()}

        M.assert_tensors_close(grads(ours), grads(base), rel=0)


def test_our_combined_1f1b_equals_megatron_cores_own_with_the_overlap() -> None:
    """``interleaved --combined-1f1b`` with --overlap-moe-expert-parallel-comm against
    megatron-core's own interleaved schedule with it (its combined 1F1B): the same combined steps
    in the same order, so the same losses and gradients, bit for bit."""
    pp, ep, m, layers = 2, 2, 6, 8
    args = (layers, m, TOPK, True)
    ours = run_ranks(
        _rank, world_size=pp * ep, pp=pp, vp=2, ep=ep,
        args=("interleaved", *args, {"combined_1f1b": True}),
    )  # fmt: skip
    native = run_ranks(_rank, world_size=pp * ep, pp=pp, vp=2, ep=ep, args=("megatron", *args))
    assert all(r["combined"] for r in ours)
    assert [r["combined"] for r in ours] == [r["combined"] for r in native]
    for ep_rank in range(ep):
        mine = [r for r in ours if r["ep_rank"] == ep_rank]
        theirs = [r for r in native if r["ep_rank"] == ep_rank]
        assert [r["losses"] for r in mine] == [r["losses"] for r in theirs]
        M.assert_tensors_close(
            {k: v for r in mine for k, v in r["grads"].items()},
            {k: v for r in theirs for k, v in r["grads"].items()},
        )


@pytest.mark.parametrize(
    ("batch_p2p", "overlap_p2p"), [(True, False), (False, False), (False, True)],
    ids=["batched", "pairwise", "overlapped"],
)  # fmt: skip
def test_megatron_cores_combined_1f1b_posts_what_the_model_derives(
    batch_p2p: bool, overlap_p2p: bool
) -> None:
    """megatron-core's own combined 1F1B (interleaved with --overlap-moe-expert-parallel-comm,
    pp 4, vp 2, ep 2), recorded: every isend / irecv and wait, each forward, each backward after
    its combined step, op for op what ``native_posting`` derives for ``interleaved
    --combined-1f1b`` (the planner's row), proven under NCCL's rules: both receives of a pair
    waited before it, its sends after it. With overlap_p2p_comm megatron-core waits and posts
    inside its combined step (``pre_forward`` ... ``post_backward`` around the layers), after it
    built the forward's plan, which the record's F marks: there the posts and waits are compared."""
    from megatron_bfpp.native_posting import P2POptions

    pp, ep, layers, m = 4, 2, 8, 8
    native = run_ranks(
        _rank, world_size=pp * ep, pp=pp, vp=2, ep=ep, timeout=500,
        args=("megatron", layers, m, TOPK, True, None, (batch_p2p, overlap_p2p)),
    )  # fmt: skip
    schedule = build_schedule(
        "interleaved", num_ranks=pp, num_microbatches=m, num_chunks=2, combined_1f1b=True
    )
    options = P2POptions(batch_p2p=batch_p2p, overlap_p2p=overlap_p2p)
    for r in native:  # every message is one micro-batch's [sequence, batch, hidden]
        got = _with_shape(r["events"], (SEQ, MICRO, HIDDEN), SHAPE)
        want = model_events(schedule, options, r["rank"])
        assert any(event[0] in ("isend", "batch") for event in got)
        if overlap_p2p:
            got, want = _posts(got), _posts(want)
        assert got == want, (r["rank"], _first_difference(got, want))


def _posts(events: list[Any]) -> list[Any]:
    """Only the posts and waits (consecutive waits as one)."""
    return _merged_waits([event for event in events if event[0] not in ("F", "B")])
