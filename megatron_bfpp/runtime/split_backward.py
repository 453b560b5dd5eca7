"""Split backward (zero-bubble's I and W) on megatron-core chunks, exact for every layer.

``I`` runs ``backward_step`` with the chunk's local linear layers deferring their weight GEMMs,
``W`` computes them (``runtime.deferred_wgrad``). DDP's hooks would reduce before the last ``W``
(some gradients come at ``I``), so the chunk stays in ``no_sync`` and its own
``start_grad_sync`` runs at its GS, as Megatron-LM's ``grad_sync_func`` does."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable
from typing import Any

import torch

from megatron_bfpp.ir import Action, ActionKind, primitives
from megatron_bfpp.runtime import deferred_wgrad
from megatron_bfpp.runtime.backward import microbatch, overlaps_grad_reduce, whole_backward
from megatron_bfpp.runtime.step import Handlers, Key, RankStep, StepPart

__all__ = ["HANDLERS", "SplitBackward"]

K = ActionKind


class SplitBackward(StepPart):
    """Micro-batches between their I and W (checked drained at step end), their deferred wgrads."""

    def __init__(self) -> None:
        self.pending: set[Key] = set()
        self.store = deferred_wgrad.WeightGradStore()
        self._deferring = contextlib.ExitStack()

    def begin(self, step: RankStep) -> None:
        if step.ctx.call.forward_only or not any(
            action.kind == K.BACKWARD_INPUT for _, action in primitives(step.program)
        ):
            return
        deferred_wgrad.install(step.ctx.model)
        if step.ctx.config.grad_sync_func is None:
            for chunk, model in enumerate(step.ctx.model):
                if overlaps_grad_reduce(model) and hasattr(model, "start_grad_sync"):
                    step.grad_sync_funcs[chunk] = lambda *_, m=model: m.start_grad_sync()
        self._deferring.enter_context(deferred_wgrad.deferring(self.store))

    def end(self, step: RankStep) -> None:
        self._deferring.close()

    def held_tensors(self, step: RankStep) -> Iterable[torch.Tensor]:
        return self.store.held_tensors()

    def leftovers(self) -> dict[str, Collection[Any]]:
        return {
            "input gradients without their weight gradients": self.pending,
            "deferred weight gradients never computed": self.store.pending,
        }


def backward_input(step: RankStep, position: int, action: Action) -> None:
    """I: the micro-batch's backward, with the local linear layers' weight GEMMs deferred."""
    part = step.part(SplitBackward)
    key = (action.stage, microbatch(action))
    with part.store.collect(key):
        whole_backward(step, position, action)
    part.pending.add(key)


def backward_weight(step: RankStep, position: int, action: Action) -> None:
    """W: the micro-batch's deferred weight gradients, accumulated as a whole backward would."""
    key = (action.stage, microbatch(action))
    part = step.part(SplitBackward)
    if key not in part.pending:
        raise RuntimeError(
            f"pipeline rank {step.rank}: {action} at position {position} has no I before it; "
            "the schedule and the executor disagree: please report this bug"
        )
    part.pending.remove(key)
    part.store.run(key)
    step.state.trace.append(str(action))


HANDLERS = Handlers(
    kinds={K.BACKWARD_INPUT: backward_input, K.BACKWARD_WEIGHT: backward_weight}, part=SplitBackward
)
