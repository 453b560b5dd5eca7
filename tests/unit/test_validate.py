"""The validator: completeness, placement, pairing, per-channel order, deadlock."""

from __future__ import annotations

import random

import pytest

from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    StageLayout,
    parse_schedule,
)
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.schedules.breadth_first import build_breadth_first
from megatron_bfpp.schedules.registry import Placement, build_schedule, get_spec, schedule_names
from megatron_bfpp.validate import (
    has_communication,
    validate_completeness,
    validate_data_order,
    validate_deadlock_free,
    validate_grad_sync,
    validate_message_order,
    validate_placement,
    validate_schedule,
)

LOOPED2 = StageLayout.looped(2)
K = ActionKind


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


def test_forwards_out_of_micro_batch_order_are_refused_in_one_line() -> None:
    """Data iterators are read in order: a stage's forwards must take micro-batches 0, 1, ...
    A lowered, deadlock-free, NCCL-safe order that swaps two is refused by validation itself,
    so by every path (the runtime's plan, a prebuilt / CSV schedule, the simulator's input)."""
    rows = [
        "0F1 0SA1>1 0F0 0SA0>1 0RG1<1 0B1 0RG0<1 0B0",
        "1RA1<0 1F1 1B1 1SG1>0 1RA0<0 1F0 1B0 1SG0>0",
    ]
    swapped = parse_schedule(rows, layout=LOOPED2, num_microbatches=2, name="swapped")
    expected = (
        "swapped: rank 0, step 2: 0F0 runs stage 0's micro-batch 0 after its micro-batch 1; "
        "data iterators are read in order, so order each stage's forwards by micro-batch"
    )
    for check in (validate_schedule, validate_data_order):
        with pytest.raises(ScheduleError) as info:
            check(swapped)
        assert str(info.value) == expected  # one line, no grid
    validate_deadlock_free(swapped)  # only the data order is wrong
    # Backwards may take any order: forwards in order, backwards swapped, is accepted.
    backwards_swapped = [
        "0F0 0SA0>1 0F1 0SA1>1 0RG1<1 0B1 0RG0<1 0B0",
        "1RA0<0 1F0 1RA1<0 1F1 1B1 1SG1>0 1B0 1SG0>0",
    ]
    validate_schedule(parse_schedule(backwards_swapped, layout=LOOPED2, num_microbatches=2))


def test_every_catalogue_schedule_reads_data_in_order() -> None:
    for name in schedule_names():
        chunks = 2 if get_spec(name).placement is Placement.LOOPED else None
        validate_data_order(
            build_schedule(name, num_ranks=4, num_microbatches=8, num_chunks=chunks)
        )


# --- the one pass agrees with the checks run one by one -------------------------------------


def _each_check_passes(schedule: Schedule, require_communication: bool) -> bool:
    try:
        validate_placement(schedule)
        validate_completeness(schedule)
        validate_grad_sync(schedule)
        if require_communication or has_communication(schedule):
            validate_message_order(schedule)
        validate_deadlock_free(schedule)
        validate_data_order(schedule)
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
        validate_schedule(base, require_communication=require_communication, nccl=False)
        for _ in range(150):
            schedule = _mutated(base, rng)
            expected = _each_check_passes(schedule, require_communication)
            try:
                validate_schedule(schedule, require_communication=require_communication)
            except ScheduleError:
                assert not expected
            else:
                assert expected


# --- data-parallel sync: each chunk's GS once, after its last backward, under every strategy --


def _moved_gs(schedule: Schedule, rank: int, stage: int, before: str) -> Schedule:
    """``schedule`` with ``rank``'s GS of ``stage`` moved to just before the action ``before``."""
    program = [a for a in schedule.per_rank[rank] if str(a) != f"{stage}GS"]
    program.insert(
        next(i for i, a in enumerate(program) if str(a) == before), Action(stage, K.GRAD_SYNC)
    )
    return _with_program(schedule, rank, program)


def _with_program(schedule: Schedule, rank: int, program: list[Action]) -> Schedule:
    programs = list(schedule.per_rank)
    programs[rank] = tuple(program)
    return schedule.with_programs(programs)


