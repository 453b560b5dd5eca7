"""Overlapped pairs (``OVERLAP_F_B``, ``3F5&1B2``): one composite action made of a forward and a
backward of another micro-batch. Its text and CSV round trip; ``passes.fuse_overlapped`` makes
them out of an existing schedule; the validator, the NCCL proof, the timing models and the memory
walks read them through the composite rule (``semantics``): a pair waits for what both parts wait
for, lasts the sum of their durations and holds the forward's activations before the backward
frees its own."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Composite,
    Schedule,
    ScheduleError,
    StageLayout,
    dump_csv_text,
    format_schedule,
    load_csv_text,
    parse_action,
    parse_schedule,
    parts,
    primitives,
)
from megatron_bfpp.nccl import TICKS, validate_nccl
from megatron_bfpp.passes import add_communication, add_grad_sync
from megatron_bfpp.passes.overlap import fuse_overlapped, overlap_pairs
from megatron_bfpp.plan.memory import peak_points
from megatron_bfpp.program import compiled
from megatron_bfpp.schedules.registry import build_schedule
from megatron_bfpp.semantics import Timing, action_duration, replay, stage_durations
from megatron_bfpp.sim import simulate
from megatron_bfpp.sim.cost import CostModel
from megatron_bfpp.validate import validate_deadlock_free, validate_schedule

K = ActionKind
F, B = K.FORWARD, K.BACKWARD


def _built(name: str, **sizes: int) -> Schedule:
    sizes = {"num_ranks": 4, "num_microbatches": 8, **sizes}
    return build_schedule(name, **sizes)


# --- the IR -----------------------------------------------------------------------------------


def test_a_pair_prints_as_its_parts_and_parses_back() -> None:
    pair = parse_action("3F5&1B2")
    assert type(pair) is Composite and pair.kind is K.OVERLAP_F_B
    assert pair.parts == (Action(3, F, 5), Action(1, B, 2)) == parts(pair)
    assert (pair.stage, pair.microbatch, pair.peer) == (3, 5, None)  # its forward's
    assert str(pair) == "3F5&1B2" and repr(pair) == "Composite(3F5&1B2)"
    assert pair == Composite(Action(3, F, 5), Action(1, B, 2))
    assert hash(pair) == hash(parse_action(" 3F5&1B2 "))
    assert pair != Action(3, F, 5) and pair != parse_action("3F5&1B3")
    assert pickle.loads(pickle.dumps(pair)) == pair
    assert parse_action("0F1&0I0").parts[1] == Action(0, K.BACKWARD_INPUT, 0)
    assert K.OVERLAP_F_B.is_compute and parts(Action(0, F, 0)) == (Action(0, F, 0),)


@pytest.mark.parametrize(
    "text, message",
    [
        ("3F5&1B5", "different micro-batches"),
        ("1B2&3F5", "a forward and then a backward"),
        ("3F5&1W2", "a forward and then a backward"),
        ("3F5&1SA2>0", "a forward and then a backward"),
        ("3F5&", "two actions joined by '&'"),
        ("3F5&1B2&0F1", "two actions joined by '&'"),
        ("3F&B5", "FORWARD needs a micro-batch"),
    ],
)
def test_a_bad_pair_is_one_line_naming_it(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as error:
        parse_action(text)
    assert "\n" not in str(error.value)


def test_a_pair_is_made_of_plain_actions_only() -> None:
    with pytest.raises(ScheduleError, match="made of its parts"):
        Action(0, K.OVERLAP_F_B, 1)
    with pytest.raises(ScheduleError, match="a forward and then a backward"):
        Composite(parse_action("3F5&1B2"), Action(1, B, 3))


def test_primitives_put_a_pairs_parts_at_its_position() -> None:
    program = tuple(map(parse_action, ["0F0", "0F1&0B0", "0B1"]))
    assert list(primitives(program)) == [
        (0, Action(0, F, 0)),
        (1, Action(0, F, 1)),
        (1, Action(0, B, 0)),
        (2, Action(0, B, 1)),
    ]
    plain = program[:1]
    assert list(primitives(plain)) == list(enumerate(plain))


@pytest.mark.parametrize("name", ["1f1b", "v-half", "interleaved"])
def test_a_fused_schedule_round_trips_through_text_and_csv(name: str) -> None:
    fused = fuse_overlapped(_built(name, **({"num_chunks": 2} if name == "interleaved" else {})))
    assert any(a.kind is K.OVERLAP_F_B for actions in fused.per_rank for a in actions)
    assert load_csv_text(dump_csv_text(fused)) == fused
    rows = [" ".join(map(str, actions)) for actions in fused.per_rank]
    layout, m = fused.layout, fused.num_microbatches
    assert parse_schedule(rows, layout=layout, num_microbatches=m, name=fused.name) == fused


def test_a_csv_pair_is_checked_part_by_part() -> None:
    text = "layout,0,1\nmicrobatches,2\n0,0F0,0F1&1B0\n1,1F0,1B0,1F1,1B1\n"
    with pytest.raises(ScheduleError, match=r"row 3, column 3: '0F1&1B0': stage 1 lives on rank 1"):
        load_csv_text(text)
    text = "layout,0\nmicrobatches,2\n0,0F0,0F1&0B7,0B1\n"
    with pytest.raises(ScheduleError, match="micro-batch 7 does not exist"):
        load_csv_text(text)


# --- fusing -----------------------------------------------------------------------------------


def test_fusing_1f1b_pairs_its_steady_state_and_moves_messages_around_each_pair() -> None:
    plain = _built("1f1b", num_ranks=3, num_microbatches=4)
    assert [f"{f}&{b}" for f, b in overlap_pairs(plain)] == [
        "0F2&0B0",
        "0F3&0B1",
        "1F1&1B0",
        "1F2&1B1",
        "1F3&1B2",
    ]  # the last rank runs each micro-batch's F and B back to back: nothing to pair
    fused = fuse_overlapped(plain)
    assert " ".join(map(str, fused.per_rank[1])) == (
        "1PS 1RA0<0 1F0 1SA0>2 1RA1<0 1RG0<2 1F1&1B0 1SA1>2 1SG0>0 1RA2<0 1RG1<2 1F2&1B1 "
        "1SA2>2 1SG1>0 1RA3<0 1RG2<2 1F3&1B2 1SA3>2 1SG2>0 1RG3<2 1B3 1SG3>0 1GS"
    )  # receives before each pair, sends after it
    assert fused.per_rank[2] == plain.per_rank[2]


@pytest.mark.parametrize("name", ["1f1b", "v-half"])
def test_fusing_the_compute_order_then_lowering_equals_fusing_the_lowered_schedule(
    name: str,
) -> None:
    compute = build_schedule(name, num_ranks=4, num_microbatches=8, lower=False)
    fused = fuse_overlapped(compute)
    validate_schedule(fused, require_communication=False)
    lowered = add_grad_sync(add_communication(fused))
    assert lowered == fuse_overlapped(_built(name), overlap_pairs(compute))


def test_overlap_pairs_skips_a_pair_that_would_close_a_cycle_of_waits() -> None:
    """GPipe's rank 0 runs its last forward, then its first backward: as one action that
    backward's gradient would wait for the forward's activation to go round the pipeline."""
    gpipe = _built("gpipe", num_ranks=2, num_microbatches=3)
    assert overlap_pairs(gpipe) == [(Action(1, F, 2), Action(1, B, 0))]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_deadlock_free(fuse_overlapped(gpipe, [(Action(0, F, 2), Action(0, B, 0))]))


@pytest.mark.parametrize(
    "pair, message",
    [
        (("0F1", "0B0"), "0F1&0B0: 0F2 runs between them on rank 0"),
        (("0F2", "1B0"), "0F2 runs on rank 0 and 1B0 on rank 1"),
        (("0F9", "0B0"), "0F9 not in the schedule"),
        (("0F2", "0B2"), "different micro-batches"),
    ],
)
def test_a_pair_that_cannot_fuse_is_one_line(pair: tuple[str, str], message: str) -> None:
    plain = _built("1f1b", num_ranks=3, num_microbatches=4)
    with pytest.raises(ScheduleError, match=message) as error:
        fuse_overlapped(plain, [(parse_action(pair[0]), parse_action(pair[1]))])
    assert "\n" not in str(error.value)
    twice = [(Action(0, F, 2), Action(0, B, 0))] * 2
    with pytest.raises(ScheduleError, match="each action fuses once"):
        fuse_overlapped(plain, twice)


def test_sharded_parameters_refuse_pairs_with_one_line() -> None:
    compute = fuse_overlapped(build_schedule("1f1b", num_ranks=2, num_microbatches=4, lower=False))
    with pytest.raises(ScheduleError, match="use sharding='optim'"):
        add_grad_sync(add_communication(compute), sharding="optim_grads_params")


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["1f1b", "v-half", "interleaved"])
def test_validation_accepts_a_fused_schedule_under_gloo_and_nccl_rules(name: str) -> None:
    fused = fuse_overlapped(_built(name, **({"num_chunks": 2} if name == "interleaved" else {})))
    validate_schedule(fused, require_grad_sync=True)  # the NCCL proof of its posting included
    validate_nccl(fused)


def test_a_deadlocking_pair_is_rejected_on_the_grid() -> None:
    gpipe = fuse_overlapped(
        _built("gpipe", num_ranks=2, num_microbatches=3), [(Action(0, F, 2), Action(0, B, 0))]
    )
    with pytest.raises(ScheduleError) as error:
        validate_schedule(gpipe)
    first, *grid = str(error.value).splitlines()
    assert first == "deadlock: every remaining rank waits for a message that is never sent first"
    assert "0F2&0B0" in grid[0] and "waits for grad 1/0" in "\n".join(grid)


@pytest.mark.parametrize(
    "rows, message",
    [
        (["0F1&0B0 0F0 0B1"], "rank 0, step 0: 0B0 of 0F1&0B0: backward before its forward"),
        (["0F0 0F1&0B0 0B1 0F1"], "0F1 appears twice"),
    ],
)
def test_a_bad_part_is_named_with_its_pair(rows: list[str], message: str) -> None:
    schedule = parse_schedule(rows, layout=StageLayout.looped(1), num_microbatches=2)
    with pytest.raises(ScheduleError, match=message) as error:
        validate_schedule(schedule, require_communication=False)
    assert "<--" in str(error.value)  # the grid, with the step marked


def test_a_part_on_another_ranks_stage_is_named() -> None:
    schedule = parse_schedule(
        ["0F0 0F1&1B0 0B0 0B1", "1F0 1F1 1B1"], layout=StageLayout.looped(2), num_microbatches=2
    )
    with pytest.raises(ScheduleError, match="rank 0, step 1: 1B0 of 0F1&1B0: stage 1 lives on"):
        validate_schedule(schedule, require_communication=False)


def test_a_pair_waits_for_both_parts_inputs_before_either_runs() -> None:
    """Compute-only, pp=2: rank 0's 0F1 feeds rank 1's pair, whose 1B0 feeds rank 0's pair.
    Apart the four run (0F1 sends at once); as pairs each waits for the other's output."""
    layout = StageLayout.looped(2)
    apart = parse_schedule(
        ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"], layout=layout, num_microbatches=2
    )
    validate_schedule(apart, require_communication=False)
    paired = parse_schedule(
        ["0F0 0F1&0B0 0B1", "1F0 1F1&1B0 1B1"], layout=layout, num_microbatches=2
    )
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(paired, require_communication=False)
    blocked = {rank: (at, tuple(message)) for rank, (at, message) in replay(paired).blocked.items()}
    assert blocked == {0: (1, ("grad", 1, 0)), 1: (1, ("act", 0, 1))}  # each at its pair
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(add_grad_sync(add_communication(paired)))


