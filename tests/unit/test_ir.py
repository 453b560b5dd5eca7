"""The IR: action text round trips, layouts, memory counting, CSV in both formats."""

from __future__ import annotations

import dataclasses
import gc
import pickle
from pathlib import Path

import pytest

from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    StageLayout,
    dump_csv,
    dump_csv_text,
    format_schedule,
    load_csv,
    load_csv_text,
    parse_action,
    parse_schedule,
    paused_gc,
    unchecked_action,
)

K = ActionKind


@pytest.mark.parametrize(
    "text, action",
    [
        ("3F5", Action(3, K.FORWARD, 5)),
        ("0B0", Action(0, K.BACKWARD, 0)),
        ("2I7", Action(2, K.BACKWARD_INPUT, 7)),
        ("2W7", Action(2, K.BACKWARD_WEIGHT, 7)),
        ("0SA5>1", Action(0, K.SEND_ACT, 5, 1)),
        ("1RA5<0", Action(1, K.RECV_ACT, 5, 0)),
        ("4SG12>3", Action(4, K.SEND_GRAD, 12, 3)),
        ("3RG12<4", Action(3, K.RECV_GRAD, 12, 4)),
        ("0EV3>7", Action(0, K.EVICT, 3, 7)),
        ("0AC3<0", Action(0, K.ACCEPT, 3, 0)),
        ("0RS3>0", Action(0, K.RESTORE, 3, 0)),
        ("0LD3<7", Action(0, K.LOAD, 3, 7)),
        ("2GS", Action(2, K.GRAD_SYNC)),
        ("11PS", Action(11, K.PARAM_SYNC)),
    ],
)
def test_action_text_round_trip(text: str, action: Action) -> None:
    assert parse_action(text) == action
    assert str(action) == text


@pytest.mark.parametrize(
    "bad", ["", "F5", "3X5", "3F", "3SA5", "3SA5<1", "3RA5>1", "3GS4", "-1F0", "3F5>1", "abc"]
)
def test_parse_action_rejects_malformed_text(bad: str) -> None:
    with pytest.raises(ScheduleError):
        parse_action(bad)


def test_action_constructor_checks_fields() -> None:
    with pytest.raises(ScheduleError, match="micro-batch"):
        Action(0, K.FORWARD)
    with pytest.raises(ScheduleError, match="peer"):
        Action(0, K.SEND_ACT, 0)
    with pytest.raises(ScheduleError, match="drop the peer"):
        Action(0, K.FORWARD, 0, 1)
    with pytest.raises(ScheduleError, match="per chunk"):
        Action(0, K.GRAD_SYNC, 0)


def test_unchecked_action_is_an_ordinary_action() -> None:
    for action in (Action(3, K.FORWARD, 5), Action(0, K.SEND_ACT, 5, 1), Action(2, K.GRAD_SYNC)):
        fast = unchecked_action(action.stage, action.kind, action.microbatch, action.peer)
        assert type(fast) is Action
        assert fast == action and hash(fast) == hash(action) and str(fast) == str(action)
        assert not fast < action and not action < fast
        assert pickle.loads(pickle.dumps(fast)) == action
    with pytest.raises(dataclasses.FrozenInstanceError):
        unchecked_action(0, K.FORWARD, 0).stage = 1  # type: ignore[misc]
    # Only the checked constructor validates; replace() goes through it.
    with pytest.raises(ScheduleError, match="drop the peer"):
        dataclasses.replace(Action(0, K.FORWARD, 0), peer=1)


def test_paused_gc_restores_the_collector_state() -> None:
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError
    assert gc.isenabled()


def test_looped_and_v_layouts() -> None:
    looped = StageLayout.looped(4, 2)
    assert looped.stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    assert looped.stages_of(1) == (1, 5)
    assert looped.chunk_of(5) == 1
    assert looped.stage_fraction == 0.5
    assert looped.kind == "looped"
    v = StageLayout.v_shape(4)
    assert v.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert v.stages_of(0) == (0, 7)
    assert v.stage_of(rank=3, chunk=1) == 4
    assert v.kind == "v-shape"
    assert StageLayout((1, 0)).kind == "custom"