@pytest.mark.parametrize("sharding", ["optim", "optim_grads_params"])
@pytest.mark.parametrize("case", ["early", "twice", "missing"])
def test_grad_sync_misplaced_is_refused_under_every_strategy(sharding: str, case: str) -> None:
    """The issue's three cases, on a built breadth-first schedule (rank 0, stage 0, whose last
    backward is 0B3): each refused in one line naming the action and its step."""
    built = build_schedule(
        "breadth-first", num_ranks=2, num_microbatches=4, num_chunks=2, sharding=sharding
    )
    validate_schedule(built)
    program = list(built.per_rank[0])
    gs = next(i for i, a in enumerate(program) if str(a) == "0GS")
    sharded = sharding == "optim_grads_params"  # one GS per run of backwards is allowed there
    if case == "early":
        bad = _moved_gs(built, 0, 0, "0B3")
        expected = (
            r"rank 0, step \d+: 0B3: computes a backward of stage 0 after its last gradient "
            r"reduction"
            if sharded
            else r"rank 0, step \d+: 0GS: starts stage 0's gradient reduction before its last"
        )
    elif case == "twice":
        bad = _with_program(built, 0, [*program, program[gs]])
        expected = r"0GS: reduces stage 0's gradients a second time"
    else:
        bad = _with_program(built, 0, program[:gs] + program[gs + 1 :])
        expected = r"rank 0, step \d+: 0B3: the last backward of stage 0 is followed by no GS"
    with pytest.raises(ScheduleError, match=expected) as error:
        validate_schedule(bad)
    with pytest.raises(ScheduleError, match=expected):
        validate_grad_sync(bad)
    assert "ERROR HERE" in str(error.value)  # the grid below the one line marks the step


def test_grad_sync_after_a_split_backwards_last_w() -> None:
    """With I and W, the chunk's gradients are complete after its last W: a GS between the
    last I and the last W is early."""
    compute = parse_schedule(
        ["0F0 0F1 0I0 0I1 0W0 0W1", "1F0 1F1 1I0 1I1 1W0 1W1"], layout=LOOPED2, num_microbatches=2
    )
    lowered = add_grad_sync(add_communication(compute))
    validate_schedule(lowered)
    assert str(lowered.per_rank[0][-1]) == "0GS"  # after its last W
    with pytest.raises(ScheduleError, match=r"0GS: starts stage 0's gradient .* \(0W1 at step"):
        validate_schedule(_moved_gs(lowered, 0, 0, "0W1"))


def test_param_sync_before_first_use_and_once() -> None:
    built = build_schedule("interleaved", num_ranks=2, num_microbatches=4, num_chunks=2)
    program = list(built.per_rank[1])
    ps = next(i for i, a in enumerate(program) if str(a) == "3PS")
    late = program[:ps] + program[ps + 1 :]
    first = next(i for i, a in enumerate(late) if a.stage == 3 and a.kind.is_compute)
    late.insert(first + 1, program[ps])
    with pytest.raises(ScheduleError, match=r"rank 1, step \d+: 3PS: gathers stage 3's "
                       r"parameters after their first use \(3F0 at step"):  # fmt: skip
        validate_schedule(_with_program(built, 1, late))
    with pytest.raises(ScheduleError, match="3PS: gathers stage 3's parameters a second time"):
        validate_schedule(_with_program(built, 1, [program[ps], *program]))


def test_grad_sync_for_a_chunk_without_backward_is_refused() -> None:
    forward_only = parse_schedule(
        ["0F0 0SA0>1 0GS", "1RA0<0 1F0"], layout=LOOPED2, num_microbatches=1
    )
    with pytest.raises(ScheduleError, match="no backward of stage 0 runs on rank 0"):
        validate_schedule(forward_only, require_backward=False)


def test_grad_sync_required_only_where_asked() -> None:
    """A schedule with no GS / PS / RL at all is not lowered for data parallelism: the
    validator accepts it unless asked (the runtime and a lowered CSV ask)."""
    lowered = add_communication(
        build_schedule("1f1b", num_ranks=2, num_microbatches=2, lower=False)
    )
    validate_schedule(lowered)
    with pytest.raises(ScheduleError, match="0B1: the last backward of stage 0 is followed by no"):
        validate_schedule(lowered, require_grad_sync=True)


@pytest.mark.parametrize("sharding", ["optim", "optim_grads_params"])
def test_every_catalogue_schedule_syncs_each_chunk_once(sharding: str) -> None:
    for name in schedule_names():
        spec = get_spec(name)
        if sharding != "optim" and name != "breadth-first":
            continue
        for num_ranks in (2, 4):
            chunks = 2 if spec.placement is Placement.LOOPED else None
            schedule = build_schedule(
                name, num_ranks=num_ranks, num_microbatches=8, num_chunks=chunks,
                sharding=sharding, validate=False,
            )  # fmt: skip
            validate_schedule(schedule, require_grad_sync=True)
            for rank, actions in enumerate(schedule.per_rank):
                syncs = [str(a) for a in actions if a.kind is K.GRAD_SYNC]
                assert sorted(syncs) == sorted(f"{s}GS" for s in schedule.layout.stages_of(rank))
