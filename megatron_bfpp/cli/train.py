"""``bfpp-train``: pretrain a small GPT or LLaMA on megatron-core with any catalogue schedule; one
rank under torchrun / srun, else ``--nproc-per-node`` forked ranks; a bad flag: one line, exit 2."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_bfpp.cli.common import (
    fail,
    finite_float,
    output_dir_problem,
    output_file_problem,
    positive_float,
)
from megatron_bfpp.compat import UnsupportedVersionError, check_megatron_core, check_torch
from megatron_bfpp.config.run_config import (
    DEFAULT_FFN_TEXT,
    LAYOUT_AUTO,
    LAYOUT_AUTO_ALONE,
    flag_name,
    layout_virtual_stages,
    model_shape,
    run_config,
)
from megatron_bfpp.flags import (
    QUIET_RANK_GRACE_S,
    OneLineParser,
    positive_int,
    printable_output,
    quiet_exit,
)
from megatron_bfpp.ir import ScheduleError, first_line
from megatron_bfpp.plan.auto import AUTO, add_auto_flags, check_auto_flags
from megatron_bfpp.schedules.fit import check_fit, check_overlap_conditions
from megatron_bfpp.schedules.registry import (
    LAYOUT_VP_FLAG,
    SCHEDULES,
    SHARDING_STRATEGIES,
    add_option_flags,
    options_from_args,
    schedule_names,
)
from megatron_bfpp.train.checkpoint_files import (
    CheckpointError,
    fresh_start_reason,
    save_path_problem,
)
from megatron_bfpp.train.checkpoint_metadata import (
    CKPT_FORMATS,
    check_resume,
    read_checkpoint,
    resume_warnings,
    save_problem,
    scheduler_policy,
)
from megatron_bfpp.train.data_source import (
    DEFAULT_SPLIT,
    DataPathError,
    TextSource,
    data_source,
    default_cache_dir,
)
from megatron_bfpp.train.metric_writers import missing_packages
from megatron_bfpp.train.save_lock import SaveLock

PROG = "bfpp-train"
_error = functools.partial(fail, PROG)  # one line on stderr, exit code 2
_ERROR_GRACE_S = 3.0
MAX_LOCAL_RANKS = 256  # processes of one machine, each with its own model: more is a typo
# numpy's range; torch refuses the data's seeds (seed x 1,000,003 + sample) from 2**64 on.
MAX_SEED = 2**32 - 1
MAX_TIMEOUT_MINUTES = 1_000_000  # about two years; timedelta overflows from about 1e15 minutes


class FlagError(ValueError):
    """A flag combination that cannot run; its message is the one line users see."""


class _Parser(OneLineParser):
    """Fills in the defaults that depend on other flags, so every reader sees the same values."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        apply_schedule_defaults(parsed)
        return parsed, rest


