"""What the three command lines share, alone: output paths checked before any work (and nothing
of the user's created or truncated by the check), strict JSON, finite numbers, and ``--help``
naming every default."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from megatron_bfpp.cli import plan as cli_plan
from megatron_bfpp.cli import sim as cli_sim
from megatron_bfpp.cli import train as cli_train
from megatron_bfpp.cli.common import (
    finite_float,
    json_text,
    non_negative_float,
    output_dir_problem,
    output_file_problem,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")


def _entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_a_new_file_in_an_existing_directory_is_fine_and_not_created(tmp_path: Path) -> None:
    assert output_file_problem("--png", str(tmp_path / "out.png")) is None
    assert _entries(tmp_path) == []  # the write test cleaned up after itself


def test_an_existing_file_is_neither_truncated_nor_touched(tmp_path: Path) -> None:
    existing = tmp_path / "metrics.jsonl"
    existing.write_text("kept\n")
    before = existing.stat().st_mtime_ns
    assert output_file_problem("--metrics-file", str(existing)) is None
    assert existing.read_text() == "kept\n"
    assert existing.stat().st_mtime_ns == before
    assert _entries(tmp_path) == ["metrics.jsonl"]


@pytest.mark.parametrize(
    ("relative", "expected"),
    [
        ("missing/out.csv", "--csv {path}: directory {root}/missing does not exist"),
        ("file/out.csv", "--csv {path}: {root}/file is not a directory"),
        ("dir", "--csv {path}: is a directory"),
    ],
    ids=["missing-directory", "under-a-regular-file", "a-directory"],
)
def test_unwritable_file_paths_are_named(tmp_path: Path, relative: str, expected: str) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    path = str(tmp_path / relative)
    assert output_file_problem("--csv", path) == expected.format(path=path, root=tmp_path)


@linux_only
def test_a_file_under_proc_is_refused() -> None:
    problem = output_file_problem("--png", "/proc/x.png")
    assert problem is not None and problem.startswith(
        "--png /proc/x.png: cannot write files in /proc ("
    )


def test_a_fifo_without_reader_does_not_block_the_check(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    problem = output_file_problem("--trace", str(fifo))
    assert problem is not None and problem.startswith(f"--trace {fifo}: cannot write {fifo} (")


def test_a_device_is_fine_and_untouched() -> None:
    assert output_file_problem("--pipeline-schedule-auto-report", os.devnull) is None
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)


def test_a_symlinked_output_is_checked_where_it_leads(tmp_path: Path) -> None:
    dangling = tmp_path / "report.json"
    dangling.symlink_to(tmp_path / "missing" / "report.json")
    assert output_file_problem("--plot", str(dangling)) == (
        f"--plot {dangling}: directory {tmp_path / 'missing'} does not exist"
    )
    (tmp_path / "missing").mkdir()
    assert output_file_problem("--plot", str(dangling)) is None
    assert _entries(tmp_path / "missing") == []
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    expected = "a symbolic link that loops (too many levels of symbolic links); point it at a"
    assert output_file_problem("--csv", str(loop)) == f"--csv {loop}: {expected} file or remove it"
    assert output_dir_problem("--save", str(loop)) == (
        f"--save {loop}: {expected} directory or remove it"
    )


def test_a_new_save_directory_is_fine_and_nothing_is_created(tmp_path: Path) -> None:
    assert output_dir_problem("--save", str(tmp_path / "new" / "deeper")) is None
    assert _entries(tmp_path) == []
    (tmp_path / "ckpt").mkdir()
    assert output_dir_problem("--save", str(tmp_path / "ckpt")) is None
    assert _entries(tmp_path / "ckpt") == []


def test_a_save_directory_under_a_regular_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    assert output_dir_problem("--save", str(file)) == f"--save {file}: {file} is not a directory"
    assert output_dir_problem("--save", str(file / "ckpt")) == (
        f"--save {file / 'ckpt'}: {file} is not a directory"
    )
    assert file.read_text() == "x"


@linux_only
def test_a_save_directory_under_proc_is_refused() -> None:
    problem = output_dir_problem("--save", "/proc/x")
    assert problem is not None and problem.startswith(
        "--save /proc/x: cannot create files in /proc ("
    )


def test_a_read_only_save_directory_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions (/proc covers root above)
            pytest.skip("running as a user that may write anywhere")
        problem = output_dir_problem("--save", str(locked / "ckpt"))
        assert problem is not None
        assert problem.startswith(f"--save {locked / 'ckpt'}: cannot create files in {locked} (")
    finally:
        locked.chmod(0o700)


def test_json_text_is_strict_and_writes_null_for_what_is_not_finite() -> None:
    data = {"a": float("inf"), "b": [1.0, float("nan"), -float("inf")], "c": {"d": 2}, "e": "x"}
    text = json_text(data)
    assert "Infinity" not in text and "NaN" not in text

    def refuse(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    assert json.loads(text, parse_constant=refuse) == {
        "a": None,
        "b": [1.0, None, None],
        "c": {"d": 2},
        "e": "x",
    }


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "NaN", "Infinity", "1e400"])
def test_floats_must_be_finite(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a finite number"):
        finite_float(text)
    with pytest.raises(argparse.ArgumentTypeError, match="expected a finite number"):
        non_negative_float(text)


def test_non_negative_float() -> None:
    assert non_negative_float("0") == 0.0
    assert finite_float("-1.5") == -1.5
    with pytest.raises(argparse.ArgumentTypeError, match=">= 0"):
        non_negative_float("-1")


def _parsers() -> list[argparse.ArgumentParser]:
    plan = cli_plan.build_parser()
    (commands,) = [a for a in plan._actions if isinstance(a, argparse._SubParsersAction)]
    return [cli_sim.build_parser(), cli_train.build_parser(), plan, *commands.choices.values()]


@pytest.mark.parametrize("parser", _parsers(), ids=lambda p: p.prog)
def test_help_names_every_default(parser: argparse.ArgumentParser) -> None:
    """Every flag whose default is a value shows it; a default that is the flag's absence
    (None, an unset switch) is either explained in the help or says nothing."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.default in (None, argparse.SUPPRESS):
            continue
        if action.default is False:
            continue
        text = formatter._get_help_string(action) or ""  # what --help prints, before % expansion
        assert "default" in text, (parser.prog, action.option_strings, text)