# --- timing and memory ------------------------------------------------------------------------


def _ends(events: Any) -> dict[str, float]:
    """When each plain compute's result exists: its event's end (a pair's: the pair's)."""
    ends = {}
    for event in events:
        if event.lane == "compute":
            for part in parts(parse_action(event.label)):
                ends[str(part)] = event.end
    return ends


def test_a_pair_starts_once_both_inputs_are_in_and_lasts_both_durations() -> None:
    """Gloo's rules, instant messages: every compute, pair or not, starts at the later of its
    rank's previous end and the ends of the computes whose results its parts consume, and a
    pair lasts t_forward + t_backward. In 1F1B's fused steady state that makes rank r's pair wait
    for the gradient rank r + 1 sends only after its own pair: each steady-state micro-batch
    becomes a chain over the ranks, 54 time units instead of 33 at pp=4, m=8."""
    plain, fused = _built("1f1b"), fuse_overlapped(_built("1f1b"))
    costs = CostModel(t_forward=1.0, t_backward=2.0)
    result = simulate(fused, costs, p2p="gloo")
    ends, last = _ends(result.events), 3
    previous: dict[int, float] = {}
    for event in (e for e in result.events if e.lane == "compute"):
        inputs = [previous.get(event.rank, 0.0)]
        for part in parts(parse_action(event.label)):
            s, mb = part.stage, part.microbatch
            if part.kind is F and s > 0:
                inputs.append(ends[f"{s - 1}F{mb}"])
            if part.kind is B and s < last:
                inputs.append(ends[f"{s + 1}B{mb}"])
        assert event.start == max(inputs), event.label
        durations = [1.0 if part.kind is F else 2.0 for part in parts(parse_action(event.label))]
        assert event.end - event.start == sum(durations)
        previous[event.rank] = event.end
    assert result.step_time == 54 and simulate(plain, costs, p2p="gloo").step_time == 33


