"""Where a schedule puts model chunks: checked against the chunks built (a looped model under a
V-shape would silently train another network), tied embeddings summed on the rank holding both,
losses delivered to the last pipeline rank, where Megatron-LM and custom loops read them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_bfpp.ir import Placement, ScheduleError, StageLayout

__all__ = [
    "check_chunk_placement",
    "deliver_to_last_rank",
    "layout_for",
    "sum_tied_embedding_grads",
    "tied_embedding_weights",
]


def layout_for(placement: Placement, *, num_ranks: int, num_chunks: int) -> StageLayout:
    """A catalogue placement's stage layout (``single``: looped, one chunk); its name works too."""
    try:
        placement = Placement(placement)
    except ValueError:
        raise ScheduleError(
            f"unknown placement {placement!r} (choose from {', '.join(Placement)})"
        ) from None
    if placement is Placement.V_SHAPE:
        if num_chunks != 2:
            raise ScheduleError(
                f"the V-shape places exactly 2 stages per rank, got {num_chunks} model chunks"
            )
        return StageLayout.v_shape(num_ranks)
    return StageLayout.looped(num_ranks, num_chunks)


def _flag(chunk: Any, name: str) -> bool | None:
    from megatron.core.utils import get_attr_wrapped_model

    try:
        return bool(get_attr_wrapped_model(chunk, name))
    except RuntimeError:  # a model without megatron-core's attribute: nothing to check
        return None


def check_chunk_placement(
    chunks: Sequence[Any], layout: StageLayout, rank: int, schedule: str
) -> None:
    """One line if this rank's chunks embed or compute the loss where the layout's stages do not
    (megatron-core models say so in ``pre_process`` / ``post_process``)."""
    for chunk, stage in enumerate(layout.stages_of(rank)):
        embeds = _flag(chunks[chunk], "pre_process")
        loss = _flag(chunks[chunk], "post_process")
        if embeds is None or loss is None:
            continue
        if (embeds, loss) != (stage == 0, layout.is_last(stage)):
            raise ScheduleError(
                f"schedule {schedule!r} runs global stage {stage} ({layout.kind} placement) on "
                f"model chunk {chunk} of pipeline rank {rank}, but that chunk was built "
                f"{'with' if embeds else 'without'} the embedding and "
                f"{'with' if loss else 'without'} the loss; build the chunks for the "
                f"{layout.kind} placement (megatron_bfpp.megatron.chunks.build_chunks, which "
                "bfpp-train and the Megatron-LM plugin use)"
            )


def tied_embedding_weights(chunks: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(input embedding, output layer) weights when this rank holds both copies of a tied embedding
    in different chunks, else ``None`` (also without ``pre_process`` / ``post_process``)."""
    if len(chunks) < 2 or not (
        _flag(chunks[0], "pre_process") and _flag(chunks[-1], "post_process")
    ):
        return None
    from megatron.core.utils import get_attr_wrapped_model

    first = get_attr_wrapped_model(chunks[0], "pre_process", return_model_obj=True)
    last = get_attr_wrapped_model(chunks[-1], "post_process", return_model_obj=True)
    if not getattr(last, "share_embeddings_and_output_weights", False):
        return None
    embedding = first.shared_embedding_or_output_weight()
    output = last.shared_embedding_or_output_weight()
    if embedding is None or output is None or embedding is output:
        return None
    return embedding, output


@torch.no_grad()
def sum_tied_embedding_grads(chunks: Sequence[Any]) -> None:
    """Both copies' gradient := their sum on the rank holding both, as Megatron's first/last-stage
    word-embedding all-reduce computes, after the data-parallel reduction as that one is."""
    weights = tied_embedding_weights(chunks)
    if weights is None:
        return
    embedding, output = (
        w.grad if (g := getattr(w, "main_grad", None)) is None else g for w in weights
    )
    if embedding is None or output is None:
        return
    total = embedding + output
    embedding.copy_(total)
    output.copy_(total)


def deliver_to_last_rank(
    store: list[Any], layout: StageLayout, pp_group: Any, device: torch.device
) -> list[Any]:
    """What the last stage returned, moved to the last pipeline rank when another rank computed
    it (a few loss values per micro-batch, once per step); ``[]`` on the rank that sent it."""
    import torch.distributed as dist

    source = layout.rank_of(layout.num_stages - 1)
    target = layout.num_ranks - 1
    me = pp_group.rank()
    if source == target or me not in (source, target):
        return store
    if me == source:
        dist.send_object_list(
            [_to(store, torch.device("cpu"))],
            dst=dist.get_global_rank(pp_group, target),
            group=pp_group,
            device=device,
        )
        return []
    received: list[Any] = [None]
    dist.recv_object_list(
        received, src=dist.get_global_rank(pp_group, source), group=pp_group, device=device
    )
    return list(_to(received[0], device))


def _to(value: Any, device: torch.device) -> Any:
    """``value`` (tensors in lists, tuples and dicts) with its tensors detached on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, dict):
        return {key: _to(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(item, device) for item in value)
    return value
