"""bfpp-plan end to end, as a user runs it: real processes and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

GPT3 = [
    "bpipe-estimate",
    "--pp",
    "8",
    "--global-batch-size",
    "128",
    "--micro-batch-sizes",
    "1",
    "2",
    "--stage-mfu",
    "0.378",
    "0.552",
]


def bfpp_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli.plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_gpt3_table() -> None:
    result = bfpp_plan(*GPT3)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in (
        "stage speedup      1.4603",
        "pipeline factor    0.9507",
        "135/142",
        "predicted speedup  1.3883",
        "memory ratio       1.2500",
        "verdict: faster only if it fits",
    ):
        assert text in out, out
    assert "37.8%" in out and "55.2%" in out


def test_gpt3_json_and_percent_agree() -> None:
    result = bfpp_plan(*GPT3, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {
        "pp",
        "global_batch_size",
        "micro_batch_small",
        "micro_batch_large",
        "stage_mfu_small",
        "stage_mfu_large",
        "stage_speedup",
        "pipeline_factor",
        "predicted_speedup",
        "pipeline_mfu_small",
        "pipeline_mfu_large",
        "one_f_one_b_stored",
        "bpipe_stored",
        "memory_ratio",
        "memory_ratio_without_bpipe",
        "faster",
        "fits",
        "worth_it",
        "verdict",
    }
    assert data["predicted_speedup"] == pytest.approx(135 / 142 * 55.2 / 37.8)
    assert (data["bpipe_stored"], data["one_f_one_b_stored"]) == (5, 8)
    assert data["worth_it"] is False and data["faster"] is True
    percent = bfpp_plan(*GPT3[:-2], "37.8", "55.2", "--percent", "--json")
    assert percent.returncode == 0, percent.stderr
    assert json.loads(percent.stdout)["predicted_speedup"] == pytest.approx(
        data["predicted_speedup"]
    )


def test_llama_not_worth_it() -> None:
    result = bfpp_plan(
        "bpipe-estimate",
        "--pp=8",
        "--global-batch-size=128",
        "--micro-batch-sizes",
        "1",
        "4",
        "--stage-mfu",
        "53.6",
        "61.9",
        "--percent",
    )
    assert result.returncode == 0, result.stderr
    assert "predicted speedup  0.9994" in result.stdout
    assert "verdict: not worth it" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "bfpp-plan: error: choose a command"),
        (("layout",), "bfpp-plan: error: argument COMMAND: invalid choice: 'layout'"),
        (("bpipe-estimate", "--pp", "8"), "bfpp-plan bpipe-estimate: error: the following"),
        ((*GPT3[:-2], "37.8", "55.2"), "a percentage? (pass 0.378, or --percent"),
        ((*GPT3[:-2], "x", "0.5"), "argument --stage-mfu: expected a number, got 'x'"),
        ((*GPT3[:-2], "inf", "0.5"), "argument --stage-mfu: expected a finite number, got 'inf'"),
        ((*GPT3[:-2], "nan", "0.5"), "argument --stage-mfu: expected a finite number, got 'nan'"),
        (
            (*GPT3[:-2], "1e-320", "0.5"),
            "stage MFU 1e-320 at the small micro-batch is too small: the stage speedup 0.5 / "
            "1e-320 is not a finite number",
        ),
        (
            (*GPT3[:2], str(10**30), *GPT3[3:]),
            f"pp must be at most 2**53 (computed in floating point); got {10**30}",
        ),
        (
            (*GPT3[:4], str(10**400), *GPT3[5:]),
            "global batch size must be at most 2**53",
        ),
        ((*GPT3[:2], "1", *GPT3[3:]), "pp must be an integer >= 2"),
        ((*GPT3[:2], "0", *GPT3[3:]), "expected a positive integer, got 0"),
        ((*GPT3[:6], "1", "3", *GPT3[8:]), "not divisible by micro-batch size 3"),
        ((*GPT3[:6], "2", "1", *GPT3[8:]), "must be larger than the 1F1B one"),
    ],
)
def test_bad_input_is_one_line_exit_2(args: tuple[str, ...], message: str) -> None:
    result = bfpp_plan(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0], lines[0]


def test_json_is_strict() -> None:
    def refuse(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    result = bfpp_plan(*GPT3, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout, parse_constant=refuse)["predicted_speedup"] > 1


def test_help_shows_every_flag() -> None:
    """bpipe-estimate's flags are all required (no defaults to show) or switches."""
    result = bfpp_plan("bpipe-estimate", "--help")
    assert result.returncode == 0
    assert "--stage-mfu MFU_SMALL MFU_LARGE" in result.stdout


# --------------------------------------------------------------------------- recommend

SMALL = ["recommend", "--model", "gpt3-52b", "--num-gpus", "64", "--gpu", "v100-32gb"]


