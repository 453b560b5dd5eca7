"""``bfpp-train --tensorboard-dir`` and ``--wandb-project``: one short run on 4 CPU ranks writes
the same per-iteration record to the JSONL file, TensorBoard event files (read back with
TensorBoard's own reader) and an offline W&B run (read back from its ``.wandb`` file); missing
packages and flags that need another flag are one line before any rank starts."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

ITERS = 3
SCALARS = ("lm loss", "learning-rate", "grad-norm", "iteration-time", "tokens-per-sec")
MEMORY = ("peak_activation_bytes", "peak_parameter_bytes", "peak_gradient_bytes")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env = {k: v for k, v in env.items() if not k.startswith("WANDB_")}
    return {**env, **extra}


def _run(*flags: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli.train", "--no-progress", *flags],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 iterations of the default breadth-first run with all three writers."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    out = tmp_path_factory.mktemp("logged")
    # No API key anywhere (HOME without ~/.netrc): W&B must go offline by itself.
    env = _env(HOME=str(out), WANDB_SILENT="true")
    proc = _run(
        "--train-iters",
        str(ITERS),
        "--metrics-file",
        str(out / "metrics.jsonl"),
        "--tensorboard-dir",
        str(out / "tb"),
        "--wandb-project",
        "bfpp-test",
        "--wandb-exp-name",
        "breadth-first-cpu",
        "--wandb-save-dir",
        str(out / "wb"),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_event_files_hold_the_jsonl_numbers(logged_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = [p for p in (logged_run / "tb").iterdir() if p.name.startswith("events.out")]
    assert len(runs) == 1, "one writer (rank 0) writes one event file"
    events = EventAccumulator(str(logged_run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(SCALARS) <= tags, tags
    for key in MEMORY:
        assert {f"memory/{key}/pp-rank-{r}" for r in range(4)} <= tags, key
    records = _records(logged_run)
    loss = {e.step: e.value for e in events.Scalars("lm loss")}
    assert sorted(loss) == [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    for record in records:
        # float32 in the event file
        assert loss[record["iteration"]] == pytest.approx(record["lm_loss"], rel=1e-6)
    activation = {e.step: e.value for e in events.Scalars("memory/peak_activation_bytes/pp-rank-0")}
    assert activation[ITERS] == records[-1]["peak_activation_bytes"][0] > 0


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a ``.wandb`` file: LevelDB's log format (32 KiB blocks of records, each a
    7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte ``:W&B`` header.
    Read here because W&B no longer ships a Python reader of its own."""
    block, header = 32768, 7
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records: list[bytes] = []
    pending = b""
    position = header
    while position + header <= len(data):
        left = block - position % block
        if left < header:  # the block's zero-filled tail
            position += left
            continue
        _, length, kind = struct.unpack_from("<IHB", data, position)
        payload = data[position + header : position + header + length]
        position += header + length
        if kind == 1:
            records.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            records.append(pending + payload)
        else:  # zeros: preallocated, never written
            break
    return records


def test_wandb_offline_run_holds_the_jsonl_numbers(logged_run: Path) -> None:
    from wandb.proto import wandb_internal_pb2

    runs = list((logged_run / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "offline without an API key, one run (rank 0's)"
    files = list(runs[0].glob("run-*.wandb"))
    assert len(files) == 1
    history: dict[int, dict[str, float]] = {}
    names = []
    for data in _wandb_records(files[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            names.append((record.run.project, record.run.display_name))
        elif kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history[int(row["_step"])] = row
    assert ("bfpp-test", "breadth-first-cpu") in names
    records = _records(logged_run)
    assert sorted(history) == [r["iteration"] for r in records]
    for record in records:
        row = history[record["iteration"]]
        assert row["lm loss"] == record["lm_loss"]
        assert row["learning-rate"] == record["lr"]
        assert row["memory/peak_gradient_bytes/pp-rank-3"] == record["peak_gradient_bytes"][3]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--wandb-exp-name", "x"], "--wandb-exp-name needs --wandb-project NAME"),
        (["--wandb-save-dir", "/tmp"], "--wandb-save-dir needs --wandb-project NAME"),
        (["--wandb-project", " "], "--wandb-project: empty name"),
        (["--tensorboard-dir", "/proc/none/tb"], "--tensorboard-dir /proc/none/tb"),
    ],
)
def test_logging_flags_one_line_before_any_rank(flags: list[str], expected: str) -> None:
    proc = _run("--train-iters", "1", *flags, env=_env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr


def test_a_missing_package_is_one_line_before_any_rank(tmp_path: Path) -> None:
    """With the package hidden (a stub that is not importable: find_spec finds nothing), the
    command names the extra to install, and no rank starts (no metrics file appears)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('tensorboard', 'wandb'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Hide())\n"
    )
    for flags, extra in (
        (["--tensorboard-dir", str(tmp_path / "tb")], "megatron-bfpp[tensorboard]"),
        (["--wandb-project", "p"], "megatron-bfpp[wandb]"),
    ):
        env = _env(PYTHONPATH=os.pathsep.join([str(hide), *sys.path]))
        proc = _run(
            "--train-iters", "1", "--metrics-file", str(tmp_path / "m.jsonl"), *flags, env=env
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and extra in lines[0], proc.stderr
        assert not (tmp_path / "m.jsonl").exists()


def test_flags_that_go_together_are_refused_on_every_rank_under_torchrun() -> None:
    """A rank other than 0 writes no logs but knows the flags are wrong: it stops too (exit 2,
    quietly: the line is local rank 0's), instead of waiting for a rank 0 that has left."""
    for rank in ("0", "1"):
        env = _env(RANK=rank, WORLD_SIZE="4", LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1")
        env["MASTER_PORT"] = "1"  # never reached: the refusal comes before any rendezvous
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_bfpp.cli.train", "--wandb-exp-name", "x"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert lines == (
            ["bfpp-train: error: --wandb-exp-name needs --wandb-project NAME"]
            if rank == "0"
            else []
        ), proc.stderr[-2000:]
