"""``bfpp-train`` checkpoints end to end (real processes, 4 CPU gloo ranks, the default GPT):
files are data, a kill never loses the last complete checkpoint, a resume that cannot work is
refused before any weight is read, and what may change on resume (schedule, learning-rate
schedule with a flag, global batch size) continues exactly.

Two runs are shared: the uninterrupted 6-iteration reference and a run that stops and saves at
iteration 3; each test resumes from its own copy of that checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

ITERS = 6
SAVED_AT = 3
GBS = 8
META = "bfpp_checkpoint.json"
TRACKER = "latest_checkpointed_iteration.txt"
KILL_ENV = "BFPP_TEST_KILL_DURING_SAVE"
LOCK = ".bfpp_save.lock"


def _run(
    *flags: str, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli.train", "--no-progress", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **(env or {})},
    )


def _metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _losses(path: Path) -> dict[int, float]:
    return {m["iteration"]: m["lm_loss"] for m in _metrics(path)}


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The run failed with exactly one line on stderr, no traceback; that line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("bfpp-train: error: "), lines[0]
    assert "Traceback" not in proc.stderr
    return lines[0]


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Losses of the uninterrupted run."""
    path = tmp_path_factory.mktemp("reference") / "metrics.jsonl"
    proc = _run("--train-iters", str(ITERS), "--metrics-file", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint at iteration 3 of the same run (``--exit-interval``)."""
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    proc = _run("--train-iters", str(ITERS), "--exit-interval", str(SAVED_AT), "--save", str(ckpt))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ckpt


@pytest.fixture(scope="module")
def saved_dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``saved`` in the torch_dist format (only read from)."""
    ckpt = tmp_path_factory.mktemp("saved_dist") / "ckpt"
    flags = ("--exit-interval", str(SAVED_AT), "--save", str(ckpt), "--ckpt-format", "torch_dist")
    proc = _run("--train-iters", str(ITERS), *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ckpt


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    """This test's own copy of the saved checkpoint."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def _rewrite_metadata(ckpt: Path, change: Any) -> None:
    path = ckpt / f"iter_{SAVED_AT:07d}" / META
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _record_file(ckpt: Path, name: str) -> None:
    """Make the metadata agree with a replaced file (as someone crafting a checkpoint would)."""
    file = ckpt / f"iter_{SAVED_AT:07d}" / name

    def change(data: dict[str, Any]) -> None:
        for record in data["files"]:
            if record["name"] == name:
                record["size"] = file.stat().st_size
                record["sha256"] = hashlib.sha256(file.read_bytes()).hexdigest()

    _rewrite_metadata(ckpt, change)


def _resume(ckpt: Path, tmp_path: Path, *flags: str) -> tuple[Any, dict[int, float]]:
    metrics = tmp_path / "resumed.jsonl"
    proc = _run("--load", str(ckpt), "--metrics-file", str(metrics), *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, _losses(metrics)


# --------------------------------------------------------------------------- what may change


MOE_FIELDS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size")  # None: a dense model


def test_checkpoint_describes_itself(saved: Path) -> None:
    directory = saved / f"iter_{SAVED_AT:07d}"
    assert (saved / TRACKER).read_text().strip() == str(SAVED_AT)
    meta = json.loads((directory / META).read_text())
    assert meta["iteration"] == SAVED_AT and meta["consumed_samples"] == SAVED_AT * GBS
    assert meta["ckpt_format"] == "torch"
    assert meta["run"]["layout"] == {
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 4,
        "num_virtual_stages_per_pipeline_rank": 2,
        "placement": "looped",
        "data_parallel_size": 1,
        "world_size": 4,
        # the uneven-stage flags, not given: even stages
        "pipeline_model_parallel_layout": None,
        "decoder_first_pipeline_num_layers": None,
        "decoder_last_pipeline_num_layers": None,
        "account_for_embedding_in_pipeline_split": False,
        "account_for_loss_in_pipeline_split": False,
        "expert_model_parallel_size": 1,
    }
    assert {key: meta["run"]["model"][key] for key in MOE_FIELDS} == dict.fromkeys(MOE_FIELDS)
    assert meta["run"]["pipeline_schedule"] == "breadth-first"
    assert meta["run"]["training"]["global_batch_size"] == GBS
    assert meta["megatron_core"].count(".") == 2
    names = sorted(record["name"] for record in meta["files"])
    assert names == [f"rank_{rank:05d}.pt" for rank in range(4)]
    assert sorted(p.name for p in directory.iterdir()) == sorted([*names, META])
    assert not [p for p in saved.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_resume_under_another_schedule_is_bit_exact(
    reference: dict[int, float], ckpt: Path, tmp_path: Path
) -> None:
    """The schedule does not change the parameters: breadth-first's checkpoint resumed under
    interleaved (same placement) continues the uninterrupted curve exactly."""
    _, losses = _resume(
        ckpt, tmp_path, "--train-iters", str(ITERS), "--pipeline-schedule", "interleaved"
    )
    assert sorted(losses) == list(range(SAVED_AT + 1, ITERS + 1))
    for iteration, loss in losses.items():
        assert loss == reference[iteration], (iteration, losses, reference)


def test_train_further_on_the_checkpoints_schedule(
    reference: dict[int, float], ckpt: Path, tmp_path: Path
) -> None:
    """More --train-iters with the old decay length (--lr-decay-iters): the first iterations are
    the uninterrupted run's, after the decay the learning rate stays at --min-lr."""
    _, losses = _resume(ckpt, tmp_path, "--train-iters", "8", "--lr-decay-iters", str(ITERS))
    assert sorted(losses) == list(range(SAVED_AT + 1, 9))
    for iteration in range(SAVED_AT + 1, ITERS + 1):
        assert losses[iteration] == reference[iteration]
    lrs = {m["iteration"]: m["lr"] for m in _metrics(tmp_path / "resumed.jsonl")}
    assert lrs[7] == lrs[8] == pytest.approx(3e-4)


def test_changed_lr_schedule_is_refused_naming_the_flags(ckpt: Path) -> None:
    proc = _run("--load", str(ckpt), "--lr", "1e-3", "--train-iters", "8")
    line = _error_line(proc)
    assert "--lr 0.001 (checkpoint: 0.003)" in line, line
    assert "--train-iters 8" in line, line
    assert (
        "--override-opt_param-scheduler" in line and "--use-checkpoint-opt_param-scheduler" in line
    )
    assert "--lr-decay-iters 6" in line, line
    assert proc.stdout == ""  # refused before any rank started


@pytest.mark.parametrize(
    ("flag", "lr_at_4"),
    # iteration 4 is half way through the cosine decay (warm-up 2 of 6 iterations):
    # min + (max - min) / 2
    [
        ("--override-opt_param-scheduler", (1e-3 + 3e-4) / 2),
        ("--use-checkpoint-opt_param-scheduler", (3e-3 + 3e-4) / 2),
    ],
    ids=["override", "use-checkpoint"],
)
@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_scheduler_flags_choose_whose_schedule(
    reference: dict[int, float],
    ckpt: Path,
    saved_dist: Path,
    tmp_path: Path,
    flag: str,
    lr_at_4: float,
    ckpt_format: str,
) -> None:
    """Either format: megatron-core 0.19 pairs torch_dist's parameter groups by their values,
    --lr among them, which no longer matched once --lr changed."""
    source = ckpt if ckpt_format == "torch" else saved_dist
    flags = ("--lr", "1e-3", flag, "--train-iters", "4", "--lr-decay-iters", str(ITERS))
    _, losses = _resume(source, tmp_path, *flags, "--ckpt-format", ckpt_format)
    lrs = {m["iteration"]: m["lr"] for m in _metrics(tmp_path / "resumed.jsonl")}
    assert lrs[4] == pytest.approx(lr_at_4, rel=1e-9)
    # the loss of iteration 4 is computed before its optimizer step: the same either way
    assert losses[4] == reference[4]


def test_changed_global_batch_size_reads_the_next_samples(
    reference: dict[int, float], ckpt: Path, tmp_path: Path
) -> None:
    """Resumed with a global batch of 16, iteration 4 reads samples 24..39 (the consumed count
    goes on), not 48..63 (iteration x new batch). Its loss is the mean over those 16 samples on
    the model of iteration 3: the reference's iteration 4 (samples 24..31) and, from a copy of
    the checkpoint whose consumed count says 32, samples 32..39."""
    proc, losses = _resume(
        ckpt,
        tmp_path,
        "--global-batch-size",
        "16",
        "--use-checkpoint-opt_param-scheduler",
        "--train-iters",
        "5",
    )
    consumed = {m["iteration"]: m["consumed_samples"] for m in _metrics(tmp_path / "resumed.jsonl")}
    assert consumed == {4: SAVED_AT * GBS + 16, 5: SAVED_AT * GBS + 32}
    assert "from iteration 3 (24 samples consumed)" in proc.stdout

    later = Path(shutil.copytree(ckpt, tmp_path / "later"))

    def consumed_32(data: dict[str, Any]) -> None:
        data["consumed_samples"] = 32

    _rewrite_metadata(later, consumed_32)
    other = tmp_path / "other"
    other.mkdir()
    _, second_half = _resume(later, other, "--train-iters", "4", "--lr-decay-iters", str(ITERS))
    assert losses[4] == pytest.approx((reference[4] + second_half[4]) / 2, abs=1e-6)
    assert abs(losses[4] - reference[4]) > 1e-4  # the two halves differ: the check has teeth


def test_torch_dist_save_and_resume_continue_exactly(
    reference: dict[int, float], tmp_path: Path
) -> None:
    """megatron-core's distributed checkpointing end to end on CPU/gloo ranks: saved at
    iteration 3, resumed, the uninterrupted curve. Each run ends (its pipes close: no writer
    process outlives it) with nothing on stderr."""
    pytest.importorskip("psutil")  # megatron-core's writer needs it; bfpp-train refuses without
    ckpt = tmp_path / "ckpt"
    flags = ("--train-iters", str(ITERS), "--ckpt-format", "torch_dist")
    proc = _run(*flags, "--exit-interval", str(SAVED_AT), "--save", str(ckpt))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    directory = ckpt / f"iter_{SAVED_AT:07d}"
    meta = json.loads((directory / META).read_text())
    assert meta["ckpt_format"] == "torch_dist" and meta["iteration"] == SAVED_AT
    assert (directory / ".metadata").is_file() and list(directory.glob("*.distcp"))

    resumed, losses = _resume(ckpt, tmp_path, *flags)
    assert resumed.stderr == ""
    assert "from iteration 3 (24 samples consumed)" in resumed.stdout
    assert sorted(losses) == list(range(SAVED_AT + 1, ITERS + 1))
    for iteration, loss in losses.items():
        assert loss == reference[iteration], (iteration, losses, reference)


# --------------------------------------------------------------------------- what is refused


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--num-layers", "16"], ["--num-layers 8, this run has 16"]),
        (
            ["--hidden-size", "128", "--num-layers", "16"],
            ["--num-layers 8, this run has 16", "--hidden-size 64, this run has 128"],
        ),
        (
            ["--pipeline-model-parallel-size", "2"],
            ["--pipeline-model-parallel-size 4, this run has 2"],
        ),
        (["--nproc-per-node", "8"], ["4 ranks (data-parallel size 1), this run has 8 (2)"]),
    ],
    ids=["layers", "layers-and-hidden", "pipeline-size", "world-size"],
)
def test_other_model_or_layout_is_refused_before_loading(
    ckpt: Path, flags: list[str], named: list[str]
) -> None:
    proc = _run("--load", str(ckpt), "--train-iters", str(ITERS), *flags)
    line = _error_line(proc)
    assert line.startswith(f"bfpp-train: error: --load {ckpt}: checkpoint was saved with "), line
    for text in named:
        assert text in line, line
    assert proc.stdout == ""  # no rank started


