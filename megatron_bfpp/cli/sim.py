"""``bfpp-sim``: build (or load) a schedule, validate it, simulate it, print and draw it."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from megatron_bfpp.cli.common import (
    closed_pipe_ends_quietly,
    ends_without_teardown,
    fail,
    json_text,
    matplotlib_problem,
    non_negative_float,
    output_file_problem,
    write_problem,
)
from megatron_bfpp.config.run_config import flag_name, layout_layer_shares, layout_stage_weights
from megatron_bfpp.flags import OneLineParser, positive_int
from megatron_bfpp.ir import (
    _CHUNK_LEVEL,
    Schedule,
    ScheduleError,
    dump_csv,
    format_schedule,
    load_csv,
)
from megatron_bfpp.messages import _LOWERED_KINDS, Message, message_of
from megatron_bfpp.nccl import nccl_report
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.grad_sync import SHARDING_STRATEGIES, add_grad_sync
from megatron_bfpp.schedules.registry import (
    ALL_OPTIONS,
    SCHEDULES,
    ScheduleOption,
    build_schedule,
    check_sharding,
    get_spec,
    in_flag_terms,
)
from megatron_bfpp.sim import (
    MAX_PNG_RANKS,
    PNG_SECONDS_PER_RANK,
    CostModel,
    SimResult,
    dump_chrome_trace,
    render_png,
    simulate,
)
from megatron_bfpp.sim.cost import cost_fields
from megatron_bfpp.sim.simulator import (
    DEFAULT_MEGATRON_GRAD_REDUCE,
    DEFAULT_P2P_MODEL,
    MEGATRON_GRAD_REDUCE,
    P2P_MODELS,
    STEADY_FROM_ACTIONS,
    simulate_steady,
    with_stage_memory,
)
from megatron_bfpp.validate import has_communication, validate_schedule

PROG = "bfpp-sim"

# bfpp-sim's option flags, each serving every schedule option naming it (--group-size: two)
_SIM_FLAGS: dict[str, tuple[ScheduleOption, ...]] = {
    flag: tuple(option for option in ALL_OPTIONS if option.sim_flag == flag)
    for flag in dict.fromkeys(option.sim_flag for option in ALL_OPTIONS)
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Validate and simulate a pipeline schedule: step time, bubble, per-rank "
        "activation memory, exposed data-parallel communication; draw it as PNG or Chrome trace.",
    )
    source = parser.add_argument_group("schedule")
    source.add_argument("--schedule", choices=list(SCHEDULES), help="schedule to build")
    source.add_argument(
        "--load-csv",
        metavar="PATH",
        help="simulate a schedule from CSV instead: ours, or torch.distributed.pipelining's "
        "_dump_csv (compute-only or lowered with UNSHARD/RESHARD and messages)",
    )
    source.add_argument("--pp", type=positive_int, help="pipeline-parallel ranks")
    source.add_argument(
        "--vp",
        type=positive_int,
        help="virtual stages (chunks) per rank: interleaved and breadth-first need it (>= 2); "
        "the V-shapes place 2, the others 1",
    )
    source.add_argument(
        "--microbatches",
        type=positive_int,
        help="micro-batches per step (default: 2 x pp, a step where every schedule reaches its "
        "steady state; the report says when it was used)",
    )
    source.add_argument(
        "--data-parallel-sharding-strategy",
        choices=SHARDING_STRATEGIES,
        default="optim",
        help="optim (default): parameters stay whole (DDP / distributed optimizer); "
        "optim_grads_params (breadth-first): parameters and gradients sharded too, each "
        "chunk gathered (PS) and released (RL) around its use and its gradients reduced into "
        "a shard after its last backward (GS), at most two chunks whole per rank",
    )
    for flag, options in _SIM_FLAGS.items():
        kind = options[0].argument(positive_int)  # the options of one flag take the same value
        source.add_argument(flag, help="; ".join(o.help for o in options), **kind)
    costs = parser.add_argument_group("costs (one micro-batch through one full 1F1B stage)")
    for cost in cost_fields():  # CostModel's own defaults and help, one flag each
        default, text = cost.default, cost.metadata["help"]
        if cost.name == "t_evict":  # its default depends on the schedule (apply_defaults)
            default = None
            text += f" (default: {BPIPE_T_EVICT:g} for bpipe, so its transfers show in the "
            text += "timeline; 0 otherwise)"
        costs.add_argument(
            flag_name(cost.name), type=non_negative_float, default=default, help=text
        )
    _add_stage_arguments(costs)
    costs.add_argument(
        "--p2p-model",
        choices=list(P2P_MODELS),
        default=DEFAULT_P2P_MODEL,
        help="how point-to-point messages are timed: "
        + "; ".join(f"{name}: {text}" for name, text in P2P_MODELS.items())
        + f" (default: {DEFAULT_P2P_MODEL})",
    )
    costs.add_argument(
        "--megatron-grad-reduce",
        choices=list(MEGATRON_GRAD_REDUCE),
        default=None,
        help="with --p2p-model megatron / megatron-blocking, where Megatron's own schedule "
        "starts each chunk's data-parallel gradient reduction (a GS, --t-grad-reduce): "
        + "; ".join(f"{name}: {text}" for name, text in MEGATRON_GRAD_REDUCE.items())
        + f" (default: {DEFAULT_MEGATRON_GRAD_REDUCE})",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument(
        "--nccl",
        action="store_true",
        help="check the schedule under NCCL's point-to-point rules, as written (one batch per "
        "run of messages between computes) and as the runtime posts it (lock-step ticks); "
        "always on with --load-csv",
    )
    out.add_argument(
        "--grid",
        choices=["compute", "full", "none"],
        help="per-rank program printed after the table (default: compute); by default one "
        f"of over {GRID_ACTIONS:,} compute actions is a line saying so",
    )
    out.add_argument(
        "--exact",
        action="store_true",
        help="time every micro-batch of a long step (over "
        f"{STEADY_FROM_ACTIONS:,} actions) instead of reading its steady state off three "
        "shorter steps whose times lie exactly on one line (the same figures, several times "
        "faster; the report says when it did)",
    )
    out.add_argument("--png", metavar="PATH", help="write a timeline picture")
    out.add_argument("--trace", metavar="PATH", help="write a Chrome trace (open in Perfetto)")
    out.add_argument("--csv", metavar="PATH", help="write the lowered schedule as CSV")
    return parser


# What an embedding and an output layer with its loss cost against a transformer layer, forward
# and backward, measured on one H200 in bf16 (docs/measurements/h200-stage-kinds.json):
# 0.011-0.026 and, at a 32k vocabulary, 0.17-0.26 (at 128k: 1.02-1.04).
EMBEDDING_WEIGHT, LOSS_WEIGHT = 0.02, 0.25


def _add_stage_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--stage-weights",
        type=_weights,
        metavar="W,W,...",
        help="uneven stages: each global stage's compute (F, B, I, W) against an even stage's, "
        "one per stage in model order (pp x vp; 1 = as even; --t-host is not weighted)",
    )
    group.add_argument(
        "--pipeline-model-parallel-layout",
        metavar="LAYOUT",
        help="uneven stages as Megatron-LM writes them ('Et*3|t*4|t*4|t*3L'): each stage "
        "weighs its layers against an even stage's, plus --embedding-weight for E and "
        "--loss-weight for L (an MTP layer m: a layer, an E and an L)",
    )
    group.add_argument(
        "--embedding-weight",
        type=non_negative_float,
        help=f"with --pipeline-model-parallel-layout: the embedding, in transformer layers "
        f"(default {EMBEDDING_WEIGHT:g}, measured on an H200)",
    )
    group.add_argument(
        "--loss-weight",
        type=non_negative_float,
        help=f"with --pipeline-model-parallel-layout: the output layer and its loss, in "
        f"transformer layers (default {LOSS_WEIGHT:g}: a 32k vocabulary on an H200; about 1 "
        "at 128k)",
    )


def _weights(text: str) -> tuple[float, ...]:
    try:
        weights = tuple(non_negative_float(part) for part in text.split(","))
    except (argparse.ArgumentTypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers >= 0 (e.g. 1.2,1,1,1.3)"
        ) from None
    return weights


def stage_weights(args: argparse.Namespace, num_stages: int) -> tuple[float, ...]:
    """``CostModel.stage_weights`` from bfpp-sim's flags, checked against the schedule's stages;
    raises ``ScheduleError`` with the one line to print."""
    layout, given = args.pipeline_model_parallel_layout, args.stage_weights
    per_layer = {"--embedding-weight": args.embedding_weight, "--loss-weight": args.loss_weight}
    if layout and given:
        raise ScheduleError("pass --stage-weights or --pipeline-model-parallel-layout, not both")
    if not layout and (named := [flag for flag, value in per_layer.items() if value is not None]):
        raise ScheduleError(
            f"{named[0]} weighs a layout's E / L: add --pipeline-model-parallel-layout"
        )
    if layout:
        embedding, loss = args.embedding_weight, args.loss_weight
        try:
            given = layout_stage_weights(
                layout,
                args.pp or 1,
                embedding=EMBEDDING_WEIGHT if embedding is None else embedding,
                loss=LOSS_WEIGHT if loss is None else loss,
            )
        except ValueError as error:
            raise ScheduleError(str(error)) from None
    if given and len(given) != num_stages:
        flag = "--pipeline-model-parallel-layout" if layout else "--stage-weights"
        raise ScheduleError(
            f"{flag} gives {len(given)} stages; the schedule has {num_stages} (pp x stages per "
            "rank): give one per stage, in model order"
        )
    return given or ()


_OUTPUTS = ("csv", "trace", "png")  # each written by --NAME PATH, reported as "wrote NAME: PATH"
_NCCL_VIEWS = {"as_written": "as written", "lock_step": "as bfpp runs it (lock-step)"}


@closed_pipe_ends_quietly
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in _OUTPUTS:
        path = getattr(args, name)
        if path is not None and (problem := output_file_problem(f"--{name}", path)):
            return fail(PROG, problem)
    if args.png and args.pp is not None and (problem := png_problem(args.pp)):
        return fail(PROG, problem)
    if args.png and (problem := matplotlib_problem("--png")):
        return fail(PROG, problem)
    if args.megatron_grad_reduce is not None and not args.p2p_model.startswith("megatron"):
        return fail(
            PROG,
            "--megatron-grad-reduce applies to --p2p-model megatron or megatron-blocking "
            "(Megatron's own 1f1b / interleaved); the other models start each reduction at the "
            "schedule's GS",
        )
    defaults = apply_defaults(args)
    try:
        schedule = _schedule_from(args)
        if args.png and (problem := png_problem(schedule.num_ranks)):
            return fail(PROG, problem)
        weights = stage_weights(args, schedule.num_stages)
        layout = args.pipeline_model_parallel_layout  # checked by stage_weights
        costs = CostModel(
            **{cost.name: getattr(args, cost.name) for cost in cost_fields()},
            stage_weights=weights,
            stage_activations=layout_layer_shares(layout) if layout else (),
        )
        result = _simulated(args, schedule, costs)
        result = with_stage_memory(result, schedule, costs.stage_activations)
        nccl = nccl_report(schedule) if args.nccl or args.load_csv else None
        if not math.isfinite(result.step_time):
            return fail(
                PROG,
                f"the costs overflow: the step time is {result.step_time}; use smaller --t-* "
                "values (one unit can be a millisecond or a second)",
            )
        writes = (
            ("--csv", args.csv, lambda path: dump_csv(schedule, path)),
            ("--trace", args.trace, lambda path: dump_chrome_trace(result, path)),
            ("--png", args.png, lambda path: render_png(result, path)),
        )
        for flag, path, write in writes:
            if path and (problem := write_problem(flag, path, write)):
                return fail(PROG, problem)
    except ScheduleError as error:
        return fail(PROG, in_flag_terms(str(error), args.schedule or "", sim=True))
    except OSError as error:
        return fail(PROG, error)
    if args.json:
        data = result.to_dict()
        if defaults:
            data["defaults_used"] = defaults
        if nccl is not None:
            data["nccl"] = nccl
        print(json_text(data))
    else:
        print(format_report(result))
        for name, text in defaults.items():
            print(f"default {name}: {text}")
        if nccl is not None:  # NCCL safety as written and as the runtime posts it
            for key, label in _NCCL_VIEWS.items():
                verdict = nccl[key]
                text = "NCCL-safe" if verdict["safe"] else f"NOT NCCL-safe: {verdict['problem']}"
                print(f"NCCL, {label}: {text}")
        if grid := _grid(args.grid, schedule):
            print(f"\n{grid}")
    for name in _OUTPUTS:
        if path := getattr(args, name):
            print(f"wrote {name}: {path}", file=sys.stderr)
    return 0


def _simulated(args: argparse.Namespace, schedule: Schedule, costs: CostModel) -> SimResult:
    """The step from its steady state, unless ``--exact``, a drawing that asks for every event
    or a schedule whose steps lie on no lines (``PlanGrid.steady``) times it whole."""
    grad_reduce = args.megatron_grad_reduce
    whole = args.load_csv or args.exact or args.png or args.trace
    if whole or not get_spec(args.schedule).plan.steady:
        return simulate(schedule, costs, p2p=args.p2p_model, megatron_grad_reduce=grad_reduce)
    options = _options(args)
    group = max(options.get("group_size") or 0, options.get("microbatch_group_size") or 0)
    return simulate_steady(
        schedule,
        costs,
        shorter=lambda n: _built(args, n, options, validate=False),
        period=max(args.pp, group),
        p2p=args.p2p_model,
        megatron_grad_reduce=grad_reduce,
    )


GRID_ACTIONS = 4_096  # the default grid's most compute actions: a page or two, not megabytes


def _grid(choice: str | None, schedule: Schedule) -> str:
    """``--grid``'s grid, by default the compute grid of a schedule small enough to read."""
    if choice == "none":
        return ""
    if choice == "full":
        return format_schedule(schedule)
    compute = schedule.compute_only()
    if choice is None and compute.num_actions > GRID_ACTIONS:
        return (
            f"grid not printed: {compute.num_actions:,} compute actions (more than "
            f"{GRID_ACTIONS:,}); --grid compute or --grid full prints it"
        )
    return format_schedule(compute)


