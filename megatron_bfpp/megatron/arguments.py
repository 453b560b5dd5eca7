"""``--pipeline-schedule`` and its options for Megatron-LM's argument parser, and their checks
(torch-free); ``default`` changes nothing: Megatron-LM keeps its own schedule bit for bit."""

from __future__ import annotations

import argparse
from typing import Any

from megatron_bfpp.config.run_config import UNEVEN_CONFIG_FIELDS, UNEVEN_FLAGS, flag_name
from megatron_bfpp.ir import Placement, ScheduleError
from megatron_bfpp.plan.auto import AUTO, add_auto_flags, check_auto_flags
from megatron_bfpp.schedules.fit import check_fit, check_overlap_conditions, step_batch_sizes
from megatron_bfpp.schedules.registry import (
    LAYOUT_VP_FLAG,
    MEGATRON_VP_FLAGS,
    SCHEDULES,
    SHARDING_STRATEGIES,
    add_option_flags,
    check_option_flags,
    get_spec,
    options_from_args,
    schedule_names,
)

__all__ = [
    "add_schedule_arguments",
    "apply_schedule_defaults",
    "check_schedule_args",
    "pipeline_schedule_choices",
    "schedule_options_from_args",
]


def stages_of_layers(layers: int, per_stage: int) -> int:
    """Virtual stages per rank from ``--num-layers-per-virtual-pipeline-stage``, as Megatron's."""
    if layers % per_stage:
        raise ScheduleError(
            f"{layers} layers per pipeline rank do not split into virtual stages of "
            f"--num-layers-per-virtual-pipeline-stage {per_stage}; use a divisor"
        )
    return layers // per_stage


def pipeline_schedule_choices() -> tuple[str, ...]:
    """``default`` (Megatron's own), ``auto`` (the planner's pick) and the catalogue."""
    return ("default", AUTO, *schedule_names())


