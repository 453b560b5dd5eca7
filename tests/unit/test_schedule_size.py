"""Schedules too large to build in about a minute are refused from their sizes alone, before
anything is allocated, with the estimate in the one-line message; the estimate follows the
real action counts."""

from __future__ import annotations

import pytest

from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.schedules.registry import (
    MAX_ACTIONS,
    MAX_RANK_STAGES,
    SCHEDULES,
    build_schedule,
    check_size,
    estimate_actions,
)
from tests.growth import growth, peak_bytes, python_lines


@pytest.mark.parametrize(
    ("name", "sharding"),
    [
        (name, sharding)
        for name in SCHEDULES
        for sharding in ("optim", "optim_grads_params")
        # overlapped pairs run two chunks at once: never sharded (test_dualpipe_v)
        if not (name == "dualpipe-v" and sharding != "optim")
    ],
)
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (8, 32)])
def test_the_estimate_follows_the_real_count(name: str, pp: int, m: int, sharding: str) -> None:
    spec = SCHEDULES[name]
    chunks = 2 if spec.placement == "looped" else None
    schedule = build_schedule(
        name, num_ranks=pp, num_microbatches=m, num_chunks=chunks, sharding=sharding
    )
    estimate = estimate_actions(
        num_ranks=pp, stages_per_rank=spec.stages_per_rank(chunks), num_microbatches=m
    )
    assert 0.9 * schedule.num_actions <= estimate <= 1.7 * schedule.num_actions


def test_too_many_actions_is_refused_with_the_estimate() -> None:
    with pytest.raises(ScheduleError) as info:
        check_size(num_ranks=4, stages_per_rank=2, num_microbatches=10**9)
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        "schedule too large: pp=4 x 2 stage(s) per rank x 1000000000 micro-batches is about "
        "56,000,000,016 actions and 39,200.0 GB (limit 4,000,000 actions, about a minute and "
        "2.8 GB); use fewer micro-batches, ranks or stages per rank"
    )


def test_per_rank_tables_over_every_stage_are_bounded_too() -> None:
    with pytest.raises(ScheduleError, match=r"ranks x stages = 10,000,000,000 entries") as info:
        check_size(num_ranks=100_000, stages_per_rank=1, num_microbatches=1)
    assert "about 320.0 GB (limit 32,000,000" in str(info.value)


def test_the_limits_themselves_are_accepted() -> None:
    per_stage = estimate_actions(num_ranks=1, stages_per_rank=1, num_microbatches=1)
    check_size(num_ranks=64, stages_per_rank=8, num_microbatches=(MAX_ACTIONS // 512 - 2) // 7)
    assert per_stage == 9
    ranks = int(MAX_RANK_STAGES**0.5)
    check_size(num_ranks=ranks, stages_per_rank=1, num_microbatches=1)
    with pytest.raises(ScheduleError):
        check_size(num_ranks=ranks + 1, stages_per_rank=1, num_microbatches=1)


@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        ("1f1b", {"num_ranks": 4, "num_microbatches": 99_999_999_999}),
        ("1f1b", {"num_ranks": 100_000, "num_microbatches": 8}),
        ("breadth-first", {"num_ranks": 4, "num_chunks": 2, "num_microbatches": 10**9}),
        ("v-zb", {"num_ranks": 100_000, "num_microbatches": 1}),
    ],
)
def test_build_schedule_refuses_before_allocating(name: str, sizes: dict[str, int]) -> None:
    def refused() -> None:
        with pytest.raises(ScheduleError, match="schedule too large"):
            build_schedule(name, **sizes)

    assert peak_bytes(refused) < 1_000_000  # nothing of the schedule's size was built


def test_sizes_that_are_not_integers_are_left_to_the_generators() -> None:
    check_size(num_ranks="4", stages_per_rank=1, num_microbatches=8)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError):
        build_schedule("1f1b", num_ranks=0, num_microbatches=8)


def test_add_communication_is_linear_in_the_ranks() -> None:
    """It kept per-stage lists for every rank: pp=1500 at 8 micro-batches took 18.6 s. Doubling
    the ranks now at most doubles its lines and its memory (a per-rank scan would be 4x)."""
    computes = {
        ranks: build_schedule("1f1b", num_ranks=ranks, num_microbatches=1, lower=False)
        for ranks in (200, 400, 3000)
    }
    add_communication(computes[200])  # one-time allocations (caches, lazy tables) are not growth
    assert growth(python_lines, lambda r: add_communication(computes[r]), 200) < 2.3
    assert growth(peak_bytes, lambda r: add_communication(computes[r]), 200) < 2.3
    lowered = add_communication(computes[3000])
    assert lowered.num_actions == computes[3000].num_actions + 4 * 2999