def test_truncated_rank_file_is_named_before_start(ckpt: Path) -> None:
    file = ckpt / f"iter_{SAVED_AT:07d}" / "rank_00002.pt"
    file.write_bytes(file.read_bytes()[:100_000])
    line = _error_line(_run("--load", str(ckpt), "--train-iters", str(ITERS)))
    assert f"iter_{SAVED_AT:07d}/rank_00002.pt has 100000 bytes" in line, line
    assert "truncated" in line


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_damaged_rank_file_is_named_by_its_rank(ckpt: Path, damage: str) -> None:
    """Metadata that agrees with a damaged file (sizes and digest rewritten) still gets one line
    naming the file: the rank's ``torch.load`` fails or the digest differs."""
    name = "rank_00002.pt"
    file = ckpt / f"iter_{SAVED_AT:07d}" / name
    data = bytearray(file.read_bytes())
    if damage == "truncated":
        file.write_bytes(bytes(data[:100_000]))
        _record_file(ckpt, name)
        expected = "is unreadable (truncated or corrupt"
    else:
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))
        expected = "does not match the SHA-256"
    line = _error_line(_run("--load", str(ckpt), "--train-iters", str(ITERS)))
    assert f"iter_{SAVED_AT:07d}/{name} {expected}" in line, line


def test_malicious_rank_file_is_not_run(ckpt: Path, tmp_path: Path) -> None:
    """A rank file whose unpickling would run a shell command (metadata rewritten to match it)
    is refused by ``weights_only`` loading: the command never runs, one line names the file."""
    marker = tmp_path / "pwned"
    name = "rank_00000.pt"
    script = (
        "import os, sys, torch\n"
        "class Payload:\n"
        "    def __reduce__(self):\n"
        "        return (os.system, (f'touch {sys.argv[2]}',))\n"
        "torch.save({'iteration': 3, 'model': Payload()}, sys.argv[1])\n"
    )
    file = ckpt / f"iter_{SAVED_AT:07d}" / name
    subprocess.run([sys.executable, "-c", script, str(file), str(marker)], check=True)
    _record_file(ckpt, name)
    line = _error_line(_run("--load", str(ckpt), "--train-iters", str(ITERS)))
    assert f"iter_{SAVED_AT:07d}/{name} refused: it would call posix.system" in line, line
    assert not marker.exists()