def apply_schedule_defaults(args: argparse.Namespace) -> None:
    """Virtual stages per rank, when not given, are the schedule's own, as in Megatron-LM."""
    spec = SCHEDULES.get(getattr(args, "pipeline_schedule", ""))
    layout = getattr(args, "pipeline_model_parallel_layout", None)  # it fixes them (validate)
    if spec is not None and getattr(args, "num_virtual_stages_per_pipeline_rank", 0) is None:
        args.num_virtual_stages_per_pipeline_rank = None if layout else spec.default_stages_per_rank


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Pretrain a small GPT or LLaMA on megatron-core with a megatron_bfpp "
        "pipeline schedule (CPU: gloo on local ranks; GPU: NCCL).",
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    m.add_argument("--num-layers", type=positive_int, default=8)
    m.add_argument("--hidden-size", type=positive_int, default=64)
    m.add_argument("--num-attention-heads", type=positive_int, default=4)
    m.add_argument(
        "--num-query-groups",
        type=positive_int,
        help="grouped-query attention (default: --num-attention-heads, no grouping)",
    )
    m.add_argument("--ffn-hidden-size", type=positive_int, help=f"(default: {DEFAULT_FFN_TEXT})")
    m.add_argument("--seq-length", type=positive_int, default=64)
    m.add_argument("--vocab-size", type=positive_int, default=256)
    _add_moe_arguments(m)

    par = p.add_argument_group("parallelism and schedule")
    by_count: dict[int, list[str]] = {}  # the virtual stages' default: each schedule's own
    for spec in SCHEDULES.values():
        by_count.setdefault(spec.default_stages_per_rank, []).append(spec.name)
    counts = "; ".join(f"{n} for {', '.join(names)}" for n, names in sorted(by_count.items()))
    par.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=positive_int, default=4)
    par.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        "--virtual-pipeline-model-parallel-size",
        type=positive_int,
        help=f"virtual pipeline stages per rank (default: the schedule's: {counts})",
    )
    uneven = "uneven stages, Megatron-LM's flags (docs/megatron-lm.md#uneven-stages)"
    par.add_argument(
        "--pipeline-model-parallel-layout",
        metavar="LAYOUT",
        help=f"{uneven}: the stages in model order, 'E' the embedding, 't' a layer, 'L' the "
        "loss ('Et*3|t*4|t*4|t*3L'); it fixes the stages per rank (a V: stage s on rank s or "
        "2p-1-s); 'auto' with --pipeline-schedule auto: the planner chooses it",
    )
    for end in ("first", "last"):
        par.add_argument(f"--decoder-{end}-pipeline-num-layers", type=positive_int, help=uneven)
    for part in ("embedding", "loss"):
        par.add_argument(
            f"--account-for-{part}-in-pipeline-split", action="store_true", help=uneven
        )
    par.add_argument(
        "--pipeline-schedule",
        default="breadth-first",
        metavar="{" + ",".join((AUTO, *schedule_names())) + "}",
        help="auto: the planner picks the schedule, its virtual stages, group size or BPipe cap "
        "for these sizes and this device (one line says which and why)",
    )
    add_option_flags(par, positive_int)
    add_auto_flags(par)
    par.add_argument(
        "--data-parallel-sharding-strategy",
        choices=SHARDING_STRATEGIES,
        default="optim",
        help="Megatron's vocabulary: optim (the distributed optimizer as usual) or "
        "optim_grads_params (parameters sharded too: each chunk gathered before its use and "
        "released after it, at most two chunks whole per rank; needs data parallelism and a "
        "looped schedule)",
    )
    par.add_argument(
        "--nproc-per-node",
        type=positive_int,
        help="ranks to start when not launched by torchrun (default: 4 on CPU, #GPUs on GPU; "
        f"at most {MAX_LOCAL_RANKS})",
    )
    par.add_argument(
        "--no-memory-check",
        action="store_true",
        help="start even if the estimated weights, gradients and Adam state exceed the memory "
        "there is (the estimate leaves out activations; it is checked before any rank starts)",
    )
    par.add_argument(
        "--distributed-timeout-minutes",
        type=positive_float,
        default=10,
        help="as in Megatron-LM: a collective or pipeline message waiting longer on another "
        "rank fails, naming it (default 10; fractions allowed, e.g. 0.5)",
    )
    par.add_argument(
        "--heartbeat-timeout",
        type=positive_int,
        default=30,
        metavar="SECONDS",
        help="local ranks only: a rank silent this long (stopped, frozen) ends the job, named "
        "(default 30)",
    )

    _add_training_and_io_arguments(p)
    return p


def _add_moe_arguments(m: Any) -> None:
    moe = "Mixture-of-Experts (Megatron-LM's flag; megatron-core's local MoE layer, no biases)"
    m.add_argument("--num-experts", type=positive_int, help=f"{moe}: experts per layer")
    m.add_argument("--moe-router-topk", type=positive_int, help=f"{moe} (default: 2)")
    m.add_argument("--moe-ffn-hidden-size", type=positive_int, help=f"{moe} (default: the FFN's)")
    m.add_argument(
        "--expert-model-parallel-size",
        type=positive_int,
        default=1,
        help=f"{moe}: ranks of the data-parallel group the experts are split over",
    )
    m.add_argument(
        "--moe-token-dispatcher-type",
        choices=("alltoall", "allgather"),
        default="alltoall",
        help=f"{moe} (default: alltoall, which gloo runs; Megatron-LM's is allgather)",
    )
    m.add_argument(
        "--overlap-moe-expert-parallel-comm",
        action="store_true",
        help=f"{moe}: run overlapped pairs (dualpipe-v, interleaved --combined-1f1b) as "
        "megatron-core's combined step, each part's all-to-all under the other's compute (needs "
        "--bf16 and --expert-model-parallel-size > 1)",
    )