def test_help_shows_the_values() -> None:
    sim = " ".join(cli_sim.build_parser().format_help().split())
    assert "forward time (default: 1.0)" in sim
    train = " ".join(cli_train.build_parser().format_help().split())
    assert "(default: 3e-03)" in train or "(default: 0.003)" in train
    assert "(default: breadth-first)" in train
    assert "(default: the schedule's: 1 for gpipe, 1f1b, bpipe; 2 for" in train


def test_bfpp_train_checks_the_metrics_file_on_rank_0_only(tmp_path: Path) -> None:
    """Rank 0 alone writes it, maybe to a directory other nodes lack; every rank saves."""
    args = cli_train.build_parser().parse_args(
        ["--metrics-file", str(tmp_path / "missing" / "m.jsonl")]
    )
    assert cli_train.output_problem(args, metrics=False) is None
    assert "does not exist" in (cli_train.output_problem(args) or "")
    args.save = str(tmp_path / "file" / "ckpt")
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in (cli_train.output_problem(args, metrics=False) or "")


def test_bfpp_train_fills_in_the_schedules_virtual_stages() -> None:
    parse = cli_train.build_parser().parse_args
    assert parse(["--pipeline-schedule", "1f1b"]).num_virtual_stages_per_pipeline_rank == 1
    assert parse(["--pipeline-schedule", "bpipe"]).num_virtual_stages_per_pipeline_rank == 1
    assert parse([]).num_virtual_stages_per_pipeline_rank == 2  # breadth-first
    assert parse(["--pipeline-schedule", "interleaved"]).num_virtual_stages_per_pipeline_rank == 2
    given = ["--pipeline-schedule", "breadth-first", "--num-virtual-stages-per-pipeline-rank", "4"]
    assert parse(given).num_virtual_stages_per_pipeline_rank == 4
    assert parse(["--pipeline-schedule", "zigzag"]).num_virtual_stages_per_pipeline_rank is None


