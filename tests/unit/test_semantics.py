"""The execution rules, shared: message keys, the validator and the replay agree on who waits
for what, and compute_ends is replay's clock."""

from __future__ import annotations

import random

import pytest

from megatron_bfpp import semantics
from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    StageLayout,
    format_schedule,
    parse_action,
    parse_schedule,
)
from megatron_bfpp.messages import WHAT, WHAT_CODE, Message, What, message_of
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.schedules.registry import SCHEDULES, build_schedule
from megatron_bfpp.semantics import Timing, compute_ends, describe_waits, replay
from megatron_bfpp.sim import simulate
from megatron_bfpp.validate import validate_deadlock_free, validate_placement, validate_schedule

K = ActionKind


# --- messages --------------------------------------------------------------------------------


def test_both_sides_of_a_message_name_the_same_message() -> None:
    pairs = [("2SA5>3", "3RA5<2"), ("3SG5>2", "2RG5<3"), ("1EV4>6", "1AC4<1"), ("1RS4>1", "1LD4<6")]
    for send, receive in pairs:
        assert message_of(parse_action(send)) == message_of(parse_action(receive))
    assert message_of(parse_action("2SA5>3")) == Message("act", 2, 5)
    assert message_of(parse_action("2RG5<3")) == Message("grad", 3, 5)
    with pytest.raises(ScheduleError, match="not a point-to-point action"):
        message_of(parse_action("2F5"))


def test_message_ids_are_distinct_and_read_back() -> None:
    """Every message's id, and BPipe's keys addressed to a rank past the ids of activations and
    gradients, name the message they were made from (validator, replay and programs alike)."""
    schedule = build_schedule("bpipe", num_ranks=4, num_microbatches=4)
    rules = semantics.Rules(schedule)
    num_ranks = schedule.num_ranks
    seen: dict[int, tuple[Message, int]] = {}
    for microbatch in range(schedule.num_microbatches):
        for stage in range(-1, schedule.num_stages + 1):
            for what in What:
                message = Message(what, stage, microbatch)
                key = rules.id(WHAT_CODE[what], stage, microbatch)
                assert rules.message(key) == message
                assert rules.message(key).what is what
                assert (key < rules.limit) == (what in ("act", "grad"))
                keys = (
                    [key] if key < rules.limit else [key * num_ranks + r for r in range(num_ranks)]
                )
                for rank, key in enumerate(keys):
                    assert key not in seen, (message, rank, seen.get(key))
                    seen[key] = (message, rank)
                    assert rules.message(key, True) == message
    ids = [
        rules.id(code, stage, microbatch)
        for code in range(len(WHAT))
        for stage in range(-1, schedule.num_stages + 1)
        for microbatch in range(schedule.num_microbatches)
    ]
    assert ids == sorted(ids)  # the canonical order of a batch's ops (nccl)


def test_message_kinds_are_one_enum_that_prints_as_its_text() -> None:
    # The runtime's own kinds (the eviction's size header) are members too, keyed like the rest.
    assert What.EVICT_SIZE in WHAT and WHAT.index(What.EVICT_SIZE) < 8
    assert [str(what) for what in What] == [
        "act",
        "grad",
        "evict",
        "restore",
        "evict-posted",
        "restore-posted",
        "evict-size",
    ]
    assert f"{Message(What.ACT, 1, 2).what}" == "act"
    assert Message(What.GRAD, 3, 5) == Message("grad", 3, 5)  # a str: old literals still match


# --- the validator and the replay apply the same rules ---------------------------------------


def _mutated(schedule: Schedule, rng: random.Random) -> Schedule:
    """Two small random edits inside each rank's own stages: swaps, drops and repeats."""
    programs = [list(actions) for actions in schedule.per_rank]
    for _ in range(2):
        program = programs[rng.randrange(len(programs))]
        i, j = rng.randrange(len(program)), rng.randrange(len(program))
        edit = rng.randrange(3)
        if edit == 0:
            program[i], program[j] = program[j], program[i]
        elif edit == 1 and len(program) > 1:
            del program[i]
        else:
            program.insert(j, program[i])
    return schedule.with_programs(programs)