def _add_training_and_io_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=positive_int, default=1)
    t.add_argument("--global-batch-size", type=positive_int, default=8)
    t.add_argument("--train-iters", type=positive_int, default=20)
    t.add_argument("--lr", type=finite_float, default=3e-3)
    t.add_argument("--min-lr", type=finite_float, default=3e-4)
    t.add_argument(
        "--lr-warmup-iters", type=int, default=2, help=">= 0, capped at the decay length - 1"
    )
    t.add_argument(
        "--lr-decay-iters",
        type=positive_int,
        help="iterations of cosine decay (default: --train-iters); to train a finished run "
        "further on its schedule, resume with a larger --train-iters and the old decay length",
    )
    t.add_argument("--weight-decay", type=finite_float, default=0.01, help=">= 0")
    t.add_argument(
        "--clip-grad", type=finite_float, default=1.0, help="global gradient-norm limit; 0: none"
    )
    t.add_argument("--seed", type=int, default=1234, help=f"0 .. {MAX_SEED}")
    t.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 weights and activations, fp32 gradients and main weights in the distributed "
        "optimizer (Megatron-LM's --bf16; default: fp32)",
    )
    t.add_argument(
        "--data-path",
        nargs="+",
        metavar="PATH",
        help="a local text file (byte-level tokens), or Megatron indexed datasets (.bin + .idx) "
        "as Megatron-LM takes them: PREFIX, or weights and prefixes W1 P1 W2 P2 ... "
        "(default: synthetic data)",
    )
    t.add_argument(
        "--split",
        help=f"indexed datasets: train,validation,test weights, as Megatron-LM's (default "
        f"{DEFAULT_SPLIT}); bfpp-train trains on the first part",
    )
    t.add_argument(
        "--data-cache-path",
        metavar="DIR",
        help="indexed datasets: where megatron-core caches its sample indices (default: "
        "PREFIX/cache beside the dataset)",
    )

    io = p.add_argument_group("checkpoints and logging")
    io.add_argument("--save", metavar="DIR", help="write checkpoints here")
    io.add_argument("--load", metavar="DIR", help="resume from this checkpoint")
    io.add_argument(
        "--ckpt-format",
        choices=CKPT_FORMATS,
        default="torch",
        help="format --save writes (--load reads either): torch: one file per rank (same "
        "layout to resume); torch_dist: megatron-core distributed checkpointing (Megatron-LM's "
        "--ckpt-format torch_dist; needs psutil)",
    )
    io.add_argument(
        "--override-opt_param-scheduler",
        action="store_true",
        help="on --load, use this run's learning-rate schedule (--lr, --min-lr, "
        "--lr-warmup-iters, --lr-decay-iters/--train-iters, --weight-decay) instead of the "
        "checkpoint's (Megatron-LM's flag)",
    )
    io.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        help="on --load, keep the checkpoint's learning-rate schedule whatever this run's "
        "flags say (Megatron-LM's flag); without either flag a changed schedule is refused",
    )
    io.add_argument(
        "--save-interval",
        type=positive_int,
        help="also save every N iterations (default: at the end only)",
    )
    io.add_argument(
        "--exit-interval",
        type=positive_int,
        help="stop after an iteration divisible by N (saving a checkpoint with --save); the "
        "learning-rate schedule still spans --lr-decay-iters (default --train-iters)",
    )
    io.add_argument("--metrics-file", metavar="PATH", help="one JSON line per iteration")
    io.add_argument("--log-interval", type=positive_int, default=1)
    io.add_argument(
        "--tensorboard-dir",
        metavar="DIR",
        help="also write TensorBoard event files here (rank 0; pip install "
        "'megatron-bfpp[tensorboard]')",
    )
    io.add_argument(
        "--wandb-project",
        metavar="NAME",
        help="also log to this Weights & Biases project (rank 0; pip install "
        "'megatron-bfpp[wandb]'); offline (wandb sync uploads it) unless an API key is "
        "configured or WANDB_MODE says otherwise",
    )
    io.add_argument("--wandb-exp-name", metavar="NAME", help="the W&B run's name")
    io.add_argument(
        "--wandb-save-dir",
        metavar="DIR",
        help="where W&B writes its run directory (default: ./wandb)",
    )
    io.add_argument(
        "--no-progress",
        action="store_true",
        help="log one line per --log-interval instead of a redrawn bar (the default when stdout "
        "is not a terminal, as in SLURM logs)",
    )


