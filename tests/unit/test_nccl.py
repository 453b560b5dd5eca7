"""NCCL's rules: the lock-step posting the runtime uses, and the model that proves postings."""

from __future__ import annotations

from typing import Any

import pytest

from megatron_bfpp.ir import ActionKind, Schedule, ScheduleError, StageLayout, parse_schedule
from megatron_bfpp.nccl import (
    Batch,
    Item,
    Posting,
    check_posting,
    check_side_pairs,
    lockstep_posting,
    nccl_report,
    validate_nccl,
    written_posting,
)
from megatron_bfpp.schedules.registry import build_schedule, forward_only_schedule, get_spec
from megatron_bfpp.validate import validate_schedule

LOOPED2 = StageLayout.looped(2)
ONE_F_ONE_B = parse_schedule(
    [
        "0F0 0SA0>1 0F1 0SA1>1 0RG0<1 0B0 0RG1<1 0B1",
        "1RA0<0 1F0 1B0 1SG0>0 1RA1<0 1F1 1B1 1SG1>0",
    ],
    layout=LOOPED2,
    num_microbatches=2,
)


def _posting(rows: list[list[Any]]) -> Posting:
    """Literal postings: an int is a position, a list of positions is one batch."""
    return Posting(
        "by hand",
        tuple(
            tuple(
                Batch(-1, tuple(Item(p) for p in step)) if isinstance(step, list) else step
                for step in row
            )
            for row in rows
        ),
    )


# --- hand-made cases ----------------------------------------------------------------------------
def test_crossing_send_and_receive_batches_deadlock() -> None:
    # Rank 0 posts act 1 alone, then grad 0; rank 1 posts grad 0 alone, then act 1: each send
    # waits for a receive queued behind the other rank's send. Gloo would run it.
    crossing = _posting(
        [
            [0, [1], 2, [3], [4], 5, [6], 7],
            [[0], 1, 2, [3], [4], 5, 6, [7]],
        ]
    )
    with pytest.raises(ScheduleError) as error:
        check_posting(ONE_F_ONE_B, crossing)
    text = str(error.value)
    assert "deadlocks on NCCL when posted by hand" in text
    assert "rank 0's batch #1 [S act0.1>1] sends act0.1" in text
    assert "rank 1's batch #1 [S grad1.0>0] sends grad1.0" in text
    assert "queued behind" in text
    assert "NCCL: stuck" in text  # the grid marks the cycle
    assert "rank  1:" in text


def test_megatron_style_tick_batches_complete() -> None:
    # megatron-core's 1F1B: rank 1 sends grad 0 and receives act 1 in one batch, as rank 0
    # sends act 1 ... and receives grad 0 in one: the partners are in the same tick.
    per_tick = _posting(
        [
            [0, [1], 2, [3, 4], 5, [6], 7],
            [[0], 1, 2, [3, 4], 5, 6, [7]],
        ]
    )
    check_posting(ONE_F_ONE_B, per_tick)


def test_written_1f1b_is_safe_and_its_lockstep_pairs_ticks() -> None:
    check_posting(ONE_F_ONE_B, written_posting(ONE_F_ONE_B))
    posting = validate_nccl(ONE_F_ONE_B)
    ticks = [{b.tick: b for b in posting.batches(rank)} for rank in (0, 1)]
    assert set(ticks[0]) == set(ticks[1])  # every batch has its partner batch at its tick
    for tick, batch in ticks[0].items():
        sends = sum(ONE_F_ONE_B.per_rank[0][i.position].kind.is_send for i in batch.items)
        receives = sum(
            ONE_F_ONE_B.per_rank[1][i.position].kind.is_recv for i in ticks[1][tick].items
        )
        assert sends == receives


