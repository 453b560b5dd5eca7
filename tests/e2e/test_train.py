"""``bfpp-train`` end to end: real processes, 4 CPU gloo ranks, the default small GPT.

One 10-iteration breadth-first run (the defaults) is the reference: its loss falls, its metrics
file has the documented keys, the other runnable schedules reproduce its first losses (same seed,
same pp=4 layout; gpipe/1f1b at vp=1, interleaved at vp=2: parameters are initialised by global
layer, so the layout does not change the model), and 5 iterations + a resume from the checkpoint
continue its curve. Bad flags fail fast with one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

ITERS = 10
COMPARED = 3  # losses 1..3 depend only on the warm-up learning rates, not on --train-iters


def _run(*flags: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli.train", "--no-progress", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _losses(path: Path) -> dict[int, float]:
    return {m["iteration"]: m["lm_loss"] for m in _metrics(path)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default breadth-first run (pp=4, vp=2, 8 micro-batches), 10 iterations."""
    path = tmp_path_factory.mktemp("reference") / "metrics.jsonl"
    proc = _run("--train-iters", str(ITERS), "--metrics-file", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


def test_default_breadth_first_run_loss_falls(reference: Path) -> None:
    losses = _losses(reference)
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert losses[ITERS] < losses[1] - 0.1, losses
    assert sum(losses[i] for i in range(8, 11)) < sum(losses[i] for i in range(1, 4)) - 0.3


def test_metrics_file_keys(reference: Path) -> None:
    for record in _metrics(reference):
        assert {
            "iteration",
            "lm_loss",
            "step_time_s",
            "pipeline_schedule",
            "lr",
            "grad_norm",
            "tokens_per_s",
        } <= set(record)
        assert record["pipeline_schedule"] == "breadth-first"
        assert record["step_time_s"] > 0 and record["tokens_per_s"] > 0
        # Measured per pipeline rank (4 by default), for every schedule.
        assert len(record["peak_activation_bytes"]) == 4
        assert all(b > 0 for b in record["peak_activation_bytes"])
        assert len(record["peak_stored_microbatches"]) == 4


@pytest.mark.parametrize(
    ("schedule", "vp"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("bpipe", 1)], ids=str
)
def test_schedules_give_the_same_losses(
    reference: Path, tmp_path: Path, schedule: str, vp: int
) -> None:
    path = tmp_path / "metrics.jsonl"
    proc = _run(
        "--pipeline-schedule",
        schedule,
        "--num-virtual-stages-per-pipeline-rank",
        str(vp),
        "--train-iters",
        str(COMPARED),
        "--metrics-file",
        str(path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = _losses(reference)
    got = _losses(path)
    assert sorted(got) == list(range(1, COMPARED + 1))
    assert {m["pipeline_schedule"] for m in _metrics(path)} == {schedule}
    for iteration, loss in got.items():
        assert loss == pytest.approx(want[iteration], abs=1e-5), (iteration, got, want)


def test_bpipe_caps_measured_activation_memory(tmp_path: Path) -> None:
    """The metrics file shows BPipe's point: rank 0 stores ceil((p+2)/2) = 3 micro-batches
    instead of 1F1B's p = 4, and the busiest rank holds fewer bytes."""
    peaks = {}
    for schedule in ("1f1b", "bpipe"):
        path = tmp_path / f"{schedule}.jsonl"
        proc = _run(
            "--pipeline-schedule",
            schedule,
            "--num-virtual-stages-per-pipeline-rank",
            "1",
            "--train-iters",
            "2",
            "--metrics-file",
            str(path),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        peaks[schedule] = _metrics(path)[-1]
    assert peaks["1f1b"]["peak_stored_microbatches"] == [4, 3, 2, 1]
    assert max(peaks["bpipe"]["peak_stored_microbatches"]) <= 3
    assert max(peaks["bpipe"]["peak_activation_bytes"]) < max(
        peaks["1f1b"]["peak_activation_bytes"]
    )


def test_resume_continues_the_same_curve(reference: Path, tmp_path: Path) -> None:
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    proc = _run(
        "--train-iters",
        str(ITERS),
        "--exit-interval",
        "5",
        "--save",
        str(ckpt),
        "--metrics-file",
        str(first),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(_losses(first)) == [1, 2, 3, 4, 5]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    proc = _run("--train-iters", str(ITERS), "--load", str(ckpt), "--metrics-file", str(second))
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = _losses(reference)
    resumed = _losses(second)
    assert sorted(resumed) == list(range(6, ITERS + 1))
    for iteration, loss in {**_losses(first), **resumed}.items():
        assert loss == pytest.approx(want[iteration], abs=1e-6), (iteration, resumed, want)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--pipeline-schedule", "zigzag"], "unknown --pipeline-schedule 'zigzag'"),
        (
            ["--num-virtual-stages-per-pipeline-rank", "1"],
            "breadth-first needs virtual pipeline stages",
        ),
        (["--tensor-model-parallel-size", "3"], "tp*pp*dp must equal the number of ranks"),
        (["--pipeline-schedule", "v-half"], "not yet runnable"),
        (["--num-layers", "6"], "--num-layers 6 is not divisible"),
        (["--bpipe-max-stored", "2"], "--bpipe-max-stored applies to --pipeline-schedule bpipe"),
    ],
    ids=["unknown-schedule", "bf-without-vp", "world-size", "not-runnable", "layers", "bpipe-cap"],
)
def test_bad_flags_one_line_nonzero_exit(flags: list[str], expected: str) -> None:
    start = time.monotonic()
    proc = _run(*flags, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("bfpp-train: error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert elapsed < 30


def test_bad_flags_under_torchrun_env_fail_on_the_rank() -> None:
    """Launched by torchrun/srun (RANK set): each rank validates and fails alone, no hang."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli.train", "--pipeline-model-parallel-size", "4"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "tp*pp*dp" in lines[0], proc.stderr