def validate(args: argparse.Namespace, world_size: int, *, rank: int = 0) -> list[str]:
    """Raise :class:`FlagError` for a combination that cannot run on ``world_size`` ranks (as
    ``rank`` sees it); return the lines to say about ``--load`` before the run starts."""
    name = args.pipeline_schedule
    try:
        check_auto_flags(args)
    except ScheduleError as error:
        raise FlagError(str(error)) from None
    if name not in schedule_names():
        raise FlagError(
            f"unknown --pipeline-schedule {name!r}; choose one of: "
            f"{', '.join((AUTO, *schedule_names()))}"
        )
    apply_schedule_defaults(args)
    problem = (
        uneven_problem(args)
        or moe_problem(args, world_size)
        or number_problem(args)
        or output_problem(args, metrics=rank == 0)
        or (
            args.save is not None
            and save_path_problem(args.save, world_size=world_size, iterations=args.train_iters)
        )
        or checkpoint_format_problem(args)
    )
    if problem is not None:
        raise FlagError(problem)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise FlagError(
            f"tensor ({tp}) x pipeline ({pp}) parallel size must divide the world size "
            f"({world_size}): tp*pp*dp must equal the number of ranks"
        )
    if args.hidden_size % args.num_attention_heads:
        raise FlagError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}"
        )
    groups = args.num_query_groups or args.num_attention_heads
    if args.num_attention_heads % groups or groups % tp or args.num_attention_heads % tp:
        raise FlagError(
            f"--num-attention-heads {args.num_attention_heads} must be a multiple of "
            f"--num-query-groups {groups}, and both of --tensor-model-parallel-size {tp}"
        )
    if (data_problem := data_path_problem(args)) is not None:
        raise FlagError(data_problem)
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise FlagError(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude "
            "each other: choose this run's learning-rate schedule or the checkpoint's"
        )
    try:
        check_fit(
            name,
            pp=pp,
            vp=args.num_virtual_stages_per_pipeline_rank,
            dp=world_size // (tp * pp),
            micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size,
            vp_flag=LAYOUT_VP_FLAG
            if args.pipeline_model_parallel_layout
            else "--num-virtual-stages-per-pipeline-rank",
            num_layers=None
            if run_config(args, world_size).layout.uneven_config()
            else args.num_layers,
            sharding=args.data_parallel_sharding_strategy,
            options=options_from_args(name, args),
            overlapped=args.overlap_moe_expert_parallel_comm,
        )
    except ScheduleError as error:
        raise FlagError(str(error)) from None
    notes = check_load(args, world_size) if args.load is not None else []
    if args.save is not None and (args.load is None or not _same_directory(args.save, args.load)):
        problem = save_problem(args.save, run_config(args, world_size))
        if problem is not None:
            raise FlagError(problem)
    return notes


def _same_directory(path: str, other: str) -> bool:
    """Whether ``--save path`` is the ``--load`` directory (then the resume rules apply)."""
    try:
        return os.path.samefile(path, other)
    except OSError:  # one of them does not exist yet
        return os.path.abspath(path) == os.path.abspath(other)


def resolve_auto(args: argparse.Namespace, world_size: int) -> None:
    """``--pipeline-schedule auto``: decided (said by rank 0) before any check needs a schedule."""
    if args.pipeline_schedule != AUTO:
        return
    check_auto_flags(args)  # --combined-1f1b: refused before auto decides
    from megatron_bfpp.train.auto import resolve_train_auto

    report = args.pipeline_schedule_auto_report
    if report is not None and (
        problem := output_file_problem("--pipeline-schedule-auto-report", report)
    ):
        raise FlagError(problem)
    try:
        resolve_train_auto(args, world_size)
    except ScheduleError as error:
        raise FlagError(str(error).splitlines()[0]) from None


