"""Overlapped pairs (``OVERLAP_F_B``) on real megatron-core GPT chunks over gloo ranks: a
schedule with its steady state's forwards and backwards fused into composites
(``passes.fuse_overlapped``) gives bit-identical losses and gradients to the same schedule
unfused, its ranks running the same computes in the same order (the composite's handler runs its
forward's and its backward's)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]


def plain_and_fused(schedule: str, batches: list[M.Batch]) -> list[Any]:
    """(losses, gradient shards, trace, composites on this rank) of ``schedule`` as built and
    with its overlap pairs fused, each on freshly built chunks."""
    from megatron.core import parallel_state

    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.ir import ActionKind
    from megatron_bfpp.passes import fuse_overlapped
    from megatron_bfpp.schedules.registry import build_schedule

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    v_shape = schedule.startswith("v-")
    plain = build_schedule(schedule, num_ranks=pp, num_microbatches=len(batches))
    results = []
    for built in (plain, fuse_overlapped(plain)):
        config = M.tiny_gpt_config(num_layers=4 * pp, **({"vp": 2} if v_shape else {}))
        chunks = M.build_model_chunks(config, placement="v-shape" if v_shape else "looped")
        func = get_forward_backward_func(built)
        store = M.run_schedule(chunks, batches, forward_backward_func=func)
        composites = sum(a.kind is ActionKind.OVERLAP_F_B for a in built.per_rank[rank])
        results.append(
            (M.losses_from_store(store), M.grad_shards(chunks), func.last_trace, composites)
        )
    return results


@pytest.mark.parametrize("schedule, pp, m", [("1f1b", 2, 4), ("v-half", 2, 4)])
def test_fused_schedule_gives_the_unfused_gradients_bit_for_bit(
    schedule: str, pp: int, m: int
) -> None:
    batches = M.make_batches(m, seed=13)
    vp = 2 if schedule.startswith("v-") else None
    ranks = run_ranks(plain_and_fused, world_size=pp, pp=pp, vp=vp, args=(schedule, batches))
    plain = [result[0] for result in ranks]
    fused = [result[1] for result in ranks]
    assert sum(f[3] for f in fused) >= 2  # the fused schedule has composites to run
    assert all(p[3] == 0 for p in plain)
    for p, f in zip(plain, fused, strict=True):
        assert f[0] == p[0]  # losses (on the rank that returns them)
        assert f[2] == p[2]  # the same computes in the same order
    M.assert_tensors_close(
        M.merge_shards(f[1] for f in fused), M.merge_shards(p[1] for p in plain), rel=0.0
    )
