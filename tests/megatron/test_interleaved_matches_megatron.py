"""Our `interleaved` and `1f1b` orders equal what megatron-core 0.16 runs, derived from its own
functions (``get_schedule_table``, ``get_pp_rank_microbatches``) and its loop structure."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_bfpp.ir import ActionKind
from megatron_bfpp.schedules.interleaved import build_interleaved
from megatron_bfpp.schedules.one_f_one_b import build_1f1b

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
pytestmark = pytest.mark.megatron


def _communicator(pp: int, rank: int, vp: int | None) -> SimpleNamespace:
    group = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vp)


def megatron_order(pp: int, rank: int, vp: int, m: int, group: int) -> list[tuple[str, int, int]]:
    """(F|B, chunk, micro-batch) in the order forward_backward_pipelining_with_interleaving runs:
    warmup forwards k, then forward k + warmup / backward k, then the remaining backwards."""
    table = schedules.get_schedule_table(m, vp, group)
    total, _, warmup, remaining = schedules.get_pp_rank_microbatches(
        m, vp, group, p2p_communicator=_communicator(pp, rank, vp)
    )

    def fwd(k: int) -> tuple[str, int, int]:
        return ("F", table[k][1], table[k][0])

    def bwd(k: int) -> tuple[str, int, int]:
        return ("B", vp - 1 - table[k][1], table[k][0])

    order = [fwd(k) for k in range(warmup)]
    for k in range(remaining):
        order += [fwd(k + warmup), bwd(k)]
    order += [bwd(k) for k in range(remaining, total)]
    return order


def ours(schedule, rank: int) -> list[tuple[str, int, int]]:  # type: ignore[no-untyped-def]
    layout = schedule.layout
    return [
        ("F" if a.kind == ActionKind.FORWARD else "B", layout.chunk_of(a.stage), a.microbatch)
        for a in schedule.per_rank[rank]
    ]


CASES = [
    (2, 2, 4, 2),
    (2, 2, 8, 2),
    (2, 2, 8, 4),
    (2, 3, 6, 2),
    (4, 2, 8, 4),
    (4, 2, 16, 4),
    (4, 2, 16, 8),
    (4, 2, 16, 16),
    (4, 3, 12, 4),
    (4, 4, 8, 4),
    (4, 2, 10, 5),
    (4, 2, 14, 5),
    (8, 2, 16, 8),
    (8, 4, 32, 8),
    (8, 2, 24, 12),
    (3, 2, 9, 3),
    (3, 2, 8, 5),
    (4, 2, 4, 4),
]


@pytest.mark.parametrize("pp, vp, m, group", CASES)
def test_interleaved_order_matches_megatron(pp: int, vp: int, m: int, group: int) -> None:
    schedule = build_interleaved(
        num_ranks=pp, num_microbatches=m, num_chunks=vp, microbatch_group_size=group
    )
    for rank in range(pp):
        assert ours(schedule, rank) == megatron_order(pp, rank, vp, m, group), f"rank {rank}"


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (4, 3), (4, 8), (8, 8), (8, 20)])
def test_1f1b_order_matches_megatron_warmup(pp: int, m: int) -> None:
    schedule = build_1f1b(num_ranks=pp, num_microbatches=m)
    for rank in range(pp):
        _, _, warmup, remaining = schedules.get_pp_rank_microbatches(
            m, 1, 1, p2p_communicator=_communicator(pp, rank, None)
        )
        expected = [("F", 0, k) for k in range(warmup)]
        for k in range(remaining):
            expected += [("F", 0, k + warmup), ("B", 0, k)]
        expected += [("B", 0, k) for k in range(remaining, m)]
        assert ours(schedule, rank) == expected, f"rank {rank}"