def _small_pair(name: str) -> tuple[Schedule, Schedule]:
    """A small compute-only schedule of the family and its lowering, to break at random."""
    num_ranks = 6 if name == "bpipe" else 3
    chunks = 2 if SCHEDULES[name].placement == "looped" else None
    compute = build_schedule(
        name, num_ranks=num_ranks, num_microbatches=6, num_chunks=chunks, lower=False
    )
    return compute, add_grad_sync(add_communication(compute))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_validator_and_replay_stop_the_same_ranks_at_the_same_steps(name: str) -> None:
    rng = random.Random(name)
    compute, lowered = _small_pair(name)
    stuck = 0
    for base in (compute, lowered):
        for _ in range(60):
            schedule = _mutated(base, rng)
            validate_placement(schedule)  # the edits keep every action on its rank
            blocked = replay(schedule).blocked
            if not blocked:
                validate_deadlock_free(schedule)
                continue
            stuck += 1
            with pytest.raises(ScheduleError, match="deadlock") as error:
                validate_deadlock_free(schedule)
            marks = format_schedule(schedule, marks=describe_waits(blocked))
            assert str(error.value).endswith(marks)
    assert stuck > 10  # the edits do produce deadlocks


def test_the_simulator_waits_for_what_the_validator_waits_for() -> None:
    """BPipe's acknowledgements order but cost no time; a schedule that deadlocks only through
    one is rejected by the validator and cannot be timed either."""
    schedule = build_schedule("bpipe", num_ranks=4, num_microbatches=8)
    acceptor = 3
    program = list(schedule.per_rank[acceptor])
    index = next(i for i, a in enumerate(program) if a.kind is K.ACCEPT)
    accept = program.pop(index)
    restore = next(
        i
        for i, a in enumerate(program)
        if a.kind is K.RESTORE and a.microbatch == accept.microbatch
    )
    program.insert(restore, accept)
    late = schedule.with_programs([*schedule.per_rank[:acceptor], program])
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(late)
    with pytest.raises(ScheduleError, match=r"cannot simulate 'bpipe': deadlock") as error:
        simulate(late)
    assert "evict-posted" in str(error.value)


def test_a_message_to_a_rank_outside_the_layout_reaches_nobody() -> None:
    rows = ["0F0 0SA0>7 0RG0<1 0B0", "1RA0<0 1F0 1B0 1SG0>0"]
    schedule = parse_schedule(rows, layout=StageLayout.looped(2), num_microbatches=1)
    assert replay(schedule).blocked == {
        0: (3, Message("grad", 1, 0)),
        1: (1, Message("act", 0, 0)),
    }
    with pytest.raises(ScheduleError, match="neighbour stage 1 lives on rank 1"):
        validate_schedule(schedule)


def test_a_stage_outside_the_layout_is_refused_not_indexed() -> None:
    schedule = Schedule(
        StageLayout.looped(2), 1, ((Action(0, K.FORWARD, 0),), (Action(5, K.FORWARD, 0),))
    )
    with pytest.raises(ScheduleError, match="outside the layout"):
        replay(schedule)
    with pytest.raises(ScheduleError, match="stage 5 does not exist"):
        validate_schedule(schedule, require_communication=False)


# --- replay's fast paths agree with its general ones ------------------------------------------


def _replays(schedule: Schedule, timing: Timing) -> list[tuple[object, ...]]:
    """What one run of ``replay`` finds, under each of its paths: ids to the last micro-batch
    or for any, and, where messages take no time, with link clocks kept."""
    found = []
    for any_microbatch, instant in ((False, None), (True, None), (False, False), (True, False)):
        rules = semantics.Rules(schedule, any_microbatch=any_microbatch)
        run = semantics.Wires(rules, timing)
        if instant is not None:
            run.instant = instant
        run.run([semantics._timed(run, rank) for rank in range(schedule.num_ranks)])
        events = semantics.Timeline(rules, timing, run.starts).events()
        found.append((run.stuck(), run.clock, run.dp_free, run.busy, events))
    return found


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_replay_paths_agree_on_generated_and_broken_schedules(name: str) -> None:
    """Ids to the count and for any micro-batch, and instant messages without link clocks and with
    them, time every schedule alike, deadlocked ones included (integer times, as bfpp-sim's)."""
    rng = random.Random(name)
    compute, lowered = _small_pair(name)
    instant = Timing(forward=2, backward=4, backward_input=2, backward_weight=2, p2p=0, transfer=0)
    timed = Timing(forward=2, backward=4, backward_input=2, backward_weight=2, p2p=1, transfer=3)
    stuck = 0
    for base in (compute, lowered):
        for _ in range(30):
            schedule = _mutated(base, rng)
            first, *others = _replays(schedule, instant)
            assert all(other == first for other in others)
            stuck += bool(first[0])
            first, *others = _replays(schedule, timed)
            assert all(other == first for other in others)
    assert stuck > 5


