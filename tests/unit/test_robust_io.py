"""Requeue, resume and data-path decisions, and robust writes and prints, on their own (no
ranks): the torch-free functions the command lines call before any rank starts."""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_bfpp.config.run_config import LRSchedule, run_config
from megatron_bfpp.launch import script_problem
from megatron_bfpp.train.checkpoint_files import fresh_start_reason, save_path_problem
from megatron_bfpp.train.checkpoint_metadata import (
    CheckpointMetadata,
    metadata_from_json,
    metadata_to_json,
    resume_warnings,
)
from megatron_bfpp.train.data_source import (
    DataPathError,
    IndexedSource,
    TextSource,
    data_source,
)
from megatron_bfpp.train.metric_writers import GuardedWriter, MetricWriteError


def test_fresh_start_only_for_a_missing_directory_or_a_first_saves_leftovers(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    assert fresh_start_reason(root) == "does not exist yet"
    root.mkdir()
    assert fresh_start_reason(root) == "is empty"
    (root / ".bfpp_save.lock").touch()
    (root / "iter_0000010.tmp-0123456789ab").mkdir()
    (root / "latest_checkpointed_iteration.txt.tmp-ab12cd34ef56").touch()
    assert "interrupted first save" in (fresh_start_reason(root) or "")
    (root / "iter_0000010.old-0123456789ab").mkdir()  # a complete copy aside: not fresh
    assert fresh_start_reason(root) is None
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").touch()  # a wrong path, not a new run
    assert fresh_start_reason(other) is None
    (tmp_path / "file").touch()
    assert fresh_start_reason(tmp_path / "file") is None


def test_save_path_is_checked_against_the_longest_file_a_save_creates(tmp_path: Path) -> None:
    assert save_path_problem(str(tmp_path / "ckpt"), world_size=4, iterations=20) is None
    long = str(tmp_path / ("x" * 200) / ("y" * 200)) + "/z" * ((4060 - len(str(tmp_path))) // 2)
    problem = save_path_problem(long[:4060], world_size=4, iterations=20)
    assert problem is not None and "choose a shorter path" in problem


def _index(path: Path, lengths: list[int], *, code: int = 8, itemsize: int = 2) -> None:
    """A Megatron ``.idx`` (megatron-core's layout) for sequences of ``lengths``, one document
    each, and its ``.bin``."""
    pointers, total = [], 0
    for length in lengths:
        pointers.append(total)
        total += length * itemsize
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(lengths), len(lengths) + 1)
    body = struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(lengths)}q", *pointers)
    docs = struct.pack(f"<{len(lengths) + 1}q", *range(len(lengths) + 1))
    path.with_suffix(".idx").write_bytes(header + body + docs)
    path.with_suffix(".bin").write_bytes(b"\x01" * total)


def test_data_source_reads_megatron_lms_data_path_forms(tmp_path: Path) -> None:
    _index(tmp_path / "a", [10, 20])
    _index(tmp_path / "b", [5])
    text = tmp_path / "t.txt"
    text.write_text("x" * 100)
    assert data_source([str(text)], seq_length=8) == TextSource(str(text))
    single = data_source([str(tmp_path / "a")], seq_length=8)
    assert single == IndexedSource((str(tmp_path / "a"),), None, "969,30,1", 30)
    assert data_source([str(tmp_path / "a.bin")], seq_length=8) == single  # the .bin: the prefix
    blend = data_source(["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")], seq_length=8)
    assert isinstance(blend, IndexedSource) and blend.weights == (0.3, 0.7)
    assert blend.blend() == ([str(tmp_path / "a"), str(tmp_path / "b")], [0.3, 0.7])
    unweighted = data_source([str(tmp_path / "a"), str(tmp_path / "b")], seq_length=8)
    assert isinstance(unweighted, IndexedSource) and unweighted.weights is None


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda p: p.with_suffix(".bin").unlink(), "a.bin no such file"),
        (lambda p: p.with_suffix(".idx").write_bytes(b"MMIDIDX\x00\x00" + b"\x00" * 40), "version"),
        (
            lambda p: p.with_suffix(".idx").write_bytes(b"not an index file at all" * 3),
            "no MMIDIDX",
        ),
        (lambda p: _index(p, [10, 20], code=9), "token types 1-8"),
        (
            lambda p: p.with_suffix(".bin").write_bytes(b"\x01" * 50),
            "has 50 bytes, its index implies 60",
        ),
        (
            lambda p: p.with_suffix(".idx").write_bytes(p.with_suffix(".idx").read_bytes()[:-4]),
            "its header implies",
        ),
    ],
    ids=["no-bin", "version", "header", "token-type", "short-bin", "short-idx"],
)
def test_a_damaged_indexed_dataset_is_one_line(tmp_path: Path, damage: Any, words: str) -> None:
    _index(tmp_path / "a", [10, 20])
    damage(tmp_path / "a")
    with pytest.raises(DataPathError, match=words):
        data_source([str(tmp_path / "a")], seq_length=8)


@pytest.mark.parametrize(
    ("items", "split", "words"),
    [
        (["0.3", "A", "-1", "B"], None, "blend weights must be finite, >= 0"),
        (["A"], "0,50,50", "--split 0,50,50"),
        (["A"], "a,b", "--split a,b"),
    ],
)
def test_blend_and_split_mistakes_are_one_line(
    tmp_path: Path, items: list[str], split: str | None, words: str
) -> None:
    _index(tmp_path / "A", [10])
    _index(tmp_path / "B", [10])
    paths = [str(tmp_path / item) if item.isalpha() else item for item in items]
    with pytest.raises(DataPathError, match=words):
        data_source(paths, seq_length=8, split=split)