def uneven_problem(args: argparse.Namespace) -> str | None:
    """megatron-core's checks of the uneven-stage flags, in one line before any rank starts; the
    stages per rank a layout lists, set (as Megatron-LM sets them)."""
    uneven = run_config(args, args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    if not (fields := uneven.layout.uneven_config()):
        return None
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout == LAYOUT_AUTO:  # auto replaced it when it decided
        return LAYOUT_AUTO_ALONE
    if layout := args.pipeline_model_parallel_layout:
        try:
            stages = layout_virtual_stages(layout, pp, args.num_layers)
        except ValueError as error:
            return str(error)
        if (vp := args.num_virtual_stages_per_pipeline_rank) not in (None, stages):
            return (
                f"--pipeline-model-parallel-layout lists {stages} stages per rank; "
                f"drop --num-virtual-stages-per-pipeline-rank {vp}"
            )
        args.num_virtual_stages_per_pipeline_rank = stages
    from megatron_bfpp.train.presets import transformer_config

    vp = args.num_virtual_stages_per_pipeline_rank
    try:
        with warnings.catch_warnings():  # megatron-core's, about no rank yet: one line stays one
            warnings.simplefilter("ignore")
            transformer_config(
                uneven.model, tp=tp, pp=pp, vp=vp if vp and vp > 1 else None, on_cpu=True, **fields
            )
    except (ValueError, AssertionError, KeyError) as error:
        return f"uneven stages: {first_line(error)}"
    return None


def moe_problem(args: argparse.Namespace, world_size: int) -> str | None:
    """megatron-core's conditions on the expert flags, in one line before any rank starts."""
    experts, ep = args.num_experts, args.expert_model_parallel_size
    if experts is None:
        dests = ("moe_router_topk", "moe_ffn_hidden_size", "overlap_moe_expert_parallel_comm")
        given = [flag_name(d) for d in dests if getattr(args, d)] + [
            "--expert-model-parallel-size"
        ] * (ep > 1)
        return f"{given[0]} needs --num-experts (a Mixture-of-Experts model)" if given else None
    dp = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    if experts % ep or dp % ep:
        return (
            f"--expert-model-parallel-size {ep} must divide --num-experts {experts} and the "
            f"data-parallel size {dp}"
        )
    if (topk := model_shape(args).router_topk) > experts:
        return f"--moe-router-topk {topk} routes to more experts than --num-experts {experts}"
    try:
        check_overlap_conditions(args)
    except ScheduleError as error:
        return str(error)
    return None


def data_path_problem(args: argparse.Namespace) -> str | None:
    """What keeps ``--data-path`` (``--split``, ``--data-cache-path``) from being read."""
    given = [flag_name(d) for d in ("split", "data_cache_path") if getattr(args, d) is not None]
    if args.data_path is None:
        return f"{given[0]} needs --data-path (Megatron indexed datasets)" if given else None
    try:
        source = data_source(args.data_path, seq_length=args.seq_length, split=args.split)
    except DataPathError as error:
        return str(error)
    if isinstance(source, TextSource):
        if given:
            return f"{given[0]} applies to Megatron indexed datasets; {source.path} is a text file"
        if args.vocab_size < 256:
            return "--data-path uses byte tokens: --vocab-size must be >= 256"
        return None
    if (problem := dataset_helpers_problem()) is not None:
        return problem
    if args.data_cache_path is not None:
        return output_dir_problem("--data-cache-path", args.data_cache_path)
    if len(source.prefixes) == 1:  # megatron-core caches a single dataset's indices beside it
        cache = default_cache_dir(source.prefixes[0])
        if output_dir_problem("--data-path", cache) is not None:
            return (
                f"--data-path {source.prefixes[0]}: megatron-core cannot create its index cache "
                f"{cache}; give --data-cache-path DIR"
            )
    return None


def dataset_helpers_problem() -> str | None:
    """megatron-core's compiled dataset helpers, found without importing megatron-core (with
    no megatron-core at all, check_megatron_core says so)."""
    spec = importlib.util.find_spec("megatron")
    locations = (spec.submodule_search_locations if spec else None) or []
    folders = [folder for p in locations if (folder := Path(p) / "core" / "datasets").is_dir()]
    if not folders or any(any(f.glob("helpers_cpp*.so")) for f in folders):
        return None
    return (
        "--data-path: megatron-core's dataset helpers (helpers_cpp) are not compiled; run "
        f"`make -C {folders[0]}` (needs pybind11), as Megatron-LM does on its first run"
    )


def number_problem(args: argparse.Namespace) -> str | None:
    """The numeric flags' ranges (argparse already refused inf and nan), checked before training."""
    if not (args.lr > 0 and 0 <= args.min_lr <= args.lr):
        return f"need --lr > 0 and 0 <= --min-lr <= --lr (got {args.lr}, {args.min_lr})"
    notes = {"lr_warmup_iters": "", "weight_decay": "", "clip_grad": " (0: no clipping)"}
    for dest, note in notes.items():
        if (value := getattr(args, dest)) < 0:
            return f"{flag_name(dest)} must be >= 0{note}, got {value}"
    if not 0 <= args.seed <= MAX_SEED:
        return f"--seed must be in 0 .. {MAX_SEED}, got {args.seed}"
    if args.distributed_timeout_minutes > MAX_TIMEOUT_MINUTES:
        minutes = args.distributed_timeout_minutes
        shown = int(minutes) if float(minutes).is_integer() else minutes
        return f"--distributed-timeout-minutes must be at most {MAX_TIMEOUT_MINUTES:,}, got {shown}"
    if args.nproc_per_node is not None and args.nproc_per_node > MAX_LOCAL_RANKS:
        return (
            f"--nproc-per-node {args.nproc_per_node}: bfpp-train starts at most "
            f"{MAX_LOCAL_RANKS} local ranks; launch larger jobs with torchrun or srun"
        )
    return None


def output_problem(args: argparse.Namespace, *, metrics: bool = True) -> str | None:
    """Where the run writes, checked before it starts: every rank refuses W&B flags that do not go
    together; only rank 0 (``metrics``) checks the paths and packages only it uses."""
    if args.save is not None and (problem := output_dir_problem("--save", args.save)):
        return problem
    if args.wandb_project is None:
        for dest in ("wandb_exp_name", "wandb_save_dir"):
            if getattr(args, dest) is not None:
                return f"{flag_name(dest)} needs --wandb-project NAME"
    elif not args.wandb_project.strip():
        return "--wandb-project: empty name"
    if not metrics:
        return None
    if args.metrics_file is not None and (
        problem := output_file_problem("--metrics-file", args.metrics_file, replaced=False)
    ):
        return problem
    packages = {"--tensorboard-dir": args.tensorboard_dir, "--wandb-project": args.wandb_project}
    if (problem := missing_packages(packages)) is not None:
        return problem
    for dest in ("tensorboard_dir", "wandb_save_dir"):
        path = getattr(args, dest)
        if path is not None and (problem := output_dir_problem(flag_name(dest), path)):
            return problem
    return None


def checkpoint_format_problem(args: argparse.Namespace) -> str | None:
    """megatron-core's ``torch_dist`` writer needs psutil, which it does not install: without
    it every save failed after training, or (0.16) the ranks waited forever."""
    torch_dist = args.save is not None and args.ckpt_format == "torch_dist"
    if torch_dist and importlib.util.find_spec("psutil") is None:
        return (
            "--ckpt-format torch_dist needs psutil (megatron-core's checkpoint writer uses it): "
            "pip install psutil (or megatron-bfpp[megatron]), or save with --ckpt-format torch"
        )
    return None


def memory_problem(args: argparse.Namespace, world_size: int, *, launched: bool) -> str | None:
    """On a CPU-only machine, a model whose weights, gradients and Adam state do not fit the
    available RAM, refused before the kernel kills it after start (GPU ranks check theirs)."""
    import torch

    from megatron_bfpp.config import model_memory

    if args.no_memory_check or torch.cuda.is_available():  # is_available does not start CUDA
        return None
    run = run_config(args, world_size)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if launched else world_size
    return model_memory.memory_problem(
        run.model,
        run.layout,
        local_ranks=local,
        ram_bytes=model_memory.available_ram_bytes(),
        bf16=run.training.bf16,
    )


def check_load(args: argparse.Namespace, world_size: int) -> list[str]:
    """Refuse a resume that cannot work, from the checkpoint's metadata alone, in one line; as
    in Megatron-LM no checkpoint yet starts fresh, and a changed seed or data path warns."""
    if (fresh := fresh_start_reason(args.load)) is not None:
        return [
            f"info: --load {args.load} {fresh}: no checkpoint to resume, starting from "
            "iteration 0 (as Megatron-LM does)"
        ]
    try:
        _, metadata = read_checkpoint(args.load)
        current = run_config(args, world_size)
        check_resume(metadata, current, root=args.load, scheduler=scheduler_policy(args))
    except CheckpointError as error:
        raise FlagError(str(error)) from None
    return [f"warning: {line}" for line in resume_warnings(metadata, current, root=args.load)]


def _run_rank(args: argparse.Namespace, store: Any = None) -> tuple[int, str | None]:
    """One rank: train; an expected failure as an exit code and its one line, for the caller."""
    from megatron_bfpp.runtime.p2p import PipelineTimeout
    from megatron_bfpp.train.checkpoint import OtherRankFailed
    from megatron_bfpp.train.liveness import RanksLost
    from megatron_bfpp.train.trainer import RendezvousTimeout, train

    try:
        train(args, store=store)
    except OtherRankFailed:
        if store is None:  # torchrun / srun: let the reporting rank print before torchrun
            time.sleep(QUIET_RANK_GRACE_S)  # stops every worker at this one's exit
        return 2, None  # the failing rank reports the one line
    except RanksLost as lost:  # torchrun / srun: this rank speaks for the job
        return 1, str(lost)
    except (PipelineTimeout, RendezvousTimeout) as error:  # a rank stopped, slow or absent
        return 1, first_line(error)
    except (FlagError, ScheduleError, ValueError, FileNotFoundError, FloatingPointError) as error:
        return 2, first_line(error)
    except KeyboardInterrupt:
        return 130, None
    return 0, None


CPU_RANKS = 4  # bfpp-train's default without a GPU


def _visible_gpus(
    env: dict[str, str] | None = None, driver: str = "/proc/driver/nvidia/gpus"
) -> int:
    """The GPUs torch will likely see (the driver's, narrowed by ``CUDA_VISIBLE_DEVICES``),
    counted without importing torch (seconds) so a flag mistake is refused at once."""
    try:
        found = len(os.listdir(driver))
    except OSError:
        return 0
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    entries = [entry.strip() for entry in visible.split(",")]
    usable = [(e.isdigit() and int(e) < found) or e.startswith(("GPU-", "MIG-")) for e in entries]
    return [*usable, False].index(False)  # CUDA stops at the first entry it cannot use


_QUIET = (
    r"Apex is not installed",  # megatron-core's local spec falls back to torch norms
    r"The \.grad attribute of a Tensor that is not a leaf",  # megatron-core optimizer probe
    # megatron-core 0.19 on CPU: fallbacks for GPU-only extras, and notes meant for its own users
    r"Transformer Engine and Apex are not installed",
    r"absl\.logging is not installed",
    r"MimoModelConfig is experimental",
    r"full scope is deprecated",  # TransformerConfig's own default cuda_graph_modules
    # torch's distributed checkpointing, called by megatron-core's torch_dist reader
    r"torch\.distributed is disabled, unavailable or uninitialized",
    r"The argument order of load has been changed",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    r"`load_state_dict` is deprecated and will be removed",  # megatron-core 0.16's reader
)
# Log records (logger name, message start) that say nothing to a bfpp-train user.
_QUIET_LOGS = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel: full_param"),
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),  # CUDA build of torch, no GPU
    # 0.19 says it on every (synchronous) torch_dist save, to users of its asynchronous one
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated"),
    # its writer's workers on a failed write (the save's one line says it and where)
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "Local worker"),
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "Local process"),  # 0.16
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "An error is caught"),
)


