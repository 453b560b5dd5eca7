"""Every catalogue schedule on uneven stages: megatron-core GPT chunks built from a
``pipeline_model_parallel_layout`` (a rank holding no layer, embedding or output included), from
first / last stage sizes, and with the embedding and loss accounted as layers, give the
unpipelined model's losses and gradients bit for bit (pure pipeline parallelism sums in the
reference's order). The chunks are drawn by global name, so every layout holds the same model;
a V places the model's stage s on rank s or 2p-1-s (docs/megatron-lm.md#uneven-stages)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.ir import Placement
from megatron_bfpp.schedules.registry import SCHEDULES, get_spec
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

PP, MICROBATCHES = 4, 8  # dualpipe-v needs 2p micro-batches
# Per placement: (virtual stages, a layout of 8 layers leaving rank 1 or 3 without any tensor).
EMPTY_RANK = {
    Placement.SINGLE: (None, "Et*4||t*2|t*2L"),  # rank 1
    Placement.LOOPED: (2, "Et*2||t|t|t||t*2|tL"),  # rank 1: stages 1 and 5
    Placement.V_SHAPE: (2, "Et*2|t*2|t|||t|t|tL"),  # rank 3: stages 3 and 4
}


def reference(batches: list[M.Batch], num_layers: int) -> tuple[list[float], dict[str, Any]]:
    return M.reference_losses_and_grads(M.tiny_gpt_config(num_layers=num_layers), batches)


def ours(batches: list[M.Batch], schedule: str, fields: dict[str, Any]) -> Any:
    from megatron_bfpp import get_forward_backward_func

    config = M.tiny_gpt_config(**fields)
    chunks = M.build_model_chunks(config, placement=get_spec(schedule).placement)
    func = get_forward_backward_func(schedule)
    store = M.run_schedule(chunks, batches, forward_backward_func=func)
    layers = sum(len(chunk.decoder.layers) for chunk in chunks)
    return M.losses_from_store(store), M.grad_shards(chunks), layers


def _check(schedule: str, vp: int | None, fields: dict[str, Any], held: list[int]) -> None:
    batches = M.make_batches(MICROBATCHES, seed=3)
    num_layers = fields.get("num_layers", 8)
    (ref,) = run_ranks(reference, world_size=1, args=(batches, num_layers))
    results = run_ranks(ours, world_size=PP, pp=PP, vp=vp, args=(batches, schedule, fields))
    assert [r[2] for r in results] == held  # the layers each rank built
    assert results[-1][0] == ref[0]  # the losses are delivered on the last pipeline rank
    M.assert_tensors_close(M.merge_shards(r[1] for r in results), ref[1], rel=0.0)


# The layers per rank of EMPTY_RANK's layouts.
HELD = {
    Placement.SINGLE: [4, 0, 2, 2],
    Placement.LOOPED: [3, 0, 3, 2],
    Placement.V_SHAPE: [3, 3, 2, 0],
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_layout_with_a_rank_holding_nothing_gives_the_unpipelined_results(schedule: str) -> None:
    placement = get_spec(schedule).placement
    vp, layout = EMPTY_RANK[placement]
    _check(schedule, vp, {"pipeline_model_parallel_layout": layout}, HELD[placement])


@pytest.mark.parametrize(
    ("schedule", "fields", "held"),
    [
        # 12 layers, first and last ranks 2 (1 per chunk), the middle ranks 4: on the V, rank r
        # holds looped slots (0, r) and (1, p-1-r)
        ("v-zb", {"num_layers": 12, "num_layers_in_first_pipeline_stage": 2,
                  "num_layers_in_last_pipeline_stage": 2}, [2, 4, 4, 2]),
        ("breadth-first", {"num_layers": 12, "num_layers_in_first_pipeline_stage": 2,
                           "num_layers_in_last_pipeline_stage": 2}, [2, 4, 4, 2]),
        # 14 layers with the embedding and the loss counted as one each: 2 per stage
        ("dualpipe-v", {"num_layers": 14, "account_for_embedding_in_pipeline_split": True,
                        "account_for_loss_in_pipeline_split": True}, [2, 4, 4, 4]),
        ("interleaved", {"num_layers": 14, "account_for_embedding_in_pipeline_split": True,
                         "account_for_loss_in_pipeline_split": True}, [3, 4, 4, 3]),
    ],
)  # fmt: skip
def test_first_last_and_accounted_stages_give_the_unpipelined_results(
    schedule: str, fields: dict[str, Any], held: list[int]
) -> None:
    _check(schedule, 2, fields, held)
