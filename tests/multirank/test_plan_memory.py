"""The planner's memory model against megatron-core: a small GPT built and trained on CPU gloo
ranks holds exactly the parameter, gradient and Adam-state bytes ``plan.memory`` predicts per
rank, and the runtime's measured activation accounting (``ForwardBackwardFunc.last_memory``)
is within 10% of the predicted peak for 1F1B, breadth-first and BPipe. Fully sharded
(breadth-first, the one schedule the runtime shards, with every group size) the runtime's
measured peaks of parameter and gradient bytes are exactly the kept shards plus the planner's
walk (``plan.memory.full_buffer_peaks``) of the chunks whole at once, weighed by each chunk's
buffer, and the planner's per-chunk parameter counts are megatron-core's."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.plan.memory import (
    full_buffer_peaks,
    peak_activation_bytes,
    peak_points,
    stage_activation_bytes,
    stage_parameters,
    weights_bytes,
)
from megatron_bfpp.plan.presets import FP32, model_from_shape
from megatron_bfpp.plan.search import rank_parameters_of
from megatron_bfpp.schedules.registry import build_schedule, get_spec
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


def _rank(
    schedule: str, options: dict[str, Any], num_layers: int, m: int, layout: str | None = None
) -> dict[str, Any]:
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
        **({"pipeline_model_parallel_layout": layout} if layout else {}),
    )
    from megatron_bfpp.schedules.registry import get_spec

    placement = get_spec(schedule).placement
    chunks = M.wrap_ddp(
        M.build_model_chunks(
            config, vocab_size=VOCAB, max_sequence_length=SEQ, placement=placement
        ),
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


def _sharded_rank(
    groups: list[int], num_layers: int, m: int, overlap: bool, layout: str | None = None
) -> list[Any]:
    """Per group size: two fully sharded breadth-first steps with Adam (the second from a
    zeroed buffer, as training runs); the runtime's peaks of each step (optimizer included),
    the chunks' buffers and kept shards, and the chunks' parameter counts."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.runtime import sharded_optimizer_step
    from megatron_bfpp.runtime.sharding import sharded_parameters

    results = []
    for group in groups:
        config = M.tiny_gpt_config(
            num_layers=num_layers,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            ffn_hidden_size=FFN,
            **({"pipeline_model_parallel_layout": layout} if layout else {}),
        )
        chunks = M.wrap_ddp(
            M.build_model_chunks(config, vocab_size=VOCAB, max_sequence_length=SEQ),
            use_distributed_optimizer=True,
            overlap_grad_reduce=overlap,
        )
        counts = [sum(p.numel() for p in chunk.parameters()) for chunk in chunks]
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), chunks
        )
        func = get_forward_backward_func(
            "breadth-first", data_parallel_sharding_strategy="optim_grads_params", group_size=group
        )
        sharded = sharded_parameters(chunks)
        peaks = []
        for step in range(2):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            batches = M.make_batches(m, micro_batch_size=MICRO, seq_len=SEQ, seed=step)
            iterators: Any = [iter(batches) for _ in chunks]
            func(
                forward_step_func=M.forward_step_func,
                data_iterator=iterators,
                model=chunks,
                num_microbatches=m,
                seq_length=SEQ,
                micro_batch_size=MICRO,
            )
            sharded_optimizer_step(optimizer, chunks)
            peaks.append((sharded.peak_bytes, sharded.peak_grad_bytes))
        results.append(
            {
                "rank": parallel_state.get_pipeline_model_parallel_rank(),
                "peaks": peaks,
                "chunk_bytes": [sum(state.full_nbytes) for state in sharded.chunks],
                "grad_chunk_bytes": [sum(state.grad_nbytes) for state in sharded.chunks],
                "kept": sum(
                    b.shard.untyped_storage().nbytes() for c in sharded.chunks for b in c.buckets
                ),
                "kept_grads": sum(
                    b.grad_shard.untyped_storage().nbytes()
                    for c in sharded.chunks
                    for b in c.buckets
                ),
                "counts": counts,
            }
        )
    return results