def test_bfpp_train_number_ranges() -> None:
    parse = cli_train.build_parser().parse_args
    assert cli_train.number_problem(parse([])) is None
    assert cli_train.number_problem(parse(["--clip-grad", "0", "--weight-decay", "0"])) is None
    assert cli_train.number_problem(parse(["--seed", "0"])) is None
    assert cli_train.number_problem(parse(["--seed", str(2**32 - 1)])) is None
    for flags, message in (
        (["--min-lr", "0.1"], "0 <= --min-lr <= --lr"),
        (["--lr", "-1"], "need --lr > 0"),
        (["--seed", str(2**32)], "--seed must be in 0 .. 4294967295"),
        (["--nproc-per-node", "257"], "at most 256 local ranks"),
    ):
        assert message in (cli_train.number_problem(parse(flags)) or ""), flags


def test_bfpp_train_torch_dist_saves_need_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core's torch_dist writer needs psutil (0.16's writer processes died without it
    and the ranks waited forever): refused before start, only when it would write."""
    parse = cli_train.build_parser().parse_args
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "psutil" else real(name, *a)
    )
    saving = parse(["--save", "ckpt", "--ckpt-format", "torch_dist"])
    problem = cli_train.checkpoint_format_problem(saving) or ""
    assert problem.startswith("--ckpt-format torch_dist needs psutil"), problem
    assert "\n" not in problem and "--ckpt-format torch" in problem
    assert cli_train.checkpoint_format_problem(parse(["--save", "ckpt"])) is None
    assert cli_train.checkpoint_format_problem(parse(["--ckpt-format", "torch_dist"])) is None


def test_visible_gpus_are_counted_without_torch(tmp_path: Path) -> None:
    """The driver's list narrowed by CUDA_VISIBLE_DEVICES up to its first non-device entry;
    no driver, no GPU (bfpp-train then starts its CPU ranks)."""
    driver = tmp_path / "gpus"
    assert cli_train._visible_gpus({}, str(driver)) == 0
    driver.mkdir()
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (driver / bus).mkdir()
    cases = {None: 3, "": 0, "1": 1, "0,2": 2, "0,7,1": 1, "-1": 0, "GPU-abc,GPU-def": 2}
    for visible, count in cases.items():
        env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        assert cli_train._visible_gpus(env, str(driver)) == count, visible


def test_the_console_script_flushes_and_ends_with_mains_code(monkeypatch, capsys) -> None:
    """``ends_without_teardown``: main's output is out before ``os._exit`` ends the process
    with main's exit code; an exception from main ends the usual way."""
    from megatron_bfpp.cli.common import ends_without_teardown

    ended: list[int] = []

    class Ended(Exception):
        pass

    def fake_exit(code: int) -> None:
        ended.append(code)
        raise Ended

    def main(argv=None) -> int:  # type: ignore[no-untyped-def]
        print("the table")
        return 3

    monkeypatch.setattr(os, "_exit", fake_exit)
    with pytest.raises(Ended):
        ends_without_teardown(main)()
    assert ended == [3]
    assert capsys.readouterr().out == "the table\n"

    def broken(argv=None) -> int:  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        ends_without_teardown(broken)()
    assert ended == [3]


def test_bfpp_sim_and_bfpp_plan_console_scripts_end_without_teardown() -> None:
    """setup.py points the two pure commands at their ``command``, not ``main``."""
    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    assert '"bfpp-sim=megatron_bfpp.cli.sim:command"' in setup
    assert '"bfpp-plan=megatron_bfpp.cli.plan:command"' in setup
