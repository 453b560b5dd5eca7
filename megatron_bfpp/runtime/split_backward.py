"""Split backward (zero-bubble's I and W) on megatron-core chunks: exact for every layer.

A V-shape schedule (v-min, v-half, v-zb) splits each micro-batch's backward into ``I``
(BACKWARD_INPUT: the gradient the previous stage needs, sent as early as possible) and ``W``
(BACKWARD_WEIGHT: the weight gradients, placed later to fill bubbles).

What runs today is the exact generic path: ``I`` is the micro-batch's whole backward through
megatron-core's own ``backward_step``, the same kernels in the same order as ``B``, with the
weight gradients accumulated where ``B`` puts them (``.grad``, or ``main_grad`` under megatron-core
DDP, whose ``no_sync`` is left before the chunk's last ``I``); ``W`` marks them done. With explicit
sync functions the chunk's reduction starts at its GS, after its last ``W``, as the schedule
says. The stored activations are freed at ``I``.

Why not defer the weight-gradient work itself: re-running autograd from the kept graph in ``W``
is not exact for megatron-core (its vocab-parallel cross entropy's backward rewrites its saved
softmax in place, so a second traversal reads corrupted values), and the cheap form, deferring
each linear layer's weight GEMM, is what megatron-core offers only through Transformer Engine
(``delay_wgrad_compute``, GPU, MoE overlap); its local layers' ``backward_dw`` does nothing. So
the schedules' order, messages and memory hold exactly, but the time ``W`` would fill is spent in
``I`` (the stated gap: zero-bubble's time saving needs deferred weight GEMMs, not built yet).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from megatron_bfpp.ir import Action, ActionKind
from megatron_bfpp.runtime.backward import microbatch, whole_backward
from megatron_bfpp.runtime.step import Handlers, Key, RankStep, StepPart

__all__ = ["HANDLERS", "SplitBackward"]

K = ActionKind


class SplitBackward(StepPart):
    """Micro-batches between their I and their W (checked drained at the end of the step)."""

    def __init__(self) -> None:
        self.pending: set[Key] = set()

    def leftovers(self) -> dict[str, Collection[Any]]:
        return {"input gradients without their weight gradients": self.pending}


def backward_input(step: RankStep, position: int, action: Action) -> None:
    """I: the micro-batch's backward (input and weight gradients, as B computes them)."""
    step.part(SplitBackward).pending.add(whole_backward(step, position, action))


def backward_weight(step: RankStep, position: int, action: Action) -> None:
    """W: the micro-batch's weight gradients are done (I accumulated them, and megatron-core
    DDP's hooks, if they dispatch the reduction, did so during the chunk's last I)."""
    key = (action.stage, microbatch(action))
    pending = step.part(SplitBackward).pending
    if key not in pending:
        raise RuntimeError(
            f"pipeline rank {step.rank}: {action} at position {position} has no I before it; "
            "the schedule and the executor disagree: please report this bug"
        )
    pending.remove(key)
    step.state.trace.append(str(action))


HANDLERS = Handlers(
    kinds={K.BACKWARD_INPUT: backward_input, K.BACKWARD_WEIGHT: backward_weight},
    part=SplitBackward,
)
