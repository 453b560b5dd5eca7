"""The validator: completeness, placement, pairing, per-channel order, deadlock."""

from __future__ import annotations

import pytest

from megatron_bfpp.ir import ScheduleError, StageLayout, parse_schedule
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.schedules.breadth_first import build_breadth_first
from megatron_bfpp.validate import validate_schedule

LOOPED2 = StageLayout.looped(2)


def test_accepts_a_correct_literal_1f1b() -> None:
    schedule = parse_schedule(
        [
            "0F0 0SA0>1 0F1 0SA1>1 0RG0<1 0B0 0RG1<1 0B1",
            "1RA0<0 1F0 1B0 1SG0>0 1RA1<0 1F1 1B1 1SG1>0",
        ],
        layout=LOOPED2,
        num_microbatches=2,
    )
    validate_schedule(schedule)


@pytest.mark.parametrize(
    "rows, message",
    [
        (["0F0 0SA0>1 0RG0<1 0B0", "1RA0<0 1F0 1SG0>0"], "no complete backward"),
        (["0F0 0F0 0SA0>1 0RG0<1 0B0", "1RA0<0 1F0 1B0 1SG0>0"], "appears twice"),
        (["0B0 0F0 0SA0>1 0RG0<1", "1RA0<0 1F0 1B0 1SG0>0"], "backward before its forward"),
        (["0F0 0SA0>1 0RG0<1 0B0", "1F0 1B0 1SG0>0 1RA0<0"], "no earlier receive"),
        (["0F0 0SA0>1 0RG0<1 0B0", "1RA0<0 1F0 1B0 1SG0>1"], "neighbour stage 0 lives on rank 0"),
        (["0F0 0SA0>1 0RG0<1 0B0", "0F0 1RA0<0 1F0 1B0 1SG0>0"], "stage 0 lives on rank 0"),
        (["0F0 0SA0>1 0RG0<1 0B0", "1RA0<0 1F0 1B0"], "never sends it"),
        (["0F0 0SA0>1 0SA0>1 0RG0<1 0B0", "1RA0<0 1F0 1B0 1SG0>0"], "never receives it"),
        (["0F0 0SA0>1 0RG0<1 0B0 0F1", "1RA0<0 1F0 1B0 1SG0>0"], "micro-batch 1 does not exist"),
    ],
)
def test_rejects_broken_schedules_with_grid(rows: list[str], message: str) -> None:
    schedule = parse_schedule(rows, layout=LOOPED2, num_microbatches=1)
    with pytest.raises(ScheduleError, match=message) as info:
        validate_schedule(schedule)
    assert "rank  0:" in str(info.value)


def test_deadlock_is_reported_with_blocked_steps_marked() -> None:
    # Rank 0 waits for a gradient that rank 1 can only produce after rank 0's activation,
    # which rank 0 sends after that wait.
    rows = ["0F0 0RG0<1 0B0 0SA0>1", "1RA0<0 1F0 1B0 1SG0>0"]
    schedule = parse_schedule(rows, layout=LOOPED2, num_microbatches=1)
    with pytest.raises(ScheduleError) as info:
        validate_schedule(schedule)
    assert "deadlock" in str(info.value)
    assert "<-- waits for" in str(info.value)


def test_pp2_looped_activation_and_gradient_share_a_peer() -> None:
    """With pp=2 and two chunks, rank 0 sends both activations (stage 0 -> 1) and gradients
    (stage 2 -> 1) to rank 1 with the same shape; swapping two posts must be rejected."""
    compute = build_breadth_first(num_ranks=2, num_microbatches=2, num_chunks=2)
    schedule = add_communication(compute)
    validate_schedule(schedule)
    rank1 = list(schedule.per_rank[1])
    recvs = [i for i, a in enumerate(rank1) if a.kind.is_recv and a.peer == 0]
    kinds = [rank1[i].kind.value for i in recvs]
    assert "RA" in kinds and "RG" in kinds
    # Post the first gradient receive before the last activation receive: both still come before
    # their consumers, but rank 0 sends that activation first, so the two would be swapped.
    last_act = max(i for i in recvs if rank1[i].kind.value == "RA")
    first_grad = min(i for i in recvs if rank1[i].kind.value == "RG")
    rank1.insert(last_act, rank1.pop(first_grad))
    swapped = schedule.with_programs([schedule.per_rank[0], rank1])
    with pytest.raises(ScheduleError, match="message order differs between ranks 0 -> 1"):
        validate_schedule(swapped)


def test_compute_only_order_is_checked_for_feasibility() -> None:
    ok = parse_schedule(["0F0 0B0", "1F0 1B0"], layout=LOOPED2, num_microbatches=1)
    validate_schedule(ok, require_communication=False)
    # Rank 1 wants micro-batch 1 first; rank 0 only sends it after micro-batch 0's backward.
    bad = parse_schedule(["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], layout=LOOPED2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(bad, require_communication=False)
