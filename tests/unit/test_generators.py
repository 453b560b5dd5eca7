"""Generators: literal orders for small cases, a legal-input sweep, and clear errors otherwise."""

from __future__ import annotations

from collections import Counter

import pytest

from megatron_bfpp.ir import ActionKind, Schedule, ScheduleError, parts
from megatron_bfpp.ir import ActionKind as K
from megatron_bfpp.schedules.registry import SCHEDULES, build_schedule


def compute_rows(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in actions) for actions in schedule.compute_only().per_rank]


def test_gpipe_literal() -> None:
    schedule = build_schedule("gpipe", num_ranks=2, num_microbatches=2)
    assert compute_rows(schedule) == ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]


def test_1f1b_literal() -> None:
    schedule = build_schedule("1f1b", num_ranks=3, num_microbatches=4)
    assert compute_rows(schedule) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_breadth_first_literal_and_lowering() -> None:
    schedule = build_schedule("breadth-first", num_ranks=2, num_microbatches=2, num_chunks=2)
    assert compute_rows(schedule) == [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
        "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1",
    ]
    rank0 = [str(a) for a in schedule.per_rank[0]]
    # Parameter gathers first, in chunk order; chunk 1's gradient sync right after its backward.
    assert rank0[:2] == ["0PS", "2PS"]
    assert rank0.index("2GS") < rank0.index("0B0")
    assert rank0[-1] == "0GS"


def test_breadth_first_groups_bound_memory() -> None:
    full = build_schedule("breadth-first", num_ranks=4, num_microbatches=16, num_chunks=2)
    grouped = build_schedule(
        "breadth-first", num_ranks=4, num_microbatches=16, num_chunks=2, group_size=4
    )
    assert max(full.peak_activations()) == 16
    assert max(grouped.peak_activations()) == 4
    assert compute_rows(grouped)[0].startswith("0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 4B0")


def test_interleaved_literal_pp2_vp2() -> None:
    schedule = build_schedule("interleaved", num_ranks=2, num_microbatches=4, num_chunks=2)
    assert compute_rows(schedule) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_1f1b_stores_p_minus_r() -> None:
    schedule = build_schedule("1f1b", num_ranks=6, num_microbatches=12)
    assert schedule.peak_activations() == (6, 5, 4, 3, 2, 1)


def _legal(name: str, p: int, v: int, m: int) -> bool:
    """The documented constraints, restated independently of the generators."""
    placement = SCHEDULES[name].placement
    if placement == "single":
        return v == 1
    if name == "dualpipe-v":
        return v in (1, 2) and m >= 2 * p  # one micro-batch per stage of the V at least
    if placement == "v-shape":
        return v in (1, 2)  # 1 stands for --vp omitted
    if v < 2:
        return False
    if name == "interleaved":
        return m >= p and (m % p == 0 or m % p >= p)
    return True


SWEEP = [
    (name, p, v, m)
    for name in SCHEDULES
    for p in range(2, 9)
    for v in range(1, 5)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 24, 32)
]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_sweep_builds_and_validates_every_legal_input(name: str) -> None:
    built = rejected = 0
    for _, p, v, m in (case for case in SWEEP if case[0] == name):
        chunks = None if v == 1 and SCHEDULES[name].placement != "looped" else v
        if _legal(name, p, v, m):
            schedule = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=chunks)
            assert schedule.num_ranks == p and schedule.num_microbatches == m
            compute = Counter(
                part.kind
                for _, _, action in schedule.iter_actions()
                if action.kind.is_compute
                for part in parts(action)
            )
            # every stage and micro-batch: a forward, and a backward whole (B) or split (I, W)
            work = schedule.num_stages * m
            assert compute[K.FORWARD] == compute[K.BACKWARD] + compute[K.BACKWARD_INPUT] == work
            assert compute[K.BACKWARD_WEIGHT] == compute[K.BACKWARD_INPUT]
            assert SCHEDULES[name].split_backward or not compute[K.BACKWARD_INPUT]
            built += 1
        else:
            with pytest.raises(ScheduleError) as info:
                build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=chunks)
            assert name.split("(")[0] in str(info.value) or "--vp" in str(info.value)
            rejected += 1
    assert built > 0


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        (
            "interleaved",
            {"num_ranks": 4, "num_microbatches": 6, "num_chunks": 2},
            r"num_microbatches % group size to be 0 or >= pp=4; got 6 % 4 = 2",
        ),
        (
            "interleaved",
            {"num_ranks": 4, "num_microbatches": 3, "num_chunks": 2},
            r"group size in \[pp=4, num_microbatches=3\].*use at least pp micro-batches",
        ),
        ("interleaved", {"num_ranks": 4, "num_microbatches": 8}, "needs virtual pipeline stages"),
        (
            "interleaved",
            {"num_ranks": 4, "num_microbatches": 8, "num_chunks": 1},
            "at least 2; with one chunk per rank use 1f1b",
        ),
        ("breadth-first", {"num_ranks": 4, "num_microbatches": 8}, "--vp"),
        (
            "breadth-first",
            {"num_ranks": 4, "num_microbatches": 8, "num_chunks": 2, "group_size": 9},
            r"group size must be in \[1, num_microbatches=8\]",
        ),
        (
            "1f1b",
            {"num_ranks": 4, "num_microbatches": 8, "num_chunks": 2},
            "one stage per rank; drop --vp",
        ),
        ("v-half", {"num_ranks": 4, "num_microbatches": 8, "num_chunks": 3}, "exactly 2 stages"),
        ("1f1b", {"num_ranks": 0, "num_microbatches": 8}, "num_ranks must be a positive integer"),
        ("gpipe", {"num_ranks": 2, "num_microbatches": 0}, "num_microbatches must be a positive"),
        (
            "1f1b",
            {"num_ranks": 2, "num_microbatches": 2, "group_size": 2},
            "1f1b does not take option",
        ),
        ("warp", {"num_ranks": 2, "num_microbatches": 2}, "unknown schedule 'warp'; choose one of"),
    ],
)
def test_bad_input_says_what_would_work(name: str, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        build_schedule(name, **kwargs)


def test_compute_only_build_is_validated_but_unlowered() -> None:
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2, lower=False)
    assert all(a.kind.is_compute for _, _, a in schedule.iter_actions())
    assert {a.kind for _, _, a in schedule.iter_actions()} == {
        ActionKind.FORWARD,
        ActionKind.BACKWARD,
    }
