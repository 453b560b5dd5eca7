"""The validator: completeness, placement, pairing, per-channel order, deadlock."""

from __future__ import annotations

import random

import pytest

from megatron_bfpp.ir import (
    Action,
    Schedule,
    ScheduleError,
    StageLayout,
    parse_schedule,
)
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.schedules.breadth_first import build_breadth_first
from megatron_bfpp.schedules.registry import build_schedule
from megatron_bfpp.validate import (
    _find_problem,
    has_communication,
    validate_completeness,
    validate_deadlock_free,
    validate_message_order,
    validate_placement,
    validate_schedule,
)

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


def test_the_one_pass_names_rank_step_and_reason() -> None:
    rows = ["0F0 0SA0>1 0RG0<1 0B0", "1RA0<0 1F0 1SG0>0 1B0"]
    schedule = parse_schedule(rows, layout=LOOPED2, num_microbatches=1)
    with pytest.raises(ScheduleError) as info:
        validate_schedule(schedule)
    first_line = str(info.value).splitlines()[0]
    assert first_line == "rank 1, step 2: 1SG0>0: sends a gradient before computing it"
    assert "^^^^^^ <-- ERROR HERE" in str(info.value)


def test_of_several_problems_the_first_kind_in_rank_order_is_reported() -> None:
    # rank 0: a local-order problem (SA before F); rank 1: a repeated F (completeness), which
    # the single checks report first although it comes later in rank order.
    rows = ["0SA0>1 0F0 0RG0<1 0B0", "1RA0<0 1F0 1F0 1B0 1SG0>0"]
    schedule = parse_schedule(rows, layout=LOOPED2, num_microbatches=1)
    with pytest.raises(ScheduleError, match="1F0 appears twice"):
        validate_schedule(schedule)
    rows[1] = "1RA0<0 1F0 1B0 1SG0>0"
    schedule = parse_schedule(rows, layout=LOOPED2, num_microbatches=1)
    with pytest.raises(ScheduleError, match="rank 0, step 0: 0SA0>1: sends an activation"):
        validate_schedule(schedule)


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


def test_forward_only_schedules_need_no_backward() -> None:
    rows = ["0F0 0SA0>1 0F1 0SA1>1", "1RA0<0 1F0 1RA1<0 1F1"]
    forward_only = parse_schedule(rows, layout=LOOPED2, num_microbatches=2)
    validate_schedule(forward_only, require_backward=False)
    with pytest.raises(ScheduleError, match="no complete backward"):
        validate_schedule(forward_only)
    # One backward present must still be complete: I without its W is not.
    half = parse_schedule(["0F0 0I0", "1F0"], layout=LOOPED2, num_microbatches=1)
    with pytest.raises(ScheduleError, match="no complete backward"):
        validate_schedule(half, require_communication=False, require_backward=False)


# --- the one pass agrees with the checks run one by one -------------------------------------


def _each_check_passes(schedule: Schedule, require_communication: bool) -> bool:
    try:
        validate_placement(schedule)
        validate_completeness(schedule)
        if require_communication or has_communication(schedule):
            validate_message_order(schedule)
        validate_deadlock_free(schedule)
    except ScheduleError:
        return False
    return True


def _mutated(schedule: Schedule, rng: random.Random) -> Schedule:
    """One small random edit: swap, drop, repeat, move to another rank, or change a field."""
    programs = [list(actions) for actions in schedule.per_rank]
    program = programs[rng.randrange(len(programs))]
    i = rng.randrange(len(program))
    action = program[i]
    edit = rng.randrange(6)
    if edit == 0:
        j = rng.randrange(len(program))
        program[i], program[j] = program[j], program[i]
    elif edit == 1:
        del program[i]
    elif edit == 2:
        program.insert(rng.randrange(len(program) + 1), action)
    elif edit == 3:
        other = programs[rng.randrange(len(programs))]
        other.insert(rng.randrange(len(other) + 1), program.pop(i))
    elif edit == 4 and action.microbatch is not None:
        mb = rng.randrange(schedule.num_microbatches + 1)
        program[i] = Action(action.stage, action.kind, mb, action.peer)
    elif edit == 5 and action.peer is not None:
        peer = rng.randrange(len(programs) + 1)
        program[i] = Action(action.stage, action.kind, action.microbatch, peer)
    else:
        stage = rng.randrange(schedule.num_stages + 1)
        program[i] = Action(stage, action.kind, action.microbatch, action.peer)
    return schedule.with_programs(programs)


@pytest.mark.parametrize(
    "name, chunks",
    [("1f1b", None), ("interleaved", 2), ("breadth-first", 2), ("bpipe", None), ("v-zb", None)],
)
def test_fast_path_accepts_exactly_what_the_single_checks_accept(
    name: str, chunks: int | None
) -> None:
    """validate_schedule reports the first problem of any kind found in its one pass; the
    single checks report one kind each: together they must accept exactly what it accepts."""
    rng = random.Random(name)
    num_ranks = 6 if name == "bpipe" else 3  # bpipe evicts from 6 ranks on
    compute = build_schedule(
        name, num_ranks=num_ranks, num_microbatches=6, num_chunks=chunks, lower=False
    )
    lowered = add_grad_sync(add_communication(compute))
    for base, require_communication in ((compute, False), (lowered, True)):
        assert (
            _find_problem(base, require_communication=require_communication, require_backward=True)
            is None
        )
        for _ in range(150):
            schedule = _mutated(base, rng)
            expected = _each_check_passes(schedule, require_communication)
            try:
                validate_schedule(schedule, require_communication=require_communication)
            except ScheduleError:
                assert not expected
            else:
                assert expected
