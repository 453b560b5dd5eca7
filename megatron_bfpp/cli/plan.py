"""``bfpp-plan``: estimates made before a run. Subcommands: ``bpipe-estimate`` (more to come)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megatron_bfpp.cli.common import OneLineParser, fail, finite_float, json_text, positive_int
from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.plan.bpipe import Estimate, bpipe_speedup_estimate

PROG = "bfpp-plan"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Plan a pipeline-parallel run before spending GPU hours on it.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        parser.error("choose a command, e.g. bpipe-estimate")
    try:
        scale = 0.01 if args.percent else 1.0
        mfu_small, mfu_large = (value * scale for value in args.stage_mfu)
        small, large = args.micro_batch_sizes
        estimate = bpipe_speedup_estimate(
            stage_mfu_small=mfu_small,
            stage_mfu_large=mfu_large,
            micro_batch_small=small,
            micro_batch_large=large,
            global_batch_size=args.global_batch_size,
            pp=args.pp,
        )
    except ScheduleError as error:
        return fail(f"{PROG} {args.command}", error)
    if args.json:
        print(json_text(estimate.to_dict()))
    else:
        print(format_estimate(estimate))
    return 0


def format_estimate(estimate: Estimate) -> str:
    e = estimate
    small, large = e.micro_batch_small, e.micro_batch_large
    rows = [
        ("micro-batch size", f"{small}", f"{large}"),
        ("schedule", "1f1b", "bpipe"),
        ("stage MFU", f"{100 * e.stage_mfu_small:.1f}%", f"{100 * e.stage_mfu_large:.1f}%"),
        (
            "pipeline MFU (eq. 3)",
            f"{100 * e.pipeline_mfu_small:.1f}%",
            f"{100 * e.pipeline_mfu_large:.1f}%",
        ),
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
        f"pipeline factor    {e.pipeline_factor:.4f}   "
        f"(B + {small}(p-1)) / (B + {large}(p-1)) = "
        f"{e.global_batch_size + small * (e.pp - 1)}/{e.global_batch_size + large * (e.pp - 1)}",
        f"predicted speedup  {e.predicted_speedup:.4f}   eq. 4, BPipe overhead ignored",
        f"memory ratio       {e.memory_ratio:.4f}   "
        f"({large} x {e.bpipe_stored}) / ({small} x {e.one_f_one_b_stored}); "
        f"1F1B at b={large}: {e.memory_ratio_without_bpipe:.4g}",
        "",
        f"verdict: {e.verdict}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
