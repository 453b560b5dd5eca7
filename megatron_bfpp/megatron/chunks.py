"""A rank's model chunks in any catalogue placement (docs/architecture.md#megatron-integration):
megatron-core's looped one and the V-shape, whose chunk holding stage ``s`` is built as looped
slot ``(s // p, s % p)`` (same layers, same parameter names), tied embeddings both on rank 0."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_bfpp.compat import building_as_pipeline_rank, model_process_groups
from megatron_bfpp.ir import Placement, StageLayout
from megatron_bfpp.runtime.placement import layout_for, tied_embedding_weights

__all__ = ["build_chunks", "placed_provider"]


def build_chunks(
    provider: Callable[..., torch.nn.Module],
    *,
    placement: Placement,
    num_ranks: int,
    num_chunks: int,
    rank: int,
    share_embeddings_and_output_weights: bool,
) -> list[torch.nn.Module]:
    """This rank's chunks, each ``provider(pre_process=, post_process=, vp_stage=,
    pg_collection=)`` (``None``, megatron-core's default, for the looped placement)."""
    layout = layout_for(placement, num_ranks=num_ranks, num_chunks=num_chunks)
    stages = layout.stages_of(rank)
    v_shape = placement == Placement.V_SHAPE  # a plain string too, as layout_for takes
    chunks = []
    for stage in stages:  # megatron-core's layer arithmetic must see the looped slot's rank
        groups = model_process_groups(pipeline_rank=stage % num_ranks) if v_shape else None
        with building_as_pipeline_rank(stage % num_ranks):
            chunks.append(
                provider(
                    pre_process=stage == 0,
                    post_process=layout.is_last(stage),
                    vp_stage=stage // num_ranks if len(stages) > 1 else None,
                    pg_collection=groups,
                )
            )
    if v_shape and share_embeddings_and_output_weights:
        _tie_output_to_embedding(chunks)
    return chunks


def placed_provider(
    provider: Callable[..., torch.nn.Module],
    *,
    num_ranks: int,
    rank: int,
    share_embeddings_and_output_weights: bool,
    seeded_as: Callable[[int], contextlib.AbstractContextManager[bool]],
) -> Callable[..., torch.nn.Module]:
    """A Megatron-LM ``model_provider`` building V-shape chunks in place of the looped ones its
    ``get_model`` asks for; ``seeded_as(q)`` seeds as 1F1B's pipeline rank ``q`` (``seeding``)."""
    stages = StageLayout.v_shape(num_ranks).stages_of(rank)
    built: dict[int, torch.nn.Module] = {}

    def build(stage: int, vp_stage: int, kwargs: dict[str, Any]) -> torch.nn.Module:
        kwargs = dict(kwargs)
        kwargs["pg_collection"] = model_process_groups(
            pipeline_rank=stage % num_ranks, base=kwargs.get("pg_collection")
        )
        with building_as_pipeline_rank(stage % num_ranks):
            return provider(
                pre_process=stage == 0,
                post_process=stage == 2 * num_ranks - 1,
                vp_stage=vp_stage,
                **kwargs,
            )

    def v_shape_provider(
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
        **kwargs: Any,
    ) -> torch.nn.Module:
        if vp_stage is None or not 0 <= vp_stage < len(stages):
            raise ValueError(
                f"a V-shape model has 2 chunks per pipeline rank; Megatron asked for vp_stage "
                f"{vp_stage} (is --num-virtual-stages-per-pipeline-rank 2?)"
            )
        stage = stages[vp_stage]
        with seeded_as(stage // 2) as reseeded:
            if reseeded and stage % 2:
                previous = stage - 1  # the first half of the same 1F1B rank's layers
                build(previous, previous // num_ranks, kwargs)  # drawn, then dropped
            model = build(stage, vp_stage, kwargs)
        built[vp_stage] = model
        if share_embeddings_and_output_weights and len(built) == len(stages):
            _tie_output_to_embedding([built[chunk] for chunk in sorted(built)])
        return model

    return v_shape_provider


@torch.no_grad()
def _tie_output_to_embedding(chunks: Sequence[Any]) -> None:
    """Set the tied output weight from the embedding where one rank holds both (no all-reduce)."""
    if (weights := tied_embedding_weights(chunks)) is not None:
        weights[1].copy_(weights[0])  # (embedding, output)
