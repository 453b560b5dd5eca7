"""The parts of a micro-batch's backward that B and a split backward's I and W share.

Whether it computes everything (B) or only the previous stage's gradient (I), a backward starts
alike (incoming gradient, stored input and output, the parts' and data-parallel hooks) and sends
its input gradient on alike: one copy for runtime.executor and runtime.split_backward.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_bfpp.compat import backward_step
from megatron_bfpp.ir import Action
from megatron_bfpp.messages import Message, What
from megatron_bfpp.runtime.step import Key, RankStep

__all__ = [
    "begin_backward",
    "microbatch",
    "overlaps_grad_reduce",
    "whole_backward",
]


def whole_backward(step: RankStep, position: int, action: Action) -> Key:
    """A micro-batch's whole backward via ``backward_step`` (B, and the split backward's I)."""
    ctx = step.ctx
    key, input_tensor, output, output_grad = begin_backward(step, position, action)
    input_grad = backward_step(
        input_tensor, output, output_grad, model_type=ctx.model_type, config=ctx.config
    )
    step.store.drop(key)
    step.state.trace.append(str(action))
    _route_input_grad(step, action.stage, key[1], input_grad)
    return key


def begin_backward(step: RankStep, position: int, action: Action) -> tuple[Key, Any, Any, Any]:
    """What every backward (B, and a split backward's I) starts with: the next stage's gradient, the
    stored input and output, the parts' and data-parallel hooks; returns those and the key."""
    stage, mb = action.stage, microbatch(action)
    key = (stage, mb)
    chunk = step.layout.chunk_of(stage)
    output_grad = _output_grad(step, stage, mb)
    if step.frees_outputs(stage) and not step.layout.is_last(stage):
        step.ctx.comm.finish_send_of(Message(What.ACT, stage, mb))
    if position in step.last_backward and step.grad_sync_funcs[chunk] is None:
        # No explicit sync function: megatron-core DDP's hooks dispatch the chunk's reduction
        # during its last backward once its no_sync context is left.
        step.leave_no_sync(chunk)
    for part in step.parts.values():
        part.before_compute(step, stage)
        part.before_backward(step, key)
    input_tensor = step.state.inputs.pop(key)
    output = step.state.outputs.pop(key)
    return key, input_tensor, output, output_grad


def _route_input_grad(step: RankStep, stage: int, mb: int, input_grad: Any) -> None:
    """The previous stage's gradient to a send, or to this rank's earlier stage (V-shape turn)."""
    if stage == 0:
        return
    if step.layout.rank_of(stage - 1) == step.rank:
        step.state.local_grads[(stage - 1, mb)] = input_grad
    else:
        step.state.grads_to_send[(stage, mb)] = input_grad


def _output_grad(step: RankStep, stage: int, mb: int) -> torch.Tensor | None:
    if step.layout.is_last(stage):
        return None
    following = step.layout.rank_of(stage + 1)
    if following == step.rank:
        return step.state.local_grads.pop((stage, mb))
    return step.ctx.comm.wait_receive(Message(What.GRAD, stage + 1, mb), following)


def overlaps_grad_reduce(model: Any) -> bool:
    """Does the chunk's DDP reduce asynchronously (``overlap_grad_reduce``)?"""
    return bool(getattr(getattr(model, "ddp_config", None), "overlap_grad_reduce", False))


def microbatch(action: Action) -> int:
    assert action.microbatch is not None  # compute actions always carry one
    return action.microbatch