def test_three_rank_ring_is_reported_with_every_rank_in_the_cycle() -> None:
    schedule = build_schedule("interleaved", num_ranks=3, num_microbatches=6, num_chunks=2)
    with pytest.raises(ScheduleError) as error:
        check_posting(schedule, written_posting(schedule))
    cycle = str(error.value).split("\nrank  0:")[0]
    for rank in range(3):
        assert f"rank {rank}'s batch" in cycle
    validate_nccl(schedule)


def test_the_issue_v_zb_cycle() -> None:
    schedule = build_schedule("v-zb", num_ranks=2, num_microbatches=3)
    with pytest.raises(ScheduleError) as error:
        check_posting(schedule, written_posting(schedule))
    text = str(error.value)
    assert "rank 0's batch #5 [S grad3.1>1] sends grad3.1" in text
    assert "rank 1's batch #4 [S act2.2>0 R grad3.1<0] is queued behind its batch #3" in text
    validate_nccl(schedule)


def test_mismatched_channel_is_an_error_not_a_deadlock() -> None:
    swapped = parse_schedule(
        [
            "0F0 0SA0>1 0F1 0SA1>1 0RG0<1 0B0 0RG1<1 0B1",
            "1RA1<0 1RA0<0 1F0 1B0 1SG0>0 1F1 1B1 1SG1>0",
        ],
        layout=LOOPED2,
        num_microbatches=2,
    )
    with pytest.raises(ScheduleError, match=r"send #0 from rank 0 to rank 1 is act0\.0 but"):
        check_posting(swapped, written_posting(swapped))


# --- the lock-step posting ------------------------------------------------------------------------
def test_lockstep_places_each_batch_between_the_computes_around_its_tick() -> None:
    schedule = build_schedule("interleaved", num_ranks=2, num_microbatches=4, num_chunks=2)
    posting = lockstep_posting(schedule)
    for rank, steps in enumerate(posting.per_rank):
        program = schedule.per_rank[rank]
        positions = [s for s in steps if isinstance(s, int)]
        assert positions == sorted(positions)  # computes and GS / PS keep program order
        p2p = sorted(i.position for b in posting.batches(rank) for i in b.items if not i.rest)
        assert p2p == [i for i, a in enumerate(program) if a.kind.is_p2p]  # each exactly once
        ticks = [b.tick for b in posting.batches(rank)]
        assert ticks == sorted(set(ticks))  # one batch per tick, in tick order


# Rank 0 parks micro-batches 1-3 on rank 2, not on its BPipe partner 3: a schedule correct and
# NCCL-safe in itself (checked below), whose payloads have no process group in the runtime.
WRONG_PARTNER = parse_schedule(
    [
        "0F0 0SA0>1 0F1 0SA1>1 0EV1>2 0F2 0SA2>1 0EV2>2 0F3 0SA3>1 0RG0<1 0B0 0EV3>2 0LD1<2 "
        "0F4 0SA4>1 0RG1<1 0B1 0LD2<2 0RG2<1 0B2 0LD3<2 0RG3<1 0B3 0RG4<1 0B4",
        "1RA0<0 1F0 1SA0>2 1RA1<0 1F1 1SA1>2 1RA2<0 1F2 1SA2>2 1RG0<2 1B0 1SG0>0 1RA3<0 1F3 "
        "1SA3>2 1RG1<2 1B1 1SG1>0 1RA4<0 1F4 1SA4>2 1RG2<2 1B2 1SG2>0 1RG3<2 1B3 1SG3>0 "
        "1RG4<2 1B4 1SG4>0",
        "0AC1<0 0AC2<0 2RA0<1 2F0 2SA0>3 2RA1<1 2F1 2SA1>3 2RG0<3 2B0 2SG0>1 0RS1>0 0AC3<0 "
        "2RA2<1 2F2 2SA2>3 2RG1<3 2B1 2SG1>1 0RS2>0 2RA3<1 2F3 2SA3>3 2RG2<3 2B2 2SG2>1 "
        "0RS3>0 2RA4<1 2F4 2SA4>3 2RG3<3 2B3 2SG3>1 2RG4<3 2B4 2SG4>1",
        "3RA0<2 3F0 3B0 3SG0>2 3RA1<2 3F1 3B1 3SG1>2 3RA2<2 3F2 3B2 3SG2>2 3RA3<2 3F3 3B3 "
        "3SG3>2 3RA4<2 3F4 3B4 3SG4>2",
    ],
    layout=StageLayout.looped(4),
    num_microbatches=5,
)