def test_binary_data_is_neither_text_nor_a_dataset(tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    blob.write_bytes(b"\x00\x01" * 100)
    with pytest.raises(DataPathError, match="is neither a text file nor a dataset prefix"):
        data_source([str(blob)], seq_length=8)


def _args(**changes: Any) -> Any:
    from megatron_bfpp.cli.train import build_parser

    args = build_parser().parse_args([])
    for key, value in changes.items():
        setattr(args, key, value)
    return args


def _metadata(args: Any) -> CheckpointMetadata:
    run = run_config(args, 4)
    schedule = LRSchedule(**dataclasses.asdict(run.training.lr_schedule()))
    return CheckpointMetadata(1, "torch", 10, 80, run, schedule, "0.19.2", ())


def test_resume_warns_for_what_megatron_lm_accepts() -> None:
    saved = _metadata(_args())
    assert resume_warnings(saved, run_config(_args(), 4), root="D") == []
    warnings = resume_warnings(
        saved, run_config(_args(seed=7, data_path=["P"], split="9,1,0"), 4), root="D"
    )
    assert len(warnings) == 2, warnings  # the split is news only for the same data
    assert "--seed 1234, this run has 7" in warnings[0]
    assert "--data-path none (synthetic data), this run has P" in warnings[1]
    same_data = _metadata(_args(data_path=["P"]))
    now = run_config(_args(data_path=["P"], split="9,1,0"), 4)
    (split,) = resume_warnings(same_data, now, root="D")
    assert "--split 969,30,1, this run has 9,1,0" in split
    default = run_config(_args(data_path=["P"], split="969,30,1"), 4)
    assert resume_warnings(same_data, default, root="D") == []


def test_checkpoints_written_before_the_split_field_still_read() -> None:
    text = metadata_to_json(_metadata(_args()))
    old = text.replace(' "split": null,\n', "")
    assert old != text
    assert metadata_from_json(old, source="x").run.training.split is None


class _Failing:
    def __init__(self) -> None:
        self.closed = 0

    def write(self, record: Any) -> None:
        try:
            raise OSError(28, "No space left on device")
        except OSError as error:
            raise RuntimeError("writer thread died") from error

    def close(self) -> None:
        self.closed += 1
        raise OSError(28, "No space left on device")


def test_a_failing_writer_is_one_line_naming_its_flag_and_closes_quietly() -> None:
    failing = _Failing()
    writer = GuardedWriter("--tensorboard-dir", "tb", lambda: failing)
    with pytest.raises(MetricWriteError) as caught:
        writer.write({"iteration": 3})
    assert str(caught.value).startswith(
        "--tensorboard-dir tb: cannot write iteration 3 (No space left on device)"
    )
    assert caught.value.__suppress_context__  # no chained tracebacks
    writer.close()  # quiet after the failure
    assert failing.closed == 1


def test_a_writer_that_cannot_start_is_one_line() -> None:
    def broken() -> Any:
        raise ImportError("tensorboard is installed broken")

    with pytest.raises(MetricWriteError, match="--wandb-project p: cannot start writing"):
        GuardedWriter("--wandb-project", "p", broken)


def test_the_launcher_refuses_what_is_not_python(tmp_path: Path) -> None:
    shell = tmp_path / "train.sh"
    shell.write_text("#!/bin/bash\necho hello\n")
    assert "not a Python script (it starts with #!/bin/bash)" in (
        script_problem(str(shell), shown="train.sh") or ""
    )
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    assert "not a Python script (line 1" in (script_problem(str(broken), shown="broken.py") or "")
    good = tmp_path / "good.py"
    good.write_text("#!/usr/bin/env python3\nprint('hi')\n")
    assert script_problem(str(good), shown="good.py") is None


def _run(*cmd: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *cmd], capture_output=True, text=True, timeout=120, env=env
    )


def test_the_launcher_refuses_a_shell_script_in_one_line_before_any_import(tmp_path: Path) -> None:
    shell = tmp_path / "train.sh"
    shell.write_text('#!/bin/bash\nexec python pretrain_gpt.py "$@"\n')
    proc = _run("-m", "megatron_bfpp.launch", str(shell), "--num-layers", "2")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"megatron_bfpp.launch: error: {shell} is not a Python script (it starts with "
        "#!/bin/bash); the launcher runs Megatron-LM's Python scripts (pretrain_gpt.py); run "
        "this one directly"
    ], proc.stderr


def test_bfpp_sim_png_without_matplotlib_is_one_line(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib is installed broken')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), *sys.path])}
    proc = _run(
        "-m", "megatron_bfpp.cli.sim", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4",
        "--png", str(tmp_path / "out.png"), env=env,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "bfpp-sim: error: --png needs matplotlib (broken): pip install 'megatron-bfpp[plot]'"
    ], proc.stderr
    assert not (tmp_path / "out.png").exists()


def test_an_ascii_stdout_prints_what_it_cannot_encode() -> None:
    """stdout is strict (stderr already escapes): an informational line naming a path it cannot
    encode used to end the run."""
    code = "from megatron_bfpp.flags import printable_output\n{}print('saved ckpt-\\xe9')"
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    plain = _run("-c", code.format(""), env=env)
    assert plain.returncode == 1 and "UnicodeEncodeError" in plain.stderr
    fixed = _run("-c", code.format("printable_output()\n"), env=env)
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout == "saved ckpt-\\xe9\n"