def png_problem(num_ranks: int) -> str | None:
    """Drawing costs about 10 ms per rank whatever else the schedule holds (one row each)."""
    if num_ranks <= MAX_PNG_RANKS:
        return None
    return (
        f"--png with pp={num_ranks}: drawing takes about "
        f"{num_ranks * PNG_SECONDS_PER_RANK:.0f} s ({1000 * PNG_SECONDS_PER_RANK:.0f} ms per rank; "
        f"limit {MAX_PNG_RANKS} ranks); drop --png (--trace draws any size in Perfetto)"
    )


# bfpp-sim's default --t-evict for bpipe (a quarter of a forward): with 0 its timeline is 1F1B's.
BPIPE_T_EVICT = 0.25


def apply_defaults(args: argparse.Namespace) -> dict[str, str]:
    """Fill the defaults that depend on the schedule; what was filled, in words, for the report."""
    used: dict[str, str] = {}
    if args.microbatches is None and args.schedule and args.pp is not None and not args.load_csv:
        args.microbatches = 2 * args.pp
        used["microbatches"] = f"{args.microbatches} (2 x pp; set --microbatches)"
    if args.t_evict is None:
        args.t_evict = BPIPE_T_EVICT if args.schedule == "bpipe" else CostModel().t_evict
        if args.schedule == "bpipe":
            used["t_evict"] = f"{BPIPE_T_EVICT:g} (bpipe's default; set --t-evict)"
    return used