def test_payloads_between_other_ranks_than_partners_are_refused_in_one_line() -> None:
    posting = lockstep_posting(WRONG_PARTNER)
    check_posting(WRONG_PARTNER, posting)  # NCCL-safe as posted: only the pairing is wrong
    assert posting.has_side
    with pytest.raises(ScheduleError) as error:
        check_side_pairs(WRONG_PARTNER, posting)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("0EV1>2 at position 4 of pipeline rank 0")
    assert "give rank 0 the partner 3" in message
    # the checks the runtime, validate_schedule and bfpp-sim's NCCL report go through
    with pytest.raises(ScheduleError, match="give rank 0 the partner 3"):
        validate_nccl(WRONG_PARTNER)
    with pytest.raises(ScheduleError, match="give rank 0 the partner 3"):
        validate_schedule(WRONG_PARTNER)
    report = nccl_report(WRONG_PARTNER)
    assert report["as_written"]["safe"] is True  # a file's own order: no pair groups there
    assert report["lock_step"] == {"safe": False, "problem": message}


@pytest.mark.parametrize("num_ranks", [4, 5, 6, 8])
def test_bpipe_payloads_run_between_partners(num_ranks: int) -> None:
    schedule = build_schedule("bpipe", num_ranks=num_ranks, num_microbatches=2 * num_ranks)
    posting = lockstep_posting(schedule)
    assert posting.has_side  # from pp 4 the cap ceil((p+2)/2) is below p: ranks evict
    check_side_pairs(schedule, posting)


def test_bpipe_eviction_size_then_payload_in_one_tick_returned_later() -> None:
    schedule = build_schedule("bpipe", num_ranks=4, num_microbatches=8)
    posting = lockstep_posting(schedule)
    tick_of: dict[tuple[str, int, int, bool], int] = {}
    for rank in range(4):
        program = schedule.per_rank[rank]
        for batch in posting.batches(rank):
            for item in batch.items:
                action = program[item.position]
                key = (action.kind.value, action.stage, action.microbatch or 0, item.rest)
                tick_of[key] = batch.tick
    evictions = [k for k in tick_of if k[0] == "EV" and not k[3]]
    assert evictions
    for _, stage, mb, _ in evictions:
        ev = tick_of[("EV", stage, mb, False)]
        assert tick_of[("AC", stage, mb, False)] == ev
        assert tick_of[("EV", stage, mb, True)] == tick_of[("AC", stage, mb, True)] == ev
        assert tick_of[("RS", stage, mb, False)] >= ev + 1
        assert tick_of[("LD", stage, mb, False)] == tick_of[("RS", stage, mb, False)]


def test_a_cpu_waiting_for_its_own_unposted_batch_is_reported_not_crashed() -> None:
    # An AC's payload is read only after its header: put both halves in one batch and the CPU
    # waits for that batch before posting it (the model once crashed explaining this cycle).
    schedule = build_schedule("bpipe", num_ranks=4, num_microbatches=8)
    posting = lockstep_posting(schedule)
    program = schedule.per_rank[3]
    row = list(posting.per_rank[3])
    at = next(
        i
        for i, step in enumerate(row)
        if isinstance(step, Batch)
        and any(program[item.position].kind is ActionKind.ACCEPT for item in step.items)
    )
    header, payload = row[at], row[at + 1]
    assert isinstance(header, Batch) and isinstance(payload, Batch) and payload.side
    row[at : at + 2] = [Batch(header.tick, header.items + payload.items)]
    merged = Posting("merged", (*posting.per_rank[:3], tuple(row)))
    with pytest.raises(ScheduleError) as error:
        check_posting(schedule, merged)
    cycle = str(error.value).split("\nrank  0:")[0]
    assert "bpipe deadlocks on NCCL when posted merged; the cycle of waits:" in cycle
    assert "rank 3 waits (after step" in cycle
    unposted = "rank 3's batch #0 (tick 3) [R act2.0<2 R evict0.2<0 R evict-payload0.2<0]"
    assert f"{unposted} is not posted yet" in cycle


