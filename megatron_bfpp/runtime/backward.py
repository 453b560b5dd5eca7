"""What B and a split backward's I share (the incoming gradient, the stored tensors, the parts'
and data-parallel hooks, the input gradient sent on): one copy for executor and split_backward."""

from __future__ import annotations

from typing import Any

from megatron_bfpp.compat import backward_step
from megatron_bfpp.ir import Action
from megatron_bfpp.messages import Message, What
from megatron_bfpp.runtime.step import Key, RankStep

__all__ = [
    "begin_backward",
    "end_backward",
    "microbatch",
    "overlaps_grad_reduce",
    "whole_backward",
]


def whole_backward(step: RankStep, position: int, action: Action) -> None:
    """A micro-batch's whole backward via ``backward_step`` (B, and the split backward's I); one
    whose forward ran as a schedule plan runs through it (``runtime.combined``)."""
    if (action.stage, action.microbatch) in step.planned:
        from megatron_bfpp.runtime import combined

        return combined.run(step, position, None, action)
    ctx = step.ctx
    key, input_tensor, output, output_grad = begin_backward(step, position, action)
    input_grad = backward_step(
        input_tensor, output, output_grad, model_type=ctx.model_type, config=ctx.config
    )
    end_backward(step, key, action, input_grad)


def end_backward(step: RankStep, key: Key, action: Action, input_grad: Any) -> None:
    """The previous stage's gradient goes to a send, or to this rank's earlier stage (V-shape
    turn); the micro-batch's stored tensors are gone."""
    stage, mb = key
    step.store.drop(key)
    step.state.trace.append(str(action))
    if stage > 0 and step.layout.rank_of(stage - 1) == step.rank:
        step.state.local_grads[(stage - 1, mb)] = input_grad
    elif stage > 0:
        step.state.grads_to_send[key] = input_grad


def begin_backward(step: RankStep, position: int, action: Action) -> tuple[Key, Any, Any, Any]:
    """What every backward (B, and a split backward's I) starts with: the next stage's gradient, the
    stored input and output, the parts' and data-parallel hooks; returns those and the key."""
    stage, mb = action.stage, microbatch(action)
    key = (stage, mb)
    chunk = step.layout.chunk_of(stage)
    following = None if step.layout.is_last(stage) else step.layout.rank_of(stage + 1)
    if following is None:
        output_grad = None
    elif following == step.rank:
        output_grad = step.state.local_grads.pop((stage, mb))
    else:
        output_grad = step.ctx.comm.wait_receive(Message(What.GRAD, stage + 1, mb), following)
    if step.frees_outputs(stage) and not step.layout.is_last(stage):
        step.ctx.comm.finish_send_of(Message(What.ACT, stage, mb))
    if position in step.last_backward and step.grad_sync_funcs[chunk] is None:
        # No sync function: DDP's hooks reduce the chunk in its last backward, once out of no_sync.
        step.leave_no_sync(chunk)
    for part in step.parts.values():
        part.before_compute(step, stage)
        part.before_backward(step, key)
    return key, step.state.inputs.pop(key), step.state.outputs.pop(key), output_grad


def overlaps_grad_reduce(model: Any) -> bool:
    """Does the chunk's DDP reduce asynchronously (``overlap_grad_reduce``)?"""
    return bool(getattr(getattr(model, "ddp_config", None), "overlap_grad_reduce", False))


def microbatch(action: Action) -> int:
    assert action.microbatch is not None  # compute actions always carry one
    return action.microbatch
