"""bfpp-sim end to end, as a user runs it: real processes, files on disk, exit codes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bfpp.ir import dump_csv, load_csv
from megatron_bfpp.schedules.registry import build_schedule
from tests.growth import peak_bytes, python_lines


def bfpp_sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli.sim", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_breadth_first_json_png_trace(tmp_path: Path) -> None:
    png, trace = tmp_path / "bf.png", tmp_path / "bf.json"
    result = bfpp_sim(
        "--schedule",
        "breadth-first",
        "--pp",
        "4",
        "--vp",
        "2",
        "--microbatches",
        "8",
        "--png",
        str(png),
        "--trace",
        str(trace),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for key in (
        "schedule",
        "num_ranks",
        "num_chunks",
        "num_microbatches",
        "step_time",
        "bubble_fraction",
        "exposed_dp_comm_time",
        "per_rank",
    ):
        assert key in data
    assert data["schedule"] == "breadth-first"
    assert (data["num_ranks"], data["num_chunks"], data["num_microbatches"]) == (4, 2, 8)
    # (p-1)/(v*m) of the ideal 8 * 3 time units: step = 24 * (1 + 3/16) = 28.5.
    assert data["step_time"] == pytest.approx(28.5)
    assert [r["rank"] for r in data["per_rank"]] == [0, 1, 2, 3]
    assert {"busy_time", "bubble_fraction", "peak_activations"} <= set(data["per_rank"][0])
    assert data["per_rank"][0]["peak_activations"] == pytest.approx(8.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("ph") == "X" and e.get("name", "")[-2:-1] != "S") > 0


def test_a_large_schedules_default_grid_is_one_line() -> None:
    """pp 16, m 512: 16,384 compute actions, past the default grid's 4,096 (a pp 64 one printed
    15 MB); --grid compute still prints all of it."""
    args = ("--schedule", "1f1b", "--pp", "16", "--microbatches", "512")
    result = bfpp_sim(*args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().splitlines()[-1] == (
        "grid not printed: 16,384 compute actions (more than 4,096); --grid compute or "
        "--grid full prints it"
    )
    asked = bfpp_sim(*args, "--grid", "compute")
    assert asked.returncode == 0, asked.stderr
    assert "\nrank 15: 15F0 " in asked.stdout
    assert len(asked.stdout) > 10 * len(result.stdout)


def test_readable_table_and_grid() -> None:
    result = bfpp_sim("--schedule", "1f1b", "--pp", "4", "--microbatches", "8")
    assert result.returncode == 0, result.stderr
    assert "bubble 27.27%" in result.stdout  # (p-1)/(m+p-1) = 3/11
    assert "rank  0: 0F0" in result.stdout
    assert "SA" not in result.stdout.split("rank  0:")[1].splitlines()[0]  # compute grid


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--schedule", "interleaved", "--pp", "4", "--vp", "2", "--microbatches", "6"],
            "got 6 % 4 = 2",
        ),
        (["--schedule", "breadth-first", "--pp", "4", "--microbatches", "8"], "--vp"),
        (["--schedule", "warp", "--pp", "4", "--microbatches", "8"], "invalid choice: 'warp'"),
        (["--schedule", "1f1b", "--pp", "0", "--microbatches", "8"], "positive integer"),
        (["--schedule", "1f1b", "--microbatches", "4"], "missing --pp"),
        (
            ["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--group-size", "2"],
            "1f1b takes no --group-size",
        ),
        (
            ["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--t-forward", "-1"],
            "expected a number >= 0",
        ),
        (["--load-csv", "/nonexistent/x.csv"], "cannot read schedule CSV"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(args: list[str], message: str) -> None:
    result = bfpp_sim(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr


def test_malformed_csv_names_the_row(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("layout,0,1\nmicrobatches,1\n0,0F0,0SA0>1\n1,1RA0<0,1Fx\n")
    result = bfpp_sim("--load-csv", str(path))
    assert result.returncode == 2
    assert "row 4, column 3" in result.stderr


def test_a_csv_parking_activations_on_another_rank_than_the_partner_is_one_line(
    tmp_path: Path,
) -> None:
    # A file whose order is correct and NCCL-safe, but whose evictions go to rank 2, not to
    # rank 0's BPipe partner 3: the runtime has no process group for that pair, so bfpp-sim
    # refuses to time it, naming the file and the fix, as the runtime refuses to run it.
    from megatron_bfpp.passes.grad_sync import add_grad_sync
    from tests.unit.test_nccl import WRONG_PARTNER

    path = tmp_path / "wrong_partner.csv"
    dump_csv(add_grad_sync(WRONG_PARTNER), path)
    result = bfpp_sim("--load-csv", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(path) in lines[0] and "give rank 0 the partner 3" in lines[0]


def test_csv_round_trip_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "v.csv"
    result = bfpp_sim(
        "--schedule", "v-half", "--pp", "4", "--microbatches", "8", "--csv", str(out), "--json"
    )
    assert result.returncode == 0, result.stderr
    again = bfpp_sim("--load-csv", str(out), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["step_time"] == json.loads(result.stdout)["step_time"]


def test_torch_compute_only_csv_is_lowered_and_simulated(tmp_path: Path) -> None:
    compute = build_schedule("1f1b", num_ranks=4, num_microbatches=8, lower=False)
    path = tmp_path / "torch.csv"
    path.write_text("\n".join(",".join(str(a) for a in row) for row in compute.per_rank) + "\n")
    result = bfpp_sim("--load-csv", str(path), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["bubble_fraction"] == pytest.approx(3 / 11)


def test_golden_csvs_still_build_identically(tmp_path: Path) -> None:
    golden = Path(__file__).resolve().parents[1] / "golden"
    paths = sorted(golden.glob("*.csv"))
    assert len(paths) >= 6, "golden schedules missing"
    for path in paths:
        stored = load_csv(path)
        name, rest = path.stem.split("__")
        params = dict(part.split("=") for part in rest.split("_"))
        rebuilt = build_schedule(
            name,
            num_ranks=int(params["pp"]),
            num_microbatches=int(params["m"]),
            num_chunks=int(params["vp"]) if "vp" in params else None,
        )
        assert rebuilt == stored, f"{path.name} changed; regenerate only if the change is meant"
        dump_csv(rebuilt, tmp_path / path.name)
        assert (tmp_path / path.name).read_text() == path.read_text()


@pytest.mark.skipif(shutil.which("bfpp-sim") is None, reason="console script not on PATH")
def test_console_script_is_installed() -> None:
    result = subprocess.run(["bfpp-sim", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "--pipeline-schedule" not in result.stdout and "--schedule" in result.stdout


def test_full_sharding_holds_two_chunks_and_is_breadth_first_only(tmp_path: Path) -> None:
    """--data-parallel-sharding-strategy optim_grads_params: two chunks of four whole per rank
    (peak par. and peak grad 0.5 of a full stage against 1.0 unsharded), and interleaved, which
    the runtime refuses fully sharded, is refused here too in one line."""
    runs = {}
    for name, strategy in (
        ("breadth-first", "optim_grads_params"),
        ("breadth-first", "optim"),
    ):
        result = bfpp_sim(
            *("--schedule", name, "--pp", "4", "--vp", "4", "--microbatches", "16"),
            *("--t-param-gather", "1", "--t-grad-reduce", "1", "--json"),
            *("--data-parallel-sharding-strategy", strategy),
        )
        assert result.returncode == 0, result.stderr
        runs[name, strategy] = json.loads(result.stdout)
    sharded, dense = runs["breadth-first", "optim_grads_params"], runs["breadth-first", "optim"]
    for key in ("peak_parameters", "peak_gradients"):
        assert [r[key] for r in sharded["per_rank"]] == [0.5] * 4
        assert [r[key] for r in dense["per_rank"]] == [1.0] * 4
    text = bfpp_sim(
        *("--schedule", "breadth-first", "--pp", "2", "--vp", "4", "--microbatches", "4"),
        *("--data-parallel-sharding-strategy", "optim_grads_params", "--grid", "full"),
    )
    assert text.returncode == 0, text.stderr
    assert "peak grad" in text.stdout and "0RL" in text.stdout and "4PS" in text.stdout
    depth = bfpp_sim(
        *("--schedule", "interleaved", "--pp", "4", "--vp", "4", "--microbatches", "16"),
        *("--data-parallel-sharding-strategy", "optim_grads_params"),
    )
    assert depth.returncode == 2
    assert depth.stderr.count("needs breadth-first") == 1
    assert len(depth.stderr.strip().splitlines()) == 1
    bad = bfpp_sim("--schedule", "1f1b", "--pp", "2", "--microbatches", "2",
                   "--data-parallel-sharding-strategy", "zero3")  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.count("invalid choice") == 1


HUGE = "9" * 20


@pytest.mark.parametrize(
    "content, message",
    [
        (
            b"\x89PNG\r\n\x1a\n\x00\xff binary",
            "row 1: byte 0x89 (offset 0) is not UTF-8 text; a schedule CSV is UTF-8 text, is "
            "this the right file?",
        ),
        (
            b"layout,0\nmicrobatches,1\n0,0F0," + b"x" * (129 * 1024) + b"\n",
            "row 3: a cell is longer than 131072 characters (csv's field size limit); schedule "
            "cells are short actions such as '3F5', is this the right file?",
        ),
        (
            f"0F0,{HUGE}F0\n".encode(),
            f"row 1, column 2: '{HUGE}F0': stage '999999999999...' is out of range (at most "
            "999999999)",
        ),
        (
            f"0F0,0F{HUGE},0B0\n".encode(),
            f"row 1, column 2: '0F{HUGE}': micro-batch '999999999999...' is out of range (at "
            "most 999999999)",
        ),
        (
            f"layout,0,1\nmicrobatches,1\n0,0F0,0SA0>{HUGE}\n1,1F0\n".encode(),
            f"row 3, column 3: cannot parse action '0SA0>{HUGE}': peer rank '999999999999...' is "
            "out of range (at most 999999999)",
        ),
        (
            f"layout,0,{HUGE}\nmicrobatches,1\n0,0F0\n".encode(),
            "row 1, column 3: rank '999999999999...' is out of range: every rank holds stages, "
            "so ranks run 0..(number of stages - 1) at most",
        ),
        (
            f"layout,0\nmicrobatches,{HUGE}\n0,0F0,0B0\n".encode(),
            "row 2: the 'microbatches' row needs one integer from 1 to 999999999, got "
            "'999999999999...'",
        ),
        (
            b"layout,0\nmicrobatches,0\n0,0F0,0B0\n",
            "row 2: the 'microbatches' row needs one integer from 1 to 999999999, got '0'",
        ),
        (
            b"layout,0,1\nmicrobatches,3\n0,0F0,0F2,0B0,0B2\n1,1F0,1F1,1F2,1F3,1B0,1B1,1B2\n",
            "the 'microbatches' row (row 2) says 3, so every stage needs forwards for "
            "micro-batches 0..2, each once: stage 0 (row 3) misses 1; stage 1 (row 4) has extra 3",
        ),
        (
            b"0F0,0F1,0F2,0B0,0B1,0B2\n1F1,1F2,1F3,1B0,1B1,1B2\n",
            "2 of 2 stages run forwards for 3 micro-batches, so every stage needs forwards for "
            "micro-batches 0..2, each once: stage 1 (row 2) misses 0 and has extra 3",
        ),
        (
            b"layout,0,1\nmicrobatches,2\n0,0F0,0F1,1F0,0B0,0B1\n1,1F0,1F1,1B0,1B1\n",
            "row 3, column 4: '1F0': stage 1 lives on rank 1 (row 4), not on this row's rank 0; "
            "move it to that row",
        ),
        (
            b"layout,0,1\nmicrobatches,2\n0,0F0,0F1,0B0,0B1\n1,1F0,1F1,1B0,1B1,0B1\n",
            "row 4, column 6: '0B1': stage 0 lives on rank 0 (row 3), not on this row's rank 1; "
            "move it to that row",
        ),
    ],
    ids=[
        "binary",
        "oversized-cell",
        "huge-stage-torch",
        "huge-microbatch-torch",
        "huge-peer",
        "huge-layout-rank",
        "huge-microbatch-count",
        "zero-microbatch-count",
        "missing-and-extra-microbatch",
        "renumbered-microbatches-torch",
        "forward-on-another-ranks-row",
        "backward-on-another-ranks-row",
    ],
)
def test_bad_csv_is_one_line_naming_file_and_row(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    result = bfpp_sim("--load-csv", str(path))
    assert result.returncode == 2
    assert result.stderr == f"bfpp-sim: error: {path}: {message}\n"


def test_csv_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + b"0F0,0F1,0B0,0B1\n,1F0,1F1,1B0,1B1\n")
    result = bfpp_sim("--load-csv", str(path), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["num_microbatches"] == 2


def test_csvs_torch_writes_run_through_the_cli(tmp_path: Path) -> None:
    """Generated by torch itself: DualPipeV's lowered CSV (OVERLAP_F_B groups, UNSHARD /
    RESHARD, REDUCE_GRAD, messages), GPipe's compute-only order with REDUCE_GRAD, and torch
    2.13's Schedule1F1B order, whose last stage runs forwards 1..m (refused in one line)."""
    pytest.importorskip("torch.distributed.pipelining")
    from torch.distributed.pipelining import schedules as torch_schedules

    from tests import torch_pipelining as tp

    dual = tp.build(
        torch_schedules.ScheduleDualPipeV, num_ranks=2, num_microbatches=4, stages_per_rank=2
    )
    path = tp.dump(dual, tmp_path / "dualpipev.csv")
    assert "OVERLAP_F_B" in path.read_text()
    result = bfpp_sim("--load-csv", str(path), "--json", "--t-p2p", "0.25")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["schedule"], data["num_ranks"], data["num_chunks"]) == ("torch-csv", 2, 2)
    gpipe = tp.build(torch_schedules.ScheduleGPipe, num_ranks=4, num_microbatches=8)
    path = tp.dump(gpipe, tmp_path / "gpipe.csv", "compute_only")
    result = bfpp_sim("--load-csv", str(path), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["bubble_fraction"] == pytest.approx(3 / 11)
    one_f_one_b = tp.build(torch_schedules.Schedule1F1B, num_ranks=2, num_microbatches=4)
    path = tp.dump(one_f_one_b, tmp_path / "1f1b.csv", "compute_only")
    result = bfpp_sim("--load-csv", str(path))
    if result.returncode != 0:  # torch's order is wrong (2.13): the one line says where
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1
        assert "stage 1 (row 2) misses 0 and has extra 4" in result.stderr


def test_our_csv_posting_messages_out_of_order_is_refused_not_repaired(tmp_path: Path) -> None:
    """Rank 1 posts its two receives in the other order: under posting-order matching the two
    activations would be swapped, so a file in our own format is refused with the validator's
    line (torch's format, which matches by tag, gets its messages derived again:
    tests/unit/test_torch_csv.py); unpaired messages are refused too."""
    path = tmp_path / "swapped.csv"
    rows = [
        "0,0F0,0SA0>1,0F1,0SA1>1,0RG0<1,0B0,0RG1<1,0B1",
        "1,1RA1<0,1RA0<0,1F0,1B0,1SG0>0,1F1,1B1,1SG1>0",
    ]
    path.write_text("layout,0,1\nmicrobatches,2\n" + "\n".join(rows) + "\n")
    swapped = bfpp_sim("--load-csv", str(path), "--grid", "none")
    assert swapped.returncode == 2
    assert "message order differs between ranks 0 -> 1" in swapped.stderr
    path.write_text("layout,0,1\nmicrobatches,2\n" + rows[0] + "\n" + rows[1][:-8] + "\n")
    result = bfpp_sim("--load-csv", str(path))
    assert result.returncode == 2
    assert result.stderr.startswith(f"bfpp-sim: error: {path}: ")
    assert result.stderr.count("\n") == 1


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("bfpp-sim: error: ") and "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("flag", "where", "message"),
    [
        ("--png", "/proc/x.png", "--png /proc/x.png: cannot write files in /proc ("),
        (
            "--trace",
            "{tmp}/missing/t.json",
            "--trace {tmp}/missing/t.json: directory {tmp}/missing",
        ),
        ("--csv", "{tmp}/file/x.csv", "--csv {tmp}/file/x.csv: {tmp}/file is not a directory"),
        ("--csv", "{tmp}", "--csv {tmp}: is a directory"),
    ],
    ids=["proc", "missing-directory", "under-a-file", "a-directory"],
)
def test_unwritable_outputs_fail_before_any_work(
    tmp_path: Path, flag: str, where: str, message: str
) -> None:
    """Checked before the schedule is built: nothing is written, not even the outputs that
    could have been (they used to be written, then the bad one raised after simulating)."""
    (tmp_path / "file").write_text("x")
    good = tmp_path / "good.json"
    result = bfpp_sim(
        *("--schedule", "1f1b", "--pp", "4", "--microbatches", "8"),
        *("--trace" if flag != "--trace" else "--csv", str(good)),
        *(flag, where.format(tmp=tmp_path)),
    )
    assert message.format(tmp=tmp_path) in _one_error_line(result)
    assert not good.exists()
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--schedule", "1f1b", "--pp", "4", "--microbatches", "99999999999"],
            "schedule too large: pp=4 x 1 stage(s) per rank x 99999999999 micro-batches is about "
            "2,799,999,999,980 actions and 1,960,000.0 GB (limit 4,000,000 actions, about a "
            "minute and 2.8 GB); use fewer micro-batches, ranks or stages per rank",
        ),
        (
            ["--schedule", "1f1b", "--pp", "100000", "--microbatches", "8"],
            "is about 5,800,000 actions and 4.1 GB (limit 4,000,000 actions",
        ),
        (
            ["--schedule", "1f1b", "--pp", "100000", "--microbatches", "1"],
            "needs per-rank tables of ranks x stages = 10,000,000,000 entries, about 320.0 GB",
        ),
        (
            ["--schedule", "1f1b", "--pp", "3000", "--microbatches", "1", "--png", "x.png"],
            "--png with pp=3000: drawing takes about 28 s (10 ms per rank; limit 2048 ranks)",
        ),
    ],
    ids=["microbatches", "pp-actions", "pp-tables", "png-ranks"],
)
def test_too_large_is_refused_at_once_with_the_estimate(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first used to grow to 24 GB, the others ran for minutes: now the refusal comes
    before anything of the schedule's size is built (bounded lines and bytes, in-process)."""
    from megatron_bfpp.cli import sim as cli_sim

    codes: list[object] = []

    def refused() -> None:
        try:
            codes.append(cli_sim.main(args))
        except SystemExit as exit:
            codes.append(exit.code)

    assert python_lines(refused) < 100_000
    assert peak_bytes(refused) < 10_000_000
    assert codes == [2, 2]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0] == lines[1], lines
    assert message in lines[0]


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_costs_are_refused_by_the_parser(value: str) -> None:
    result = bfpp_sim("--schedule", "1f1b", "--pp", "2", "--microbatches", "2", f"--t-p2p={value}")
    assert f"argument --t-p2p: expected a finite number, got '{value}'" in _one_error_line(result)