CASES = [
    # schedule, tp, pp, vp, dp, micro-batches
    ("1f1b", 1, 4, None, 1, 8),
    ("bpipe", 1, 4, None, 1, 8),
    ("breadth-first", 1, 2, 2, 1, 4),
    ("1f1b", 2, 2, None, 1, 4),  # tensor and sequence parallel
    ("breadth-first", 1, 2, 2, 2, 4),  # the distributed optimizer's shards over dp
    ("interleaved", 1, 2, 2, 1, 4),
    ("v-half", 1, 2, 2, 1, 4),  # the V placement: rank 0 holds the first and last stages
    ("gpipe", 1, 2, None, 1, 4),  # every forward before any backward
    ("v-min", 1, 2, 2, 1, 4),
    ("v-zb", 1, 2, 2, 1, 4),  # split backward: W frees what I kept
    ("dualpipe-v", 1, 2, 2, 1, 4),  # overlapped pairs: F & B of two micro-batches as one
    ("dualpipe-v", 1, 3, 2, 1, 7),
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
    per_stage = stage_parameters(
        model, tp=tp, pp=pp, chunks=vp or 1, placement=get_spec(schedule).placement
    )
    walked = full_buffer_peaks(built, per_stage)
    for rank in range(pp):
        params, grads, state = weights_bytes(counts[rank], dp=dp, precision=FP32, sharded=False)
        # Unsharded, every chunk is whole all step: the walk says the rank's parameters.
        assert walked[rank] == (counts[rank], counts[rank])
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


UNEVEN = [
    # schedule, pp, vp, micro-batches, layout (8 layers): end stages lighter, or heavier
    ("1f1b", 4, None, 8, "Et|t*3|t*3|tL"),
    ("bpipe", 4, None, 8, "Et*3|t|t|t*3L"),  # rank 3 holds rank 0's heavier evictions
    ("interleaved", 2, 2, 4, "Et*3|t|t|t*3L"),
    ("v-half", 2, 2, 4, "E|t*3|t*3|t*2L"),  # rank 0 holds stages 0 and 3: E, 2 layers, L
    ("breadth-first", 2, 2, 4, "Et|t*2|t*2|t*3L"),
]


@pytest.mark.parametrize(
    ("schedule", "pp", "vp", "m", "layout"), UNEVEN, ids=[c[0] for c in UNEVEN]
)
def test_the_planners_uneven_walk_matches_megatron_core(
    schedule: str, pp: int, vp: int | None, m: int, layout: str
) -> None:
    """On uneven stages (auto's planning, docs/planner.md#uneven-stages) each rank holds exactly
    the parameters the planner counts from its stages' layers, and its measured activation peak
    is within 10% of the planner's walk weighing each stored micro-batch by its stage's layers."""
    from megatron_bfpp.config.run_config import UnevenStages

    results = run_ranks(_rank, world_size=pp, tp=1, pp=pp, vp=vp, args=(schedule, {}, 8, m, layout))
    layers = UnevenStages(pipeline_model_parallel_layout=layout).stage_layers(8, pp, vp or 1)
    model = _planned_model(8)
    counts = rank_parameters_of(
        model, schedule=schedule, tp=1, pp=pp, vp=vp or 1, stage_layers=layers
    )
    layer = stage_activation_bytes(
        model, micro_batch_size=MICRO, tp=1, layers_per_stage=1, vocab_size=VOCAB,
        sequence_parallel=False, recompute="none", precision=FP32,
    )  # fmt: skip
    built = build_schedule(schedule, num_ranks=pp, num_microbatches=m, num_chunks=vp, lower=False)
    activations = peak_activation_bytes(peak_points(built, layers), layer)
    for rank in range(pp):
        params, grads, _ = weights_bytes(counts[rank], dp=1, precision=FP32, sharded=False)
        mine = [r for r in results if r["rank"] == rank]
        assert {(r["parameters"], r["gradients"]) for r in mine} == {(params, grads)}
        for r in mine:
            assert r["activations"] == pytest.approx(activations[rank], rel=0.10), (
                rank, r["activations"], activations[rank],
            )  # fmt: skip


def _evicted_rank(layout: str, num_layers: int, m: int) -> dict[str, Any]:
    """One BPipe step on ``layout``: the bytes of each payload this rank evicted, by stage."""
    from megatron.core import parallel_state

    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.runtime.activations import ActivationStore

    moved: dict[int, set[int]] = {}
    evict = ActivationStore.evict

    def recording(self: Any, key: Any, tensors: Any) -> Any:
        buffer, record = evict(self, key, tensors)
        moved.setdefault(key[0], set()).add(record.nbytes)
        return buffer, record

    config = M.tiny_gpt_config(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
        ffn_hidden_size=FFN, pipeline_model_parallel_layout=layout,
    )  # fmt: skip
    chunks = M.wrap_ddp(
        M.build_model_chunks(config, vocab_size=VOCAB, max_sequence_length=SEQ),
        use_distributed_optimizer=True,
    )
    ActivationStore.evict = recording  # type: ignore[method-assign]
    try:
        get_forward_backward_func("bpipe")(
            forward_step_func=M.forward_step_func,
            data_iterator=iter(M.make_batches(m, micro_batch_size=MICRO, seq_len=SEQ, seed=1)),
            model=chunks,
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=MICRO,
        )
    finally:
        ActivationStore.evict = evict  # type: ignore[method-assign]
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return {"rank": rank, "moved": {stage: sorted(sizes) for stage, sizes in moved.items()}}


def test_bpipe_moves_what_each_uneven_stage_stores() -> None:
    """BPipe on uneven stages: what each evicting stage sends its partner and gets back (the
    runtime's payload bytes) against the simulator's transfer weights
    (``CostModel.stage_activations``, from ``plan.search.stage_activation_shares``): the
    planner times stage s's evict and restore as an even stage's times that share."""
    from megatron_bfpp.config.run_config import UnevenStages
    from megatron_bfpp.plan.search import Candidate, stage_activation_shares

    pp, m, num_layers = 6, 12, 12  # pp 6 caps at 4: ranks 0 and 1 (stores 6 and 5) evict
    model = _planned_model(num_layers)
    for layout in ("Et|t*3|t*2|t*2|t*2|t*2L", "Et*3|t|t*2|t*2|t*2|t*2L"):
        results = run_ranks(_evicted_rank, world_size=pp, pp=pp, args=(layout, num_layers, m))
        moved = {stage: sizes for r in results for stage, sizes in r["moved"].items()}
        assert sorted(moved) == [0, 1]  # the stages storing more than the cap
        assert all(len(sizes) == 1 for sizes in moved.values())  # one size per stage
        layers = UnevenStages(pipeline_model_parallel_layout=layout).stage_layers(num_layers, pp, 1)
        c = Candidate("bpipe", "optim", 1, pp, 1, 1, MICRO, "none", stage_layers=layers)
        shares = stage_activation_shares(c, model, FP32)
        even = stage_activation_bytes(
            model, micro_batch_size=MICRO, tp=1, layers_per_stage=num_layers // pp,
            vocab_size=VOCAB, sequence_parallel=False, recompute="none", precision=FP32,
        ).layers  # fmt: skip
        for stage in (0, 1):
            assert moved[stage][0] == pytest.approx(shares[stage] * even, rel=0.10), (
                layout, stage, moved, shares, even,
            )  # fmt: skip


SHARDED_LAYOUT = "Et|t*2|t*2|t*2|t*3|t*2|t*2|t*2L"  # 16 layers on pp 2 x vp 4, ends lighter


@pytest.mark.parametrize(
    ("overlap", "layout"),
    [(True, None), (False, None), (True, SHARDED_LAYOUT)],
    ids=["overlap", "no-overlap", "uneven"],
)
def test_fully_sharded_peaks_are_the_planners_walk_for_every_group_size(
    overlap: bool, layout: str | None
) -> None:
    """pp 2, vp 4, dp 2, 4 micro-batches per rank in groups of 1, 2 and 4: per rank and step,
    the runtime's peak parameter bytes are the kept shards plus the walk's gathered chunks, and
    its peak gradient bytes the kept gradient shards plus the walk's accumulating chunks
    (megatron-core's buffers, padding included, are the walk's weights; the planner's own
    unpadded per-chunk counts are checked equal to megatron-core's parameters). With
    overlap_grad_reduce a reduction lands at the next GS, as the walk counts it; without, it
    lands at its own GS, so the gradient peak is at most the walk's. On uneven stages (auto
    plans them sharded too) the planner's per-chunk counts follow each stage's layers."""
    from megatron_bfpp.config.run_config import UnevenStages
    from megatron_bfpp.ir import Placement

    pp, vp, dp, m = 2, 4, 2, 4
    groups = [1, 2, m]
    num_layers = 2 * pp * vp
    results = run_ranks(
        _sharded_rank,
        world_size=pp * dp,
        pp=pp,
        vp=vp,
        args=(groups, num_layers, m, overlap, layout),
    )
    model = _planned_model(num_layers)
    layers = UnevenStages(pipeline_model_parallel_layout=layout).stage_layers(num_layers, pp, vp)
    planned = stage_parameters(
        model, tp=1, pp=pp, chunks=vp, placement=Placement.LOOPED, stage_layers=layers
    )
    assert bool(layout) == (len(set(planned[1:-1])) > 1)  # uneven: the middle stages differ
    for index, group in enumerate(groups):
        built = build_schedule(
            "breadth-first",
            num_ranks=pp,
            num_microbatches=m,
            num_chunks=vp,
            sharding="optim_grads_params",
            group_size=group,
        )
        for per_group in results:
            got = per_group[index]
            rank = got["rank"]
            stages = built.layout.stages_of(rank)  # this rank's chunks, in chunk order
            assert got["counts"] == [planned[s] for s in stages], (group, rank)
            weights = [0] * built.num_stages
            grad_weights = [0] * built.num_stages
            for chunk, stage in enumerate(stages):
                weights[stage] = got["chunk_bytes"][chunk]
                grad_weights[stage] = got["grad_chunk_bytes"][chunk]
            gathered = full_buffer_peaks(built, weights)[rank][0]
            accumulated = full_buffer_peaks(built, grad_weights)[rank][1]
            for params, grads in got["peaks"]:
                assert params == got["kept"] + gathered, (group, rank)
                if overlap:
                    assert grads == got["kept_grads"] + accumulated, (group, rank)
                else:
                    assert grads <= got["kept_grads"] + accumulated, (group, rank)


def _mtp_rank(arch: str, num_layers: int, mtp: int) -> dict[str, Any]:
    """This rank's parameters of a GPTModel with ``mtp`` MTP layers, as megatron-core builds it,
    and its measured activation peak over one 1F1B step of 4 micro-batches."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.train.presets import gpt_chunks

    llama = arch == "llama"
    gated = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                 add_bias_linear=False)  # fmt: skip
    config = M.tiny_gpt_config(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
        ffn_hidden_size=FFN, mtp_num_layers=mtp, **(gated if llama else {}),
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization="RMSNorm" if llama else "LayerNorm")
    chunks = gpt_chunks(
        config, layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        share_embeddings_and_output_weights=not llama,
        position_embedding_type="rope" if llama else "learned_absolute",
        init=lambda model: None,  # drawn below, after counting
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )  # fmt: skip
    parameters = sum(p.numel() for c in chunks for p in c.parameters())
    mtp_parameters = sum(p.numel() for c in chunks for n, p in c.named_parameters() if "mtp" in n)
    torch.manual_seed(0)  # megatron-core's init is off in the tests' config (values: any)
    with torch.no_grad():
        for p in (p for c in chunks for p in c.parameters()):
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.02)
    wrapped = M.wrap_ddp(chunks, use_distributed_optimizer=True)
    func = get_forward_backward_func("1f1b", measure_memory=True)
    func(
        forward_step_func=M.forward_step_func,
        data_iterator=iter(M.make_batches(4, micro_batch_size=MICRO, seq_len=SEQ, seed=1)),
        model=wrapped,
        num_microbatches=4,
        seq_length=SEQ,
        micro_batch_size=MICRO,
    )
    return {
        "rank": parallel_state.get_pipeline_model_parallel_rank(),
        "parameters": parameters,
        "mtp": mtp_parameters,
        "activations": func.last_memory.peak_activation_bytes,
    }


@pytest.mark.parametrize("arch", ["llama", "gpt"])
@pytest.mark.parametrize("pp", [1, 2])
def test_the_planners_mtp_parameters_are_megatron_cores(arch: str, pp: int) -> None:
    """``--mtp-num-layers 2``: each rank holds exactly the parameters the planner counts, the MTP
    block (and, at pp > 1, the embedding it looks up) on the last stage, and its measured
    activation peak over a 1F1B step is within 10% of the planner's walk."""
    from megatron_bfpp.ir import Placement
    from megatron_bfpp.plan.memory import mtp_parameters, rank_parameters
    from megatron_bfpp.plan.presets import model_from_shape

    results = run_ranks(_mtp_rank, world_size=pp, tp=1, pp=pp, args=(arch, 4, 2))
    model = model_from_shape(
        arch=arch, num_layers=4, hidden_size=HIDDEN, num_attention_heads=HEADS,
        ffn_hidden_size=FFN, seq_length=SEQ, vocab_size=VOCAB, dropout=False, mtp_num_layers=2,
    )  # fmt: skip
    counts = rank_parameters(model, tp=1, pp=pp, chunks=1, placement=Placement.LOOPED)
    stage = stage_activation_bytes(
        model, micro_batch_size=MICRO, tp=1, layers_per_stage=4 // pp, vocab_size=VOCAB,
        sequence_parallel=False, recompute="none", precision=FP32,
    )  # fmt: skip
    built = build_schedule("1f1b", num_ranks=pp, num_microbatches=4, lower=False)
    activations = peak_activation_bytes(peak_points(built), stage)
    for r in results:
        assert r["parameters"] == counts[r["rank"]], (r, counts)
        assert r["activations"] == pytest.approx(activations[r["rank"]], rel=0.10), (
            r["rank"], r["activations"], activations[r["rank"]],
        )  # fmt: skip
    last = next(r for r in results if r["rank"] == pp - 1)
    assert last["mtp"] > 0 and mtp_parameters(model, tp=1, stages=pp) >= last["mtp"]
