"""``bfpp-plan``: estimates made before a run (``recommend``, ``auto``, ``profile``,
``bpipe-estimate``); pure like the planner, only ``profile`` imports torch when it runs."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

from megatron_bfpp.cli.common import (
    closed_pipe_ends_quietly,
    ends_without_teardown,
    fail,
    finite_float,
    json_text,
    matplotlib_problem,
    output_file_problem,
    positive_int_up_to,
    write_problem,
)
from megatron_bfpp.config.run_config import DEFAULT_FFN_TEXT, UnevenStages, flag_name, layout_of
from megatron_bfpp.flags import OneLineParser, positive_int
from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.plan.auto import AutoRequest, _gib, decide, hardware
from megatron_bfpp.plan.bpipe import Estimate, bpipe_speedup_estimate
from megatron_bfpp.plan.costs import ProfileCurve
from megatron_bfpp.plan.memory import RECOMPUTE
from megatron_bfpp.plan.presets import (
    BF16_MIXED,
    FP32,
    GPUS,
    MODELS,
    Model,
    get_gpu,
    get_model,
    model_description,
)
from megatron_bfpp.plan.profile import load_profile
from megatron_bfpp.plan.search import (
    PARTITION_SHIFT,
    Cluster,
    Plan,
    SearchOptions,
    SearchResult,
    families,
    family_name,
)
from megatron_bfpp.schedules.fit import BATCH_SCHEDULE_FLAG, step_batch_sizes
from megatron_bfpp.schedules.registry import GROUP_SIZE, MAX_STORED, SHARDING_STRATEGIES
from megatron_bfpp.sim.simulator import DEFAULT_P2P_MODEL, MEGATRON_GRAD_REDUCE, P2P_MODELS

PROG = "bfpp-plan"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG, description="Plan a pipeline-parallel run before spending GPU hours on it."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    _add_recommend(commands)
    _add_auto(commands)
    _add_profile(commands)
    bpipe = commands.add_parser(
        "bpipe-estimate",
        help="is BPipe worth it: predicted speedup of a larger micro-batch (eq. 2-4 of "
        "'Re-evaluating BPipe') and the activation memory it needs",
        description="From single-stage MFU measured at two micro-batch sizes, predict the "
        "whole-pipeline speedup of moving from 1F1B at the smaller to BPipe at the larger "
        "(eq. 4 of 'Re-evaluating BPipe', BPipe's own overhead ignored), and compare the "
        "activation memory of the busiest rank.",
    )
    bpipe.add_argument("--pp", type=positive_int, required=True, help="pipeline-parallel ranks")
    bpipe.add_argument(
        "--global-batch-size",
        type=positive_int,
        required=True,
        help="samples one pipeline processes per step (global batch / data-parallel size)",
    )
    bpipe.add_argument(
        "--micro-batch-sizes",
        type=positive_int,
        nargs=2,
        required=True,
        metavar=("SMALL", "LARGE"),
        help="1F1B's micro-batch size, then the larger one BPipe makes room for",
    )
    bpipe.add_argument(
        "--stage-mfu",
        type=finite_float,
        nargs=2,
        required=True,
        metavar=("MFU_SMALL", "MFU_LARGE"),
        help="MFU of one stage run alone at each micro-batch size, as fractions (0.378)",
    )
    bpipe.add_argument(
        "--percent", action="store_true", help="--stage-mfu values are percentages (37.8)"
    )
    bpipe.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


@closed_pipe_ends_quietly
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        parser.error("choose a command, e.g. recommend or bpipe-estimate")
    handlers = {"recommend": _recommend, "auto": _auto, "profile": _profile}
    try:  # each command's expected failure (a ScheduleError) is one line naming the command
        return handlers.get(args.command, _bpipe_estimate)(args)
    except ScheduleError as error:
        return fail(f"{PROG} {args.command}", error)


def _bpipe_estimate(args: argparse.Namespace) -> int:
    mfu_small, mfu_large = (value * (0.01 if args.percent else 1.0) for value in args.stage_mfu)
    small, large = args.micro_batch_sizes
    estimate = bpipe_speedup_estimate(
        stage_mfu_small=mfu_small,
        stage_mfu_large=mfu_large,
        micro_batch_small=small,
        micro_batch_large=large,
        global_batch_size=args.global_batch_size,
        pp=args.pp,
    )
    print(json_text(estimate.to_dict()) if args.json else format_estimate(estimate))
    return 0


def format_estimate(estimate: Estimate) -> str:
    e, pct = estimate, "{:.1%}".format
    small, large = e.micro_batch_small, e.micro_batch_large
    rows = [
        ("micro-batch size", f"{small}", f"{large}"),
        ("schedule", "1f1b", "bpipe"),
        ("stage MFU", pct(e.stage_mfu_small), pct(e.stage_mfu_large)),
        ("pipeline MFU (eq. 3)", pct(e.pipeline_mfu_small), pct(e.pipeline_mfu_large)),
        ("stored micro-batches", f"{e.one_f_one_b_stored}", f"{e.bpipe_stored}"),
        ("activation memory", "1", f"{e.memory_ratio:.3g}"),
    ]
    lines = [
        f"BPipe estimate: pp={e.pp} batch per pipeline={e.global_batch_size} "
        f"micro-batch {small} -> {large}",
        "",
        f"{'':<22}  {'before':>8}  {'after':>8}",
        *(f"{label:<22}  {a:>8}  {b:>8}" for label, a, b in rows),
        "",
        f"stage speedup      {e.stage_speedup:.4f}   MFU_stage({large}) / MFU_stage({small})",
        f"pipeline factor    {e.pipeline_factor:.4f}   (B + {small}(p-1)) / (B + {large}(p-1)) = "
        f"{e.global_batch_size + small * (e.pp - 1)}/{e.global_batch_size + large * (e.pp - 1)}",
        f"predicted speedup  {e.predicted_speedup:.4f}   eq. 4, BPipe overhead ignored",
        f"memory ratio       {e.memory_ratio:.4f}   "
        f"({large} x {e.bpipe_stored}) / ({small} x {e.one_f_one_b_stored}); "
        f"1F1B at b={large}: {e.memory_ratio_without_bpipe:.4g}",
        "",
        f"verdict: {e.verdict}",
    ]
    return "\n".join(lines)


# Bounds on the search's inputs, far above any real job, past which it ran for minutes.
_GPUS = positive_int_up_to(1 << 20, "GPUs this planner searches over")
_GPUS_PER_NODE = positive_int_up_to(1024, "GPUs per node")
_BATCH = positive_int_up_to(1 << 24, "sequences per global batch")
_LAYERS = positive_int_up_to(100_000, "transformer layers")
_WIDTH = positive_int_up_to(1 << 24, "a model dimension")


def _add_shape_flags(command: argparse.ArgumentParser) -> None:
    shape = command.add_argument_group(
        "model", "a preset (--model) or an explicit shape (--arch and the sizes)"
    )
    shape.add_argument("--model", metavar="NAME", help=f"preset: {', '.join(MODELS)}")
    shape.add_argument("--arch", choices=("gpt", "llama"), help="explicit shape: architecture")
    shape.add_argument("--num-layers", type=_LAYERS, metavar="L")
    shape.add_argument("--hidden-size", type=_WIDTH, metavar="H")
    shape.add_argument("--num-attention-heads", type=_WIDTH, metavar="A")
    shape.add_argument("--num-query-groups", type=_WIDTH, metavar="G", help="default: one per head")
    shape.add_argument(
        "--ffn-hidden-size", type=_WIDTH, metavar="F", help=f"default: {DEFAULT_FFN_TEXT}"
    )
    shape.add_argument("--vocab-size", type=_WIDTH, metavar="V", help="default: 50257 gpt")
    shape.add_argument(
        "--seq-length", type=_WIDTH, metavar="S", help="default: the preset's (2048)"
    )
    shape.add_argument(
        "--mtp-num-layers",
        type=int,
        metavar="N",
        help="multi-token prediction layers on the last stage (Megatron-LM's flag; default: 0)",
    )


_MOE_DESTS = (
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "moe_layer_freq",
)  # fmt: skip


def _moe_layer_freq(text: str) -> int | tuple[int, ...]:
    """``--moe-layer-freq``: an int, or a 0/1 per layer as ``([0]*3+[1]*58)`` (never evaluated)."""
    if text.isdigit():
        return int(text)
    pattern: list[int] = []
    for term in text.strip("()").replace(" ", "").split("+"):
        values, _, times = term.partition("*")
        if not (values[:1] == "[" and values[-1:] == "]" and (times or "1").isdigit()):
            raise argparse.ArgumentTypeError(f"not an integer or a ([0]*k+[1]*n) list: {text!r}")
        pattern += [int(v) for v in values[1:-1].split(",") if v.isdigit()] * int(times or 1)
    return tuple(pattern)


def _add_moe_flags(command: argparse.ArgumentParser) -> None:
    moe = command.add_argument_group("Mixture of Experts, as Megatron-LM's flags")
    moe.add_argument("--num-experts", type=_WIDTH, metavar="E", help="default: dense")
    moe.add_argument("--moe-router-topk", type=_WIDTH, metavar="K", help="default: 2")
    moe.add_argument("--moe-ffn-hidden-size", type=_WIDTH, metavar="F", help="default: the FFN")
    moe.add_argument("--moe-shared-expert-intermediate-size", type=_WIDTH, metavar="F")
    moe.add_argument("--moe-layer-freq", type=_moe_layer_freq, metavar="N", help="default: 1")


def _add_cluster_flags(
    command: OneLineParser, title: str, gpu_help: str
) -> argparse._ArgumentGroup:
    """The cluster's flags, alike in ``recommend`` and ``auto``: the group they are in."""
    cluster = command.add_argument_group(title)
    cluster.add_argument("--num-gpus", type=_GPUS, required=True, metavar="N")
    cluster.add_argument("--gpus-per-node", type=_GPUS_PER_NODE, default=8, metavar="G")
    cluster.add_argument("--gpu", required=True, metavar="NAME", help=gpu_help)
    return cluster