def test_replay_takes_micro_batches_past_the_count() -> None:
    """The list of arrivals ends at ``num_microbatches``; a schedule naming more reruns on the
    dict and times every message apart, as before."""
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    narrow = Schedule(schedule.layout, 1, schedule.per_rank)  # claims one micro-batch
    for timing in (Timing(), Timing(forward=1, backward=2, p2p=0, transfer=0)):
        wide, cut = replay(schedule, timing), replay(narrow, timing)
        assert not cut.blocked
        assert (cut.compute_end, cut.busy, cut.events) == (wide.compute_end, wide.busy, wide.events)


def test_a_message_to_another_rank_than_the_neighbour_stages_reaches_nobody() -> None:
    rows = ["0F0 0SA0>2 0RG0<1 0B0", "1RA0<0 1F0 1SA0>2 1RG0<2 1B0 1SG0>0", "2RA0<1 2F0 2B0 2SG0>1"]
    schedule = parse_schedule(rows, layout=StageLayout.looped(3), num_microbatches=1)
    assert replay(schedule).blocked == {
        0: (3, Message("grad", 1, 0)),
        1: (1, Message("act", 0, 0)),
        2: (1, Message("act", 1, 0)),
    }


# --- compute_ends is replay's clock ----------------------------------------------------------


# bpipe's moves and dualpipe-v's overlapped pairs are replay's alone (compute_ends refuses them)
@pytest.mark.parametrize("name", sorted(set(SCHEDULES) - {"bpipe", "dualpipe-v"}))
def test_compute_ends_are_the_ends_of_replay_compute_events(name: str) -> None:
    chunks = 3 if SCHEDULES[name].placement == "looped" else None
    schedule = build_schedule(name, num_ranks=4, num_microbatches=8, num_chunks=chunks, lower=False)
    timing = Timing(forward=1.5, backward=2.5, backward_input=1.25, backward_weight=1.25, p2p=0.3)
    ends, blocked = compute_ends(schedule, timing)
    run = replay(schedule, timing)
    assert not blocked and not run.blocked
    for rank in range(schedule.num_ranks):
        events = [e.end for e in run.events if e.rank == rank and e.lane == "compute"]
        assert ends[rank] == events


def test_compute_ends_keep_micro_batches_past_the_count_apart() -> None:
    """Its flat per-message lists are sized by the micro-batches the actions name, not by
    ``num_microbatches``, so a schedule that names more still times every message apart."""
    rows = ["0F0 0F1 0F2 0B2 0B1 0B0", "1F0 1F1 1F2 1B2 1B1 1B0"]
    schedule = parse_schedule(rows, layout=StageLayout.looped(2), num_microbatches=3)
    narrow = Schedule(schedule.layout, 1, schedule.per_rank)  # claims one micro-batch
    timing = Timing(forward=1.0, backward=2.0, p2p=0.5)
    ends, blocked = compute_ends(narrow, timing)
    assert not blocked
    assert ends == compute_ends(schedule, timing).ends
    assert ends[1] == [2.5, 3.5, 4.5, 6.5, 8.5, 10.5]


def test_compute_ends_refuse_a_stage_outside_the_layout() -> None:
    schedule = Schedule(
        StageLayout.looped(2), 1, ((Action(0, K.FORWARD, 0),), (Action(5, K.FORWARD, 0),))
    )
    with pytest.raises(ScheduleError, match="outside the layout"):
        compute_ends(schedule)


def test_compute_ends_take_compute_only_schedules() -> None:
    lowered = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="compute-only schedule of F, B, I and W"):
        compute_ends(lowered)
    rows = ["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"]
    stuck = parse_schedule(rows, layout=StageLayout.looped(2), num_microbatches=2)
    ends, blocked = compute_ends(stuck)
    assert blocked == {0: (1, Message("grad", 1, 0)), 1: (0, Message("act", 0, 1))}
    assert ends == [[1.0], []]
