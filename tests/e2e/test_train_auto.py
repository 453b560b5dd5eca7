"""``bfpp-train --pipeline-schedule auto`` end to end on CPU ranks: one line before the ranks
start, the chosen schedule runs, and its losses equal the same schedule named explicitly; the
report; the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bfpp.config.run_config import layout_stages

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]

ITERS = 3
# pp=4 on 4 CPU ranks, 8 layers (2 per rank), 8 micro-batches: auto may choose among 1f1b,
# gpipe, bpipe, interleaved / breadth-first vp=2 and the V-shapes.
LAYOUT = ("--train-iters", str(ITERS), "--num-layers", "8", "--global-batch-size", "8")


def _run(*flags: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli.train", "--no-progress", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["lm_loss"] for line in path.read_text().splitlines() if line]


def _named(choice: dict, *, stages: bool = True) -> list[str]:
    """The flags naming auto's choice (``stages``: its virtual stages too; a layout fixes them)."""
    named = ["--pipeline-schedule", choice["schedule"]]
    if stages:
        named += ["--num-virtual-stages-per-pipeline-rank", str(choice["virtual_stages"])]
    if choice["group_size"] is not None:
        named += ["--breadth-first-group-size", str(choice["group_size"])]
    if choice["max_stored"] is not None:
        named += ["--bpipe-max-stored", str(choice["max_stored"])]
    return named


def test_auto_runs_its_choice_with_the_named_schedules_losses(tmp_path: Path) -> None:
    auto_metrics, report = tmp_path / "auto.jsonl", tmp_path / "auto.json"
    proc = _run(
        *LAYOUT,
        "--pipeline-schedule",
        "auto",
        "--metrics-file",
        str(auto_metrics),
        "--pipeline-schedule-auto-report",
        str(report),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("bfpp-train: auto: ")]
    assert len(lines) == 1, proc.stdout  # once per job, not once per rank
    assert "no CUDA: memory is not a constraint" in lines[0]
    named = _named(json.loads(report.read_text())["choice"])
    explicit = tmp_path / "named.jsonl"
    proc = _run(*LAYOUT, *named, "--metrics-file", str(explicit))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_losses(auto_metrics)) == ITERS
    assert _losses(auto_metrics) == _losses(explicit)


def test_auto_chooses_the_layout_too_and_its_choice_trains_as_named(tmp_path: Path) -> None:
    """--pipeline-model-parallel-layout auto: the planner's partition with the schedule, the line
    naming the layout that reproduces it, and the losses of both named."""
    report, metrics = tmp_path / "auto.json", tmp_path / "auto.jsonl"
    proc = _run(
        *LAYOUT, "--pipeline-schedule", "auto", "--pipeline-model-parallel-layout", "auto",
        "--metrics-file", str(metrics), "--pipeline-schedule-auto-report", str(report),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("bfpp-train: auto: ")]
    layout = line.split("its layout: --pipeline-model-parallel-layout ")[1].rstrip("]").strip("'")
    choice = json.loads(report.read_text())["choice"]
    assert [stage.count("t") for stage in layout_stages(layout)] == choice["stage_layers"]
    named = [*_named(choice, stages=False), "--pipeline-model-parallel-layout", layout]
    explicit = tmp_path / "named.jsonl"
    proc = _run(*LAYOUT, *named, "--metrics-file", str(explicit))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_losses(metrics)) == ITERS and _losses(metrics) == _losses(explicit)


@pytest.mark.parametrize(
    "uneven",
    [
        ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"],
        ["--pipeline-model-parallel-layout", "Et*2|t*2|t*2|t*2L"],
    ],
    ids=["first-last", "layout"],
)
def test_auto_on_uneven_stages_runs_its_choice_with_the_named_schedules_losses(
    tmp_path: Path, uneven: list[str]
) -> None:
    """auto plans on the user's uneven stages (each candidate's layers, the output layer in the
    last stage's time) and its choice trains with the losses of that schedule named on them."""
    report, metrics = tmp_path / "auto.json", tmp_path / "auto.jsonl"
    proc = _run(
        *LAYOUT, *uneven, "--pipeline-schedule", "auto", "--metrics-file", str(metrics),
        "--pipeline-schedule-auto-report", str(report),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("bfpp-train: auto: ")]
    assert len(lines) == 1 and lines[0].endswith(f"stages of {' '.join(uneven)}]"), lines
    data = json.loads(report.read_text())
    choice = data["choice"]
    assert sum(choice["stage_layers"]) == 8 and data["layout"]["uneven_stages"] == " ".join(uneven)
    named = _named(choice, stages="--pipeline-model-parallel-layout" not in uneven)
    explicit = tmp_path / "named.jsonl"
    proc = _run(*LAYOUT, *uneven, *named, "--metrics-file", str(explicit))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_losses(metrics)) == ITERS and _losses(metrics) == _losses(explicit)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--num-virtual-stages-per-pipeline-rank", "2", "--bpipe-max-stored", "3"],
            "--bpipe-max-stored applies to bpipe, which runs one stage per rank",
        ),
        (
            [
                "--pipeline-schedule-auto-gpu",
                "v100-32gb",
                "--hidden-size",
                "8192",
                "--num-attention-heads",
                "64",
                "--seq-length",
                "4096",
                "--micro-batch-size",
                "8",
                "--global-batch-size",
                "64",
            ],
            "nothing fits v100-32gb",
        ),
    ],
)
def test_auto_refusals_are_one_line(flags: list[str], words: str) -> None:
    proc = _run("--pipeline-schedule", "auto", "--num-layers", "8", *flags, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr


def test_auto_flags_need_auto() -> None:
    proc = _run("--pipeline-schedule", "1f1b", "--pipeline-schedule-auto-gpu", "v100-32gb")
    assert proc.returncode == 2
    assert "--pipeline-schedule-auto-gpu applies to --pipeline-schedule auto" in proc.stderr
