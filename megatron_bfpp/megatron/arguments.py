"""``--pipeline-schedule`` and its options for Megatron-LM's argument parser, and their checks.

Pure argparse plus the (torch-free) schedule registry: ``install()`` wires these into
``megatron.training.arguments``; tests call them directly on a plain parser / namespace.

``--pipeline-schedule default`` (the default) changes nothing: Megatron-LM keeps its own
schedule selection bit for bit and none of the checks below run.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_bfpp.ir import ScheduleError

__all__ = [
    "PIPELINE_SCHEDULE_CHOICES",
    "add_schedule_arguments",
    "check_schedule_args",
    "schedule_options_from_args",
]

PIPELINE_SCHEDULE_CHOICES = (
    "default",
    "gpipe",
    "1f1b",
    "interleaved",
    "breadth-first",
    "bpipe",
    "v-min",
    "v-half",
    "v-zb",
)
_GROUP_TITLE = "pipeline schedule (megatron_bfpp)"
_VP_FLAGS = "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank"


def add_schedule_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the megatron_bfpp argument group to ``parser`` (returns it, like Megatron's helpers)."""
    group = parser.add_argument_group(title=_GROUP_TITLE)
    group.add_argument(
        "--pipeline-schedule",
        choices=PIPELINE_SCHEDULE_CHOICES,
        default="default",
        help="Pipeline schedule. 'default' keeps Megatron's own choice (1F1B, or interleaved "
        "with virtual stages); the others run megatron_bfpp's schedules. breadth-first and "
        f"interleaved need virtual stages ({_VP_FLAGS}).",
    )
    group.add_argument(
        "--breadth-first-group-size",
        type=int,
        default=None,
        help="breadth-first: micro-batches per group (bounds activation memory; default: all "
        "micro-batches in one group).",
    )
    group.add_argument(
        "--bpipe-max-stored",
        type=int,
        default=None,
        help="bpipe: most activations (in 1F1B stage units) any rank may hold (default: "
        "BPipe's ceil((p+2)/2)).",
    )
    return parser


def schedule_options_from_args(args: Any) -> dict[str, Any]:
    """The schedule's own options (registry names) read from Megatron's parsed ``args``."""
    name = getattr(args, "pipeline_schedule", "default")
    options: dict[str, Any] = {}
    if name == "breadth-first" and getattr(args, "breadth_first_group_size", None) is not None:
        options["group_size"] = args.breadth_first_group_size
    elif name == "interleaved":
        # Megatron's own flag (from TransformerConfig) sets the depth-first group size.
        group = getattr(args, "microbatch_group_size_per_vp_stage", None)
        if group is not None:
            options["microbatch_group_size"] = group
    elif name == "bpipe" and getattr(args, "bpipe_max_stored", None) is not None:
        options["max_stored"] = args.bpipe_max_stored
    return options


def check_schedule_args(args: Any) -> None:
    """Check ``--pipeline-schedule`` against Megatron's other (already validated) arguments.

    Runs after Megatron's own ``validate_args`` (which derives
    ``virtual_pipeline_model_parallel_size`` and ``data_parallel_size``). Raises
    :class:`ScheduleError` with one line saying what to change.
    """
    from megatron_bfpp.runtime.api import RUNNABLE_SCHEDULES as runnable
    from megatron_bfpp.schedules.registry import build_schedule, get_spec

    name = getattr(args, "pipeline_schedule", "default")
    if name not in PIPELINE_SCHEDULE_CHOICES:
        raise ScheduleError(
            f"--pipeline-schedule {name!r} is unknown; choose one of: "
            f"{', '.join(PIPELINE_SCHEDULE_CHOICES)}"
        )
    group_size = getattr(args, "breadth_first_group_size", None)
    max_stored = getattr(args, "bpipe_max_stored", None)
    if group_size is not None and name != "breadth-first":
        raise ScheduleError("--breadth-first-group-size needs --pipeline-schedule breadth-first")
    if max_stored is not None and name != "bpipe":
        raise ScheduleError("--bpipe-max-stored needs --pipeline-schedule bpipe")
    if name == "default":
        return
    if group_size is not None and group_size < 1:
        raise ScheduleError(f"--breadth-first-group-size must be >= 1, got {group_size}")
    if max_stored is not None and max_stored < 1:
        raise ScheduleError(f"--bpipe-max-stored must be >= 1, got {max_stored}")
    if name not in runnable:
        raise ScheduleError(
            f"--pipeline-schedule {name} is not yet runnable on megatron-core (runnable: "
            f"{', '.join(runnable)}); bfpp-sim can already simulate and draw it"
        )

    spec = get_spec(name)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if pp < 2:
        raise ScheduleError(
            f"--pipeline-schedule {name} needs --pipeline-model-parallel-size >= 2 (got {pp}); "
            "without pipeline parallelism use --pipeline-schedule default"
        )
    if spec.placement == "looped" and vp is None:
        raise ScheduleError(
            f"--pipeline-schedule {name} needs virtual pipeline stages: set {_VP_FLAGS} "
            "(at least 2 stages per rank)"
        )
    if spec.placement == "single" and vp is not None:
        raise ScheduleError(
            f"--pipeline-schedule {name} runs one stage per rank; drop {_VP_FLAGS} "
            f"(got {vp} virtual stages per rank) or use interleaved / breadth-first"
        )
    if getattr(args, "rampup_batch_size", None):
        raise ScheduleError(
            f"--pipeline-schedule {name} does not support --rampup-batch-size yet; "
            "use --pipeline-schedule default"
        )

    micro = int(args.micro_batch_size)
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    global_batch = int(args.global_batch_size)
    if global_batch % (micro * dp):
        raise ScheduleError(
            f"--global-batch-size {global_batch} is not a multiple of micro-batch size x "
            f"data-parallel size ({micro} x {dp})"
        )
    num_microbatches = global_batch // (micro * dp)
    try:
        build_schedule(
            name,
            num_ranks=pp,
            num_microbatches=num_microbatches,
            num_chunks=vp if spec.placement == "looped" else None,
            **schedule_options_from_args(args),
        )
    except ScheduleError as error:
        raise ScheduleError(
            f"--pipeline-schedule {name} cannot run {num_microbatches} micro-batches on "
            f"pp={pp}" + (f", vp={vp}" if vp else "") + f": {str(error).splitlines()[0]}"
        ) from None
