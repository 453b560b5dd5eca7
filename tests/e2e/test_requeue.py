"""Requeue like Megatron-LM (``--save D --load D``), resume consistency, and Megatron's indexed
datasets, end to end on 2 CPU ranks (``bfpp-train`` processes; the sbatch template under a
stand-in ``srun``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.ports import free_port, run_launch

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
TRACKER = "latest_checkpointed_iteration.txt"
SMALL = [
    "--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
    "--no-progress",
]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**base, **extra}


def _train(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli.train", *SMALL, *flags],
        capture_output=True,
        text=True,
        timeout=400,
        env=env or _env(),
    )


def _lines(text: str, start: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(start)]


def _side_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_save_and_load_of_a_new_directory_starts_fresh_in_one_line(
    tmp_path: Path, state: str
) -> None:
    """Megatron-LM's requeue pattern: it used to be refused ("not a bfpp-train checkpoint").
    The directory's name is not ASCII and stdout is ASCII: the info and "saved" lines escape it
    instead of ending the run (they used to raise UnicodeEncodeError after training)."""
    root = tmp_path / "ckpt-é"
    if state == "empty":
        root.mkdir()
    proc = _train(
        "--train-iters", "2", "--save", str(root), "--load", str(root),
        env=_env(PYTHONIOENCODING="ascii"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = _lines(proc.stdout, "bfpp-train: info: --load ")
    assert len(info) == 1, proc.stdout
    assert "ckpt-\\xe9" in info[0] and "starting from iteration 0" in info[0], info
    assert "saved checkpoint" in proc.stdout and "Traceback" not in proc.stderr
    assert (root / TRACKER).read_text().strip() == "2"


def test_a_kill_during_the_first_save_is_requeued_from_scratch_and_cleaned(
    tmp_path: Path,
) -> None:
    """A rank killed while the first checkpoint is written leaves only its temporary directory:
    every requeue used to be refused. Now the requeue starts fresh, its save removes the
    leftover, and the next requeue resumes."""
    root = tmp_path / "ckpt"
    flags = ["--train-iters", "2", "--save", str(root), "--load", str(root)]
    killed = _train(*flags, env=_env(BFPP_TEST_KILL_DURING_SAVE="rank-file:1"))
    assert killed.returncode != 0
    assert not (root / TRACKER).exists() and _side_entries(root), sorted(os.listdir(root))
    requeued = _train(*flags)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert len(_lines(requeued.stdout, "bfpp-train: info: --load ")) == 1, requeued.stdout
    assert (root / TRACKER).read_text().strip() == "2"
    assert _side_entries(root) == []
    resumed = _train(*flags, "--train-iters", "3", "--lr-decay-iters", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from iteration 2" in resumed.stdout and "info:" not in resumed.stdout


def _fake_slurm(bin_dir: Path) -> None:
    """``srun`` runs its command here (its own options dropped); ``scontrol show hostnames``
    names this machine."""
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/bash\necho localhost\n")
    for tool in (srun, scontrol):
        tool.chmod(0o755)


def _sbatch(tmp_path: Path, root: Path, **extra: str) -> subprocess.Popen[str]:
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        _fake_slurm(bin_dir)
    env = _env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_ID="7",
        CHECKPOINT_DIR=str(root),
        PYTHON=sys.executable,
        GPUS_PER_NODE="2",
        MASTER_PORT=str(free_port()),
        **extra,
    )
    return subprocess.Popen(
        ["bash", str(REPO / "scripts" / "slurm" / "bfpp_train.sbatch"),
         "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--train-iters", "2",
         "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # the job's processes, all signalled as SLURM signals them
    )  # fmt: skip


def test_sbatch_template_requeues_after_a_sigterm_during_the_first_save(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    marker = tmp_path / "saving"
    job = _sbatch(tmp_path, root, BFPP_TEST_PAUSE_DURING_SAVE=str(marker))
    deadline = time.monotonic() + 400
    while not marker.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marker.exists(), job.communicate(timeout=60)[0][-3000:]
    os.killpg(job.pid, signal.SIGTERM)  # SLURM's preemption: SIGTERM to every process
    job.communicate(timeout=120)
    assert job.returncode != 0
    assert not (root / TRACKER).exists() and _side_entries(root), sorted(os.listdir(root))
    requeue = _sbatch(tmp_path, root)
    output, _ = requeue.communicate(timeout=400)
    assert requeue.returncode == 0, output[-3000:]
    assert len(_lines(output, "bfpp-train: info: --load ")) == 1, output[-3000:]
    assert (root / TRACKER).read_text().strip() == "2"
    assert _side_entries(root) == []


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    proc = _train("--train-iters", "2", "--save", str(root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def test_a_changed_seed_or_data_path_is_accepted_with_one_warning_each(
    saved: Path, tmp_path: Path
) -> None:
    """Megatron-LM's check_checkpoint_args compares model and parallel sizes only: a changed
    --seed or --data-path is accepted there, and here too, but no longer silently."""
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    proc = _train(
        "--train-iters", "3", "--lr-decay-iters", "2", "--load", str(saved), "--seed", "7",
        "--data-path", str(text),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = _lines(proc.stdout, "bfpp-train: warning: ")
    assert len(warnings) == 2, proc.stdout
    assert "--seed 1234, this run has 7" in warnings[0], warnings
    assert f"--data-path none (synthetic data), this run has {text}" in warnings[1], warnings
    assert "from iteration 2" in proc.stdout


def test_a_changed_model_shape_is_refused_naming_the_flag_and_both_values(saved: Path) -> None:
    proc = _train("--train-iters", "3", "--load", str(saved), "--seq-length", "32")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--seq-length 64, this run has 32" in lines[0], proc.stderr


# --------------------------------------------------------------------------- indexed datasets


def _indexed_dataset(prefix: Path, *, step: int, documents: int = 40) -> None:
    """Documents of arithmetic progressions (``step`` apart, modulo 256), written by
    megatron-core's own writer."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    for doc in range(documents):
        length = 20 + (doc * 37) % 180
        builder.add_item(torch.tensor([(doc * 11 + step * i) % 256 for i in range(length)]))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def _metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_megatron_indexed_datasets_train_through_megatron_core(tmp_path: Path) -> None:
    """One prefix, then Megatron-LM's weighted blend with --split: both train (they used to be
    refused as missing files, or a .bin trained on as bytes)."""
    _indexed_dataset(tmp_path / "a", step=3)
    _indexed_dataset(tmp_path / "b", step=5)
    metrics = tmp_path / "m.jsonl"
    single = _train(
        "--train-iters", "2", "--data-path", str(tmp_path / "a"), "--metrics-file", str(metrics)
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    assert [m["iteration"] for m in _metrics(metrics)] == [1, 2]
    assert list((tmp_path / "a" / "cache").iterdir())  # megatron-core's own index cache
    blend = _train(
        "--train-iters", "2", "--split", "90,10,0", "--data-cache-path", str(tmp_path / "cache"),
        "--data-path", "0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b"),
    )  # fmt: skip
    assert blend.returncode == 0, blend.stderr[-3000:]


