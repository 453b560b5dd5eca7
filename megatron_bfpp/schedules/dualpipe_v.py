"""DualPipeV (DeepSeek-V3's DualPipe folded onto the V placement; torch's ``ScheduleDualPipeV``):
rank r holds stages r and 2p-1-r and in its steady state runs one micro-batch's forward on one of
them with another's backward on the other as one overlapped pair (``ir.Composite``), so that on
a GPU each one's expert-parallel all-to-all can hide under the other's compute. DeepSeek's
phases (docs/schedules.md, "dualpipe-v"): fill the V, split backwards (I now, W later) while it
fills, pairs, split backwards again while it drains. m >= 2p, as DeepSeek's and torch's."""

from __future__ import annotations

from collections import deque

from megatron_bfpp.ir import Action, Composite, Schedule, ScheduleError, StageLayout, paused_gc
from megatron_bfpp.ir import ActionKind as K
from megatron_bfpp.ir import unchecked_action as action
from megatron_bfpp.schedules.common import check_counts, make_schedule

__all__ = ["LEAST_MICROBATCHES_PER_RANK", "build_dualpipe_v"]

LEAST_MICROBATCHES_PER_RANK = 2  # one per stage of the V: the planners read it too


@paused_gc()
def build_dualpipe_v(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV on ``num_ranks`` ranks (2 stages each) for ``num_microbatches`` >= 2 x ranks."""
    check_counts("dualpipe-v", num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    if m < (least := LEAST_MICROBATCHES_PER_RANK * p):
        raise ScheduleError(
            f"dualpipe-v needs at least 2 x pp = {least} micro-batches on {p} pipeline ranks (one "
            f"per stage of the V), got {m}; use more micro-batches, or v-zb / v-half, which run "
            "any number"
        )
    programs = [_program(p, m, rank) for rank in range(p)]
    return make_schedule("dualpipe-v", StageLayout.v_shape(p), m, programs)


def _program(p: int, m: int, r: int) -> list[Action]:
    """Rank r's order. Micro-batches are numbered per stage in issue order, forwards and
    backwards (B or I) apart; each I queues its W, and a W slot runs the oldest queued."""
    down, up = r, 2 * p - 1 - r  # its stage down the V and back up
    forwards, backwards = {down: 0, up: 0}, {down: 0, up: 0}
    queued: deque[Action] = deque()
    out: list[Action] = []

    def f(stage: int) -> Action:
        forwards[stage] += 1
        return action(stage, K.FORWARD, forwards[stage] - 1)

    def b(stage: int, split: bool = False) -> Action:
        backwards[stage] += 1
        if split:
            queued.append(action(stage, K.BACKWARD_WEIGHT, backwards[stage] - 1))
        return action(stage, K.BACKWARD_INPUT if split else K.BACKWARD, backwards[stage] - 1)

    def w() -> list[Action]:
        return [queued.popleft()] if queued else []

    out += [f(down) for _ in range(2 * (p - r - 1))]  # fill the first leg
    for _ in range(r + 1):  # both legs
        out += [f(down), f(up)]
    for _ in range(p - r - 1):  # while the V fills: I, its W, a forward
        out += [b(up, split=True), *w(), f(up)]
    for step in range(m - 2 * p + r + 1):  # the steady state: pairs, but at the V's tip first
        out += [f(down), b(up)] if step == 0 and r == p - 1 else [Composite(f(down), b(up))]
        out.append(Composite(f(up), b(down)))
    for _ in range(p - r - 1):  # the first leg's forwards are done
        out += [b(up), Composite(f(up), b(down))]
    split = False  # drain: split from the middle on, so that Ws fill the last bubbles
    for step in range(r + 1):
        split = split or (step == (r + 1) // 2 and r % 2 == 1)
        out.append(b(up, split))
        split = split or (step == (r + 1) // 2 and r % 2 == 0)
        out.append(b(down, split))
    for _ in range(p - r - 1):
        out += [*w(), b(down, split)]
    for _ in range(r + 1):
        out += w()
    return out