def _add_recommend(commands: argparse._SubParsersAction[OneLineParser]) -> None:
    command = commands.add_parser(
        "recommend",
        help="rank the parallel configurations of a model on a cluster by predicted step time",
        description="Search schedule, tensor/pipeline/virtual/data parallel sizes, micro-batch "
        "size and recomputation for a model on a cluster; drop what does not fit in GPU memory; "
        "simulate the schedules that can win; print them best first. Formulas and sources: "
        "docs/planner.md.",
    )
    _add_shape_flags(command)
    _add_moe_flags(command)
    cluster = _add_cluster_flags(command, "cluster and batch", f"{', '.join(GPUS)}")
    cluster.add_argument("--global-batch-size", type=_BATCH, required=True, metavar="B")
    search = command.add_argument_group("search")
    for flag, names in (
        ("--schedules", sorted({n for n, _ in families()})),
        ("--recompute", RECOMPUTE),
    ):
        text = f"comma-separated subset of {','.join(names)} (default: all)"
        search.add_argument(flag, metavar="LIST", help=text)
    search.add_argument(
        "--sequence-parallel",
        choices=("on", "off"),
        default="on",
        help="with tensor parallelism (Megatron-LM's --sequence-parallel; default: on); off: "
        "the 2022 papers' setting (docs/planner.md#the-papers-conditions)",
    )
    search.add_argument(
        "--profile",
        metavar="FILE",
        help="a stage profile (bfpp-plan profile) instead of the built-in efficiency curve",
    )
    search.add_argument("--top", type=positive_int, default=10, metavar="K")
    search.add_argument(
        "--pipeline-model-parallel-layout",
        choices=("auto",),
        help="auto: also try each row on uneven stages (the first and last lighter by up to "
        f"{PARTITION_SHIFT} layers, as --pipeline-schedule auto does) and keep the fastest; the "
        "table then lists the layout that reproduces it (default: even stages)",
    )
    search.add_argument(
        "--p2p-model",
        choices=list(P2P_MODELS),
        default=DEFAULT_P2P_MODEL,
        help="how the simulator times point-to-point messages: "
        + "; ".join(f"{name}: {text}" for name, text in P2P_MODELS.items())
        + f" (default: {DEFAULT_P2P_MODEL})",
    )
    search.add_argument(
        "--megatron-p2p",
        choices=("overlap", "blocking"),
        default="overlap",
        help="how Megatron's own interleaved rows post p2p: overlap (Megatron-LM's default) or "
        "blocking (p2p overlap off, as in 2022; interleaved then needs pp > 2)",
    )
    search.add_argument(
        "--megatron-grad-reduce",
        choices=list(MEGATRON_GRAD_REDUCE),
        default="overlap",
        help="where Megatron's own 1f1b / interleaved rows start each chunk's data-parallel "
        "gradient reduction: "
        + "; ".join(f"{name}: {text}" for name, text in MEGATRON_GRAD_REDUCE.items())
        + " (default: overlap)",
    )
    out = command.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        help="throughput per GPU vs batch size per GPU per schedule family, and time vs cost "
        "(needs matplotlib: pip install megatron-bfpp[plot]); runs one search per batch size",
    )
    out.add_argument(
        "--critical-batch-size",
        type=finite_float,
        metavar="B_CRIT",
        help="for --plot's time/cost panel: samples needed grow as 1 + B/B_CRIT",
    )