def _main(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli.train", *SMALL, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )


def _one_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_data_that_is_neither_text_nor_an_indexed_dataset_is_one_line(tmp_path: Path) -> None:
    _indexed_dataset(tmp_path / "a", step=3)
    binary = tmp_path / "weights.npy"
    binary.write_bytes(bytes(range(256)) * 4)
    assert "is neither a text file nor a dataset prefix (binary data)" in _one_error(
        _main("--data-path", str(binary))
    )
    # the .bin alone, given as if it were text, is read as the dataset (not as bytes)
    (tmp_path / "lonely.idx").write_bytes((tmp_path / "a.idx").read_bytes())
    assert "lonely.bin no such file" in _one_error(_main("--data-path", str(tmp_path / "lonely")))
    truncated = tmp_path / "a.bin"
    truncated.write_bytes(truncated.read_bytes()[:-10])
    assert "its index implies" in _one_error(_main("--data-path", str(tmp_path / "a.bin")))


# --------------------------------------------------------------------------- writes and prints


def test_a_failing_metrics_write_is_one_line_naming_its_flag() -> None:
    """/dev/full accepts the open and fails every write: it used to end the run with 30 lines
    of chained tracebacks."""
    proc = _train("--train-iters", "2", "--metrics-file", "/dev/full")
    line = _one_error(proc)
    assert line.startswith(
        "bfpp-train: error: --metrics-file /dev/full: cannot write iteration 1 (No space left"
    ), line


def test_a_save_path_too_long_for_its_files_is_refused_at_start(tmp_path: Path) -> None:
    """Valid at start (the directory itself can be made), too long for the files a save puts in
    it: that used to fail after training."""
    left = 4070 - len(str(tmp_path))  # the directory: 4,070 bytes; its files: over 4,095
    parts = []
    while left > 201:
        parts.append("d" * 200)
        left -= 201
    parts.append("e" * (left - 1))
    root = Path(tmp_path, *parts)
    assert len(str(root)) == 4070
    line = _one_error(_main("--save", str(root)))
    assert "too long for the checkpoint files a save creates there" in line, line


def test_the_launcher_prints_megatrons_usage_once_under_torchrun(tmp_path: Path) -> None:
    """Every rank parses the same arguments: each used to print Megatron's usage and error."""
    pytest.importorskip("megatron.training")
    script = tmp_path / "parse.py"
    script.write_text("from megatron.training.arguments import parse_args\nparse_args()\n")
    proc = run_launch(
        lambda port: [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(port), "-m", "megatron_bfpp.launch", str(script),
            "--num-layers", "x",
        ],
        capture_output=True, text=True, timeout=400, env=_env(),
    )  # fmt: skip
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert output.count("usage: parse.py") == 1, output[-3000:]
    assert output.count("error: argument --num-layers: invalid int value: 'x'") == 1
