"""Rank placement for BPipe: stage ``x`` ships activations to ``p-1-x``, so each pair shares a
node (the BPipe re-evaluation paper's Figure 2). Megatron-LM permutes only parallel dimensions:
the launcher exports the order as ``BFPP_RANK_ORDER``, ``python -m megatron_bfpp.launch`` rewrites
``RANK`` from it (docs/architecture.md#megatron-integration). Pure, for SLURM scripts."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

__all__ = [
    "RANK_ORDER_ENV",
    "PlacementError",
    "apply_rank_order_from_env",
    "format_rank_order",
    "node_stages",
    "pair_adjacent_rank_order",
    "parse_rank_order",
    "pipeline_stage_of_rank",
]

RANK_ORDER_ENV = "BFPP_RANK_ORDER"
ORDERS = ("tp-dp-pp", "tp-pp-dp")


class PlacementError(ValueError):
    """An impossible placement request (the message says which input to change)."""


def pair_adjacent_rank_order(
    *,
    pipeline_parallel_size: int,
    gpus_per_node: int,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    order: str = "tp-dp-pp",
) -> tuple[int, ...]:
    """The Megatron global rank to run in each launch slot (``node * gpus_per_node +
    local_rank``) so that pipeline stages ``x`` and ``p-1-x`` of every replica share a node;
    ``order``: ``tp-dp-pp`` (Megatron's default) or ``tp-pp-dp`` (``--use-tp-pp-dp-mapping``)."""
    p, g, tp, dp = pipeline_parallel_size, gpus_per_node, tensor_parallel_size, data_parallel_size
    for flag, value in (
        ("pipeline_parallel_size", p),
        ("gpus_per_node", g),
        ("tensor_parallel_size", tp),
        ("data_parallel_size", dp),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlacementError(f"{flag} must be a positive integer, got {value!r}")
    if order not in ORDERS:
        raise PlacementError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if p % 2:
        raise PlacementError(
            f"pair-adjacent placement pairs stage x with p-1-x: pipeline_parallel_size must be "
            f"even, got {p}"
        )
    if g % (2 * tp):
        raise PlacementError(
            f"a node must hold whole evictor/acceptor pairs of tensor-parallel groups: "
            f"gpus_per_node ({g}) must be a multiple of 2 x tensor_parallel_size ({2 * tp})"
        )
    world = tp * p * dp
    if world > g and world % g:
        raise PlacementError(
            f"world size tp*pp*dp = {tp}*{p}*{dp} = {world} must be a multiple of "
            f"gpus_per_node ({g}) (or fit on one node)"
        )
    # Rank strides of one data-parallel replica and of one pipeline stage under ``order``.
    replica, stage_stride = (tp, tp * dp) if order == "tp-dp-pp" else (tp * p, tp)
    return tuple(
        t + replica * d + stage_stride * stage
        for d in range(dp)
        for x in range(p // 2)
        for stage in (x, p - 1 - x)
        for t in range(tp)
    )


def pipeline_stage_of_rank(
    rank: int,
    *,
    pipeline_parallel_size: int,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    order: str = "tp-dp-pp",
) -> int:
    """The pipeline stage Megatron gives global ``rank`` under ``order``."""
    tp, p, dp = tensor_parallel_size, pipeline_parallel_size, data_parallel_size
    if order == "tp-dp-pp":
        return rank // (tp * dp)
    if order == "tp-pp-dp":
        return (rank // tp) % p
    raise PlacementError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")


def format_rank_order(slot_to_rank: Sequence[int]) -> str:
    """The ``BFPP_RANK_ORDER`` value: comma-separated ranks, one per launch slot."""
    return ",".join(str(rank) for rank in slot_to_rank)


def parse_rank_order(text: str) -> tuple[int, ...]:
    """Inverse of :func:`format_rank_order`; rejects anything but a permutation of 0..n-1."""
    try:
        ranks = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise PlacementError(
            f"{RANK_ORDER_ENV} must be comma-separated integers, got {text!r}"
        ) from None
    if sorted(ranks) != list(range(len(ranks))):
        raise PlacementError(
            f"a rank order must be a permutation of 0..{len(ranks) - 1}, got {list(ranks)}"
        )
    return ranks


def apply_rank_order_from_env(environ: MutableMapping[str, str]) -> int | None:
    """Rewrite ``RANK`` (the launch slot, kept in ``BFPP_LAUNCH_RANK``) to the Megatron rank
    ``BFPP_RANK_ORDER`` maps it to; the new rank, or None without it."""
    text = environ.get(RANK_ORDER_ENV)
    if not text:
        return None
    order = parse_rank_order(text)
    slot = int(environ.get("BFPP_LAUNCH_RANK", environ.get("RANK", "0")))
    world = int(environ.get("WORLD_SIZE", str(len(order))))
    if world != len(order):
        raise PlacementError(f"{RANK_ORDER_ENV} has {len(order)} entries but WORLD_SIZE is {world}")
    environ["BFPP_LAUNCH_RANK"] = str(slot)
    environ["RANK"] = str(order[slot])
    return order[slot]


def node_stages(
    slot_to_rank: Sequence[int],
    *,
    gpus_per_node: int,
    pipeline_parallel_size: int,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    order: str = "tp-dp-pp",
) -> list[list[int]]:
    """Pipeline stage in each slot, grouped by node (for docs, dry runs and tests)."""
    stages = [
        pipeline_stage_of_rank(
            rank,
            pipeline_parallel_size=pipeline_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            order=order,
        )
        for rank in slot_to_rank
    ]
    return [stages[i : i + gpus_per_node] for i in range(0, len(stages), gpus_per_node)]