def _schedule_from(args: argparse.Namespace) -> Schedule:
    if args.load_csv:
        if args.schedule:
            raise ScheduleError("pass either --schedule or --load-csv, not both")
        return schedule_from_csv(args.load_csv, sharding=args.data_parallel_sharding_strategy)
    given = {"--schedule": args.schedule, "--pp": args.pp, "--microbatches": args.microbatches}
    if missing := [flag for flag, value in given.items() if value is None]:
        raise ScheduleError(f"missing {', '.join(missing)} (or pass --load-csv PATH)")
    options = _options(args)
    check_sharding(args.schedule, args.data_parallel_sharding_strategy)
    return _built(args, args.microbatches, options)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The schedule options bfpp-sim's flags set (one flag may serve several schedules')."""
    spec = get_spec(args.schedule)
    options: dict[str, Any] = {}
    for flag, flag_options in _SIM_FLAGS.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))  # argparse's dest
        if value is None:
            continue
        taken = [option for option in spec.options if option in flag_options]
        if not taken:
            takers = " and ".join(
                s.name for s in SCHEDULES.values() if set(s.options) & set(flag_options)
            )
            raise ScheduleError(f"{spec.name} takes no {flag} ({takers} do)")
        options.update((option.name, value) for option in taken)
    return options


def _built(
    args: argparse.Namespace, microbatches: int, options: dict[str, Any], *, validate: bool = True
) -> Schedule:
    return build_schedule(
        args.schedule,
        num_ranks=args.pp,
        num_microbatches=microbatches,
        num_chunks=args.vp,
        sharding=args.data_parallel_sharding_strategy,
        validate=validate,
        **options,
    )


def schedule_from_csv(path: str, *, sharding: str = "optim") -> Schedule:
    """A CSV's schedule, lowered and validated (errors name the file); a lowered one as written,
    but torch's messages, paired by tag, derived again if the two sides order them differently."""
    loaded = load_csv(path)
    lowered = has_communication(loaded) or any(
        action.kind in _CHUNK_LEVEL for actions in loaded.per_rank for action in actions
    )
    if lowered and sharding != "optim":
        raise ScheduleError(
            f"{path}: --data-parallel-sharding-strategy applies to a compute-only CSV; this one "
            "is lowered and already places its GS / PS / RL"
        )
    try:
        if not lowered:
            validate_schedule(loaded, require_communication=False)
            loaded = add_grad_sync(add_communication(loaded), sharding=sharding)
        elif loaded.name == _TORCH_FORMAT and _messages_reordered(loaded):
            without = loaded.with_programs(
                [a for a in actions if a.kind not in _LOWERED_KINDS] for actions in loaded.per_rank
            )
            loaded = replace(add_communication(without), name=f"{loaded.name}, messages re-derived")
        validate_schedule(loaded, require_grad_sync=True)
    except ScheduleError as error:
        raise ScheduleError(f"{path}: {error}") from error
    return loaded


