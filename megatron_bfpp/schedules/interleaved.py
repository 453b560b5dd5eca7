"""Megatron's depth-first interleaved schedule, in the exact order megatron-core 0.16-0.20 runs:
the forwards follow its ``get_schedule_table``, the backwards the same with chunks reversed, and
rank r warms up as its ``get_pp_rank_microbatches`` says, then runs 1F1B."""

from __future__ import annotations

from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Composite,
    Schedule,
    ScheduleError,
    StageLayout,
    paused_gc,
    unchecked_action,
)
from megatron_bfpp.schedules.common import check_counts, interleave_1f1b, make_schedule

__all__ = ["build_interleaved"]


@paused_gc()
def build_interleaved(
    *,
    num_ranks: int,
    num_microbatches: int,
    num_chunks: int,
    microbatch_group_size: int | None = None,
    combined_1f1b: bool = False,
) -> Schedule:
    """Megatron's interleaved order, group size its ``microbatch_group_size_per_vp_stage`` (default
    p), megatron-core's limits checked first; ``combined_1f1b``: one more warm-up F, then pairs."""
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
    if 0 < (remainder := num_microbatches % group) < num_ranks:
        raise ScheduleError(
            f"interleaved needs num_microbatches % group size to be 0 or >= pp={num_ranks}; "
            f"got {num_microbatches} % {group} = {remainder} (use a multiple of {group})"
        )
    layout = StageLayout.looped(num_ranks, num_chunks)
    table: list[tuple[int, int]] = []  # (micro-batch, chunk): megatron-core's get_schedule_table
    for start in range(0, num_microbatches, group):
        end = num_microbatches if start + group >= num_microbatches else start + group
        table.extend((m, c) for c in range(num_chunks) for m in range(start, end))
    f, b, action = ActionKind.FORWARD, ActionKind.BACKWARD, unchecked_action
    last_chunk = num_chunks - 1
    programs: list[list[Action]] = []
    for rank in range(num_ranks):
        # Forward k runs table[k] through its chunk, backward k through the mirrored chunk.
        forwards = [action(chunk * num_ranks + rank, f, mb) for mb, chunk in table]
        backwards = [action((last_chunk - chunk) * num_ranks + rank, b, mb) for mb, chunk in table]
        warmup = min((num_ranks - rank - 1) * 2 + last_chunk * group + combined_1f1b, len(table))
        programs.append(program := interleave_1f1b(forwards, backwards, warmup))
        if combined_1f1b:  # steady step k: forward warmup + k and backward k as one pair
            program[warmup : 2 * len(table) - warmup] = map(Composite, forwards[warmup:], backwards)
    return make_schedule("interleaved", layout, num_microbatches, programs)