def _model_from_args(args: argparse.Namespace) -> Model:
    required = ("arch", "num_layers", "hidden_size", "num_attention_heads")
    dests = (*required, "num_query_groups", "ffn_hidden_size", "vocab_size", *_MOE_DESTS)
    explicit = [flag_name(dest) for dest in dests if getattr(args, dest, None) is not None]
    if args.model is not None:
        if explicit:
            raise ScheduleError(
                f"--model {args.model} is a preset; drop {', '.join(explicit)} or drop --model "
                "and give the whole shape"
            )
        model = get_model(args.model)
        model = model.with_seq_length(args.seq_length) if args.seq_length else model
        if args.mtp_num_layers is not None:
            model = model.with_mtp(args.mtp_num_layers)
        return model
    if missing := [flag_name(dest) for dest in required if getattr(args, dest) is None]:
        raise ScheduleError(
            f"give --model NAME ({', '.join(MODELS)}) or an explicit shape; missing "
            f"{', '.join(missing)}"
        )
    return model_description(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length or 2048,
        gated=args.arch == "llama",
        ffn_default="bfpp-train",  # DEFAULT_FFN_TEXT: the models bfpp-train builds
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups,
        vocab_size=args.vocab_size,
        moe={dest: getattr(args, dest, None) for dest in _MOE_DESTS},
        mtp_num_layers=args.mtp_num_layers,
    )


