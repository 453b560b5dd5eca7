"""The memory estimate's parameter count is the model's: bfpp-train's presets built by
megatron-core on real layouts hold exactly the parameters ``model_memory`` counts per pipeline
rank (tensor-parallel splits, virtual stages, embeddings, tied output copy, final norm)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.config.model_memory import parameters_per_pipeline_rank
from megatron_bfpp.config.run_config import Layout, ModelShape
from megatron_bfpp.ir import Placement
from megatron_bfpp.testing.multirank import run_ranks

pytestmark = pytest.mark.megatron


def _count(
    shape: ModelShape,
    tp: int,
    pp: int,
    vp: int | None,
    placement: Placement = Placement.LOOPED,
    uneven: dict[str, Any] | None = None,
) -> tuple[int, int]:
    from megatron.core import parallel_state

    from megatron_bfpp.train.presets import build_model_chunks, transformer_config

    ep = parallel_state.get_expert_model_parallel_world_size()
    uneven = uneven or {}
    config = transformer_config(shape, tp=tp, pp=pp, vp=vp, on_cpu=True, ep=ep, **uneven)
    chunks = build_model_chunks(config, shape, seed=1, placement=placement)
    held = sum(param.numel() for chunk in chunks for param in chunk.parameters())
    return parallel_state.get_pipeline_model_parallel_rank(), held


@pytest.mark.parametrize(
    ("preset", "groups", "tp", "pp", "vp"),
    [("gpt", None, 1, 2, 2), ("llama", 2, 2, 2, None), ("llama", None, 1, 4, 2)],
    ids=["gpt-pp2-vp2", "llama-gqa-tp2-pp2", "llama-pp4-vp2"],
)
def test_estimated_parameters_are_the_models(
    preset: str, groups: int | None, tp: int, pp: int, vp: int | None
) -> None:
    shape = ModelShape(preset, 8, 64, 4, groups, None, 32, 256)
    results: list[Any] = run_ranks(
        _count, world_size=tp * pp, tp=tp, pp=pp, vp=vp, args=(shape, tp, pp, vp)
    )
    held: dict[int, set[int]] = {}
    for pipeline_rank, count in results:
        held.setdefault(pipeline_rank, set()).add(count)
    layout = Layout(tp, pp, vp or 1, Placement.LOOPED if vp else Placement.SINGLE, 1, tp * pp)
    expected = parameters_per_pipeline_rank(shape, layout)
    assert [held[rank] for rank in range(pp)] == [{count} for count in expected]


LAYOUT = "pipeline_model_parallel_layout"
FIRST_LAST = {"decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 2}
ACCOUNTED = {
    "account_for_embedding_in_pipeline_split": True,
    "account_for_loss_in_pipeline_split": True,
}
UNEVEN = {  # id: (preset, placement, layers, Layout's uneven fields); pp 4, vp 2
    "layout-rank-1-empty": ("gpt", Placement.LOOPED, 8, {LAYOUT: "Et*2||t|t|t||t*2|tL"}),
    "v-layout": ("llama", Placement.V_SHAPE, 8, {LAYOUT: "E|t*2|t|t|t|t|t|tL"}),
    "v-first-last": ("gpt", Placement.V_SHAPE, 12, FIRST_LAST),
    "accounted": ("llama", Placement.LOOPED, 14, ACCOUNTED),
}


@pytest.mark.parametrize("case", UNEVEN)
def test_estimated_parameters_on_uneven_stages_are_the_models(case: str) -> None:
    """bfpp-train's memory check on Megatron's uneven layouts: each pipeline rank's parameters
    as megatron-core builds them (a rank holding nothing included), looped and on the V."""
    preset, placement, layers, uneven = UNEVEN[case]
    shape = ModelShape(preset, layers, 64, 4, None, None, 32, 256)
    layout = Layout(1, 4, 2, placement, 1, 4, **uneven)  # type: ignore[arg-type]
    results: list[Any] = run_ranks(
        _count, world_size=4, pp=4, vp=2, args=(shape, 1, 4, 2, placement, layout.uneven_config())
    )
    held = dict(results)
    assert [held[rank] for rank in range(4)] == parameters_per_pipeline_rank(shape, layout)


@pytest.mark.parametrize(
    ("preset", "tp", "ep", "moe_ffn"),
    [("gpt", 1, 2, None), ("llama", 2, 2, 48)],
    ids=["gpt-ep2", "llama-tp2-ep2-expert-ffn"],
)
def test_estimated_parameters_with_experts_are_the_models(
    preset: str, tp: int, ep: int, moe_ffn: int | None
) -> None:
    """bfpp-train's Mixture-of-Experts models (megatron-core's local MoE layer, no linear biases):
    the router whole, experts / ep experts per rank split over tp, as megatron-core builds them."""
    shape = ModelShape(preset, 4, 64, 4, None, None, 32, 256, 4, 2, moe_ffn)
    pp, dp = 2, ep
    results: list[Any] = run_ranks(
        _count, world_size=tp * pp * dp, tp=tp, pp=pp, ep=ep, args=(shape, tp, pp, None)
    )
    held: dict[int, set[int]] = {}
    for pipeline_rank, count in results:
        held.setdefault(pipeline_rank, set()).add(count)
    layout = Layout(tp, pp, 1, Placement.SINGLE, dp, tp * pp * dp, expert_model_parallel_size=ep)
    expected = parameters_per_pipeline_rank(shape, layout)
    assert [held[rank] for rank in range(pp)] == [{count} for count in expected]
    dense = parameters_per_pipeline_rank(ModelShape(preset, 4, 64, 4, None, None, 32, 256), layout)
    assert all(e != d for e, d in zip(expected, dense, strict=True))  # experts were built
