"""Check a Megatron-LM command line on a login node (torch-free), from its arguments and world
size alone: ``validate_args`` checks only after the job has waited for its nodes."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megatron_bfpp.config.run_config import (
    LAYOUT_AUTO,
    LAYOUT_AUTO_ALONE,
    layout_virtual_stages,
)
from megatron_bfpp.flags import OneLineParser, positive_int
from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.megatron.arguments import (
    add_schedule_arguments,
    apply_schedule_defaults,
    check_schedule_args,
    stages_of_layers,
)
from megatron_bfpp.megatron.auto import resolve_megatron_auto
from megatron_bfpp.plan.auto import AUTO
from megatron_bfpp.schedules.fit import BATCH_SCHEDULE_FLAG, num_microbatches, step_batch_sizes

__all__ = ["check_megatron_command", "check_parallel_layout", "parse_megatron_command"]


# Megatron-LM's flags these checks read, with Megatron's defaults.
_SIZES = {
    "--tensor-model-parallel-size": 1,
    "--pipeline-model-parallel-size": 1,
    "--context-parallel-size": 1,
    "--num-query-groups": 1,
}
_OPTIONAL_SIZES = (
    "--num-layers",
    "--num-attention-heads",
    "--micro-batch-size",
    "--global-batch-size",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    # What --pipeline-schedule auto reads of the model.
    "--hidden-size",
    "--seq-length",
    "--ffn-hidden-size",
    "--vocab-size",
)
_SWITCHES = (
    "--group-query-attention",
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
    "--use-tp-pp-dp-mapping",
    # What --pipeline-schedule auto reads of the model and the training.
    "--swiglu",
    "--bf16",
    "--fp16",
    "--use-distributed-optimizer",
    "--sequence-parallel",
)


def _parser() -> argparse.ArgumentParser:
    # Errors become one ScheduleError line, not usage text and exit 2: the caller reports them.
    parser = OneLineParser(add_help=False, allow_abbrev=False, raises=ScheduleError)
    for flag, default in _SIZES.items():
        parser.add_argument(flag, type=positive_int, default=default)
    for flag in _OPTIONAL_SIZES:
        parser.add_argument(flag, type=positive_int, default=None)
    for flag in _SWITCHES:
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--pipeline-model-parallel-layout", default=None)
    parser.add_argument("--rampup-batch-size", nargs="*", default=None)
    parser.add_argument(BATCH_SCHEDULE_FLAG, default=None)
    # What --pipeline-schedule auto reads of the training (Megatron's defaults).
    for flag in ("--hidden-dropout", "--attention-dropout"):
        parser.add_argument(flag, type=float, default=0.1)
    parser.add_argument("--recompute-granularity", default=None)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--tokenizer-type", default=None)
    parser.add_argument("--data-parallel-sharding-strategy", default=None)
    parser.add_argument(
        "--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm"
    )
    # Megatron-LM owns this schedule option's flag, so add_schedule_arguments leaves it out.
    parser.add_argument(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        dest="microbatch_group_size_per_vp_stage",
        type=positive_int,
        default=None,
    )
    return add_schedule_arguments(parser)


def parse_megatron_command(argv: Sequence[str], *, world_size: int) -> argparse.Namespace:
    """The arguments these checks read, plus what Megatron's ``validate_args`` derives."""
    args, _ = _parser().parse_known_args(list(argv))
    args.world_size = world_size
    if args.step_batch_size_schedule is not None and args.global_batch_size is not None:
        raise ScheduleError(  # Megatron-LM's own refusal, before the nodes start
            f"{BATCH_SCHEDULE_FLAG} and --global-batch-size exclude each other; drop "
            "--global-batch-size (the schedule gives every step's)"
        )
    if args.pipeline_schedule == AUTO:  # decided as on the GPUs, but quietly and without CUDA
        resolve_megatron_auto(
            args,
            sharding=args.data_parallel_sharding_strategy,
            env={"WORLD_SIZE": str(world_size)},
            quiet=True,
        )
    if args.pipeline_model_parallel_layout == LAYOUT_AUTO:  # auto replaced it when it decided
        raise ScheduleError(LAYOUT_AUTO_ALONE)
    apply_schedule_defaults(args)  # what the plugin does before Megatron validates (vp 2)
    model_size = (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    if world_size % model_size:
        raise ScheduleError(
            f"world size {world_size} is not a multiple of tensor x pipeline x context parallel "
            f"sizes ({args.tensor_model_parallel_size} x {args.pipeline_model_parallel_size} x "
            f"{args.context_parallel_size} = {model_size}); change the node count or the sizes"
        )
    args.data_parallel_size = world_size // model_size
    args.virtual_pipeline_model_parallel_size = _virtual_stages(args)
    if args.micro_batch_size is None:
        raise ScheduleError("--micro-batch-size is missing; Megatron-LM needs it")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    return args


def _virtual_stages(args: argparse.Namespace) -> int | None:
    """Megatron's ``virtual_pipeline_model_parallel_size``: ``None`` for one stage per rank."""
    flags = (
        "--num-layers-per-virtual-pipeline-stage",
        "--num-virtual-stages-per-pipeline-rank",
        "--pipeline-model-parallel-layout",
    )
    given = [flag for flag in flags if getattr(args, flag[2:].replace("-", "_")) is not None]
    if len(given) > 1:
        raise ScheduleError(f"{' and '.join(given)} exclude each other; give one")
    if args.pipeline_model_parallel_layout is not None:
        return _layout_virtual_stages(args)
    vp: int | None = args.num_virtual_stages_per_pipeline_rank
    if args.num_layers_per_virtual_pipeline_stage is not None:
        layers = _layers_per_rank(args)
        if layers is None:
            raise ScheduleError(
                "--num-layers-per-virtual-pipeline-stage needs --num-layers split evenly over "
                "the pipeline; otherwise use --num-virtual-stages-per-pipeline-rank"
            )
        vp = stages_of_layers(layers, args.num_layers_per_virtual_pipeline_stage)
    return None if vp == 1 else vp


def _layout_virtual_stages(args: argparse.Namespace) -> int | None:
    """Megatron's vp from a layout (its stages / pp), after megatron-core's checks of it."""
    try:
        vp = layout_virtual_stages(
            args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size, args.num_layers
        )
    except ValueError as error:
        raise ScheduleError(str(error)) from None
    return None if vp == 1 else vp


def _layers_per_rank(args: argparse.Namespace) -> int | None:
    """Layers per pipeline rank, split evenly; ``None`` when uneven by design or not given."""
    uneven = (
        args.decoder_first_pipeline_num_layers,
        args.decoder_last_pipeline_num_layers,
        args.pipeline_model_parallel_layout,
    )
    if args.num_layers is None or any(value is not None for value in uneven):
        return None
    layers: int = (
        args.num_layers
        + int(args.account_for_embedding_in_pipeline_split)
        + int(args.account_for_loss_in_pipeline_split)
    )
    pp: int = args.pipeline_model_parallel_size
    if layers % pp:
        raise ScheduleError(
            f"--num-layers {args.num_layers} does not split over --pipeline-model-parallel-size "
            f"{pp} ({layers} % {pp} = {layers % pp}); choose a pipeline size that divides it"
        )
    return layers // pp


def check_parallel_layout(args: argparse.Namespace) -> None:
    """Megatron's own checks that the parallel sizes alone decide."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    heads = args.num_attention_heads
    if heads is not None and heads % tp:
        raise ScheduleError(
            f"--num-attention-heads {heads} is not a multiple of --tensor-model-parallel-size {tp}"
        )
    if args.group_query_attention and args.num_query_groups % tp:
        raise ScheduleError(
            f"--num-query-groups {args.num_query_groups} is not a multiple of "
            f"--tensor-model-parallel-size {tp}"
        )
    vp = args.virtual_pipeline_model_parallel_size
    layers = _layers_per_rank(args)
    if vp is not None and layers is not None and layers % vp:
        raise ScheduleError(
            f"{layers} layers per pipeline rank do not split into {vp} virtual stages; "
            "choose a virtual pipeline size that divides them"
        )
    least = 2 if args.overlap_p2p_comm else 3
    if vp is not None and pp < least:
        raise ScheduleError(
            f"virtual pipeline stages need --pipeline-model-parallel-size >= {least} (got {pp})"
            + ("" if args.overlap_p2p_comm else " without p2p overlap")
        )
    steps = step_batch_sizes(args)
    for batch in steps or (args.global_batch_size,):
        num_microbatches(
            global_batch_size=batch,
            micro_batch_size=args.micro_batch_size,
            data_parallel_size=args.data_parallel_size,
            what=f"{BATCH_SCHEDULE_FLAG}'s batch size {batch}" if steps else None,
        )


def check_megatron_command(argv: Sequence[str], *, world_size: int) -> argparse.Namespace:
    """Raise :class:`ScheduleError` (one line) for ``pretrain_gpt.py`` arguments that cannot run
    on ``world_size`` GPUs; the parsed namespace, for the launcher's parallel sizes."""
    args = parse_megatron_command(argv, world_size=world_size)
    check_parallel_layout(args)
    check_schedule_args(args)
    return args