def _choices(text: str | None, allowed: Sequence[str], flag: str) -> tuple[str, ...]:
    if text is None:
        return ()
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    if (bad := [c for c in chosen if c not in allowed]) or not chosen:
        raise ScheduleError(
            f"{flag}: {', '.join(bad) or 'empty'}; choose from {', '.join(allowed)}"
        )
    return chosen


def _recommend(args: argparse.Namespace) -> int:
    model, gpu = _model_from_args(args), get_gpu(args.gpu)
    cluster = Cluster(args.num_gpus, args.gpus_per_node, gpu)
    schedules = _choices(args.schedules, sorted({n for n, _ in families()}), "--schedules")
    recompute = _choices(args.recompute, RECOMPUTE, "--recompute") or RECOMPUTE
    profile = load_profile(args.profile) if args.profile else None
    efficiency = ProfileCurve.from_profile(profile, gpu) if profile is not None else None
    if args.critical_batch_size is not None and args.critical_batch_size <= 0:
        raise ScheduleError(
            f"--critical-batch-size must be positive, got {args.critical_batch_size}"
        )
    if args.plot and (problem := output_file_problem("--plot", args.plot)):
        raise ScheduleError(problem)
    if args.plot and (problem := matplotlib_problem("--plot")):
        raise ScheduleError(f"{problem} (or drop --plot)")
    options = SearchOptions(
        schedules=schedules,
        recompute=recompute,
        top=args.top,
        efficiency=efficiency,
        best_per_family=not args.json,  # the table explains the ranking family by family
        sequence_parallel=args.sequence_parallel == "on",
        p2p_model=args.p2p_model,
        megatron_p2p_overlap=args.megatron_p2p == "overlap",
        megatron_overlap_grad_reduce=args.megatron_grad_reduce == "overlap",
        partitions=args.pipeline_model_parallel_layout == "auto",
    )
    from megatron_bfpp.plan.search import no_candidates_reason, recommend

    query = dict(
        model=model, cluster=cluster, global_batch_size=args.global_batch_size, options=options
    )
    result = recommend(**query)
    if not result.candidates_evaluated:
        raise ScheduleError(no_candidates_reason(**query))
    if not result.plans:
        raise ScheduleError(
            f"no configuration of {model.name} fits {cluster.num_gpus} x {gpu.name} at "
            f"global batch {args.global_batch_size} ({result.rejected_out_of_memory} of "
            f"{result.candidates_evaluated} candidates do not fit in memory); use more or "
            "larger GPUs"
        )
    if args.plot:
        from megatron_bfpp.plan.plot import batch_sweep, default_batch_sizes, render_plot

        sizes = sorted({*default_batch_sizes(cluster.num_gpus), args.global_batch_size})
        plot = functools.partial(
            render_plot,
            batch_sweep(model=model, cluster=cluster, options=options, batch_sizes=sizes),
            model=model,
            cluster=cluster,
            critical_batch_size=args.critical_batch_size,
        )
        if problem := write_problem("--plot", args.plot, plot):
            raise ScheduleError(problem)
    if args.json:
        print(json_text(result.to_dict()))
    else:
        print(
            format_recommendation(
                result,
                model=model,
                cluster=cluster,
                global_batch_size=args.global_batch_size,
                schedules=schedules,
            )
        )
        if args.plot:
            print(f"\nplot: {args.plot}")
    return 0