# --------------------------------------------------------------------------- kills


@pytest.mark.parametrize(
    ("kill", "after"),
    [("rank-file:3", "temporary"), ("publish:0", "moved-aside")],
    ids=["before-last-rank-file", "between-renames"],
)
def test_kill_during_a_resave_keeps_the_complete_checkpoint(
    reference: dict[int, float], ckpt: Path, tmp_path: Path, kill: str, after: str
) -> None:
    """Re-saving iteration 3 (a new run saving into the same directory) is killed: while rank 3
    has not written its file (3 of 4 files in the temporary directory), or on rank 0 between
    moving the old iteration 3 aside and renaming the new one in. The old checkpoint and the
    tracker survive, a resume from it continues the reference curve, and that resume's save
    clears what the kill left."""
    directory = ckpt / f"iter_{SAVED_AT:07d}"
    before = _digests(directory)
    proc = _run(
        "--train-iters",
        str(ITERS),
        "--exit-interval",
        str(SAVED_AT),
        "--save",
        str(ckpt),
        env={KILL_ENV: kill},
    )
    assert proc.returncode != 0
    assert (ckpt / TRACKER).read_text().strip() == str(SAVED_AT)
    if after == "temporary":
        assert _digests(directory) == before
        (temp,) = [p for p in ckpt.iterdir() if ".tmp-" in p.name]
        assert len(list(temp.glob("rank_*.pt"))) == 3 and not (temp / META).exists()
    else:
        assert not directory.exists()
        (aside,) = [p for p in ckpt.iterdir() if ".old-" in p.name]
        assert _digests(aside) == before

    _, losses = _resume(ckpt, tmp_path, "--train-iters", str(ITERS), "--save", str(ckpt))
    for iteration, loss in losses.items():
        assert loss == reference[iteration], (iteration, losses, reference)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        LOCK,
        f"iter_{SAVED_AT:07d}",
        f"iter_{ITERS:07d}",
        TRACKER,
    ]
    assert _digests(directory) == before
    assert (ckpt / TRACKER).read_text().strip() == str(ITERS)