def test_an_empty_batch_in_a_deadlock_is_named_not_crashed() -> None:
    # Rank 0 waits for an empty blocking batch queued behind its stuck send of act 1 (the
    # crossing case above): the cycle names the step before it (the model once indexed the
    # empty batch's first op).
    crossing = _posting(
        [
            [0, [1], 2, [3], [4], 5, [6], 7],
            [[0], 1, 2, [3], [4], 5, 6, [7]],
        ]
    )
    row = list(crossing.per_rank[0])
    row.insert(4, Batch(-1, (), blocking=True))
    with_empty = Posting("by hand", (tuple(row), crossing.per_rank[1]))
    with pytest.raises(ScheduleError) as error:
        check_posting(ONE_F_ONE_B, with_empty)
    cycle = str(error.value).split("\nrank  0:")[0]
    assert "rank 0 waits (after step 3) for its batch #2 []" in cycle
    assert "rank 0's batch #2 [] is queued behind its batch #1 [S act0.1>1]" in cycle


def test_a_schedule_the_gloo_rules_reject_has_no_lockstep_posting() -> None:
    stuck = parse_schedule(
        ["0RG0<1 0B0 0F0 0SA0>1", "1RA0<0 1F0 1B0 1SG0>0"],
        layout=LOOPED2,
        num_microbatches=1,
    )
    with pytest.raises(ScheduleError, match="no lock-step posting exists"):
        lockstep_posting(stuck)


# --- the catalogue --------------------------------------------------------------------------------
def _catalogue() -> list[tuple[str, int, int, int | None, dict[str, Any], str]]:
    cases = []
    for name in (
        "gpipe",
        "1f1b",
        "interleaved",
        "breadth-first",
        "bpipe",
        "v-min",
        "v-half",
        "v-zb",
    ):
        looped = get_spec(name).placement == "looped"
        for p in (2, 3, 4, 8):
            for m in sorted({p, p + 1, 2 * p, 2 * p + 1, 3 * p + 1}):
                for v in (2, 4) if looped else (None,):
                    options: list[dict[str, Any]] = [{}]
                    if name == "breadth-first":
                        options += [{"group_size": g} for g in sorted({1, 2, p}) if g < m]
                    if name == "interleaved":
                        options += [{"microbatch_group_size": m}]
                    if name == "bpipe":
                        options += [{"max_stored": c} for c in range(2, p + 1)]
                    for option in options:
                        for sharding in ("optim", "optim_grads_params"):
                            cases.append((name, p, m, v, option, sharding))
    return cases


def _build(
    name: str, p: int, m: int, v: int | None, option: dict[str, Any], sharding: str
) -> Schedule | None:
    try:
        return build_schedule(
            name, num_ranks=p, num_microbatches=m, num_chunks=v, sharding=sharding, **option
        )
    except ScheduleError:
        return None  # a layout the schedule does not take (the generators' tests cover those)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_every_catalogue_schedule_is_proven_nccl_safe_training_and_forward_only(p: int) -> None:
    proven = 0
    for name, ranks, m, v, option, sharding in _catalogue():
        if ranks != p:
            continue
        schedule = _build(name, ranks, m, v, option, sharding)
        if schedule is None:
            continue
        for planned in (schedule, forward_only_schedule(schedule)):
            validate_nccl(planned)
            proven += 1
    assert proven > 100


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "option"),
    [
        ("interleaved", 2, 4, 2, {}),
        ("breadth-first", 2, 3, 2, {}),
        ("v-half", 3, 4, None, {}),
        ("v-zb", 2, 3, None, {}),
    ],
)
def test_the_orders_that_crossed_as_written_are_proven_in_lockstep(
    name: str, p: int, m: int, v: int | None, option: dict[str, Any]
) -> None:
    schedule = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v, **option)
    with pytest.raises(ScheduleError, match="deadlocks on NCCL when posted as written"):
        check_posting(schedule, written_posting(schedule))
    validate_nccl(schedule)


