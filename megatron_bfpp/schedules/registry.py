"""The schedule generators behind one registry keyed by the user-facing names.

``build_schedule`` is the one way in: it checks the inputs against the schedule's placement,
runs the family's generator (a compute order), lowers it with the passes (messages, gradient and
parameter sync) and validates the result, so every caller gets a schedule that is proven to run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_bfpp.ir import ActionKind, Schedule, ScheduleError
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.schedules.bpipe import build_bpipe
from megatron_bfpp.schedules.breadth_first import build_breadth_first
from megatron_bfpp.schedules.gpipe import build_gpipe
from megatron_bfpp.schedules.interleaved import build_interleaved
from megatron_bfpp.schedules.one_f_one_b import build_1f1b
from megatron_bfpp.schedules.v_shape import build_v_half, build_v_min, build_v_zb
from megatron_bfpp.validate import validate_schedule

__all__ = [
    "SCHEDULES",
    "ScheduleSpec",
    "build_schedule",
    "forward_only_schedule",
    "get_spec",
    "schedule_names",
]


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """What a user-facing schedule name means.

    ``placement`` is "single" (one stage per rank), "looped" (``num_chunks`` >= 2 stages per rank,
    stage s on rank s % p) or "v-shape" (two stages per rank, rank r holds r and 2p-1-r).
    ``options`` are the extra keyword arguments its generator accepts.
    """

    name: str
    summary: str
    generator: Callable[..., Schedule]
    placement: str
    options: tuple[str, ...] = ()
    split_backward: bool = False


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", "all forwards, then all backwards", build_gpipe, "single"),
        ScheduleSpec(
            "1f1b", "one forward one backward (megatron-core default)", build_1f1b, "single"
        ),
        ScheduleSpec(
            "interleaved",
            "Megatron's depth-first interleaved (looped) schedule",
            build_interleaved,
            "looped",
            ("microbatch_group_size",),
        ),
        ScheduleSpec(
            "breadth-first",
            "looped, each chunk runs all micro-batches before the next",
            build_breadth_first,
            "looped",
            ("group_size",),
        ),
        ScheduleSpec(
            "bpipe",
            "1F1B with activation eviction to the partner stage",
            build_bpipe,
            "single",
            ("max_stored",),
        ),
        ScheduleSpec(
            "v-min",
            "V-shape, about 1/3 of 1F1B's activation memory",
            build_v_min,
            "v-shape",
            split_backward=True,
        ),
        ScheduleSpec(
            "v-half",
            "V-shape, about 1/2 of 1F1B's activation memory",
            build_v_half,
            "v-shape",
            split_backward=True,
        ),
        ScheduleSpec(
            "v-zb",
            "V-shape zero bubble at 1F1B's activation memory",
            build_v_zb,
            "v-shape",
            split_backward=True,
        ),
    )
}


def schedule_names() -> tuple[str, ...]:
    return tuple(SCHEDULES)


def get_spec(name: str) -> ScheduleSpec:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(
            f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}"
        ) from None


def build_schedule(
    name: str,
    *,
    num_ranks: int,
    num_microbatches: int,
    num_chunks: int | None = None,
    lower: bool = True,
    **options: Any,
) -> Schedule:
    """A validated schedule; ``lower=False`` stops at the compute order (still validated).

    ``num_chunks`` is the virtual pipeline size (stages per rank): required for looped
    schedules, 1 or omitted for single-stage ones, 2 or omitted for V-shape ones. Options left
    at ``None`` take the schedule's default.
    """
    spec = get_spec(name)
    chosen = {key: value for key, value in options.items() if value is not None}
    unknown = sorted(set(chosen) - set(spec.options))
    if unknown:
        accepted = ", ".join(spec.options) or "none"
        raise ScheduleError(
            f"{name} does not take option(s) {', '.join(unknown)}; it accepts: {accepted}"
        )
    chunk_args = _chunk_arguments(spec, num_chunks)
    schedule = spec.generator(
        num_ranks=num_ranks, num_microbatches=num_microbatches, **chunk_args, **chosen
    )
    if lower:
        schedule = add_grad_sync(add_communication(schedule))
    validate_schedule(schedule, require_communication=lower)
    return schedule


def _chunk_arguments(spec: ScheduleSpec, num_chunks: int | None) -> dict[str, int]:
    if spec.placement == "looped":
        if num_chunks is None:
            raise ScheduleError(
                f"{spec.name} needs a virtual pipeline size: pass --vp (Megatron: "
                "--num-virtual-stages-per-pipeline-rank) of at least 2"
            )
        return {"num_chunks": num_chunks}
    if spec.placement == "v-shape":
        if num_chunks not in (None, 2):
            raise ScheduleError(
                f"{spec.name} places exactly 2 stages per rank (V-shape); "
                f"drop --vp or pass --vp 2, got {num_chunks}"
            )
        return {}
    if num_chunks not in (None, 1):
        raise ScheduleError(
            f"{spec.name} runs one stage per rank; drop --vp (got {num_chunks}) "
            "or choose interleaved / breadth-first"
        )
    return {}


def forward_only_schedule(schedule: Schedule) -> Schedule:
    """The evaluation schedule: every rank's forwards in the training order, lowered again.

    For ``interleaved`` this is exactly megatron-core's forward-only order (all forwards in
    schedule-table order), and for every schedule each stage still reads its data in order.
    """
    compute = schedule.with_programs(
        [a for a in actions if a.kind is ActionKind.FORWARD] for actions in schedule.per_rank
    )
    lowered = add_communication(compute)
    validate_schedule(lowered, require_backward=False)
    return lowered