_TORCH_FORMAT = "torch-csv"  # load_csv's name for a file in torch's format (it has no name row)


def _messages_reordered(schedule: Schedule) -> bool:
    """True when the activation / gradient messages pair up but some pair of ranks posts them
    in another order on the two sides; anything else (BPipe transfers too) is the validator's."""
    channels: dict[tuple[int, int], tuple[list[Message], list[Message]]] = {}
    for rank, actions in enumerate(schedule.per_rank):
        for action in actions:
            kind, peer = action.kind, action.peer
            if kind.is_p2p and kind not in _LOWERED_KINDS:
                return False
            if kind in _LOWERED_KINDS and peer is not None:
                channel = (rank, peer) if kind.is_send else (peer, rank)
                sides = channels.setdefault(channel, ([], []))
                sides[0 if kind.is_send else 1].append(message_of(action))
    if any(sends != got and sorted(sends) != sorted(got) for sends, got in channels.values()):
        return False
    return any(sends != got for sends, got in channels.values())


def format_report(result: SimResult) -> str:
    data = result.to_dict()
    lines = [
        f"schedule {data['schedule']}: pp={data['num_ranks']} chunks/rank={data['num_chunks']} "
        f"micro-batches={data['num_microbatches']}",
        f"step time {data['step_time']:.4g}   bubble {100 * data['bubble_fraction']:.2f}%   "
        f"exposed DP comm {data['exposed_dp_comm_time']:.4g}",
        f"p2p timing model: {data['p2p_model']} ({P2P_MODELS[data['p2p_model']]})",
    ]
    if lengths := data["steady_from"]:
        lines.append(
            f"timed from its steady state: steps of {', '.join(map(str, lengths))} "
            "micro-batches lie exactly on one line (--exact times every micro-batch)"
        )
    if weights := data["costs"]["stage_weights"]:
        memory = "by layers" if data["stage_memory"] else "per even stage"
        lines.append(
            f"stage weights: {', '.join(f'{w:.4g}' for w in weights)} (uneven stages; "
            f"memory {memory})"
        )
    if reduce := data["megatron_grad_reduce"]:
        lines.append(f"gradient reductions: {reduce} ({MEGATRON_GRAD_REDUCE[reduce]})")
    lines += [
        "",
        f"{'rank':>4}  {'busy':>10}  {'bubble %':>8}  {'peak act.':>9}  {'peak par.':>9}  "
        f"{'peak grad':>9}  {'GS':>5}  {'PS':>5}  {'exposed DP':>10}",
    ]
    for row in data["per_rank"]:
        lines.append(
            f"{row['rank']:>4}  {row['busy_time']:>10.4g}  {100 * row['bubble_fraction']:>8.2f}  "
            f"{row['peak_activations']:>9.3g}  {row['peak_parameters']:>9.3g}  "
            f"{row['peak_gradients']:>9.3g}  {row['grad_syncs']:>5}  {row['param_syncs']:>5}  "
            f"{row['exposed_dp_comm_time']:>10.4g}"
        )
    units = data["units"]
    lines.append(f"peak act. = stored activations, in {units['peak_activations']}")
    lines.append(f"peak par. = {units['peak_parameters']}")
    lines.append(f"peak grad = {units['peak_gradients']}")
    lines.append("GS / PS = gradient reductions / parameter gathers per step")
    return "\n".join(lines)


command = ends_without_teardown(main)  # the console script (setup.py)

if __name__ == "__main__":
    command()
