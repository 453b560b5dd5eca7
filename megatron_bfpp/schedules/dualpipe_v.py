"""DualPipeV (DeepSeek-V3's DualPipe folded onto the V placement; torch's ``ScheduleDualPipeV``):
rank r holds stages r and 2p-1-r, and in its steady state runs one micro-batch's forward on one
of them together with another micro-batch's backward on the other as one overlapped action
(``ir.Composite``), so that on a GPU each one's expert-parallel all-to-all can hide under the
other's compute. The order is DeepSeek's, phase by phase (docs/schedules.md, "DualPipeV"): fill
the V, zero-bubble split backwards (I, then W later) while it fills, pairs in the steady state,
split backwards again while it drains. It needs m >= 2p: fewer leave the steady state's counts
negative, as in DeepSeek's and torch's."""

from __future__ import annotations

from collections import deque

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
from megatron_bfpp.schedules.common import check_counts, make_schedule

__all__ = ["build_dualpipe_v", "min_microbatches"]

_F, _B, _I, _W = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)


def min_microbatches(num_ranks: int) -> int:
    """The fewest micro-batches DualPipeV runs on ``num_ranks`` ranks: one per stage."""
    return 2 * num_ranks


@paused_gc()
def build_dualpipe_v(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV on ``num_ranks`` ranks (2 stages each) for ``num_microbatches`` >= 2 x ranks."""
    check_counts("dualpipe-v", num_ranks=num_ranks, num_microbatches=num_microbatches)
    least = min_microbatches(num_ranks)
    if num_microbatches < least:
        raise ScheduleError(
            f"dualpipe-v needs at least 2 x pp = {least} micro-batches on {num_ranks} pipeline "
            f"ranks (one per stage of the V), got {num_microbatches}; use more micro-batches, "
            "or v-zb / v-half, which run any number"
        )
    programs = [_Rank(num_ranks, num_microbatches, rank).program() for rank in range(num_ranks)]
    return make_schedule("dualpipe-v", StageLayout.v_shape(num_ranks), num_microbatches, programs)


class _Rank:
    """One rank's program, built phase by phase. Micro-batches are numbered per stage and kind
    in issue order: a stage's forwards 0, 1, ...; its backwards (B or I) likewise; each I leaves
    its W queued, and a W slot runs the oldest queued one."""

    def __init__(self, num_ranks: int, num_microbatches: int, rank: int) -> None:
        self.p, self.m, self.r = num_ranks, num_microbatches, rank
        self.first, self.second = rank, 2 * num_ranks - 1 - rank  # down and up the V
        self.forwards = {self.first: 0, self.second: 0}
        self.backwards = {self.first: 0, self.second: 0}
        self.queued: deque[Action] = deque()  # W of each I, oldest first
        self.actions: list[Action] = []

    def forward(self, stage: int) -> Action:
        microbatch = self.forwards[stage]
        self.forwards[stage] = microbatch + 1
        return unchecked_action(stage, _F, microbatch)

    def backward(self, stage: int, *, split: bool) -> Action:
        """A backward: whole (B), or its input half (I) with its W queued for later."""
        microbatch = self.backwards[stage]
        self.backwards[stage] = microbatch + 1
        if split:
            self.queued.append(unchecked_action(stage, _W, microbatch))
        return unchecked_action(stage, _I if split else _B, microbatch)

    def add(self, *actions: Action) -> None:
        self.actions.extend(actions)

    def pair(self, forward_stage: int, backward_stage: int) -> None:
        """One forward and another micro-batch's whole backward, overlapped."""
        forward = self.forward(forward_stage)
        self.add(Composite(forward, self.backward(backward_stage, split=False)))

    def weight(self) -> None:
        if self.queued:
            self.add(self.queued.popleft())

    def program(self) -> list[Action]:
        p, m, r, down, up = self.p, self.m, self.r, self.first, self.second
        for _ in range(2 * (p - r - 1)):  # fill the first leg
            self.add(self.forward(down))
        for _ in range(r + 1):  # both legs
            self.add(self.forward(down), self.forward(up))
        for _ in range(p - r - 1):  # zero bubble while the V fills: I, its W, a forward
            self.add(self.backward(up, split=True))
            self.weight()
            self.add(self.forward(up))
        for step in range(m - 2 * p + r + 1):  # the steady state: pairs
            if step == 0 and r == p - 1:  # the V's tip: nothing to overlap with yet
                self.add(self.forward(down), self.backward(up, split=False))
            else:
                self.pair(down, up)
            self.pair(up, down)
        for _ in range(p - r - 1):  # the first leg's forwards are done
            self.add(self.backward(up, split=False))
            self.pair(up, down)
        split = False  # drain: split from the middle on, so Ws fill the last bubbles
        for step in range(r + 1):
            split = split or (step == (r + 1) // 2 and r % 2 == 1)
            self.add(self.backward(up, split=split))
            split = split or (step == (r + 1) // 2 and r % 2 == 0)
            self.add(self.backward(down, split=split))
        for _ in range(p - r - 1):
            self.weight()
            self.add(self.backward(down, split=split))
        for _ in range(r + 1):
            self.weight()
        return self.actions
