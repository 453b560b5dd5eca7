"""Does a schedule fit a parallel layout: the one check every training front end runs first.

bfpp-train and Megatron-LM (its ``validate_args`` and the pre-flight of
``megatron_bfpp.megatron.preflight``) ask the same questions of the same numbers: may the
schedule's placement take this many virtual stages, do the layers split over the stages, how
many micro-batches does a step hold, may parameters be sharded, and does the schedule build and
validate. Asked once here, they cannot drift apart between front ends. Each front end passes its
own spelling of the virtual-pipeline flag; the options' flags come from the catalogue
(:func:`~megatron_bfpp.schedules.registry.in_flag_terms`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.schedules.registry import (
    build_schedule,
    check_sharding,
    check_sharding_data_parallel,
    get_spec,
    in_flag_terms,
)

__all__ = ["Fit", "check_fit", "num_microbatches"]


@dataclass(frozen=True, slots=True)
class Fit:
    """What a layout that fits gives the generator: its ``num_chunks`` (``None``: the
    placement's own), the stages each rank holds and the micro-batches of one step."""

    num_chunks: int | None
    stages_per_rank: int
    num_microbatches: int


def num_microbatches(
    *, global_batch_size: int, micro_batch_size: int, data_parallel_size: int
) -> int:
    """Micro-batches per step on each pipeline (Megatron-LM's rule): the global batch is split
    evenly over the data-parallel replicas, and each replica's share into micro-batches."""
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step:
        raise ScheduleError(
            f"--global-batch-size {global_batch_size} is not a multiple of micro-batch size x "
            f"data-parallel size ({micro_batch_size} x {data_parallel_size})"
        )
    return global_batch_size // per_step


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
) -> Fit:
    """Schedule ``name`` on ``pp`` pipeline ranks with ``vp`` virtual stages per rank (``None``:
    not given), ``dp`` data-parallel replicas and the given batch sizes, or one
    :class:`ScheduleError` line saying what to change, cheapest question first: the placement
    (naming ``vp_flag``), the layers over the stages (with ``num_layers``; a front end that
    splits layers its own way checks them itself), the micro-batches, the sharding strategy,
    then the schedule built and validated with ``options`` (a generator's error in flag terms,
    after the sizes it was built for)."""
    spec = get_spec(name)
    chunks = spec.chunks_for(vp, vp_flag=vp_flag)
    stages = spec.stages_per_rank(chunks)
    if num_layers is not None and num_layers % (pp * stages):
        raise ScheduleError(
            f"--num-layers {num_layers} is not divisible by pipeline x virtual stages "
            f"({pp} x {stages} = {pp * stages})"
        )
    m = num_microbatches(
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        data_parallel_size=dp,
    )
    check_sharding(name, sharding)
    check_sharding_data_parallel(sharding, dp)
    try:
        build_schedule(
            name,
            num_ranks=pp,
            num_microbatches=m,
            num_chunks=chunks,
            sharding=sharding,
            **(options or {}),
        )
    except ScheduleError as error:
        sizes = f"pp={pp}" + (f", vp={stages}" if stages > 1 else "")
        first = in_flag_terms(str(error).strip().splitlines()[0], name)
        raise ScheduleError(
            f"--pipeline-schedule {name} cannot run {m} micro-batches on {sizes}: {first}"
        ) from None
    return Fit(num_chunks=chunks, stages_per_rank=stages, num_microbatches=m)