@pytest.mark.parametrize("bad", [(), (0, 2), (0, 0, 1), (1, 1)])
def test_layout_rejects_uneven_or_gappy_placement(bad: tuple[int, ...]) -> None:
    with pytest.raises(ScheduleError):
        StageLayout(bad)


def test_stored_activations_of_literal_1f1b() -> None:
    schedule = parse_schedule(
        ["0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"],
        layout=StageLayout.looped(2),
        num_microbatches=3,
    )
    assert schedule.stored_activations(0) == (1, 2, 1, 2, 1, 0)
    assert schedule.peak_activations() == (2, 1)


def test_stored_activations_count_split_backward_until_w_and_eviction() -> None:
    schedule = parse_schedule(
        ["0F0 0F1 0EV1>1 0I0 0W0 0LD1<1 0I1 0W1", "0AC1<0 0RS1>0 1F0 1I0 1W0 1F1 1I1 1W1"],
        layout=StageLayout.looped(2),
        num_microbatches=2,
    )
    # I keeps the activations (W still needs its inputs); W frees them.
    assert schedule.stored_activations(0) == (1, 2, 1, 1, 0, 1, 1, 0)
    assert schedule.stored_activations(1)[:2] == (1, 0)


def test_schedule_rejects_rank_count_mismatch() -> None:
    with pytest.raises(ScheduleError, match="rank programs"):
        Schedule(StageLayout.looped(2), 1, ((),))


def test_format_schedule_marks_failing_step() -> None:
    schedule = parse_schedule(["0F0 0B0"], layout=StageLayout.looped(1), num_microbatches=1)
    text = format_schedule(schedule, marks={(0, 1): "ERROR HERE"})
    assert "rank  0: 0F0 0B0" in text
    assert "^^^ <-- ERROR HERE" in text


def _sample() -> Schedule:
    return parse_schedule(
        ["0PS 0F0 0SA0>1 0RG0<1 0B0 0GS", "1PS 1RA0<0 1F0 1B0 1SG0>0 1GS"],
        layout=StageLayout.looped(2),
        num_microbatches=1,
        name="1f1b",
    )


def test_csv_round_trip(tmp_path: Path) -> None:
    schedule = _sample()
    path = tmp_path / "s.csv"
    dump_csv(schedule, path)
    assert load_csv(path) == schedule
    assert load_csv_text(dump_csv_text(schedule)) == schedule


def test_csv_malformed_row_is_named() -> None:
    text = "layout,0,1\nmicrobatches,1\n0,0F0,0Q0\n1,1F0\n"
    with pytest.raises(ScheduleError, match=r"row 3, column 3: .*'0Q0'"):
        load_csv_text(text, source="x.csv")
    with pytest.raises(ScheduleError, match="row 3: expected rank 0"):
        load_csv_text("layout,0\nmicrobatches,1\n5,0F0\n")
    with pytest.raises(ScheduleError, match="missing 'layout' or 'microbatches'"):
        load_csv_text("layout,0\n0,0F0\n")


def test_load_csv_reports_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match="cannot read"):
        load_csv(tmp_path / "nope.csv")


def test_torch_compute_only_csv_infers_looped_layout() -> None:
    # What torch.distributed.pipelining's _dump_csv writes for ScheduleInterleaved1F1B-like
    # orders: one row per rank, empty cells for idle steps, stages looped over 2 ranks.
    text = "0F0,0F1,2F0,,2F1,2B0,,2B1,0B0,0B1\n,1F0,1F1,3F0,3B0,3F1,3B1,1B0,1B1\n"
    schedule = load_csv_text(text)
    assert schedule.layout == StageLayout.looped(2, 2)
    assert schedule.num_microbatches == 2
    assert [str(a) for a in schedule.per_rank[1][:3]] == ["1F0", "1F1", "3F0"]


def test_torch_csv_infers_v_layout_and_rejects_comm_actions() -> None:
    text = "0F0,3F0,3I0,3W0,0I0,0W0\n1F0,2F0,2I0,2W0,1I0,1W0\n"
    assert load_csv_text(text).layout == StageLayout.v_shape(2)
    with pytest.raises(ScheduleError, match="row 1, column 2: '0SEND_F0' is not a compute"):
        load_csv_text("0F0,0SEND_F0\n")
    with pytest.raises(ScheduleError, match="stage 0 also appears on rank 0"):
        load_csv_text("0F0\n0F1\n")