def _drop_record(prefix: str) -> Callable[[logging.LogRecord], bool]:
    return lambda record: not record.getMessage().startswith(prefix)


def main(argv: Sequence[str] | None = None) -> int:
    for message in _QUIET:
        warnings.filterwarnings("ignore", message=message)
    for logger, prefix in _QUIET_LOGS:
        logging.getLogger(logger).addFilter(_drop_record(prefix))
    printable_output()
    args = build_parser().parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    # Before torch is imported: when a rank or the store's host dies, every store call of every
    # rank would add a C++ warning and its stack around the one line that names it.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    world_size = (
        int(os.environ["WORLD_SIZE"])
        if launched
        else (args.nproc_per_node or _visible_gpus() or CPU_RANKS)
    )
    try:
        resolve_auto(args, world_size)
        notes = validate(args, world_size, rank=int(os.environ["RANK"]) if launched else 0)
        check_megatron_core()
        if (torch_warning := check_torch()) and os.environ.get("RANK", "0") == "0":
            print(torch_warning, file=sys.stderr, flush=True)  # once per run
        if (problem := memory_problem(args, world_size, launched=launched)) is not None:
            raise FlagError(problem)
    except (FlagError, UnsupportedVersionError) as error:
        # Under torchrun every rank checks the same flags: one line per node, not per rank.
        if launched and os.environ.get("LOCAL_RANK", "0") != "0":
            quiet_exit(2)  # local rank 0 prints the line first
        return _error(str(error))
    if not launched or os.environ["RANK"] == "0":  # said once for the job
        for note in notes:
            print(f"{PROG}: {note}", flush=True)
    if launched:
        code, reason = _run_rank(args)  # under torchrun, rank 0 takes --save's lock
        if reason:
            _error(reason)
        return code
    lock = None
    if args.save is not None:
        try:
            lock = SaveLock.acquire(args.save)  # held by this launcher for the whole run
        except CheckpointError as error:
            return _error(str(error))
    try:
        return _spawn(args, world_size)
    finally:
        if lock is not None:
            lock.release()