@pytest.mark.parametrize("p2p", ["gloo", "lockstep"])
def test_where_every_pairs_inputs_are_in_time_the_step_is_the_same(p2p: str) -> None:
    """Interleaved, pp=4, vp=2, m=8: every pair's backward input has arrived by the time its
    forward would start, so summing the two durations changes nothing."""
    plain = _built("interleaved", num_chunks=2)
    fused = fuse_overlapped(plain)
    assert len(overlap_pairs(plain)) == 28
    assert simulate(fused, p2p=p2p).step_time == simulate(plain, p2p=p2p).step_time == 28.5


@pytest.mark.parametrize("p2p", ["gloo", "lockstep"])
def test_a_pair_is_one_compute_event_of_both_durations(p2p: str) -> None:
    fused = fuse_overlapped(_built("v-half"))
    costs = CostModel(t_forward=1.0, t_backward=3.0, t_weight=1.0, t_p2p=0.25)
    pairs = [e for e in simulate(fused, costs, p2p=p2p).events if e.kind is K.OVERLAP_F_B]
    assert len(pairs) == 10
    for event in pairs:
        assert event.lane == "compute" and "&" in event.label
        # v-half's chunks hold half a stage: F 0.5 and I (t_backward - t_weight) 1.0
        assert event.end - event.start == pytest.approx(1.5)


