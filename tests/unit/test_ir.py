"""The IR: action text round trips, layouts, memory counting, CSV in both formats."""

from __future__ import annotations

import dataclasses
import gc
import pickle
from pathlib import Path

import pytest

from megatron_bfpp.ir import (
    MAX_ACTIONS,
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
    assert v.rank_of(4) == 3 and v.chunk_of(4) == 1  # rank 3's second chunk
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


def test_torch_csv_infers_v_layout_and_names_bad_cells() -> None:
    text = "0F0,3F0,3I0,3W0,0I0,0W0\n1F0,2F0,2I0,2W0,1I0,1W0\n"
    assert load_csv_text(text).layout == StageLayout.v_shape(2)
    with pytest.raises(ScheduleError, match=r"row 1, column 2: '0SEND_F0': stage 0 has no next"):
        load_csv_text("0F0,0SEND_F0\n")
    with pytest.raises(ScheduleError, match=r"row 1, column 2: '0FOO0' is not one of torch's"):
        load_csv_text("0F0,0FOO0\n")
    with pytest.raises(ScheduleError, match=r"row 2, column 1: stage 0 also appears on rank 0"):
        load_csv_text("0F0\n0F1\n")


# --- CSV: torch's cells, mapped ----------------------------------------------------------------


def _texts(schedule: Schedule) -> list[list[str]]:
    return [[str(a) for a in actions] for actions in schedule.per_rank]


def test_torch_overlap_cells_become_pairs_and_compute_only_reduce_grad_is_dropped() -> None:
    # Shapes torch writes: DualPipeV's OVERLAP_F_B groups, GPipe's REDUCE_GRAD, idle cells.
    text = (
        "0F0,0F1,3F0,(0F2;3B0)OVERLAP_F_B,3F1,3B1,3F2,3B2,0B0,0B1,0B2,0REDUCE_GRAD,3REDUCE_GRAD\n"
        ",1F0,2F0,1F1,2B0,2F1,(1F2;2B1)OVERLAP_F_B,2F2,2B2,1B0,1B1,1B2\n"
    )
    schedule = load_csv_text(text)
    assert schedule.layout == StageLayout.v_shape(2)
    assert schedule.num_microbatches == 3
    # an OVERLAP_F_B group is our overlapped pair: it waits, lasts and sends as torch's group
    assert _texts(schedule)[0][3:5] == ["0F2&3B0", "3F1"]
    assert _texts(schedule)[1][5:7] == ["1F2&2B1", "2F2"]
    assert not any(a.kind is K.GRAD_SYNC for _, _, a in schedule.iter_actions())


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ("(0F1;3W0)OVERLAP_F_B", r"column 2: an overlapped pair is a forward and then a backward"),
        ("(0F0;3B0)OVERLAP_F_B", r"column 2: .*joins a forward and a backward of different"),
        ("(0F1;3B0;3F1)OVERLAP_F_B", r"column 2: '\(0F1;3B0;3F1\)OVERLAP_F_B': an OVERLAP_F_B "),
    ],
)
def test_a_torch_group_that_is_no_pair_is_one_line(cell: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as info:
        load_csv_text(f"0F0,{cell},0B0,0B1\n,1F0,2F0,1F1,2B0,2F1,2B1,1B0,1B1\n")
    assert "\n" not in str(info.value)


def test_torch_lowered_cells_map_to_ours_with_peers_from_the_layout() -> None:
    text = (
        "0UNSHARD,0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD,0RESHARD\n"
        "1UNSHARD,1RECV_F0,1F0,1B0,1SEND_B0,1REDUCE_GRAD,1RESHARD\n"
    )
    assert _texts(load_csv_text(text)) == [
        ["0PS", "0F0", "0SA0>1", "0RG0<1", "0B0", "0GS", "0RL"],
        ["1PS", "1RA0<0", "1F0", "1B0", "1SG0>0", "1GS", "1RL"],
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("0F0,0B0,0RECV_F0\n", r"column 3: '0RECV_F0': stage 0 has no previous stage"),
        ("0F0,0B0,0UNSHARD3\n", r"'0UNSHARD3': UNSHARD is per stage, without a micro-batch"),
        ("0F0,0B0,0SEND_F\n", r"'0SEND_F': SEND_F needs a micro-batch"),
        ("0F0,(0B0;0UNSHARD)OVERLAP_F_B\n", r"holds compute actions \(F, B, I, W\), not UNSHARD"),
        ("0F0,(0B0;0F1)MERGE\n", r"only OVERLAP_F_B groups actions, not MERGE"),
        ("0F0,1F0,0SEND_F0,1B0,0B0\n", r"'0SEND_F0': stages 0 and 1 are both on rank 0"),
    ],
)
def test_torch_cells_that_cannot_map_are_named(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        load_csv_text(text, source="t.csv")


# --- CSV: hostile and broken files: one line naming the file and the row ---------------------


def _one_line(error: pytest.ExceptionInfo[ScheduleError]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    ours = dump_csv_text(_sample())
    torch_text = "0F0,0B0\n,1F0,1B0\n"
    for name, text in (("ours.csv", ours), ("torch.csv", torch_text)):
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert load_csv(path) == load_csv_text(text)
        assert load_csv_text("\ufeff" + text) == load_csv_text(text)


def test_binary_file_names_the_byte_and_row(tmp_path: Path) -> None:
    path = tmp_path / "b.csv"
    path.write_bytes(b"layout,0\nmicrobatches,1\n0,0F0,\xff\xfe\n")
    with pytest.raises(ScheduleError) as error:
        load_csv(path)
    assert _one_line(error) == (
        f"{path}: row 3: byte 0xff (offset 30) is not UTF-8 text; a schedule CSV is UTF-8 "
        "text, is this the right file?"
    )
    path.write_bytes("0F0,0B0\n".encode("utf-16-le"))  # decodes as UTF-8, full of NULs
    with pytest.raises(ScheduleError, match=r"row 1: contains a NUL character"):
        load_csv(path)


def test_oversized_cell_is_one_line_not_a_csv_traceback() -> None:
    text = "layout,0\nmicrobatches,1\n0,0F0," + "x" * (129 * 1024) + "\n"
    with pytest.raises(ScheduleError) as error:
        load_csv_text(text, source="big.csv")
    assert _one_line(error).startswith("big.csv: row 3: a cell is longer than 131072 characters")
    with pytest.raises(ScheduleError, match=r"^big\.csv: row 2: a cell is longer"):
        load_csv_text('0F0,0B0\n0F1,"' + "y" * (200 * 1024), source="big.csv")


def test_a_csv_is_read_within_its_limits_in_linear_time(tmp_path: Path) -> None:
    """A 1 MB file of 20,000 rank rows hung (a count per rank: quadratic), /dev/zero grew to
    22 GB, and a 2 M-row file was read whole (31 s, 2 GB) before its row 6 was refused."""
    from megatron_bfpp.ir import MAX_CSV_BYTES, MAX_CSV_ROWS
    from megatron_bfpp.schedules.registry import MAX_ACTIONS as REGISTRY_MAX_ACTIONS
    from tests.growth import growth, python_lines

    assert MAX_ACTIONS == REGISTRY_MAX_ACTIONS  # one budget, in ir

    def torch_rows(n: int) -> None:  # torch's rows: a layout of n ranks is inferred
        load_csv_text("\n".join(f"{r}F0,{r}B0" for r in range(n)), source="wide.csv")

    assert growth(python_lines, torch_rows, 2_000) < 2.3
    many = tmp_path / "many.csv"
    many.write_text("layout,0\nmicrobatches,1\n" + "0,0F0\n" * (MAX_CSV_ROWS + 10))
    with pytest.raises(ScheduleError) as error:
        load_csv(many)
    assert _one_line(error).startswith(f"{many}: row {MAX_CSV_ROWS + 4}: more rows or cells")
    big = tmp_path / "big.csv"
    with open(big, "wb") as file:
        file.truncate(MAX_CSV_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ScheduleError, match=r"more than 64 MiB, more than a schedule of 4,000"):
        load_csv(big)
    with pytest.raises(ScheduleError, match="more than 64 MiB"):
        load_csv("/dev/zero")


HUGE = "9" * 20


@pytest.mark.parametrize(
    "text, message",
    [
        (
            f"layout,0\nmicrobatches,1\n0,{HUGE}F0\n",
            f"x.csv: row 3, column 2: cannot parse action '{HUGE}F0': stage '999999999999...' "
            "is out of range (at most 999999999)",
        ),
        (
            f"layout,0\nmicrobatches,1\n0,0F{HUGE}\n",
            f"x.csv: row 3, column 2: cannot parse action '0F{HUGE}': micro-batch "
            "'999999999999...' is out of range (at most 999999999)",
        ),
        (
            f"layout,0,1\nmicrobatches,1\n0,0F0,0SA0>{HUGE}\n1,1F0\n",
            f"x.csv: row 3, column 3: cannot parse action '0SA0>{HUGE}': peer rank "
            "'999999999999...' is out of range (at most 999999999)",
        ),
        (
            "layout,0\nmicrobatches,1\n0,0F0,5B0\n",
            "x.csv: row 3, column 3: '5B0': stage 5 does not exist (the layout has 1)",
        ),
        (
            "layout,0,1\nmicrobatches,1\n0,0F0,0SA0>7\n1,1F0\n",
            "x.csv: row 3, column 3: '0SA0>7': peer rank 7 does not exist (the layout has 2)",
        ),
        (
            "layout,0\nmicrobatches,2\n0,0F0,0F1,0B0,0B1,0B5\n",
            "x.csv: row 3, column 6: '0B5': micro-batch 5 does not exist (the 'microbatches' row "
            "(row 2) says 2)",
        ),
        (
            f"layout,0,{HUGE}\nmicrobatches,1\n0,0F0\n",
            "x.csv: row 1, column 3: rank '999999999999...' is out of range: every rank holds "
            "stages, so ranks run 0..(number of stages - 1) at most",
        ),
        (
            f"0F0,{HUGE}F0\n",
            f"x.csv: row 1, column 2: '{HUGE}F0': stage '999999999999...' is out of range (at "
            "most 999999999)",
        ),
        (
            f"0F0,0F{HUGE},0B0\n",
            f"x.csv: row 1, column 2: '0F{HUGE}': micro-batch '999999999999...' is out of range "
            "(at most 999999999)",
        ),
        (
            "0F0,0B0,0F999999999\n",
            "x.csv: 1 of 1 stages run forwards for 2 micro-batches, so every stage needs forwards "
            "for micro-batches 0..1, each once: stage 0 (row 1) misses 1 and has extra 999999999",
        ),
        (
            "0F0,0B0\n1F0,1B0,5F0\n",
            "x.csv: no action names stage(s) 2..4, yet row 2, column 3 names stage 5: cannot "
            "infer the layout",
        ),
        ("0F0,0B0,０F1\n", "x.csv: row 1, column 3: '０F1' is not one of torch's actions"),
        ("layout,0\nmicrobatches,1\n²,0F0\n", "x.csv: row 3: expected rank 0 in the first cell"),
    ],
)
def test_out_of_range_indices_are_one_line(text: str, message: str) -> None:
    with pytest.raises(ScheduleError) as error:
        load_csv_text(text, source="x.csv")
    assert _one_line(error).startswith(message)


@pytest.mark.parametrize("value", ["0", "-1", "two", "2,3", "1000000000", HUGE, ""])
def test_bad_microbatch_count_is_one_line(value: str) -> None:
    with pytest.raises(ScheduleError) as error:
        load_csv_text(f"layout,0\nmicrobatches,{value}\n0,0F0,0B0\n", source="m.csv")
    assert _one_line(error).startswith(
        "m.csv: row 2: the 'microbatches' row needs one integer from 1 to 999999999, got "
    )


@pytest.mark.parametrize(
    "rows, problem",
    [
        ("0,0F0,0F2,0B0,0B2", "stage 0 (row 3) misses 1"),
        ("0,0F0,0F1,0F1,0F2,0B0,0B1,0B2", "stage 0 (row 3) repeats 1"),
        ("0,0F3,0B3", "stage 0 (row 3) misses 0..2 and has extra 3"),
        ("0,0F0,0F1,0F2,0F5,0F7,0B0,0B1,0B2", "stage 0 (row 3) has extra 5, 7"),
    ],
)
def test_every_stage_must_run_forwards_for_exactly_0_to_m_minus_1(rows: str, problem: str) -> None:
    with pytest.raises(ScheduleError) as error:
        load_csv_text(f"layout,0\nmicrobatches,3\n{rows}\n", source="f.csv")
    assert _one_line(error) == (
        "f.csv: the 'microbatches' row (row 2) says 3, so every stage needs forwards for "
        f"micro-batches 0..2, each once: {problem}"
    )


def test_a_stage_with_no_forwards_and_a_huge_count_are_named_without_building_range_m() -> None:
    text = "layout,0,1\nmicrobatches,999999999\n0,0F0,0B0\n1,1F0,1B0\n"
    with pytest.raises(ScheduleError) as error:
        load_csv_text(text, source="h.csv")
    assert _one_line(error).endswith(
        "stage 0 (row 3) misses 1..999999998; stage 1 (row 4) misses 1..999999998"
    )
    text = "layout,0,0\nmicrobatches,1\n0,0F0,0B0\n"
    with pytest.raises(ScheduleError, match=r"stage 1 \(row 3\) misses 0$"):
        load_csv_text(text, source="h.csv")


def test_layout_with_a_huge_rank_is_refused_without_hanging() -> None:
    with pytest.raises(ScheduleError, match="every rank used"):
        StageLayout((0, 10**30))


def test_header_problems_name_the_row() -> None:
    with pytest.raises(ScheduleError, match=r"^d.csv: row 3: a second 'layout' row \(the first"):
        load_csv_text("layout,0\nmicrobatches,1\nlayout,0\n0,0F0,0B0\n", source="d.csv")
    with pytest.raises(ScheduleError, match=r"^d.csv: 2 rank rows, but the 'layout' row \(row 1"):
        load_csv_text("layout,0\nmicrobatches,1\n0,0F0,0B0\n1,0F0\n", source="d.csv")
    with pytest.raises(ScheduleError, match=r"^d.csv: row 1: every rank must hold the same"):
        load_csv_text("layout,0,1,1\nmicrobatches,1\n0,0F0\n1,1F0\n", source="d.csv")
    with pytest.raises(ScheduleError, match=r"^d.csv: row 1, column 3: the 'layout' row lists"):
        load_csv_text("layout,0,x\nmicrobatches,1\n0,0F0\n", source="d.csv")


def test_rows_are_file_rows_blank_lines_included() -> None:
    text = "layout,0,1\n\nmicrobatches,1\n\n0,0F0,0SA0>1,0RG0<1,0B0\n1,1RA0<0,1Fx\n"
    with pytest.raises(ScheduleError, match=r"^<csv>: row 6, column 3: cannot parse action '1Fx'"):
        load_csv_text(text)


def test_parse_action_takes_ascii_digits_only() -> None:
    with pytest.raises(ScheduleError, match="cannot parse action"):
        parse_action("３F0")
    with pytest.raises(ScheduleError, match=r"stage '1{12}\.\.\.' is out of range"):
        parse_action("1" * 5000 + "F0")