def _spawn(args: argparse.Namespace, world_size: int) -> int:
    """Fork ``world_size`` ranks (megatron-core imported once, here) and report how they ended."""
    import megatron.core.distributed
    import megatron.core.models.gpt
    import megatron.core.optimizer  # noqa: F401
    import torch

    import megatron_bfpp.runtime
    import megatron_bfpp.train.trainer  # noqa: F401
    from megatron_bfpp.local_ranks import Stopped, fork_ranks

    if args.nproc_per_node is None and world_size != (
        seen := torch.cuda.device_count() if torch.cuda.is_available() else CPU_RANKS
    ):
        world_size = seen  # one rank per GPU torch sees: other GPUs than the driver listed
        try:
            validate(args, world_size)
        except FlagError as error:
            return _error(f"{error} ({world_size} ranks: one per GPU torch sees)")
    try:
        run = fork_ranks(
            lambda rank, store: _run_rank(args, store=store),
            world_size,
            error_grace=_ERROR_GRACE_S,
            failed=lambda outcome: outcome[0] != 0,
            name="bfpp-train-rank",
            heartbeat_timeout=args.heartbeat_timeout,
            warn_once=True,
        )
    except KeyboardInterrupt:
        _error(f"interrupted; stopped all {world_size} ranks")
        return 130
    except Stopped as stopped:
        _error(f"{signal.Signals(stopped.signum).name}: stopped all {stopped.num_ranks} ranks")
        return 128 + stopped.signum
    return _report(run)


def _report(run: Any) -> int:
    """One line per distinct failure and the exit code of the rank to blame: ranks that failed
    because another left say nothing new, and only a bug's traceback is printed, once."""
    messages = [
        outcome[1] for _, outcome in sorted(run.results.items()) if outcome[0] != 0 and outcome[1]
    ]
    culprit = run.culprit
    if culprit is None or culprit not in run.lost:  # else theirs follow from the lost rank's
        for message in dict.fromkeys(messages):  # each distinct line once, in rank order
            _error(message)
    if culprit is None:
        return _error(f"ranks {list(run.killed)} still running when stopped") if run.killed else 0
    if culprit in run.results:
        return max(int(run.results[culprit][0]), 1)
    others = sorted((set(run.failed_at) | set(run.killed)) - {culprit})
    after = f"; stopped the other ranks ({others})" if others else ""
    text = run.errors[culprit].rstrip()
    if culprit in run.lost:
        _error(f"{text}{after}")
    else:  # an unexpected exception: the traceback is the report
        sys.stderr.write(text + "\n")
        _error(f"rank {culprit} failed (traceback above){after}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
