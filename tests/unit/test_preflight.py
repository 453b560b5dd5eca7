"""The launcher's pre-start check of a Megatron-LM command line (megatron_bfpp.megatron.preflight):
what Megatron's validate_args derives, its layout checks, then the plugin's own schedule checks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.megatron.auto import megatron_request
from megatron_bfpp.megatron.preflight import check_megatron_command
from megatron_bfpp.plan.auto import decide, hardware

BASE = "--num-layers 16 --num-attention-heads 8 --micro-batch-size 1 --global-batch-size 16"


def _check(extra: str, world_size: int = 8) -> argparse.Namespace:
    return check_megatron_command(f"{BASE} {extra}".split(), world_size=world_size)


def test_derives_what_megatron_derives_and_passes_other_arguments_through() -> None:
    args = _check(
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--num-layers-per-virtual-pipeline-stage 4 --pipeline-schedule breadth-first "
        "--breadth-first-group-size 2 --data-path /some/where --lr 3e-4"
    )
    assert args.data_parallel_size == 2
    assert args.virtual_pipeline_model_parallel_size == 2
    vp_one = _check("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 1")
    assert vp_one.virtual_pipeline_model_parallel_size is None
    assert check_megatron_command(["--micro-batch-size", "2"], world_size=4).global_batch_size == 8


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--tensor-model-parallel-size 3", "world size 8 is not a multiple of tensor x pipeline"),
        ("--tensor-model-parallel-size 8 --num-attention-heads 12", "heads 12 is not a multiple"),
        (
            "--tensor-model-parallel-size 4 --group-query-attention --num-query-groups 2",
            "--num-query-groups 2 is not a multiple of --tensor-model-parallel-size 4",
        ),
        ("--pipeline-model-parallel-size 8 --num-layers 12", "does not split over"),
        (
            "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 3",
            "4 layers per pipeline rank do not split into 3 virtual stages",
        ),
        (
            "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 3",
            "4 layers per pipeline rank do not split into virtual stages of",
        ),
        (
            "--num-virtual-stages-per-pipeline-rank 2 --num-layers-per-virtual-pipeline-stage 2",
            "exclude each other",
        ),
        (
            "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
            "--no-overlap-p2p-communication",
            "need --pipeline-model-parallel-size >= 3 (got 2) without p2p overlap",
        ),
        ("--global-batch-size 12", "--global-batch-size 12 is not a multiple of micro-batch"),
        (
            "--pipeline-model-parallel-size 2 --pipeline-schedule breadth-first "
            "--num-virtual-stages-per-pipeline-rank 1",
            "needs virtual",
        ),
        ("--micro-batch-size 0", "--micro-batch-size: expected a positive integer, got 0"),
    ],
)
def test_refusals_are_one_line(extra: str, message: str) -> None:
    with pytest.raises(ScheduleError) as error:
        _check(extra)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_micro_batch_size() -> None:
    with pytest.raises(ScheduleError, match="--micro-batch-size is missing"):
        check_megatron_command(["--pipeline-model-parallel-size", "2"], world_size=2)


def test_a_layout_sets_the_virtual_stages_as_megatron_does() -> None:
    layout = "--pipeline-model-parallel-layout"
    args = _check(f"--pipeline-model-parallel-size 2 {layout} Et*4|t*4|t*4|t*4L")
    assert args.virtual_pipeline_model_parallel_size == 2
    one_each = _check(f"--pipeline-model-parallel-size 2 {layout} Et*8|t*8L")
    assert one_each.virtual_pipeline_model_parallel_size is None
    v = _check(f"--pipeline-model-parallel-size 2 {layout} E|(t*8|)*2L --pipeline-schedule v-zb")
    assert v.virtual_pipeline_model_parallel_size == 2


LAYOUT = "--pipeline-model-parallel-layout"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (  # the layout's mistakes, as megatron-core refuses them on every rank
            f"--pipeline-model-parallel-size 2 {LAYOUT} E|t*4|t*4|t*4|t*4,L",
            f"{LAYOUT} E|t*4|t*4|t*4|t*4,L lists 5 stages, not a multiple of "
            "--pipeline-model-parallel-size 2",
        ),
        (f"{LAYOUT} Et*8|t*7L", "places 15 transformer layers, not --num-layers 16"),
        (f"{LAYOUT} Et*8|x*8L", "'x' is no layer kind"),
        (f"{LAYOUT} Et*8|t*8L --num-virtual-stages-per-pipeline-rank 2", "exclude each other"),
        (  # the schedule's, which the launcher used to leave to the ranks
            f"--pipeline-model-parallel-size 2 {LAYOUT} Et*3|t*3|t*3|t*3|t*2|t*2L "
            "--pipeline-schedule v-half",
            "v-half places exactly 2 stages per rank",
        ),
        (
            f"--pipeline-model-parallel-size 2 {LAYOUT} Et*4|t*4|t*4|t*4L --pipeline-schedule 1f1b",
            "one stage per rank",
        ),
        (
            f"--pipeline-model-parallel-size 4 {LAYOUT} Et*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2L "
            "--global-batch-size 6 --micro-batch-size 1 --pipeline-schedule interleaved",
            "interleaved cannot run 3 micro-batches on pp=4, vp=2",
        ),
    ],
)
def test_layout_refusals_are_one_line_before_any_rank_starts(extra: str, message: str) -> None:
    with pytest.raises(ScheduleError) as error:
        _check(extra)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def _launch(script: str, *args: str, local_rank: str = "0") -> tuple[int, str, dict[str, bool]]:
    """``python -m megatron_bfpp.launch`` as torchrun starts it on one node of 4 ranks; its exit
    code, stderr, and whether torch / megatron-core were imported before it ended."""
    import os
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from megatron_bfpp import launch\n"
        "try:\n"
        "    launch.main(sys.argv[1:])\n"
        "    code = 0\n"
        "except SystemExit as exit:\n"
        "    code = exit.code\n"
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'megatron.core')}))\n"
        "sys.exit(code)\n"
    )
    env = dict(os.environ, WORLD_SIZE="4", RANK=local_rank, LOCAL_RANK=local_rank)
    proc = subprocess.run(
        [sys.executable, "-c", code, script, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    return proc.returncode, proc.stderr, json.loads(proc.stdout.splitlines()[-1])


def test_the_launcher_refuses_schedule_mistakes_once_per_node_before_any_import(
    tmp_path: Path,
) -> None:
    """One mistyped schedule flag under torchrun printed 3,105 lines (every rank's usage, import
    warnings and Megatron's argument dump), the right line four times after 47.6 s. Now local
    rank 0 prints one line, every rank exits 2, and neither torch nor Megatron is imported."""
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('the script ran')\n")
    flags = ("--micro-batch-size", "1", "--global-batch-size", "8", "--num-layers", "16",
             "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "v-half",
             "--num-virtual-stages-per-pipeline-rank", "4")  # fmt: skip
    code, err, imported = _launch(str(script), *flags)
    assert code == 2
    assert err.splitlines() == [
        "megatron_bfpp.launch: error: v-half places exactly 2 stages per rank (V-shape); drop "
        "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank or "
        "set it to 2, got 4"
    ], err
    assert imported == {"torch": False, "megatron.core": False}
    code, err, _ = _launch(str(script), *flags, local_rank="1")
    assert (code, err) == (2, "")  # the other ranks of the node: quiet, same exit code
    code, err, _ = _launch(str(tmp_path / "missing.py"))
    assert code == 2 and err.strip() == "megatron_bfpp.launch: error: no such script: " + str(
        tmp_path / "missing.py"
    )


def test_looped_and_v_schedules_get_two_virtual_stages_as_the_plugin_gives_them() -> None:
    """The plugin sets --num-virtual-stages-per-pipeline-rank 2 for these before Megatron
    validates; the preflight (sbatch dry runs, the launcher) used to refuse them instead."""
    for name in ("breadth-first", "interleaved", "v-half"):
        args = check_megatron_command(
            ["--micro-batch-size", "1", "--global-batch-size", "8", "--num-layers", "8",
             "--pipeline-model-parallel-size", "4", "--pipeline-schedule", name],
            world_size=4,
        )  # fmt: skip
        assert args.virtual_pipeline_model_parallel_size == 2, name


# Megatron-LM's batch-size schedule: no --global-batch-size (Megatron refuses both), so its
# global_batch_size is micro-batch x data-parallel size, which no step runs.
RAMP = ["--micro-batch-size", "1", "--num-layers", "16", "--pipeline-model-parallel-size", "4"]


def test_a_batch_size_schedule_is_checked_at_every_step_not_at_one_micro_batch() -> None:
    """``0:4,512:8`` on pp 4 runs 4 then 8 micro-batches per step; the pre-flight used to take
    the global batch as 1 x 1 and refuse interleaved ("cannot run 1 micro-batches")."""
    for name in ("interleaved", "breadth-first", "1f1b"):
        args = check_megatron_command(
            [*RAMP, "--pipeline-schedule", name, "--step-batch-size-schedule", "0:4,512:8"],
            world_size=4,
        )
        assert args.pipeline_schedule == name
    with pytest.raises(ScheduleError) as error:  # a step interleaved cannot run
        check_megatron_command(
            [*RAMP, "--pipeline-schedule", "interleaved", "--step-batch-size-schedule", "0:4 1K:6"],
            world_size=4,
        )
    assert str(error.value).startswith(
        "--pipeline-schedule interleaved cannot run 6 micro-batches on pp=4, vp=2 (a step of "
        "--step-batch-size-schedule): "
    )


@pytest.mark.parametrize(
    ("schedule", "extra", "world", "message"),
    [
        ("0:4,512:8", ["--global-batch-size", "8"], 4, "exclude each other; drop --global-batch"),
        ("0:4,512:5", [], 8, "--step-batch-size-schedule's batch size 5 is not a multiple of"),
        ("0:4,512", [], 4, "'512' is not THRESHOLD:BATCH_SIZE"),
        ("4:4,512:8", [], 4, "the first step must start at 0 (it starts at 4 samples)"),
        ("0:4,x:8", [], 4, "'x:8' is not THRESHOLD:BATCH_SIZE"),
    ],
)
def test_batch_size_schedule_mistakes_are_one_line(
    schedule: str, extra: list[str], world: int, message: str
) -> None:
    with pytest.raises(ScheduleError) as error:
        check_megatron_command(
            [*RAMP, "--pipeline-schedule", "1f1b", "--step-batch-size-schedule", schedule, *extra],
            world_size=world,
        )
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_auto_plans_for_the_batch_schedule_steps() -> None:
    """auto used to plan the same run for m = 1 (global batch = micro-batch x dp): it times
    the last step's batch and keeps only what runs every step's micro-batches."""
    args = argparse.Namespace(
        num_layers=16, hidden_size=64, num_attention_heads=4, seq_length=32,
        micro_batch_size=1, global_batch_size=None, pipeline_model_parallel_size=4,
        step_batch_size_schedule="0:4,512:8",
    )  # fmt: skip
    hw = hardware(device_name=None, device_memory=None)
    request = megatron_request(args, world_size=4, env={}, hw=hw, sharding=None)
    assert (request.global_batch_size, request.batch_schedule) == (8, (4, 8))
    assert request.step_microbatches == (4, 8)
    decision = decide(request)
    assert decision.to_dict()["layout"]["num_microbatches"] == 8  # type: ignore[index]
    rows = [row for row in decision.rows if row.plan is not None or row.lower_bound_s]
    assert {row.candidate.schedule for row in rows} >= {"interleaved", "breadth-first"}
    # breadth-first's groups of the timed step (8 micro-batches): one group, or groups of pp
    groups = {row.candidate.group_size for row in rows if row.candidate.schedule == "breadth-first"}
    assert groups == {None, 4}
    # a group that an earlier step cannot run is ruled out, saying why
    args.breadth_first_group_size, args.step_batch_size_schedule = 8, "0:4,512:8,1K:16"
    with pytest.raises(ScheduleError) as error:
        decide(megatron_request(args, world_size=4, env={}, hw=hw, sharding=None))
    assert "breadth-first vp=2 group=8: cannot run a step of 4 micro-batches" in str(error.value)
    assert "\n" not in str(error.value)
