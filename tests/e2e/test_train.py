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
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

ITERS = 10
COMPARED = 3  # losses 1..3 depend only on the warm-up learning rates, not on --train-iters


def _run(
    *flags: str, timeout: float = 120, no_progress: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    progress = ("--no-progress",) if no_progress else ()
    return subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli.train", *progress, *flags],
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
        # In bfpp-sim's unit (micro-batches through a full 1F1B stage; a chunk at vp=2 is half
        # of one): the measured peaks are the simulator's for the same schedule.
        from megatron_bfpp.schedules.registry import build_schedule
        from megatron_bfpp.sim import simulate

        simulated = simulate(build_schedule("breadth-first", num_ranks=4, num_chunks=2,
                                            num_microbatches=8))  # fmt: skip
        assert record["peak_activations"] == list(simulated.peak_activations), record


@pytest.mark.parametrize(
    ("schedule", "vp"),
    [
        ("gpipe", None),
        ("1f1b", None),
        ("interleaved", 2),
        ("bpipe", 1),
        ("v-min", 2),
        ("v-half", None),
        ("v-zb", 2),
        ("dualpipe-v", None),
    ],
    ids=str,
)
def test_schedules_give_the_same_losses(
    reference: Path, tmp_path: Path, schedule: str, vp: int | None
) -> None:
    """Without --num-virtual-stages-per-pipeline-rank each schedule takes its own default (1 for
    gpipe and 1f1b, as in Megatron-LM)."""
    path = tmp_path / "metrics.jsonl"
    vp_flag = () if vp is None else ("--num-virtual-stages-per-pipeline-rank", str(vp))
    proc = _run(
        "--pipeline-schedule",
        schedule,
        *vp_flag,
        "--train-iters",
        str(COMPARED),
        "--metrics-file",
        str(path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from megatron_bfpp.schedules.registry import get_spec

    default_vp = get_spec(schedule).default_stages_per_rank  # the V places two per rank
    assert f"vp={vp or default_vp} " in proc.stdout  # the banner
    want = _losses(reference)
    got = _losses(path)
    assert sorted(got) == list(range(1, COMPARED + 1))
    assert {m["pipeline_schedule"] for m in _metrics(path)} == {schedule}
    for iteration, loss in got.items():
        assert loss == pytest.approx(want[iteration], abs=1e-5), (iteration, got, want)


LAYOUT = "--pipeline-model-parallel-layout"
V_HALF = ["--pipeline-schedule", "v-half"]


ENDS = ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"]


@pytest.mark.parametrize(
    "flags",
    [
        [*V_HALF, LAYOUT, "E|t*2|t|t|t|t|t|tL"],  # stage 0 the embedding alone
        ["--pipeline-schedule", "dualpipe-v", LAYOUT, "Et*2|t*2|t|||t|t|tL"],  # rank 3: nothing
        [LAYOUT, "Et*2||t|t|t||t*2|tL"],  # breadth-first; rank 1: nothing
        ["--pipeline-schedule", "bpipe", LAYOUT, "Et*4||t*2|t*2L"],
        ["--pipeline-schedule", "1f1b", *ENDS],  # 1, 2, 2, 3 layers
    ],
    ids=["v-half-layout", "dualpipe-v-empty-rank", "bf-empty-rank", "bpipe-layout", "1f1b-ends"],
)
def test_uneven_stages_give_the_same_losses(
    reference: Path, tmp_path: Path, flags: list[str]
) -> None:
    """Megatron-LM's uneven-stage flags (docs/megatron-lm.md#uneven-stages): the same model
    (initialised by global layer) on other stages per rank trains to the reference's losses."""
    path = tmp_path / "metrics.jsonl"
    proc = _run(*flags, "--train-iters", str(COMPARED), "--metrics-file", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = _losses(reference), _losses(path)
    assert sorted(got) == list(range(1, COMPARED + 1))
    for iteration, loss in got.items():
        assert loss == pytest.approx(want[iteration], abs=1e-5), (iteration, got, want)


MOE = ["--pipeline-model-parallel-size", "2", "--num-experts", "4", "--global-batch-size", "16"]
OVERLAP = [*MOE, "--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm"]


def test_experts_dualpipe_v_gives_1f1bs_losses_and_the_counted_parameters(tmp_path: Path) -> None:
    """A Mixture-of-Experts GPT (4 experts, top 2, megatron-core's all-to-all dispatcher on gloo):
    dualpipe-v with the experts split over 2 ranks, saved at iteration 2 and resumed, trains to
    1F1B's losses with every expert on each rank (experts are initialised by global index, so
    both hold one model); each pipeline rank holds the parameter bytes the memory check counts,
    and a resume at another expert-parallel size is refused in one line."""
    from megatron_bfpp.config.model_memory import parameters_per_pipeline_rank
    from megatron_bfpp.config.run_config import Layout, ModelShape
    from megatron_bfpp.ir import Placement

    def train(schedule: str, ep: str, *flags: str) -> subprocess.CompletedProcess[str]:
        path = tmp_path / f"{schedule}.jsonl"
        ours = ["--pipeline-schedule", schedule, "--expert-model-parallel-size", ep]
        return _run(
            *MOE, *ours, "--train-iters", str(COMPARED), "--metrics-file", str(path), *flags
        )

    checkpoint = str(tmp_path / "ckpt")
    saved = ["--save", checkpoint, "--save-interval", "2"]
    for schedule, ep, flags in (
        ("1f1b", "1", []),
        ("dualpipe-v", "2", [*saved, "--exit-interval", "2"]),
        ("dualpipe-v", "2", ["--load", checkpoint]),  # appends iteration 3 to its metrics
    ):
        proc = train(schedule, ep, *flags)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "8 layers (4 experts, top 2)" in proc.stdout and f"ep={ep}," in proc.stdout
    want, got = (_losses(tmp_path / f"{name}.jsonl") for name in ("1f1b", "dualpipe-v"))
    assert sorted(got) == list(range(1, COMPARED + 1))
    for iteration, loss in got.items():
        assert loss == pytest.approx(want[iteration], abs=1e-5), (iteration, got, want)
    shape = ModelShape("gpt", 8, 64, 4, None, None, 64, 256, 4)
    layout = Layout(1, 2, 2, Placement.V_SHAPE, 2, 4, expert_model_parallel_size=2)
    counted = [4 * n for n in parameters_per_pipeline_rank(shape, layout)]  # fp32
    assert _metrics(tmp_path / "dualpipe-v.jsonl")[-1]["peak_parameter_bytes"] == counted
    refused = train("dualpipe-v", "1", "--load", checkpoint)
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith(
        "checkpoint was saved with --expert-model-parallel-size 2, this run has 1; a checkpoint "
        "resumes only on the same model and parallel layout (the schedule, --micro-batch-size "
        "and --global-batch-size may change)"
    ), refused.stderr


def test_bf16_experts_run_overlapped_pairs_combined_and_resume_exactly(tmp_path: Path) -> None:
    """--bf16 (bf16 weights, fp32 main weights in the optimizer, as Megatron-LM's) with
    --overlap-moe-expert-parallel-comm: dualpipe-v's pairs run as megatron-core's combined step
    (forwards built as schedule plans, counted per iteration) with exactly the losses of
    dualpipe-v run plainly. Saved at iteration 2 in either format and resumed, iterations 3 and 4
    are the uninterrupted run's (the per-rank file keeps the main weights: rebuilt from bf16
    weights they would round, and iteration 4 would differ); each pipeline rank holds 2 bytes
    per counted parameter, and a resume in fp32 is refused in one line."""
    from megatron_bfpp.config.model_memory import parameters_per_pipeline_rank
    from megatron_bfpp.config.run_config import Layout, ModelShape
    from megatron_bfpp.ir import Placement

    flags = [*MOE, "--expert-model-parallel-size", "2", "--pipeline-schedule", "dualpipe-v"]
    overlap = "--overlap-moe-expert-parallel-comm"

    def train(name: str, *more: str) -> subprocess.CompletedProcess[str]:
        path = ["--metrics-file", str(tmp_path / f"{name}.jsonl")]
        proc = _run(*flags, "--train-iters", "4", *path, *more, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    plain = train("plain", "--bf16")
    assert ", bf16, " in plain.stdout and "with the all-to-all overlap" not in plain.stdout
    for form in ("torch", "torch_dist"):
        saved = ["--save", str(tmp_path / form), "--save-interval", "2", "--exit-interval", "2"]
        first = train(form, "--bf16", overlap, "--ckpt-format", form, *saved)
        assert "schedule dualpipe-v with the all-to-all overlap" in first.stdout
        train(form, "--bf16", overlap, "--ckpt-format", form, "--load", str(tmp_path / form))
    want = _metrics(tmp_path / "plain.jsonl")
    for form in ("torch", "torch_dist"):
        got = _metrics(tmp_path / f"{form}.jsonl")  # iterations 1-2, then the resumed 3-4
        assert [m["iteration"] for m in got] == [1, 2, 3, 4], got
        assert [m["lm_loss"] for m in got] == [m["lm_loss"] for m in want], (form, got, want)
        assert all(m["schedule_plans"] > 0 for m in got)
    assert all(m["schedule_plans"] == 0 for m in want)
    shape = ModelShape("gpt", 8, 64, 4, None, None, 64, 256, 4)
    layout = Layout(1, 2, 2, Placement.V_SHAPE, 2, 4, expert_model_parallel_size=2)
    counted = [2 * n for n in parameters_per_pipeline_rank(shape, layout)]  # bf16
    assert want[-1]["peak_parameter_bytes"] == counted
    refused = _run(*flags, "--train-iters", "4", "--load", str(tmp_path / "torch"))
    assert refused.returncode == 2
    assert "checkpoint was saved with --bf16, this run has fp32" in refused.stderr, refused.stderr


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
    assert peaks["1f1b"]["peak_activations"] == [4, 3, 2, 1]
    assert max(peaks["bpipe"]["peak_activations"]) <= 3
    assert max(peaks["bpipe"]["peak_activation_bytes"]) < max(
        peaks["1f1b"]["peak_activation_bytes"]
    )


def test_log_without_a_terminal_is_one_line_per_iteration() -> None:
    """Without --no-progress and with stdout a pipe (as in a SLURM log) the run logs lines: a
    redrawn bar would leave every iteration on one line joined by carriage returns."""
    proc = _run("--train-iters", "3", no_progress=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stdout
    logged = [line for line in proc.stdout.splitlines() if line.startswith("iteration ")]
    assert [line.split("|")[0].split()[1] for line in logged] == ["1/3", "2/3", "3/3"]
    assert "vp=2 " in proc.stdout  # the banner, as with --no-progress


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
        (
            ["--pipeline-schedule", "v-half", "--num-virtual-stages-per-pipeline-rank", "4"],
            "v-half places exactly 2 stages per rank (V-shape); drop "
            "--num-virtual-stages-per-pipeline-rank or set it to 2, got 4",
        ),
        (["--num-layers", "6"], "--num-layers 6 is not divisible"),
        (["--bpipe-max-stored", "2"], "--bpipe-max-stored applies to --pipeline-schedule bpipe"),
        (
            [
                "--pipeline-schedule",
                "bpipe",
                "--num-virtual-stages-per-pipeline-rank",
                "1",
                "--bpipe-max-stored",
                "1",
            ],
            "error: --pipeline-schedule bpipe cannot run 8 micro-batches on pp=4: "
            "--bpipe-max-stored 1 leaves no room to load an evicted micro-batch back while "
            "another is stored; use --bpipe-max-stored 2 or more",
        ),
        (
            ["--pipeline-schedule", "1f1b", "--num-virtual-stages-per-pipeline-rank", "2"],
            "1f1b runs one stage per rank; drop --num-virtual-stages-per-pipeline-rank or set "
            "it to 1 (got 2)",
        ),
        (["--lr", "inf"], "argument --lr: expected a finite number, got 'inf' (see --help)"),
        (["--lr", "nan"], "argument --lr: expected a finite number, got 'nan'"),
        (["--min-lr", "inf"], "argument --min-lr: expected a finite number, got 'inf'"),
        (["--lr", "0"], "need --lr > 0 and 0 <= --min-lr <= --lr (got 0.0, 0.0003)"),
        (["--lr-warmup-iters", "-1"], "--lr-warmup-iters must be >= 0, got -1"),
        (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
        (["--weight-decay", "inf"], "argument --weight-decay: expected a finite number"),
        (["--clip-grad", "-1"], "--clip-grad must be >= 0 (0: no clipping), got -1.0"),
        (["--clip-grad", "nan"], "argument --clip-grad: expected a finite number, got 'nan'"),
        (["--seed", "-1"], "--seed must be in 0 .. 4294967295, got -1"),
        (["--seed", "4294967296"], "--seed must be in 0 .. 4294967295, got 4294967296"),
        (
            ["--distributed-timeout-minutes", "10000000000"],
            "--distributed-timeout-minutes must be at most 1,000,000, got 10000000000",
        ),
        (
            ["--distributed-timeout-minutes", "0"],
            "argument --distributed-timeout-minutes: expected a number > 0, got 0",
        ),
        (
            ["--nproc-per-node", "100000"],
            "--nproc-per-node 100000: bfpp-train starts at most 256 local ranks; launch larger "
            "jobs with torchrun or srun",
        ),
        (
            ["--global-batch-size", "1000000000"],
            "schedule too large: pp=4 x 2 stage(s) per rank x 1000000000 micro-batches is about "
            "56,000,000,016 actions and 39,200.0 GB (limit 4,000,000 actions, about a minute and "
            "2.8 GB); use fewer micro-batches, ranks or stages per rank",
        ),
        (
            ["--hidden-size", "65536", "--num-attention-heads", "8"],
            "for weights, gradients and Adam state",
        ),
        (
            [*V_HALF, "--num-layers", "12", LAYOUT, "E|t*2|t|t|t|t|t|t|t|t|t|tL"],
            "v-half places exactly 2 stages per rank (V-shape); drop "
            "--pipeline-model-parallel-layout's stages per rank (its stages / pipeline size) or "
            "set it to 2, got 3",
        ),
        (
            [LAYOUT, "E|t*8|L"],
            "--pipeline-model-parallel-layout E|t*8|L lists 3 stages, not a multiple",
        ),
        (
            [*V_HALF, LAYOUT, "E|t*2|t|t|t|t|t|t*2L"],
            "--pipeline-model-parallel-layout E|t*2|t|t|t|t|t|t*2L places 9 transformer layers, "
            "not --num-layers 8",
        ),
        ([LAYOUT, "E|t*2|tx|t*2|t*2L"], "'x' is no layer kind"),
        (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size needs --num-experts"),
        (
            ["--num-experts", "3", "--expert-model-parallel-size", "2"],
            "--expert-model-parallel-size 2 must divide --num-experts 3 and the data-parallel "
            "size 1",
        ),
        (["--num-experts", "2", "--moe-router-topk", "3"], "--moe-router-topk 3 routes to more"),
        (
            [*OVERLAP, "--pipeline-schedule", "dualpipe-v"],
            "--overlap-moe-expert-parallel-comm needs --bf16 or --fp16 (megatron-core's "
            "conditions for its combined step)",
        ),
        (
            [*OVERLAP, "--bf16", "--pipeline-schedule", "1f1b"],
            "--overlap-moe-expert-parallel-comm hides expert all-to-alls in overlapped forward-"
            "backward pairs, which 1f1b has none of here",
        ),
        (
            ["--overlap-moe-expert-parallel-comm"],
            "--overlap-moe-expert-parallel-comm needs --num-experts",
        ),
        (
            ["--pipeline-schedule", "auto", "--account-for-loss-in-pipeline-split"],
            "--pipeline-schedule auto: no schedule can run this layout (",
        ),
        (
            ["--pipeline-model-parallel-layout", "auto"],
            "--pipeline-model-parallel-layout auto needs --pipeline-schedule auto",
        ),
    ],
    ids=[
        "unknown-schedule",
        "bf-without-vp",
        "world-size",
        "v-shape-vp-4",
        "layers",
        "bpipe-cap",
        "bpipe-cap-too-low",
        "1f1b-with-vp-2",
        "lr-inf",
        "lr-nan",
        "min-lr-inf",
        "lr-zero",
        "warmup-negative",
        "weight-decay-negative",
        "weight-decay-inf",
        "clip-grad-negative",
        "clip-grad-nan",
        "seed-negative",
        "seed-too-large",
        "timeout-too-large",
        "timeout-zero",
        "nproc-too-large",
        "global-batch-too-large",
        "model-too-large",
        "v-shape-layout-of-3-per-rank",
        "layout-stages",
        "layout-layers",
        "layout-kind",
        "ep-without-experts",
        "ep-not-dividing",
        "topk-above-experts",
        "overlap-without-bf16",
        "overlap-without-pairs",
        "overlap-without-experts",
        "auto-uneven-unsplit",
        "layout-auto-alone",
    ],
)
def test_bad_flags_one_line_nonzero_exit(flags: list[str], expected: str) -> None:
    """One line, exit 2, and (what made it slow: seconds of imports before the check) neither
    torch nor megatron-core imported, except where the check needs them: the model's memory
    against this machine's, and megatron-core's checks of uneven stages."""
    proc = _run_main(*flags)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("bfpp-train: error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    imported = json.loads(proc.stdout.splitlines()[-1])
    if "for weights, gradients and Adam state" in expected:
        assert imported["torch"], imported
    elif not {LAYOUT, ENDS[0], "--account-for-loss-in-pipeline-split"} & set(flags):
        # megatron-core checks the uneven-stage flags (auto on them probes torch's device)
        assert imported == {"torch": False, "megatron.core": False}, imported


def _run_main(*flags: str) -> subprocess.CompletedProcess[str]:
    """bfpp-train's ``main`` in a fresh interpreter, which then prints (one JSON line) whether
    torch and megatron-core were imported: the property a fast refusal stands for."""
    code = (
        "import json, sys\n"
        "from megatron_bfpp.cli.train import main\n"
        "try:\n"
        "    code = main(sys.argv[1:])\n"
        "except SystemExit as exit:\n"
        "    code = exit.code\n"
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'megatron.core')}))\n"
        "sys.exit(code)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-c", code, "--no-progress", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


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


@pytest.mark.parametrize(
    ("flag", "where", "message"),
    [
        ("--save", "/proc/x", "--save /proc/x: cannot create files in /proc ("),
        ("--save", "{tmp}/file/ckpt", "--save {tmp}/file/ckpt: {tmp}/file is not a directory"),
        (
            "--metrics-file",
            "{tmp}/missing/m.jsonl",
            "--metrics-file {tmp}/missing/m.jsonl: directory {tmp}/missing does not exist",
        ),
        ("--metrics-file", "{tmp}", "--metrics-file {tmp}: is a directory"),
        ("--metrics-file", "/proc/m.jsonl", "--metrics-file /proc/m.jsonl: cannot write files in"),
    ],
    ids=["save-proc", "save-under-a-file", "metrics-missing-dir", "metrics-a-dir", "metrics-proc"],
)
def test_unwritable_outputs_fail_before_training(
    tmp_path: Path, flag: str, where: str, message: str
) -> None:
    """These used to train to the end and then fail (a traceback for --metrics-file)."""
    (tmp_path / "file").write_text("x")
    proc = _run_main(flag, where.format(tmp=tmp_path))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("bfpp-train: error: " + message.format(tmp=tmp_path)), lines[0]
    # Refused before anything was imported to train with: no rank started.
    assert json.loads(proc.stdout) == {"torch": False, "megatron.core": False}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert (tmp_path / "file").read_text() == "x"


def test_bad_flags_under_torchrun_are_one_line_per_node() -> None:
    """Every rank checks the same flags; only each node's local rank 0 says what is wrong."""
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli.train", "--pipeline-model-parallel-size", "4"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr == ""


def test_a_warning_every_rank_gives_is_printed_once() -> None:
    """megatron-core warns about CUDA_DEVICE_MAX_CONNECTIONS on every tensor-parallel rank (it
    was printed 4 times, with its source line)."""
    proc = _run(
        *("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
        *("--train-iters", "1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("CUDA_DEVICE_MAX_CONNECTIONS") == 1, proc.stderr


def test_a_diverged_run_is_one_line() -> None:
    """A NaN loss ends the run on every rank: one line, not a traceback."""
    proc = _run("--lr", "1e30", "--min-lr", "0", "--train-iters", "3")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [
        "bfpp-train: error: lm loss is nan at iteration 3: training diverged (try a lower --lr)"
    ], proc.stderr


# bfpp-train whose backward turns every gradient non-finite from iteration 3 on while the loss
# stays finite (what an overflow in the backward does): a hook on each forward's output, in
# every rank (the launcher forks them after this runs).
SHARDED = ("--data-parallel-sharding-strategy", "optim_grads_params")
_POISONED_BACKWARD = """
import sys
import megatron_bfpp.train.trainer as trainer
from megatron_bfpp.cli.train import main

plain_step, plain_forward, at = trainer._train_step, trainer.forward_step, [0]

def train_step(run):
    at[0] = run.iteration + 1
    return plain_step(run)

def forward_step(device, data_iterator, model, return_schedule_plan=False):
    output, loss = plain_forward(device, data_iterator, model, return_schedule_plan)
    if at[0] >= 3 and output.requires_grad:
        output.register_hook(lambda grad: grad * float("inf"))
    return output, loss

trainer._train_step, trainer.forward_step = train_step, forward_step
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "layout",
    [
        ("--pipeline-schedule", "1f1b", "--pipeline-model-parallel-size", "2"),
        ("--pipeline-model-parallel-size", "2", *SHARDED),
    ],
    ids=["1f1b", "breadth-first-sharded"],
)
def test_a_non_finite_gradient_is_never_applied_nor_saved(
    tmp_path: Path, layout: tuple[str, ...]
) -> None:
    """A finite loss with NaN / inf gradients at the last iteration (fp32: no grad scaler
    skips the step): the run used to apply the step, save NaN weights as the latest checkpoint
    and exit 0. It stops
    before the optimizer step in one line naming the iteration; the tracker keeps the last
    good checkpoint."""
    save = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-c", _POISONED_BACKWARD, "--no-progress", *layout, "--train-iters",
         "3", "--save", str(save), "--save-interval", "1"],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(
        "bfpp-train: error: iteration 3: the gradient norm is not finite (NaN or inf) though "
        "the lm loss is ("
    ), lines
    assert lines[0].endswith(
        f"stopped before the optimizer step; the latest checkpoint in --save {save} stays "
        "iteration 2; try a lower --lr"
    ), lines
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000001", "iter_0000002"]


def test_help_shows_defaults() -> None:
    proc = _run("--help", timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "--pipeline-schedule {" in text and "(default: breadth-first)" in text
    assert "--lr LR (default: 0.003)" in text
    assert "(default: the schedule's: 1 for gpipe, 1f1b, bpipe; 2 for interleaved" in text


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda path: None, "no such file"),
        (
            lambda path: path.write_bytes(b""),
            "is empty; it needs at least seq_length + 2 = 66 bytes",
        ),
        (lambda path: path.write_bytes(b"x" * 65), "has 65 bytes; it needs at least"),
        (lambda path: path.mkdir(), "is a directory; give a text file or the prefix"),
        (lambda path: os.mkfifo(path), "is not a regular file (a FIFO, socket or device)"),
    ],
    ids=["missing", "empty", "too-short", "directory", "fifo"],
)
def test_data_path_problems_are_refused_before_any_rank_in_their_own_words(
    tmp_path: Path, make: Any, words: str
) -> None:
    """They used to be found after the ranks were forked (~10 s), a directory or a FIFO called
    "no such file"; a FIFO is never opened (a reader would block)."""
    path = tmp_path / "text"
    make(path)
    proc = _run_main("--data-path", str(path), "--vocab-size", "256", "--seq-length", "64")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"bfpp-train: error: --data-path {path}: {words}"), lines[0]
    assert json.loads(proc.stdout) == {"torch": False, "megatron.core": False}