def test_overflowing_costs_are_refused_and_json_stays_strict(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    result = bfpp_sim(
        *("--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--json"),
        *("--t-forward", "1e308", "--t-backward", "1e308", "--trace", str(trace)),
    )
    assert "the costs overflow: the step time is inf" in _one_error_line(result)
    assert result.stdout == "" and not trace.exists()


def test_json_is_strict() -> None:
    def refuse(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    result = bfpp_sim(
        *("--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--json"),
        *("--t-forward", "0", "--t-backward", "0", "--t-weight", "0"),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout, parse_constant=refuse)
    assert data["step_time"] == 0.0 and data["bubble_fraction"] == 0.0


def test_help_shows_defaults() -> None:
    result = bfpp_sim("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--t-forward T_FORWARD forward time (default: 1.0)" in text
    assert "(default: compute)" in text


def test_json_step_time_is_exact() -> None:
    """Stages of 1/3 used to sum to 12.999999999999996; the simulator now times in integers."""
    result = bfpp_sim(
        *("--schedule", "interleaved", "--pp", "2", "--vp", "3", "--microbatches", "4", "--json")
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step_time"] == 13
    assert '"step_time": 13.0,' in result.stdout


def test_nccl_safety_as_written_and_as_run(tmp_path: Path) -> None:
    """``--nccl`` says whether a schedule's order is safe on NCCL as written and as the runtime
    posts it; with ``--load-csv`` (ours, or torch's DualPipeV as torch dumps it) always."""
    result = bfpp_sim("--schedule", "v-zb", "--pp", "2", "--microbatches", "3", "--nccl")
    assert result.returncode == 0, result.stderr
    assert "NCCL, as written: NOT NCCL-safe: v-zb deadlocks on NCCL" in result.stdout
    assert "rank 0's batch #5 [S grad3.1>1] sends grad3.1" in result.stdout
    assert "NCCL, as bfpp runs it (lock-step): NCCL-safe" in result.stdout
    plain = bfpp_sim("--schedule", "v-zb", "--pp", "2", "--microbatches", "3", "--json")
    assert "nccl" not in json.loads(plain.stdout)  # only when asked: large schedules cost
    path = tmp_path / "1f1b.csv"
    dump_csv(build_schedule("1f1b", num_ranks=4, num_microbatches=8), path)
    nccl = json.loads(bfpp_sim("--load-csv", str(path), "--json").stdout)["nccl"]
    assert nccl == {
        "as_written": {"safe": True, "problem": None},
        "lock_step": {"safe": True, "problem": None},
    }
    pytest.importorskip("torch.distributed.pipelining")
    from torch.distributed.pipelining import schedules as torch_schedules

    from tests import torch_pipelining as tp

    dual = tp.build(
        torch_schedules.ScheduleDualPipeV, num_ranks=2, num_microbatches=4, stages_per_rank=2
    )
    result = bfpp_sim("--load-csv", str(tp.dump(dual, tmp_path / "dualpipev.csv")), "--json")
    assert result.returncode == 0, result.stderr
    verdicts = json.loads(result.stdout)["nccl"]
    assert verdicts["lock_step"]["safe"] is True
    assert isinstance(verdicts["as_written"]["safe"], bool)


@pytest.mark.parametrize(
    "command",
    [
        ["megatron_bfpp.cli.sim", "--schedule", "breadth-first", "--pp", "8", "--vp", "4",
         "--microbatches", "64"],
        ["megatron_bfpp.cli.sim", "--schedule", "1f1b", "--pp", "64", "--microbatches", "64",
         "--json"],
        ["megatron_bfpp.cli.plan", "recommend", "--model", "gpt3-6.7b", "--num-gpus", "8",
         "--gpus-per-node", "8", "--gpu", "a100-80gb", "--global-batch-size", "8"],
    ],
    ids=["sim-table", "sim-json", "plan-recommend"],
)  # fmt: skip
def test_a_reader_that_closes_the_pipe_ends_it_quietly(command: list[str]) -> None:
    """``bfpp-sim ... | head -1``: the reader is gone (here before the first line is written,
    while the command still imports); the command ends with exit 141 (what a shell shows for
    SIGPIPE) and nothing on stderr, not a BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    code = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert err == "", err
    assert code == 141


def test_defaults_that_depend_on_the_schedule_are_said() -> None:
    """``--microbatches`` defaults to 2 x pp; bpipe's ``--t-evict`` to a quarter of a forward, so
    its transfers take time and show (at 0 its picture was exactly 1F1B's); both are reported."""
    result = bfpp_sim("--schedule", "bpipe", "--pp", "4", "--grid", "none")
    assert result.returncode == 0, result.stderr
    assert "micro-batches=8" in result.stdout
    assert "default microbatches: 8 (2 x pp; set --microbatches)" in result.stdout
    assert "default t_evict: 0.25 (bpipe's default; set --t-evict)" in result.stdout
    data = json.loads(bfpp_sim("--schedule", "bpipe", "--pp", "4", "--json").stdout)
    assert data["costs"]["t_evict"] == 0.25 and set(data["defaults_used"]) == {
        "microbatches",
        "t_evict",
    }
    assert data["units"]["peak_activations"].startswith("micro-batches through one full 1F1B")
    given = json.loads(
        bfpp_sim("--schedule", "1f1b", "--pp", "4", "--microbatches", "6", "--json").stdout
    )
    assert given["costs"]["t_evict"] == 0.0 and "defaults_used" not in given


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("early", r"rank 0, step \d+: 0GS: starts stage 0's gradient reduction before its last "
         r"backward \(0B1 at step \d+\)"),
        ("twice", r"rank 0, step \d+: 0GS: reduces stage 0's gradients a second time"),
        ("missing", r"rank 0, step \d+: 0B1: the last backward of stage 0 is followed by no GS"),
        ("none", r"rank 0, step \d+: 0B1: the last backward of stage 0 is followed by no GS"),
    ],
)  # fmt: skip
def test_csv_with_misplaced_gradient_sync_is_refused(
    tmp_path: Path, case: str, message: str
) -> None:
    """A lowered CSV whose GS comes before its chunk's last backward, twice, or not at all
    (here or on every chunk) used to simulate, cheaper where GS was missing."""
    built = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    rank0 = [str(a) for a in built.per_rank[0]]
    assert rank0[-1] == "0GS"
    edited = {
        "early": [*rank0[:-3], "0GS", *rank0[-3:-1]],
        "twice": [*rank0, "0GS"],
        "missing": rank0[:-1],
        "none": [a for a in rank0 if a[1:] not in ("GS", "PS")],
    }[case]
    rank1 = [str(a) for a in built.per_rank[1]]
    if case == "none":
        rank1 = [a for a in rank1 if a[1:] not in ("GS", "PS")]
    path = tmp_path / "gs.csv"
    path.write_text(
        "layout,0,1\nmicrobatches,2\n" + ",".join(["0", *edited]) + "\n"
        + ",".join(["1", *rank1]) + "\n"
    )  # fmt: skip
    line = _one_error_line(bfpp_sim("--load-csv", str(path)))
    assert re.search(message, line), line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("flag", ["--csv", "--trace"])
def test_an_output_on_a_full_device_is_one_line_naming_its_flag(flag: str) -> None:
    """Written in place (never replaced), and its failure named: it was a bare `[Errno 28]`.
    (``--png`` on devices: tests/unit/test_files.py, on device nodes of its own: matplotlib
    used to add ``.png`` to a path without a suffix, here ``/dev/full.png``.)"""
    proc = bfpp_sim("--schedule", "1f1b", "--pp", "2", "--grid", "none", flag, "/dev/full")
    assert proc.returncode == 2
    assert proc.stderr == (
        f"bfpp-sim: error: {flag} /dev/full: cannot write it (No space left on device)\n"
    )
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full")