def format_recommendation(
    result: SearchResult,
    *,
    model: Model,
    cluster: Cluster,
    global_batch_size: int,
    schedules: Sequence[str] = (),
) -> str:
    """The table people read: one row per configuration, best first, then each family's best."""
    gpu = cluster.gpu
    shown = (*result.plans, *result.best_per_family.values())
    marked = next((plan for plan in shown if plan.p2p_model.startswith("megatron")), None)
    width = max(28, *(len(_name(plan)) for plan in shown)) if shown else 28  # MoE rows run long
    header = (
        f"{'#':>2}  {'schedule':<{width}} {'tp':>2} {'pp':>3} {'vp':>2} {'dp':>3} {'b':>3} "
        f"{'m':>4} {'recompute':<9} {'step s':>8} {'tokens/s':>9} {'MFU':>6} {'bubble':>6} "
        f"{'params':>6} {'grads':>6} {'optim':>6} {'acts':>6} {'total':>6}"
    )
    lines = [
        f"{model.name}: {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_attention_heads} heads, sequence {model.seq_length}; "
        f"{cluster.num_gpus} x {gpu.name} ({cluster.gpus_per_node} per node); "
        f"global batch {global_batch_size} ({global_batch_size / cluster.num_gpus:g} per GPU)",
        f"{result.candidates_evaluated} candidates, {result.rejected_out_of_memory} do not fit "
        f"in {gpu.memory_bytes / 2**30:.0f} GiB, {result.simulated} simulated, {result.pruned} "
        f"pruned by bounds, {result.seconds:.1f} s; compute from the {result.efficiency_source}",
        f"p2p timing model: {result.p2p_model} ({P2P_MODELS[result.p2p_model]})",
    ]
    if marked is not None:
        reduce = marked.megatron_grad_reduce or "overlap"
        lines.append(
            f"rows marked [M]: Megatron's own schedule, timed by {P2P_MODELS[marked.p2p_model]}; "
            f"gradient reductions: {reduce} ({MEGATRON_GRAD_REDUCE[reduce]})"
        )
    lines += ["", header, "-" * len(header)]
    lines += [_row(rank, plan, width) for rank, plan in enumerate(result.plans, 1)]
    if result.best_per_family and result.plans:
        first = result.plans[0].step_time_s
        lines += ["", "best of each schedule family (slower than #1 by):"]
        for plan in result.best_per_family.values():
            c = plan.candidate
            lines.append(
                f"  {_name(plan):<{width}} {plan.step_time_s:8.3f} s  "
                f"{100 * (plan.step_time_s / first - 1):+6.1f}%  tp={c.tp} pp={c.pp} vp={c.vp} "
                f"dp={c.dp} b={c.micro_batch_size} {c.recompute}, bubble "
                f"{100 * plan.bubble_fraction:.1f}%"
                + (f", layout '{layout_of(c.stage_layers)}'" if c.stage_layers else "")
            )
        missing = sorted(
            {family_name(n, sh) for n, sh in families() if not schedules or n in schedules}
            - set(result.best_per_family)
        )
        if missing:
            lines.append(f"  none fits in memory (or none exists): {', '.join(missing)}")
    if uneven := [(i, p) for i, p in enumerate(result.plans, 1) if p.candidate.stage_layers]:
        lines += ["", "uneven stages (the rest even):"]
        lines += [
            f"  #{i}: --pipeline-model-parallel-layout '{layout_of(p.candidate.stage_layers)}'"
            for i, p in uneven
        ]
    lines += [
        "",
        "step s: predicted step time; MFU: eq. 1 model FLOPs of 'Re-evaluating BPipe' over the "
        "GPUs' peak; bubble: idle share of the simulated step; memory in GiB per GPU "
        "(busiest pipeline rank).",
    ]
    return "\n".join(lines)


