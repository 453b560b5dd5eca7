"""``--pipeline-schedule auto`` in the front ends' own terms, without GPUs or Megatron-LM:
Megatron-LM's parsed arguments (what the plugin's ``validate_args`` does with them), the SLURM
pre-flight, and Megatron-Bridge's ``ConfigContainer`` up to the decision (Bridge itself is not
installed here: ``use_schedule``'s last steps, patching Bridge's modules, run on the bridge
stack only)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_bfpp.config.run_config import layout_of
from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.megatron.auto import resolve_bridge_auto, resolve_megatron_auto
from megatron_bfpp.megatron.preflight import check_megatron_command, parse_megatron_command
from tests.multirank.test_auto import _megatron_args

CPU = (None, None)
RANK0 = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}


def test_megatron_args_get_the_choice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _megatron_args()
    args.pipeline_schedule_auto_report = str(tmp_path / "auto.json")
    decision = resolve_megatron_auto(args, sharding=None, env=RANK0, device=CPU)
    assert decision is not None
    assert args.pipeline_schedule == decision.schedule != "auto"
    if decision.stages_per_rank > 1:
        assert args.num_virtual_stages_per_pipeline_rank == decision.stages_per_rank
    out = capsys.readouterr().out
    assert out.count("megatron_bfpp: auto: ") == 1 and "a100-40gb as given" in out
    assert json.loads((tmp_path / "auto.json").read_text())["line"] == decision.line()
    layout = decision.to_dict()["layout"]
    assert layout["data_parallel"] == 2 and layout["precision"] == "bf16-mixed"  # type: ignore[index]


def test_other_ranks_decide_quietly(capsys: pytest.CaptureFixture[str]) -> None:
    quiet = resolve_megatron_auto(
        _megatron_args(), sharding=None, env={**RANK0, "RANK": "3"}, device=CPU
    )
    loud = resolve_megatron_auto(_megatron_args(), sharding=None, env=RANK0, device=CPU)
    assert quiet is not None and loud is not None and quiet.to_dict() == loud.to_dict()
    assert capsys.readouterr().out.count("auto: ") == 1


def test_megatron_virtual_stages_flag_is_a_constraint() -> None:
    args = _megatron_args()
    args.num_layers_per_virtual_pipeline_stage = 2  # 4 layers per rank: vp = 2
    decision = resolve_megatron_auto(args, sharding=None, env=RANK0, device=CPU)
    assert decision is not None and decision.stages_per_rank == 2


def test_megatron_without_pipeline_keeps_megatrons_own(capsys: pytest.CaptureFixture[str]) -> None:
    args = _megatron_args()
    args.pipeline_model_parallel_size = 1
    assert resolve_megatron_auto(args, sharding=None, env=RANK0, device=CPU) is None
    assert args.pipeline_schedule == "default"
    assert "no pipeline schedule to choose" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"num_virtual_stages_per_pipeline_rank": 2, "bpipe_max_stored": 3},
         "--bpipe-max-stored applies to bpipe"),
        ({"decoder_first_pipeline_num_layers": 3}, "does not split 16 layers over 4 x 1"),
        ({"pipeline_model_parallel_layout": "auto", "decoder_last_pipeline_num_layers": 2},
         "chooses the layers per stage itself; drop --decoder-last-pipeline-num-layers"),
        ({"hidden_size": None}, "needs --hidden-size"),
    ],
)  # fmt: skip
def test_megatron_refusals_are_one_line(change: dict[str, Any], words: str) -> None:
    args = _megatron_args()
    for key, value in change.items():
        setattr(args, key, value)
    with pytest.raises(ScheduleError, match=words) as caught:
        resolve_megatron_auto(args, sharding=None, env=RANK0, device=CPU)
    assert "\n" not in str(caught.value)


def test_megatron_args_get_the_layout_auto_chose() -> None:
    """--pipeline-model-parallel-layout auto: the chosen stages written back as a layout string
    Megatron-LM reads (its stages per rank from the string, no virtual-stage flag written)."""
    args = _megatron_args()
    args.pipeline_model_parallel_layout = "auto"
    decision = resolve_megatron_auto(args, sharding=None, env=RANK0, device=CPU)
    assert decision is not None
    layers = decision.chosen.candidate.stage_layers
    assert args.pipeline_model_parallel_layout == layout_of(layers) and sum(layers) == 16
    assert args.num_virtual_stages_per_pipeline_rank is None
    assert decision.line().endswith(f"--pipeline-model-parallel-layout '{layout_of(layers)}']")


GPT3_175B = shlex.split(
    "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --sequence-parallel "
    "--use-distributed-optimizer --micro-batch-size 1 --global-batch-size 32 --bf16 "
    "--pipeline-schedule auto"
)


def test_preflight_decides_quietly(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_megatron_command(GPT3_175B, world_size=128)
    assert args.pipeline_schedule not in ("auto", "default")
    check_megatron_command(GPT3_175B, world_size=128)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--num-virtual-stages-per-pipeline-rank", "4", "--bpipe-max-stored", "3"],
         "--bpipe-max-stored applies to bpipe"),
        (["--pipeline-schedule-auto-gpu", "v100-32gb"], "nothing fits v100-32gb"),
    ],
)  # fmt: skip
def test_preflight_refusals_are_one_line(extra: list[str], words: str) -> None:
    with pytest.raises(ScheduleError, match=words) as caught:
        check_megatron_command(GPT3_175B + extra, world_size=128)
    assert "\n" not in str(caught.value)


def test_preflight_takes_the_layout_auto_chooses_and_refuses_it_alone() -> None:
    args = parse_megatron_command(
        [*GPT3_175B, "--pipeline-model-parallel-layout", "auto"], world_size=128
    )
    assert args.pipeline_model_parallel_layout.startswith("E")  # the planner's partition
    named = [a for a in GPT3_175B if a not in ("--pipeline-schedule", "auto")]
    with pytest.raises(ScheduleError, match=r"^--pipeline-model-parallel-layout auto needs --pipe"):
        check_megatron_command([*named, "--pipeline-model-parallel-layout", "auto"], world_size=128)


def test_bridge_takes_the_layout_auto_chooses() -> None:
    config = _bridge_config(pipeline_model_parallel_layout="auto")
    _, _, decision = resolve_bridge_auto(config, {}, env={"WORLD_SIZE": "4"}, device=CPU)
    layers = decision.chosen.candidate.stage_layers
    assert config.model.pipeline_model_parallel_layout == layout_of(layers)
    assert config.model.virtual_pipeline_model_parallel_size is None


def test_auto_flags_need_auto() -> None:
    argv = [a for a in GPT3_175B if a != "auto"] + ["1f1b", "--pipeline-schedule-auto-gpu", "x"]
    with pytest.raises(ScheduleError, match="applies to --pipeline-schedule auto"):
        check_megatron_command(argv, world_size=128)


def _bridge_config(**model: Any) -> SimpleNamespace:
    fields: dict[str, Any] = dict(
        num_layers=16,
        hidden_size=1024,
        num_attention_heads=16,
        seq_length=1024,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=None,
        bf16=True,
        recompute_granularity=None,
    )
    fields.update(model)
    return SimpleNamespace(
        model=SimpleNamespace(**fields),
        train=SimpleNamespace(micro_batch_size=1, global_batch_size=4),
        optimizer=SimpleNamespace(optimizer="adam", use_distributed_optimizer=True),
        ddp=SimpleNamespace(use_megatron_fsdp=False),
    )


def test_bridge_config_reaches_a_decision(capsys: pytest.CaptureFixture[str]) -> None:
    config = _bridge_config()
    env = {"WORLD_SIZE": "4", "RANK": "0"}
    name, options, decision = resolve_bridge_auto(config, {}, env=env, device=CPU)
    assert name == decision.schedule
    assert not any("V-shape" in (row.excluded or "") for row in decision.rows)
    if decision.stages_per_rank > 1 and not name.startswith(("v-", "dualpipe")):
        assert config.model.virtual_pipeline_model_parallel_size == decision.stages_per_rank
    assert options == decision.options
    assert capsys.readouterr().out.count("megatron_bfpp: auto: ") == 1


def test_bridge_auto_leaves_out_the_v_shapes_where_a_field_needs_it() -> None:
    config = _bridge_config(mtp_num_layers=1)
    env = {"WORLD_SIZE": "4", "RANK": "0"}
    name, _, decision = resolve_bridge_auto(config, {}, env=env, device=CPU)
    assert not name.startswith(("v-", "dualpipe"))
    excluded = "config.model.mtp_num_layers does not run with a V-shape"
    assert any(row.excluded == excluded for row in decision.rows)


def test_bridge_needs_the_launchers_world_size() -> None:
    with pytest.raises(ScheduleError, match="needs the job's WORLD_SIZE"):
        resolve_bridge_auto(_bridge_config(), {}, env={}, device=CPU)


def test_ranks_that_choose_differently_are_named_with_the_input_that_differs() -> None:
    """The line every rank raises when the ranks' choices differ: the first input that differs
    (here the GPU), each group of ranks with what it read and chose; equal choices pass, even
    from different inputs; a rank that refused is a choice like any other."""
    from megatron_bfpp.megatron.auto import auto_inputs, disagreement

    def facts(device: tuple[str, int], decision: str) -> dict[str, str]:
        inputs = auto_inputs(profile_path=None, gpu_flag=None, device=device, env={})
        return {**inputs, "decision": decision}

    h100, a100 = ("NVIDIA H100 80GB HBM3", 80 * 2**30), ("NVIDIA A100-SXM4-40GB", 40 * 2**30)
    assert disagreement([facts(h100, "v-zb"), facts(a100, "v-zb")]) is None
    line = disagreement([facts(h100, "v-zb"), facts(h100, "v-zb"), facts(a100, "1f1b")] * 2)
    assert line == (
        "--pipeline-schedule auto: the ranks chose differently, their GPU differs (ranks 0-1, "
        "3-4: NVIDIA H100 80GB HBM3 80 GiB -> v-zb; ranks 2, 5: NVIDIA A100-SXM4-40GB 40 GiB -> "
        "1f1b); run the job on one GPU model, or name it with the auto GPU flag, or name the "
        "schedule"
    )
    refused = disagreement([facts(h100, "v-zb"), facts(h100, "refused (nothing fits)")])
    assert refused == (
        "--pipeline-schedule auto: the ranks chose differently, from the same inputs (rank 0: "
        "v-zb; rank 1: refused (nothing fits)); give every rank the same arguments, or name the "
        "schedule"
    )
