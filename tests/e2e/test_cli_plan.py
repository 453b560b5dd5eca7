"""bfpp-plan end to end, as a user runs it: real processes and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

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