def _name(plan: Plan) -> str:
    """A row's family, its group, BPipe cap or combined 1F1B, and [M] when Megatron posts it."""
    c = plan.candidate
    group = f" g={c.group_size}" if c.group_size else " combined-1f1b" if c.combined_1f1b else ""
    cap = f" cap={c.max_stored}" if c.max_stored else ""
    ep = f" ep={c.ep}" if c.ep > 1 else ""
    return c.family + group + cap + ep + (" [M]" if plan.p2p_model.startswith("megatron") else "")


def _row(rank: int, plan: Plan, width: int) -> str:
    c, mem = plan.candidate, plan.memory
    return (
        f"{rank:>2}  {_name(plan):<{width}} {c.tp:>2} {c.pp:>3} {c.vp:>2} {c.dp:>3} "
        f"{c.micro_batch_size:>3} {plan.num_microbatches:>4} {c.recompute:<9} "
        f"{plan.step_time_s:>8.3f} {plan.tokens_per_s:>9.0f} {100 * plan.mfu:>5.1f}% "
        f"{100 * plan.bubble_fraction:>5.1f}% {_gib(mem.parameters):>6} {_gib(mem.gradients):>6} "
        f"{_gib(mem.optimizer):>6} {_gib(mem.activations):>6} {_gib(mem.total):>6}"
    )


