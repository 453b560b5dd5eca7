"""Megatron's depth-first interleaved schedule, in the exact order megatron-core 0.16-0.20 runs.

Forward "virtual micro-batches" follow megatron-core's ``get_schedule_table``: groups of
``microbatch_group_size`` micro-batches run through chunk 0, then chunk 1, ...; backwards follow
the same table with chunks reversed. Rank r warms up with (p - r - 1) * 2 + (v - 1) * group
forwards (megatron-core's ``get_pp_rank_microbatches``), then alternates one forward and one
backward, then drains.
"""

from __future__ import annotations

from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    StageLayout,
    paused_gc,
    unchecked_action,
)
from megatron_bfpp.schedules.common import check_counts, interleave_1f1b, make_schedule

__all__ = ["build_interleaved"]


def _schedule_table(
    num_microbatches: int, num_chunks: int, group_size: int
) -> list[tuple[int, int]]:
    """(micro-batch, chunk) per virtual micro-batch; mirrors megatron-core's get_schedule_table."""
    table: list[tuple[int, int]] = []
    for start in range(0, num_microbatches, group_size):
        end = num_microbatches if start + group_size >= num_microbatches else start + group_size
        table.extend((m, c) for c in range(num_chunks) for m in range(start, end))
    return table


def _warmup_count(
    *, rank: int, num_ranks: int, num_chunks: int, num_microbatches: int, group_size: int
) -> int:
    total = num_microbatches * num_chunks
    return min((num_ranks - rank - 1) * 2 + (num_chunks - 1) * group_size, total)


@paused_gc()
def build_interleaved(
    *,
    num_ranks: int,
    num_microbatches: int,
    num_chunks: int,
    microbatch_group_size: int | None = None,
) -> Schedule:
    """Megatron's interleaved order; the group size is its ``microbatch_group_size_per_vp_stage``
    (default p), with megatron-core's constraints checked before any rank starts."""
    check_counts(
        "interleaved", num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks
    )
    group = num_ranks if microbatch_group_size is None else microbatch_group_size
    if num_chunks < 2:
        raise ScheduleError(
            "interleaved needs a virtual pipeline size (--vp / num_chunks) of at least 2; "
            "with one chunk per rank use 1f1b"
        )
    if not num_ranks <= group <= num_microbatches:
        raise ScheduleError(
            f"interleaved needs the micro-batch group size in [pp={num_ranks}, "
            f"num_microbatches={num_microbatches}], got {group}"
            + ("; use at least pp micro-batches" if num_microbatches < num_ranks else "")
        )
    remainder = num_microbatches % group
    if 0 < remainder < num_ranks:
        raise ScheduleError(
            f"interleaved needs num_microbatches % group size to be 0 or >= pp={num_ranks}; "
            f"got {num_microbatches} % {group} = {remainder} (use a multiple of {group})"
        )
    layout = StageLayout.looped(num_ranks, num_chunks)
    table = _schedule_table(num_microbatches, num_chunks, group)
    f, b, action = ActionKind.FORWARD, ActionKind.BACKWARD, unchecked_action
    last_chunk = num_chunks - 1
    sizes = dict(num_ranks=num_ranks, num_chunks=num_chunks, num_microbatches=num_microbatches)
    programs: list[list[Action]] = []
    for rank in range(num_ranks):
        # Forward k runs table[k] through its chunk, backward k through the mirrored chunk.
        forwards = [action(chunk * num_ranks + rank, f, mb) for mb, chunk in table]
        backwards = [action((last_chunk - chunk) * num_ranks + rank, b, mb) for mb, chunk in table]
        warmup = _warmup_count(rank=rank, group_size=group, **sizes)
        programs.append(interleave_1f1b(forwards, backwards, warmup))
    return make_schedule("interleaved", layout, num_microbatches, programs)