@pytest.mark.parametrize("name", ["1f1b", "v-half", "interleaved"])
def test_fusing_keeps_every_ranks_activation_peak(name: str) -> None:
    plain = _built(name, **({"num_chunks": 2} if name == "interleaved" else {}))
    fused = fuse_overlapped(plain)
    assert fused.peak_activations() == plain.peak_activations()
    assert peak_points(fused) == peak_points(plain)  # the planner's walk
    for p2p in ("gloo", "lockstep"):
        assert (
            simulate(fused, p2p=p2p).peak_activations == simulate(plain, p2p=p2p).peak_activations
        )


def test_a_pair_holds_its_forwards_activations_before_its_backward_frees_its_own() -> None:
    schedule = parse_schedule(["0F0 0F1&0B0 0B1"], layout=StageLayout.looped(1), num_microbatches=2)
    assert schedule.stored_activations(0) == (1, 2, 0)
    assert simulate(schedule, p2p="gloo").peak_activations == (2,)


def test_the_lock_step_replay_gives_a_pair_both_parts_ticks() -> None:
    ticks = {kind: (tick,) * 6 for kind, tick in TICKS.items()}  # the same on every stage
    assert action_duration(ticks, parse_action("3F5&1B2")) == TICKS[F] + TICKS[B] == 3
    assert action_duration(stage_durations(Timing(), 6), parse_action("3F5&1I2")) == 2.0


def test_megatron_cores_own_posting_refuses_pairs_outside_its_combined_1f1b() -> None:
    with pytest.raises(ScheduleError, match=r"runs overlapped pairs \(F&B\) only in interleaved"):
        simulate(fuse_overlapped(_built("1f1b")), p2p="megatron")


def test_a_fused_timeline_draws(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from megatron_bfpp.sim.export import chrome_trace, render_png

    result = simulate(fuse_overlapped(_built("1f1b")))
    assert render_png(result, tmp_path / "fused.png").stat().st_size > 0
    names = {event["name"] for event in chrome_trace(result)["traceEvents"]}
    assert "0F3&0B0" in names
    assert format_schedule(fuse_overlapped(_built("1f1b"))).count("&") == 18


def test_the_compiled_program_answers_for_a_pair_by_its_parts() -> None:
    """``Program.wait_of`` (the integer form of ``Rules``' tables that the lock-step replay and
    the NCCL model read) gives a pair its parts' inputs."""
    fused = fuse_overlapped(_built("1f1b", num_ranks=3, num_microbatches=4))
    pair = parse_action("1F1&1B0")
    position = fused.per_rank[1].index(pair)
    wanted = [("act", 0, 1), ("grad", 2, 0)]
    program = compiled(fused)
    assert program.wait[1][position] == -1  # none of its own: its parts'
    assert [tuple(program.message_of(program.wait_of(p))) for p in parts(pair)] == wanted