def _add_auto(commands: argparse._SubParsersAction[OneLineParser]) -> None:
    command = commands.add_parser(
        "auto",
        help="the decision --pipeline-schedule auto would make for a layout, before the job",
        description="Print the line a job started with --pipeline-schedule auto prints (rank "
        "0, before any model is built): the schedule, virtual stages, breadth-first group or "
        "BPipe cap the planner picks for the model, parallel sizes and batch given, with the "
        "runner-up and Megatron's own default; --json for the ranked table (the job's "
        "--pipeline-schedule-auto-report). docs/planner.md#bfpp-plan-auto.",
    )
    _add_shape_flags(command)
    _add_moe_flags(command)
    cluster = _add_cluster_flags(
        command,
        "cluster",
        f"{', '.join(GPUS)} (the job's --pipeline-schedule-auto-gpu; its memory a bound)",
    )
    cluster.add_argument("--profile", metavar="FILE", help="a stage profile (bfpp-plan profile)")
    layout = command.add_argument_group("layout and batch, as Megatron-LM's flags")
    for flag in (
        "--tensor-model-parallel-size", "--context-parallel-size", "--expert-model-parallel-size",
        "--micro-batch-size",
    ):  # fmt: skip
        layout.add_argument(flag, type=positive_int, default=1, metavar="N")
    layout.add_argument(
        "--pipeline-model-parallel-size", type=positive_int, required=True, metavar="N"
    )
    layout.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=positive_int,
        metavar="N",
        help="fix the virtual stages (default: auto chooses)",
    )
    layout.add_argument("--global-batch-size", type=_BATCH, metavar="B")
    layout.add_argument(
        BATCH_SCHEDULE_FLAG,
        metavar="SCHEDULE",
        help="Megatron-LM's batch-size schedule (0:256,1M:512) instead of --global-batch-size",
    )
    layout.add_argument("--recompute", choices=RECOMPUTE, default="none")
    layout.add_argument("--sequence-parallel", choices=("on", "off"), default="on")
    layout.add_argument("--precision", choices=("bf16-mixed", "fp32"), default="bf16-mixed")
    layout.add_argument(
        "--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES, default="optim"
    )
    for option in (GROUP_SIZE, MAX_STORED):
        layout.add_argument(
            option.flag, dest=option.dest, type=positive_int, metavar="N", help=option.help
        )
    uneven = "uneven stages, Megatron-LM's flag (docs/planner.md#uneven-stages)"
    layout.add_argument(
        "--pipeline-model-parallel-layout",
        metavar="LAYOUT",
        help=f"{uneven}; 'auto': the planner chooses it with the schedule",
    )
    for end in ("first", "last"):
        layout.add_argument(
            f"--decoder-{end}-pipeline-num-layers", type=positive_int, metavar="N", help=uneven
        )
    for part in ("embedding", "loss"):
        layout.add_argument(f"--account-for-{part}-in-pipeline-split", action="store_true")
    layout.add_argument(
        "--overlap-moe-expert-parallel-comm",
        action="store_true",
        help="the job hides expert all-to-alls in pairs megatron-core combines: auto plans only "
        "those (dualpipe-v, interleaved combined-1f1b) and credits what they hide; without it "
        "no schedule is credited any",
    )
    command.add_argument("--json", action="store_true", help="print the ranked table as JSON")


