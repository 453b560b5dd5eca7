"""Checkpoint metadata and directory handling alone (torch-free): what a checkpoint records, which
resume differences are refused and how they are named, and that publishing a checkpoint never
leaves the last complete one missing."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_bfpp.cli.train import build_parser
from megatron_bfpp.config.run_config import UNEVEN_FLAGS, RunConfig, run_config
from megatron_bfpp.train.checkpoint_files import (
    METADATA_FILE,
    TRACKER,
    CheckpointError,
    checkpoint_dir,
    clean_stale,
    complete_checkpoint,
    make_temp_dir,
    publish,
    read_tracker,
    remove_old,
    write_tracker,
)
from megatron_bfpp.train.checkpoint_metadata import (
    FORMAT_VERSION,
    METADATA_LIMIT,
    CheckpointMetadata,
    FileRecord,
    check_resume,
    metadata_from_json,
    metadata_to_json,
    read_checkpoint,
    save_problem,
    scheduler_policy,
)

WORLD = 4


def _config(*flags: str, world: int = WORLD) -> RunConfig:
    return run_config(build_parser().parse_args(list(flags)), world)


def _metadata(
    config: RunConfig, *, iteration: int = 3, files: tuple[FileRecord, ...] = ()
) -> CheckpointMetadata:
    return CheckpointMetadata(
        format_version=FORMAT_VERSION,
        ckpt_format="torch",
        iteration=iteration,
        consumed_samples=iteration * config.training.global_batch_size,
        run=config,
        opt_param_scheduler=config.training.lr_schedule(),
        megatron_core="0.19.2",
        files=files,
    )


def _refusal(saved: RunConfig, current: RunConfig, **kwargs: Any) -> str:
    with pytest.raises(CheckpointError) as caught:
        check_resume(_metadata(saved), current, root="DIR", **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- run config


def test_run_config_from_flags() -> None:
    config = _config("--pipeline-schedule", "interleaved", "--global-batch-size", "16")
    assert config.layout.placement == "looped"
    assert config.layout.data_parallel_size == 1 and config.layout.world_size == WORLD
    assert config.training.decay_iters == config.training.train_iters == 20
    schedule = config.training.lr_schedule()
    assert (schedule.lr_warmup_steps, schedule.lr_decay_steps) == (2 * 16, 20 * 16)
    assert schedule.wd_incr_steps == schedule.lr_decay_steps


def test_warm_up_is_capped_below_the_decay() -> None:
    schedule = _config("--train-iters", "2", "--lr-warmup-iters", "5").training.lr_schedule()
    assert schedule.lr_warmup_steps == 1 * 8 < schedule.lr_decay_steps == 2 * 8


# --------------------------------------------------------------------------- JSON


def test_metadata_round_trips_through_json() -> None:
    files = (FileRecord("rank_00000.pt", 10, "ab" * 32),)
    metadata = _metadata(_config("--num-query-groups", "2", "--data-path", "x.txt"), files=files)
    assert metadata_from_json(metadata_to_json(metadata), source="m.json") == metadata


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.update(iteration="3"), "m.json: .iteration should be an integer, got '3'"),
        (lambda d: d["run"]["layout"].pop("world_size"), "m.json: .run.layout should be an object"),
        (lambda d: d.update(format_version=99), "m.json: format_version 99"),
        (
            lambda d: d["files"].append({"name": 3}),
            "m.json: .files[0] should be an object with keys name, size, sha256",
        ),
        (
            lambda d: d.update(consumed_samples=True),
            "m.json: .consumed_samples should be an integer, got True",
        ),
        (
            lambda d: d["run"]["layout"].update(placement="zigzag"),
            "m.json: .run.layout.placement should be one of 'single', 'looped', 'v-shape', got",
        ),
    ],
    ids=["type", "missing-key", "version", "record", "bool-is-not-int", "unknown-placement"],
)
def test_bad_metadata_is_one_error_naming_the_file(edit: Any, expected: str) -> None:
    data = json.loads(metadata_to_json(_metadata(_config())))
    edit(data)
    with pytest.raises(CheckpointError) as caught:
        metadata_from_json(json.dumps(data), source="m.json")
    assert str(caught.value).startswith(expected), str(caught.value)
    with pytest.raises(CheckpointError, match=r"^m\.json: not valid JSON"):
        metadata_from_json("{", source="m.json")


# --------------------------------------------------------------------------- resume rules


def test_same_run_under_another_schedule_may_resume() -> None:
    saved = _config()
    check_resume(_metadata(saved), _config("--pipeline-schedule", "interleaved"), root="DIR")
    check_resume(_metadata(saved), _config("--micro-batch-size", "2"), root="DIR")
    # defaults filled in: an explicit default is the same model
    check_resume(
        _metadata(saved), _config("--ffn-hidden-size", "256", "--num-query-groups", "4"), root="DIR"
    )


def test_other_model_and_layout_are_named_flag_by_flag() -> None:
    message = _refusal(
        _config(),
        _config(
            "--num-layers", "16", "--hidden-size", "128", "--pipeline-model-parallel-size", "2"
        ),
    )
    assert message.startswith(
        "--load DIR: checkpoint was saved with --num-layers 8, this run has 16; "
    )
    assert "--hidden-size 64, this run has 128" in message
    assert "--pipeline-model-parallel-size 4, this run has 2" in message


def test_placement_and_world_size_are_refused() -> None:
    message = _refusal(
        _config(),
        _config(
            "--pipeline-schedule", "1f1b", "--num-virtual-stages-per-pipeline-rank", "1", world=8
        ),
    )
    assert "--num-virtual-stages-per-pipeline-rank 2, this run has 1" in message
    assert (
        "--pipeline-schedule breadth-first (looped placement), this run has 1f1b (single)"
        in message
    )
    assert "4 ranks (data-parallel size 1), this run has 8 (2)" in message


def test_another_uneven_layout_is_refused_and_a_record_before_them_reads_as_even() -> None:
    layout = "Et*2||t|t|t||t*2|tL"
    flags = ("--pipeline-model-parallel-layout", layout, "--num-virtual-stages-per-pipeline-rank")
    message = _refusal(_config(), _config(*flags, "2"))
    assert f"--pipeline-model-parallel-layout None, this run has {layout}" in message
    first = "--decoder-first-pipeline-num-layers"
    assert f"{first} 1, this run has None" in _refusal(_config(first, "1"), _config())
    data = json.loads(metadata_to_json(_metadata(_config())))
    for dest in UNEVEN_FLAGS:  # written before the uneven-stage flags existed
        del data["run"]["layout"][dest]
    assert metadata_from_json(json.dumps(data), source="m.json").run == _config()


def test_changed_learning_rate_schedule_names_flags_and_both_overrides() -> None:
    message = _refusal(
        _config(), _config("--lr", "1e-3", "--min-lr", "1e-4", "--weight-decay", "0.1")
    )
    assert "--lr 0.001 (checkpoint: 0.003), --min-lr 0.0001 (checkpoint: 0.0003)" in message
    assert "--weight-decay 0.1 (checkpoint: 0.01)" in message
    assert "--override-opt_param-scheduler" in message
    assert "--use-checkpoint-opt_param-scheduler" in message


def test_longer_training_needs_the_old_decay_length() -> None:
    message = _refusal(_config(), _config("--train-iters", "30"))
    assert "--train-iters 30 (decay over 30 iterations, checkpoint: 20)" in message
    assert message.endswith("to train further on the checkpoint's schedule: --lr-decay-iters 20")
    check_resume(
        _metadata(_config()), _config("--train-iters", "30", "--lr-decay-iters", "20"), root="DIR"
    )


def test_changed_global_batch_size_alone_is_named_alone() -> None:
    message = _refusal(_config(), _config("--global-batch-size", "16"))
    assert "--global-batch-size 16 (checkpoint: 8; warm-up and decay count samples)" in message
    assert "--train-iters" not in message.split(";")[0] and "--lr-warmup-iters" not in message


@pytest.mark.parametrize("policy", ["override", "checkpoint"])
def test_scheduler_flags_allow_a_changed_schedule_not_a_changed_model(policy: str) -> None:
    current = _config("--lr", "1e-3", "--train-iters", "30", "--global-batch-size", "16")
    check_resume(_metadata(_config()), current, root="DIR", scheduler=policy)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="--num-layers"):
        check_resume(
            _metadata(_config()), _config("--num-layers", "16"), root="DIR", scheduler=policy
        )  # type: ignore[arg-type]


def test_scheduler_policy_from_flags() -> None:
    parse = build_parser().parse_args
    assert scheduler_policy(parse([])) == "check"
    assert scheduler_policy(parse(["--override-opt_param-scheduler"])) == "override"
    assert scheduler_policy(parse(["--use-checkpoint-opt_param-scheduler"])) == "checkpoint"


# --------------------------------------------------------------------------- directory


def _complete(root: Path, iteration: int, files: dict[str, bytes]) -> CheckpointMetadata:
    """Publish a checkpoint the way save_checkpoint does (without ranks)."""
    temp = make_temp_dir(root, iteration)
    for name, data in files.items():
        (temp / name).write_bytes(data)
    records = tuple(FileRecord(name, len(data), None) for name, data in files.items())
    metadata = _metadata(_config(), iteration=iteration, files=records)
    (temp / METADATA_FILE).write_text(metadata_to_json(metadata))
    remove_old(publish(temp, checkpoint_dir(root, iteration)))
    write_tracker(root, iteration)
    return metadata


def test_tracker_is_replaced_atomically(tmp_path: Path) -> None:
    write_tracker(tmp_path, 5)
    write_tracker(tmp_path, 7)
    assert read_tracker(tmp_path) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == [TRACKER]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no latest_checkpointed_iteration.txt"),
        ("abc\n", "holds 'abc', not an iteration"),
        ("\u00b2\n", "not an iteration number"),  # str.isdigit() says yes, int() says no
        ("9" * 300, r"has 300 bytes, more than such a file holds \(64\)"),
        ("9" * 5_000, "has 5,000 bytes"),
        ("1" * (1 << 20), "has 1,048,576 bytes"),
        ("9" * 40, "holds '9999999999999999999999999999999999999999', not an iteration"),
    ],
    ids=["missing", "letters", "superscript", "300-digits", "5000-digits", "1-MB", "40-digits"],
)
def test_bad_tracker_is_one_line(tmp_path: Path, content: str | None, expected: str) -> None:
    if content is not None:
        (tmp_path / TRACKER).write_text(content)
    with pytest.raises(CheckpointError, match=expected) as info:
        read_tracker(tmp_path)
    assert "\n" not in str(info.value)


def test_a_tracker_that_is_a_fifo_or_a_symlink_is_refused_without_waiting(tmp_path: Path) -> None:
    """A FIFO used to block the reader forever; a symlink is never followed."""
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / TRACKER)
    with pytest.raises(CheckpointError, match="is not a regular file"):
        read_tracker(fifo)
    link = tmp_path / "link"
    link.mkdir()
    (tmp_path / "elsewhere").write_text("3\n")
    (link / TRACKER).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        read_tracker(link)


def test_saving_over_another_models_checkpoint_is_named_with_both_shapes(tmp_path: Path) -> None:
    _complete(tmp_path, 3, {"rank_00000.pt": b"x"})
    assert save_problem(tmp_path, _config()) is None  # the same model may save there
    assert save_problem(tmp_path / "empty", _config("--hidden-size", "128")) is None
    assert save_problem(tmp_path, _config("--num-layers", "4")) == (
        f"--save {tmp_path}: holds a checkpoint of another model (iteration 3, saved with "
        "--num-layers 8, this run has 4); this run's saves would overwrite it: choose another "
        "--save directory"
    )
    (tmp_path / TRACKER).unlink()
    (tmp_path / TRACKER).symlink_to(tmp_path / "elsewhere")
    assert save_problem(tmp_path, _config()) == (
        f"--save {tmp_path}: {TRACKER} is a symbolic link (a checkpoint holds only its own "
        "regular files); remove it or choose another --save directory"
    )


def test_deep_or_huge_metadata_is_one_line(tmp_path: Path) -> None:
    _complete(tmp_path, 3, {"rank_00000.pt": b"x"})
    meta = checkpoint_dir(tmp_path, 3) / METADATA_FILE
    meta.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        read_checkpoint(tmp_path)
    with open(meta, "wb") as file:
        file.truncate(METADATA_LIMIT + 1)
    with pytest.raises(CheckpointError, match="more than such a file holds"):
        read_checkpoint(tmp_path)


def test_a_symlinked_rank_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """It used to be opened and hashed (a file outside the checkpoint) before being refused."""
    _complete(tmp_path, 3, {"rank_00000.pt": b"x" * 10})
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"x" * 10)
    rank_file = checkpoint_dir(tmp_path, 3) / "rank_00000.pt"
    rank_file.unlink()
    rank_file.symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt is a symbolic link"):
        read_checkpoint(tmp_path)


def test_read_checkpoint_checks_every_recorded_file(tmp_path: Path) -> None:
    metadata = _complete(tmp_path, 3, {"rank_00000.pt": b"x" * 10, "rank_00001.pt": b"y" * 20})
    path, read = read_checkpoint(tmp_path)
    assert path == checkpoint_dir(tmp_path, 3) and read == metadata
    (path / "rank_00001.pt").write_bytes(b"y" * 5)
    with pytest.raises(
        CheckpointError,
        match=r"iter_0000003/rank_00001\.pt has 5 bytes, the checkpoint recorded 20 \(truncated",
    ):
        read_checkpoint(tmp_path)
    (path / "rank_00001.pt").unlink()
    with pytest.raises(CheckpointError, match=r"iter_0000003/rank_00001\.pt is missing"):
        read_checkpoint(tmp_path)


def test_incomplete_checkpoint_is_refused(tmp_path: Path) -> None:
    checkpoint_dir(tmp_path, 4).mkdir()
    write_tracker(tmp_path, 4)
    with pytest.raises(CheckpointError, match=r"iter_0000004 is missing or incomplete"):
        read_checkpoint(tmp_path)


def test_resave_keeps_the_old_copy_until_the_new_one_is_in_place(tmp_path: Path) -> None:
    """A kill between moving the old copy aside and renaming the new one in: the old copy is
    still found (and put back by the next save); the half-written new one is discarded."""
    _complete(tmp_path, 3, {"rank_00000.pt": b"old"})
    temp = make_temp_dir(tmp_path, 3)
    (temp / "rank_00000.pt").write_bytes(b"new")
    (temp / METADATA_FILE).write_text("{}")

    class Killed(Exception):
        pass

    def kill() -> None:
        raise Killed

    with pytest.raises(Killed):
        publish(temp, checkpoint_dir(tmp_path, 3), between=kill)
    assert not checkpoint_dir(tmp_path, 3).exists()
    found = complete_checkpoint(tmp_path, 3)
    assert found is not None and ".old-" in found.name
    assert read_checkpoint(tmp_path)[0] == found
    clean_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", TRACKER]
    assert (checkpoint_dir(tmp_path, 3) / "rank_00000.pt").read_bytes() == b"old"


def test_resave_replaces_the_old_copy(tmp_path: Path) -> None:
    _complete(tmp_path, 3, {"rank_00000.pt": b"old"})
    _complete(tmp_path, 3, {"rank_00000.pt": b"newer"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", TRACKER]
    assert read_checkpoint(tmp_path)[1].files[0].size == 5


def test_clean_stale_removes_interrupted_saves_only(tmp_path: Path) -> None:
    _complete(tmp_path, 3, {"rank_00000.pt": b"a"})
    leftover = make_temp_dir(tmp_path, 6)
    (leftover / "rank_00000.pt").write_bytes(b"partial")
    unrelated = tmp_path / "notes.tmp-x"
    unrelated.mkdir()
    clean_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", TRACKER, "notes.tmp-x"]


def test_directories_get_umask_permissions(tmp_path: Path) -> None:
    """Not tempfile's private 0700/0600: other users of a shared checkpoint directory can read."""
    _complete(tmp_path, 1, {"rank_00000.pt": b"a"})
    reference = tmp_path / "plain"
    reference.mkdir()
    assert checkpoint_dir(tmp_path, 1).stat().st_mode == reference.stat().st_mode
    (tmp_path / "plain.txt").write_text("x")
    assert (tmp_path / TRACKER).stat().st_mode == (tmp_path / "plain.txt").stat().st_mode


def test_metadata_dataclasses_are_frozen() -> None:
    metadata = _metadata(_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        metadata.iteration = 4  # type: ignore[misc]


def test_reading_a_checkpoint_loads_no_torch() -> None:
    """The command line checks a resume before it starts ranks: without importing torch."""
    code = (
        "import sys\n"
        "import megatron_bfpp.train.checkpoint_metadata, megatron_bfpp.config.run_config\n"
        "import megatron_bfpp.train.checkpoint_files\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_unknown_format_is_refused(tmp_path: Path) -> None:
    _complete(tmp_path, 2, {"rank_00000.pt": b"x"})
    meta = checkpoint_dir(tmp_path, 2) / METADATA_FILE
    meta.write_text(meta.read_text().replace('"ckpt_format": "torch"', '"ckpt_format": "pickle"'))
    with pytest.raises(CheckpointError, match=r"unknown ckpt_format 'pickle' \(known: torch, "):
        read_checkpoint(tmp_path)