# --------------------------------------------------------------------------- faults


def _limit_file_size(limit: int) -> None:
    """In the child: files may not grow past ``limit`` bytes (Python ignores SIGXFSZ, so a write
    past it fails with EFBIG): a full disk, without root or a small file system."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_failed_save_is_one_line_keeps_the_last_checkpoint_and_clears_its_files(
    reference: dict[int, float], ckpt: Path, tmp_path: Path, ckpt_format: str
) -> None:
    """The disk fills during a save (here: no file may grow past 64 KiB, smaller than any rank's
    share): one line naming the directory and what failed, not torch's 43-line RuntimeError
    or megatron-core's CheckpointException; the tracker and the last checkpoint untouched, the
    failed save's temporary directory removed, and a resume from it continues exactly."""
    if ckpt_format == "torch_dist":
        pytest.importorskip("psutil")
    directory = ckpt / f"iter_{SAVED_AT:07d}"
    before = _digests(directory)
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli.train", "--no-progress", "--load", str(ckpt),
         "--train-iters", str(ITERS), "--save", str(ckpt), "--ckpt-format", ckpt_format],
        capture_output=True,
        text=True,
        timeout=300,
        env=base,
        preexec_fn=lambda: _limit_file_size(64 * 1024),
    )  # fmt: skip
    line = _error_line(proc)
    assert line.startswith(
        f"bfpp-train: error: --save {ckpt}: rank 0 could not write iteration {ITERS} ("
    ), line
    assert line.endswith(
        "bytes free there); the last complete checkpoint is untouched and this save's files "
        "were removed"
    ), line
    assert (ckpt / TRACKER).read_text().strip() == str(SAVED_AT)
    assert _digests(directory) == before
    assert sorted(p.name for p in ckpt.iterdir()) == [LOCK, directory.name, TRACKER]
    _, losses = _resume(ckpt, tmp_path, "--train-iters", str(ITERS))
    for iteration, loss in losses.items():
        assert loss == reference[iteration], (iteration, losses, reference)