def _auto(args: argparse.Namespace) -> int:
    """The job's decision from the command's flags (Megatron-LM's names and defaults)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    if args.num_gpus % (tp * pp * cp):
        raise ScheduleError(
            f"--num-gpus {args.num_gpus} is not a multiple of tensor x pipeline x context "
            f"parallel sizes ({tp} x {pp} x {cp} = {tp * pp * cp})"
        )
    dp = args.num_gpus // (tp * pp * cp)
    steps = step_batch_sizes(args) if args.step_batch_size_schedule else ()
    if bool(steps) == (args.global_batch_size is not None):
        raise ScheduleError(f"give one of --global-batch-size and {BATCH_SCHEDULE_FLAG}")
    hw = hardware(
        device_name=None, device_memory=None, gpu_flag=args.gpu, profile_path=args.profile
    )
    request = AutoRequest(
        model=_model_from_args(args),
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=steps[-1] if steps else args.global_batch_size,
        batch_schedule=steps,
        hardware=hw,
        recompute=args.recompute,
        precision=FP32 if args.precision == "fp32" else BF16_MIXED,
        sharding=args.data_parallel_sharding_strategy,
        gpus_per_node=min(args.gpus_per_node, args.num_gpus),
        vp=args.num_virtual_stages_per_pipeline_rank,
        group_size=args.breadth_first_group_size,
        max_stored=args.bpipe_max_stored,
        sequence_parallel=args.sequence_parallel == "on",
        ep=args.expert_model_parallel_size,
        moe_overlap=args.overlap_moe_expert_parallel_comm,
        uneven=UnevenStages.read(args),
    )
    decision = decide(request)
    print(json_text(decision.to_dict()) if args.json else f"megatron_bfpp: {decision.line()}")
    return 0


def _add_profile(commands: argparse._SubParsersAction[OneLineParser]) -> None:
    command = commands.add_parser(
        "profile",
        help="measure one pipeline stage of a megatron-core GPT/LLaMA on this machine's device "
        "and write a JSON profile for 'recommend --profile'",
        description="Build a few transformer layers of the model with megatron-core (tp=1) on "
        "the local device and time their forward, backward, and the backward's input- and "
        "weight-gradient parts at each micro-batch size, the first stage's embedding and the last "
        "stage's output layer and loss (megatron-core's GPTModel modules), and the runtime's "
        "host time per "
        "compute action beyond them (t_host: a one-rank 1F1B step against the same calls made "
        "bare, at the smallest micro-batch size). Runs on CPU too (for the format and tests); "
        "its figures mean something on the GPU you plan for. Needs torch and megatron-core "
        "(pip install megatron-bfpp[megatron]).",
    )
    _add_shape_flags(command)
    command.add_argument(
        "--profile-layers", type=positive_int, default=1, metavar="K", help="layers to time"
    )
    command.add_argument(
        "--micro-batch-sizes", type=positive_int, nargs="+", default=[1, 2, 4], metavar="B"
    )
    command.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    command.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), help="default: bf16 on CUDA, fp32 on CPU"
    )
    command.add_argument("--warmup", type=positive_int, default=2, metavar="N")
    command.add_argument("--iterations", type=positive_int, default=5, metavar="N")
    command.add_argument("--output", "-o", required=True, metavar="FILE.json")


def _profile(args: argparse.Namespace) -> int:
    model = _model_from_args(args)
    if model.num_experts:
        raise ScheduleError(f"{model.name} has experts; profile times dense layers: give a shape")
    if problem := output_file_problem("--output", args.output):
        raise ScheduleError(problem)
    try:
        from megatron_bfpp import stage_timing
    except ImportError as error:
        raise ScheduleError(
            f"profile needs torch and megatron-core ({error}); pip install "
            "'megatron-bfpp[megatron]'"
        ) from None
    profile = stage_timing.measure_stage(
        model=model,
        num_layers=args.profile_layers,
        micro_batch_sizes=tuple(args.micro_batch_sizes),
        device=args.device,
        dtype=args.dtype,
        warmup=args.warmup,
        iterations=args.iterations,
    )
    write = functools.partial(stage_timing.write_profile, profile)
    if problem := write_problem("--output", args.output, write):
        raise ScheduleError(problem)
    rows = ", ".join(
        f"b={m.micro_batch_size}: F {1e3 * m.forward_s:.2f} ms, B {1e3 * m.backward_s:.2f} ms"
        for m in profile.measurements
    )
    host = "" if profile.t_host is None else f"; host {1e3 * profile.t_host:.3f} ms per action"
    print(
        f"{PROG} profile: {profile.device} ({profile.dtype}), {profile.num_layers} layer(s): "
        f"{rows}{host}"
    )
    first = profile.measurements[0]
    if weights := first.end_weights(profile.num_layers):
        print(
            f"stage ends at b={first.micro_batch_size}, in layers: embedding {weights[0]:.3g}, "
            f"output and loss {weights[1]:.3g} (bfpp-sim --embedding-weight {weights[0]:.3g} "
            f"--loss-weight {weights[1]:.3g})"
        )
    print(f"wrote {args.output}")
    return 0


command = ends_without_teardown(main)  # the console script (setup.py)

if __name__ == "__main__":
    command()
