"""Does a schedule fit a parallel layout: the one check every training front end (bfpp-train,
Megatron-LM's ``validate_args`` and pre-flight) runs first, asked once so they cannot drift."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_bfpp.ir import Schedule, ScheduleError
from megatron_bfpp.schedules.registry import (
    build_schedule,
    check_sharding,
    check_sharding_data_parallel,
    get_spec,
    in_flag_terms,
)
from megatron_bfpp.semantics import combined_pairs

__all__ = [
    "BATCH_SCHEDULE_FLAG",
    "Fit",
    "check_fit",
    "check_overlap_conditions",
    "num_microbatches",
    "parse_batch_schedule",
    "step_batch_sizes",
]

# Megatron-LM's batch-size schedule (megatron-core's StepBatchsizeNumMicroBatchesCalculator).
BATCH_SCHEDULE_FLAG = "--step-batch-size-schedule"
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


@dataclass(frozen=True, slots=True)
class Fit:
    """What a layout that fits gives the generator: its ``num_chunks`` (``None``: the
    placement's own), the stages each rank holds and the micro-batches of one step."""

    num_chunks: int | None
    stages_per_rank: int
    num_microbatches: int


def check_overlapped_pairs(schedule: Schedule) -> None:
    """megatron-core's all-to-all overlap runs only in pairs that run as its combined step
    (``semantics.combined_pairs``); a schedule without one would take the flag and hide nothing."""
    if not any(combined_pairs(program) for program in schedule.per_rank):
        raise ScheduleError(
            "--overlap-moe-expert-parallel-comm hides expert all-to-alls in overlapped forward-"
            f"backward pairs, which {schedule.name} has none of here; use --pipeline-schedule "
            "dualpipe-v, or interleaved with --combined-1f1b, or drop the flag"
        )


def check_overlap_conditions(args: Any) -> None:
    """megatron-core asserts these in ``TransformerConfig`` (a traceback per rank, after the
    arguments); said here in one line, before any work, for Megatron-LM's and bfpp-train's
    parsed arguments (a flag a front end lacks counts as its default)."""
    if not getattr(args, "overlap_moe_expert_parallel_comm", False):
        return
    unmet = [
        condition
        for condition, met in (
            ("--expert-model-parallel-size > 1",
             (getattr(args, "expert_model_parallel_size", 1) or 1) > 1),
            ("--bf16 or --fp16", getattr(args, "bf16", False) or getattr(args, "fp16", False)),
            ("--moe-token-dispatcher-type alltoall or flex",
             getattr(args, "moe_token_dispatcher_type", None) in ("alltoall", "flex")),
            ("no --recompute-granularity full",
             getattr(args, "recompute_granularity", None) != "full"),
        )
        if not met
    ]  # fmt: skip
    if unmet:
        raise ScheduleError(
            f"--overlap-moe-expert-parallel-comm needs {'; '.join(unmet)} (megatron-core's "
            "conditions for its combined step)"
        )


def num_microbatches(
    *,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    what: str | None = None,
) -> int:
    """Micro-batches per step on each pipeline, Megatron-LM's rule: the global batch split evenly
    over the replicas, then into micro-batches; ``what`` names the batch in errors."""
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step:
        named = what or f"--global-batch-size {global_batch_size}"
        raise ScheduleError(
            f"{named} is not a multiple of micro-batch size x data-parallel size "
            f"({micro_batch_size} x {data_parallel_size})"
        )
    return global_batch_size // per_step


def parse_batch_schedule(text: str, *, seq_length: int | None) -> tuple[tuple[int, int], ...]:
    """Megatron-LM's ``--step-batch-size-schedule`` (``"0:4,512:8"``, ``"0:768 250B:1536"``) as
    megatron-core reads it: (threshold in samples, global batch) pairs in order, thresholds in
    tokens when ``seq_length`` is given, or a :class:`ScheduleError` where megatron-core asserts."""
    steps = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ScheduleError(
                f"{BATCH_SCHEDULE_FLAG}: {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. 0:256,1M:512)"
            )
        numbers: list[int] = []  # as megatron-core reads them: 512, 2.5K, 250B
        for part in entry.split(":", 1):
            digits = part.strip().upper()
            scale = _SUFFIXES.get(digits[-1:], 1)
            try:
                numbers.append(int(float(digits[:-1] if scale > 1 else digits) * scale))
            except ValueError:
                raise ScheduleError(
                    f"{BATCH_SCHEDULE_FLAG}: {entry!r} is not THRESHOLD:BATCH_SIZE (numbers, with "
                    "an optional K, M, B or T)"
                ) from None
        threshold, batch = numbers
        steps.append((threshold // seq_length if seq_length else threshold, batch))
    steps.sort(key=lambda step: step[0])
    if not steps:
        raise ScheduleError(f"{BATCH_SCHEDULE_FLAG} is empty; give THRESHOLD:BATCH_SIZE pairs")
    if steps[0][0] != 0:
        raise ScheduleError(
            f"{BATCH_SCHEDULE_FLAG}: the first step must start at 0 (it starts at "
            f"{steps[0][0]} samples)"
        )
    for (before, _), (after, _) in itertools.pairwise(steps):
        if after <= before:
            raise ScheduleError(
                f"{BATCH_SCHEDULE_FLAG}: thresholds must increase (two steps start at {after} "
                "samples)"
            )
    if bad := [batch for _, batch in steps if batch < 1]:
        raise ScheduleError(f"{BATCH_SCHEDULE_FLAG}: batch sizes must be positive, got {bad[0]}")
    return tuple(steps)


def step_batch_sizes(args: object) -> tuple[int, ...]:
    """Every step's global batch under Megatron-LM's batch-size schedule in parsed arguments, ``()``
    without one (its ``global_batch_size`` is then micro-batch x dp, which no step runs)."""
    text = getattr(args, "step_batch_size_schedule", None)
    if not text:
        return ()
    seq = getattr(args, "seq_length", None)
    steps = parse_batch_schedule(str(text), seq_length=int(seq) if seq else None)
    return tuple(batch for _, batch in steps)


def check_fit(
    name: str,
    *,
    pp: int,
    vp: int | None,
    dp: int,
    micro_batch_size: int,
    global_batch_size: int,
    vp_flag: str,
    num_layers: int | None = None,
    sharding: str = "optim",
    options: Mapping[str, Any] | None = None,
    batch_schedule: Sequence[int] = (),
    overlapped: bool = False,
) -> Fit:
    """Schedule ``name`` on ``pp`` ranks with ``vp`` virtual stages per rank (``None``: not
    given) and ``dp`` replicas, or one :class:`ScheduleError` line saying what to change;
    ``batch_schedule`` (:func:`step_batch_sizes`): every step's must run, the last's returned;
    ``overlapped`` (``--overlap-moe-expert-parallel-comm``): each with pairs that can hide it."""
    spec = get_spec(name)
    chunks = spec.chunks_for(vp, vp_flag=vp_flag)
    stages = spec.stages_per_rank(chunks)
    if num_layers is not None and num_layers % (pp * stages):
        raise ScheduleError(
            f"--num-layers {num_layers} is not divisible by pipeline x virtual stages "
            f"({pp} x {stages} = {pp * stages})"
        )
    batches = tuple(batch_schedule) or (global_batch_size,)
    counts = [
        num_microbatches(
            global_batch_size=batch,
            micro_batch_size=micro_batch_size,
            data_parallel_size=dp,
            what=f"{BATCH_SCHEDULE_FLAG}'s batch size {batch}" if batch_schedule else None,
        )
        for batch in batches
    ]
    check_sharding(name, sharding)
    check_sharding_data_parallel(sharding, dp)
    sizes = f"pp={pp}" + (f", vp={stages}" if stages > 1 else "")
    where = f" (a step of {BATCH_SCHEDULE_FLAG})" if batch_schedule else ""
    for m in dict.fromkeys(counts):  # each distinct count once, in the schedule's order
        try:
            built = build_schedule(
                name,
                num_ranks=pp,
                num_microbatches=m,
                num_chunks=chunks,
                sharding=sharding,
                **(options or {}),
            )
        except ScheduleError as error:
            raise ScheduleError(
                f"--pipeline-schedule {name} cannot run {m} micro-batches on {sizes}{where}: "
                f"{in_flag_terms(str(error).strip().splitlines()[0], name)}"
            ) from None
        if overlapped:
            check_overlapped_pairs(built)
    return Fit(num_chunks=chunks, stages_per_rank=stages, num_microbatches=counts[-1])