def test_recommend_table() -> None:
    result = bfpp_plan(*SMALL, "--global-batch-size", "16", "--top", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("gpt3-52b: 64 layers, hidden 8192, 64 heads, sequence 2048; 64 x")
    assert "candidates," in lines[1] and "do not fit in 32 GiB" in lines[1]
    assert "built-in efficiency curve for v100-32gb" in lines[1]
    assert lines[2].startswith("p2p timing model: lockstep (")
    rows = [line for line in lines[3:] if line[:2].strip().isdigit()]
    assert [int(row.split()[0]) for row in rows] == [1, 2, 3, 4, 5]
    assert "MFU: eq. 1 model FLOPs" in result.stdout


def test_recommend_json() -> None:
    result = bfpp_plan(*SMALL, "--global-batch-size", "32", "--top", "3", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {"p2p_model", "candidates_evaluated", "rejected_out_of_memory", "configs"}
    assert data["p2p_model"] == "lockstep"
    assert data["candidates_evaluated"] >= 2000
    assert len(data["configs"]) == 3
    first = data["configs"][0]
    for key in (
        "schedule",
        "tensor_parallel",
        "pipeline_parallel",
        "virtual_stages",
        "data_parallel",
        "micro_batch_size",
        "sharding",
        "recompute",
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "p2p_model",
    ):
        assert key in first
    assert set(first["memory_per_gpu_bytes"]) == {
        "parameters",
        "gradients",
        "optimizer",
        "activations",
        "total",
    }
    assert first["tokens_per_s"] == pytest.approx(32 * 2048 / first["step_time_s"])


def test_recommend_explicit_shape_and_constraints() -> None:
    result = bfpp_plan(
        "recommend",
        "--arch",
        "llama",
        "--num-layers",
        "16",
        "--hidden-size",
        "2048",
        "--num-attention-heads",
        "16",
        "--seq-length",
        "1024",
        "--num-gpus",
        "8",
        "--gpu",
        "a100-40gb",
        "--global-batch-size",
        "32",
        "--schedules",
        "1f1b,breadth-first",
        "--recompute",
        "none",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    configs = json.loads(result.stdout)["configs"]
    assert {c["schedule"] for c in configs} <= {"1f1b", "breadth-first"}
    assert {c["recompute"] for c in configs} == {"none"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("recommend", "--model", "gpt4", "--num-gpus", "8", "--gpu", "a100-80gb"),
            "unknown model 'gpt4'; choose one of gpt3-6.7b,",
        ),
        (
            (*SMALL[:-1], "tpu", "--global-batch-size", "8"),
            "unknown GPU 'tpu'; choose one of v100-32gb, a100-40gb, a100-80gb, h100-80gb",
        ),
        (
            (*SMALL, "--global-batch-size", "8", "--num-layers", "4"),
            "--model gpt3-52b is a preset; drop --num-layers",
        ),
        (
            ("recommend", "--num-gpus", "8", "--gpu", "a100-80gb", "--global-batch-size", "8"),
            "give --model NAME",
        ),
        (
            ("recommend", "--model", "llama-7b", "--num-gpus", "12", "--gpu", "a100-80gb"),
            "--num-gpus 12 is not a whole number of nodes of --gpus-per-node 8",
        ),
        ((*SMALL, "--global-batch-size", "8", "--schedules", "zigzag"), "--schedules: zigzag;"),
        (
            (*SMALL, "--global-batch-size", "8", "--profile", "/nonexistent.json"),
            "--profile /nonexistent.json: cannot read it",
        ),
        (
            (*SMALL, "--global-batch-size", "8", "--plot", "/nonexistent/dir/x.png"),
            "--plot /nonexistent/dir/x.png: directory /nonexistent/dir does not exist",
        ),
        (
            ("recommend", "--model", "gpt3-175b", "--num-gpus", "8", "--gpu", "v100-32gb"),
            "no configuration of gpt3-175b fits 8 x v100-32gb",
        ),
        (
            (
                "recommend",
                "--model",
                "gpt3-175b",
                "--num-gpus",
                "1000",
                "--gpu",
                "h100-80gb",
                "--global-batch-size",
                "1536",
            ),
            "error: 1000 x h100-80gb cannot be split into tp x pp x dp for gpt3-175b at global "
            "batch 1536: ",
        ),
        ((*SMALL, "--global-batch-size", "0"), "expected a positive integer, got 0"),
    ],
)
def test_recommend_bad_input_is_one_line(args: tuple[str, ...], message: str) -> None:
    if "--global-batch-size" not in args:
        args = (*args, "--global-batch-size", "8")
    result = bfpp_plan(*args)
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0], lines[0]


def test_recommend_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "plan.png"
    result = bfpp_plan(
        "recommend",
        "--model",
        "llama-7b",
        "--num-gpus",
        "8",
        "--gpu",
        "a100-80gb",
        "--global-batch-size",
        "8",
        "--top",
        "1",
        "--recompute",
        "selective",
        "--plot",
        str(target),
        "--critical-batch-size",
        "256",
    )
    assert result.returncode == 0, result.stderr
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {target}" in result.stdout