def add_schedule_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the megatron_bfpp argument group to ``parser`` (returns it, like Megatron's helpers)."""
    group = parser.add_argument_group(title="pipeline schedule (megatron_bfpp)")
    group.add_argument(
        "--pipeline-schedule",
        choices=pipeline_schedule_choices(),
        default="default",
        help="Pipeline schedule. 'default' keeps Megatron's own choice (1F1B, or interleaved "
        "with virtual stages); 'auto' lets the planner pick one of ours for this layout (one "
        "line says which and why); the others run megatron_bfpp's schedules. breadth-first and "
        f"interleaved need virtual stages ({MEGATRON_VP_FLAGS}; without either: 2 per rank).",
    )
    add_option_flags(group, int, megatron=True)
    add_auto_flags(group)
    return parser


# Megatron-LM's ways of asking for virtual pipeline stages (any one of them set: the user chose).
_VP_SOURCES = (
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "pipeline_model_parallel_layout",
    "hybrid_layer_pattern",
    "hybrid_override_pattern",  # its older name
)


def apply_schedule_defaults(args: Any) -> None:
    """Before ``validate_args``: looped / V schedules given no virtual stages get 2 per rank."""
    spec = SCHEDULES.get(getattr(args, "pipeline_schedule", "default"))
    given = any(getattr(args, name, None) is not None for name in _VP_SOURCES)
    if spec is not None and spec.placement is not Placement.SINGLE and not given:
        args.num_virtual_stages_per_pipeline_rank = spec.default_stages_per_rank


def schedule_options_from_args(args: Any) -> dict[str, Any]:
    """The schedule's own options (registry names) read from Megatron's parsed ``args``."""
    name = getattr(args, "pipeline_schedule", "default")
    return {} if name in ("default", AUTO) else options_from_args(name, args, megatron=True)


def check_schedule_args(args: Any) -> None:
    """Check ``--pipeline-schedule`` against the arguments ``validate_args`` completed."""
    name = getattr(args, "pipeline_schedule", "default")
    if name not in pipeline_schedule_choices():
        raise ScheduleError(
            f"--pipeline-schedule {name!r} is unknown; choose one of: "
            f"{', '.join(pipeline_schedule_choices())}"
        )
    if name == AUTO:  # resolved in validate_args before Megatron's checks; never left here
        raise ScheduleError("--pipeline-schedule auto was not resolved (megatron_bfpp.install())")
    check_auto_flags(args)
    check_option_flags(None if name == "default" else name, args, megatron=True)
    if name == "default":
        return
    options = schedule_options_from_args(args)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if pp < 2:
        raise ScheduleError(
            f"--pipeline-schedule {name} needs --pipeline-model-parallel-size >= 2 (got {pp}); "
            "without pipeline parallelism use --pipeline-schedule default"
        )
    sharding: str = getattr(args, "bfpp_data_parallel_sharding_strategy", None) or "optim"
    if sharding not in SHARDING_STRATEGIES:  # Megatron-FSDP's values
        raise ScheduleError(
            f"--data-parallel-sharding-strategy {sharding} is Megatron-FSDP's; with "
            f"--pipeline-schedule {name} choose optim (the distributed optimizer) or "
            "optim_grads_params (parameters sharded too, gathered per chunk by the schedule)"
        )
    check_fit(
        name,
        pp=pp,
        vp=getattr(args, "virtual_pipeline_model_parallel_size", None),
        dp=int(getattr(args, "data_parallel_size", 1) or 1),
        micro_batch_size=int(args.micro_batch_size),
        global_batch_size=int(args.global_batch_size),
        # with a layout, Megatron-LM derives vp from its stage count
        vp_flag=LAYOUT_VP_FLAG
        if getattr(args, "pipeline_model_parallel_layout", None)
        else MEGATRON_VP_FLAGS,
        sharding=sharding,
        options=options,
        # --step-batch-size-schedule: global_batch_size (mbs x dp) is no step's; every step runs
        batch_schedule=step_batch_sizes(args),
        overlapped=bool(getattr(args, "overlap_moe_expert_parallel_comm", False)),
    )
    check_overlap_conditions(args)
    if getattr(args, "rampup_batch_size", None):
        raise ScheduleError(
            f"--pipeline-schedule {name} does not support --rampup-batch-size yet; "
            "use --pipeline-schedule default"
        )
    given = given_flags(args, NO_V_SHAPE_FLAGS)
    if get_spec(name).placement is Placement.V_SHAPE and given:
        raise ScheduleError(
            f"--pipeline-schedule {name} places layers on a V (rank r holds stages r and 2p-1-r) "
            f"and does not support {given[0]} yet; drop it"
        )
    if sharding != "optim":
        _check_sharded_optimizer_args(args)


# Megatron-LM's flags that place layers unevenly. Every schedule runs them: megatron's looped
# stage arithmetic names the model's stages in order, and a V places stage s on rank s or 2p-1-s
# (chunks.placed_provider). auto plans on them (plan.auto.AutoRequest.uneven).
UNEVEN_LAYOUT_FLAGS = tuple(flag_name(dest) for dest in UNEVEN_FLAGS)
# Megatron-Bridge's config fields for them (megatron-core's TransformerConfig's).
UNEVEN_LAYOUT_FIELDS = UNEVEN_CONFIG_FIELDS
# What the V-shapes cannot run with in Megatron-LM, and Bridge's fields for it.
NO_V_SHAPE_FLAGS = ("--mtp-num-layers", "--defer-embedding-wgrad-compute")
NO_V_SHAPE_FIELDS = ("mtp_num_layers", "defer_embedding_wgrad_compute")


def given_flags(args: Any, flags: tuple[str, ...]) -> list[str]:
    """The ``flags`` Megatron-LM's parsed ``args`` set (their destinations truthy), in order."""
    return [flag for flag in flags if getattr(args, flag[2:].replace("-", "_"), None)]


def _check_sharded_optimizer_args(args: Any) -> None:
    """The optimizer flags sharded parameters (``optim_grads_params``) need or cannot run with."""
    if not getattr(args, "use_distributed_optimizer", False):
        raise ScheduleError(
            "--data-parallel-sharding-strategy optim_grads_params shards megatron-core's "
            "distributed-optimizer buffers: add --use-distributed-optimizer"
        )
    reads_parameters = given_flags(
        args, ("--log-params-norm", "--check-weight-hash-across-dp-replicas-interval")
    )
    if reads_parameters:
        raise ScheduleError(
            f"{reads_parameters[0]} reads every parameter between steps, when sharded parameters "
            "are released; drop it with --data-parallel-sharding-strategy optim_grads_params"
        )
    if getattr(args, "overlap_param_gather", False):
        raise ScheduleError(
            "--data-parallel-sharding-strategy optim_grads_params gathers each chunk where the "
            "schedule says and overlaps those gathers itself: drop --overlap-param-gather"
        )
    unsupported = given_flags(args, ("--use-precision-aware-optimizer", "--fp8-param-gather"))
    if (getattr(args, "num_distributed_optimizer_instances", 1) or 1) > 1:
        unsupported.append("--num-distributed-optimizer-instances")
    if unsupported:
        raise ScheduleError(
            f"{unsupported[0]} is not supported with --data-parallel-sharding-strategy "
            "optim_grads_params (the optimizer steps on shard-only buffers there); drop it"
        )