def test_rest_items_belong_to_evictions_only() -> None:
    schedule = build_schedule("bpipe", num_ranks=4, num_microbatches=6, max_stored=2)
    posting = lockstep_posting(schedule)
    for rank in range(4):
        for batch in posting.batches(rank):
            for item in batch.items:
                if item.rest:
                    kind = schedule.per_rank[rank][item.position].kind
                    assert kind in (ActionKind.EVICT, ActionKind.ACCEPT)


# --- validation -----------------------------------------------------------------------------------
EVICT_THEN_LOAD = parse_schedule(
    [
        "0F0 0SA0>1 0EV0>1 0RG0<1 0LD0<1 0B0",
        "1RA0<0 0AC0<0 1F0 1B0 1SG0>0 0RS0>0",
    ],
    layout=LOOPED2,
    num_microbatches=1,
)


def test_an_eviction_loaded_back_before_the_next_compute_has_a_lockstep_posting() -> None:
    """Rank 0 evicts and loads back before its next compute, the backward that consumes the
    restore: the tick replay used to defer the eviction to that compute and wait forever (the
    partner's RS waits for the eviction); it settles deferred transfers where a rank waits."""
    posting = validate_nccl(EVICT_THEN_LOAD)
    ticks = {
        str(EVICT_THEN_LOAD.per_rank[r][i.position]) + "+" * i.rest: b.tick
        for r in (0, 1)
        for b in posting.batches(r)
        for i in b.items
    }
    assert ticks["0EV0>1"] == ticks["0AC0<0"] == 1  # rank 0's SA tick: AC was posted at 0
    assert ticks["0RS0>0"] == ticks["0LD0<1"] >= ticks["0EV0>1"] + 1


def test_validate_schedule_proves_the_lockstep_posting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation includes the NCCL proof of a lowered schedule (the one the runtime posts);
    build_schedule leaves it to the runtime and the simulator, a compute-only order has none."""
    import megatron_bfpp.validate as validate

    proven: list[str] = []

    def prove(schedule: Schedule) -> Posting:
        proven.append(schedule.name)
        return validate_nccl(schedule)

    monkeypatch.setattr(validate, "validate_nccl", prove)
    validate.validate_schedule(EVICT_THEN_LOAD)
    assert proven == ["custom"]
    validate.validate_schedule(EVICT_THEN_LOAD, nccl=False)
    validate.validate_schedule(EVICT_THEN_LOAD.compute_only(), require_communication=False)
    build_schedule("bpipe", num_ranks=4, num_microbatches=8)
    assert proven == ["custom"]


def test_the_runtime_keeps_no_model_after_its_proof() -> None:
    """A training process proves its posting once and never times it: the model's columns
    (0.4 GB at pp 64, m 1,024) are not held through training."""
    from megatron_bfpp import nccl
    from megatron_bfpp.runtime.executor import planned

    schedule = build_schedule("breadth-first", num_ranks=4, num_microbatches=8, num_chunks=2)
    nccl.check_posting(schedule, nccl.lockstep_posting(schedule))
    assert nccl._MODELS  # the proof alone keeps it for the simulator
    planned(schedule)
    assert nccl._MODELS == []