def test_a_second_run_on_the_same_save_directory_is_refused(tmp_path: Path) -> None:
    """Two runs with one ``--save``: their checkpoints used to overwrite each other's (both
    exiting 0). The second is refused in one line naming the first, before any rank starts;
    the first goes on."""
    ckpt = tmp_path / "ckpt"
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    first = subprocess.Popen(
        [sys.executable, "-m", "megatron_bfpp.cli.train", "--no-progress", "--train-iters", "400",
         "--save", str(ckpt), "--save-interval", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=base,
    )  # fmt: skip
    try:
        lock = ckpt / LOCK
        while not (lock.exists() and f"pid {first.pid} on" in lock.read_text()):
            assert first.poll() is None, first.communicate()[1][-3000:]
        second = _run("--train-iters", str(ITERS), "--save", str(ckpt))
        line = _error_line(second)
        assert line.startswith(
            f"bfpp-train: error: --save {ckpt}: another run is saving there (pid {first.pid} on "
        ), line
        assert second.stdout == ""  # no rank started
        assert first.poll() is None  # the first run is still training
    finally:
        first.terminate()
        first.communicate(timeout=120)
    assert sorted(p.name for p in ckpt.iterdir()) == [LOCK]  # neither run saved anything


def test_saving_over_another_models_checkpoint_is_refused_before_start(ckpt: Path) -> None:
    """``--save`` into a directory whose checkpoint records another model (hidden 64 there,
    128 here) used to overwrite it and exit 0, though ``--load`` of it would be refused."""
    before = _digests(ckpt / f"iter_{SAVED_AT:07d}")
    proc = _run("--hidden-size", "128", "--train-iters", "1", "--save", str(ckpt))
    line = _error_line(proc)
    assert line == (
        f"bfpp-train: error: --save {ckpt}: holds a checkpoint of another model (iteration "
        f"{SAVED_AT}, saved with --hidden-size 64, this run has 128; --ffn-hidden-size 256, "
        "this run has 512); this run's saves would overwrite it: choose another --save directory"
    ), line
    assert proc.stdout == ""  # no rank started
    assert (ckpt / TRACKER).read_text().strip() == str(SAVED_AT)
    assert _digests(ckpt / f"iter_{SAVED_AT:07d}") == before


# Taking --save's lock on a full disk (os.pwrite fails with ENOSPC, as it does there), then the
# command line as usual.
_FULL_DISK_AT_THE_LOCK = """
import errno, os, sys
from megatron_bfpp.cli.train import main

def full(fd, data, offset):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

os.pwrite = full
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_at_the_save_lock_is_one_line_and_leaves_no_lock_file(
    tmp_path: Path,
) -> None:
    """It was a 10-line OSError traceback, and a 0-byte lock file stayed behind."""
    save = tmp_path / "ckpt"
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_AT_THE_LOCK, "--no-progress", "--train-iters", "1",
         "--save", str(save)],
        capture_output=True, text=True, timeout=120, env=base,
    )  # fmt: skip
    line = _error_line(proc)
    assert line == (
        f"bfpp-train: error: --save {save}: cannot write its lock file {LOCK} (No space left "
        "on device); free space there or choose another --save directory"
    ), line
    assert list(save.iterdir()) == []


def test_a_dangling_save_symlink_is_followed(tmp_path: Path) -> None:
    """The link's target is created and holds the checkpoint; the link stays. It was refused
    with "cannot create its lock file ... (File exists)"."""
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "disk" / "ckpt")
    proc = _run(
        *("--nproc-per-node", "1", "--pipeline-model-parallel-size", "1"),
        *("--pipeline-schedule", "1f1b", "--train-iters", "1", "--save", str(link)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert link.is_symlink()
    assert (tmp_path / "disk" / "ckpt" / TRACKER).read_text().strip() == "1"
    assert (tmp_path / "disk" / "ckpt" / "iter_0000001" / META).is_file()


def test_a_looping_save_symlink_is_one_line_naming_it(tmp_path: Path) -> None:
    loop = tmp_path / "ckpt"
    loop.symlink_to(loop)
    line = _error_line(_run("--train-iters", "1", "--save", str(loop)))
    assert line == (
        f"bfpp-train: error: --save {loop}: a symbolic link that loops (too many levels of "
        "symbolic links); point it at a directory or remove it"
    ), line