# --------------------------------------------------------------------------- profile


@pytest.mark.megatron
def test_profile_on_cpu_then_recommend_reads_it(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    profile = tmp_path / "stage.json"
    shape = [
        "--arch",
        "gpt",
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--vocab-size",
        "256",
    ]
    result = bfpp_plan(
        "profile",
        *shape,
        "--profile-layers",
        "2",
        "--micro-batch-sizes",
        "1",
        "2",
        "--iterations",
        "5",  # a median of 5 resists the odd slow step of a loaded machine
        "--warmup",
        "1",
        "-o",
        str(profile),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(profile.read_text())
    assert data["format"] == "bfpp-stage-profile" and data["device_type"] == "cpu"
    assert [m["micro_batch_size"] for m in data["measurements"]] == [1, 2]
    for m in data["measurements"]:
        assert m["forward_s"] > 0 and m["backward_s"] > 0
        # I and W are timed on their own, through the runtime's split (the profiler refuses
        # a run in which I deferred no weight GEMM), so they need not add up to B exactly.
        assert m["backward_input_s"] > 0 and m["backward_weight_s"] > 0
        # the stage ends, from a one-layer GPTModel's own embedding and output layer with loss
        assert m["embedding_s"] > 0 and m["output_s"] > 0
    assert "stage ends at b=1, in layers: embedding" in result.stdout
    assert "(bfpp-sim --embedding-weight " in result.stdout
    # the runtime's host time per compute action, measured apart (tests/unit/test_host_time.py)
    assert data["t_host"] >= 0 and "ms per action" in result.stdout
    planned = bfpp_plan(
        "recommend",
        *shape,
        "--num-gpus",
        "4",
        "--gpu",
        "a100-80gb",
        "--global-batch-size",
        "8",
        "--profile",
        str(profile),
    )
    assert planned.returncode == 0, planned.stderr
    assert "compute from the profile measured on CPU" in planned.stdout


@pytest.mark.megatron
def test_the_stage_cost_check_runs(tmp_path: Path) -> None:
    """scripts/check_stage_costs.py (docs/simulator.md's figures) on its tiny case: a row per
    stage of the layout, predicted from the profile's weights, measured on megatron-core's own
    stage. Its errors are CPU timings and are not asserted on here."""
    pytest.importorskip("megatron.core")
    script = Path(__file__).resolve().parents[2] / "scripts" / "check_stage_costs.py"
    result = subprocess.run(
        [
            sys.executable,
            str(script),
            "--quick",
            "--warmup",
            "1",
            "--iterations",
            "3",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("  E")]
    rows += [line.split() for line in result.stdout.splitlines() if line.startswith("  ttt")]
    assert [row[0] for row in rows] == ["Et", "tttmL"]  # an MTP layer on the last stage
    for _, weight, predicted, measured, error in rows:
        assert float(weight) > 0 and float(predicted) > 0 and float(measured) > 0
        assert error.endswith("%")
    assert "largest error" in result.stdout


AUTO = [
    "auto", "--model", "gpt3-52b", "--num-gpus", "64", "--gpu", "v100-32gb",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
    "--recompute", "full",
]  # fmt: skip


def test_auto_prints_the_jobs_line_and_its_report() -> None:
    """``bfpp-plan auto``: the line a job under --pipeline-schedule auto prints, from the same
    decision (plan.auto.decide on the same request), and --json its report."""
    from megatron_bfpp.plan.auto import AutoRequest, decide, hardware
    from megatron_bfpp.plan.presets import get_model

    result = bfpp_plan(*AUTO, "--global-batch-size", "64")
    assert result.returncode == 0, result.stderr
    request = AutoRequest(
        model=get_model("gpt3-52b"),
        tp=8,
        pp=8,
        dp=1,
        micro_batch_size=1,
        global_batch_size=64,
        hardware=hardware(device_name=None, device_memory=None, gpu_flag="v100-32gb"),
        recompute="full",
    )
    line = decide(request).line()
    assert result.stdout == f"megatron_bfpp: {line}\n"
    report = bfpp_plan(*AUTO, "--step-batch-size-schedule", "0:32,1M:64", "--json")
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert data["format"] == "bfpp-auto-report" and data["line"] == line
    assert data["layout"]["step_batch_sizes"] == [32, 64]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--num-gpus", "60", "--global-batch-size", "64"], "--num-gpus 60 is not a multiple of"),
        ([], "give one of --global-batch-size and --step-batch-size-schedule"),
        (["--global-batch-size", "63", "--micro-batch-size", "2"], "63 is not a multiple of"),
        (["--global-batch-size", "64", "--gpu", "k80"], "unknown GPU 'k80'"),
    ],
)
def test_auto_refuses_bad_input_in_one_line(extra: list[str], message: str) -> None:
    result = bfpp_plan(*AUTO, *extra)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bfpp-plan auto: error: "), lines
    assert message in lines[0]
