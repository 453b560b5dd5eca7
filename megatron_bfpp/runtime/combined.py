"""megatron-core's combined forward-backward step (``--overlap-moe-expert-parallel-comm``): each
forward of ``semantics.planned_forwards`` runs as a schedule plan (``build_schedule_plan``), its
whole backward through that plan, and an overlapped pair of two such parts
(``semantics.combined_pairs``) as one ``combined_forward_backward_step``, which on a GPU runs each
part's expert all-to-all on its own stream under the other part's compute."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from megatron_bfpp.compat import loss_stage_told, set_a2a_streams
from megatron_bfpp.ir import Action
from megatron_bfpp.runtime.backward import begin_backward, end_backward, microbatch
from megatron_bfpp.runtime.step import RankStep

__all__ = ["check_forward_step_func", "run"]


def run(step: RankStep, position: int, forward: Action | None, backward: Action | None) -> None:
    """``forward``, ``backward`` or both as one megatron-core combined step, with each side's
    messages, stored tensors and hooks as the plain handlers have them."""
    from megatron.core.pipeline_parallel import combined_1f1b
    from megatron.core.pipeline_parallel.schedules import check_first_val_step

    from megatron_bfpp.runtime.executor import begin_forward, end_forward

    ctx, chunks = step.ctx, len(step.ctx.model)
    set_a2a_streams(ctx.config)
    f_model = iterator = input_tensor = f_chunk = mb = None
    if forward is not None:
        f_chunk, mb = step.layout.chunk_of(forward.stage), microbatch(forward)
        f_model, iterator = ctx.model[f_chunk], ctx.data_iterators[f_chunk]
        input_tensor = begin_forward(step, forward)
    b_model = key = b_input = b_output = b_grad = None
    if backward is not None:
        b_model = ctx.model[step.layout.chunk_of(backward.stage)]
        key, b_input, b_output, b_grad = begin_backward(step, position, backward)
    capture: Any = contextlib.nullcontext()
    if step.measuring and forward is not None:
        capture = step.store.capture((forward.stage, microbatch(forward)))
    told: Any = contextlib.nullcontext()  # the forward's chunk takes the loss, or not
    if forward is not None:
        told = loss_stage_told(step.layout.is_last(forward.stage), step.ctx.cp_group_size)
    with told, capture:
        output, num_tokens, input_grad = combined_1f1b.combined_forward_backward_step(
            ctx.call.forward_step_func, iterator, f_model, ctx.call.num_microbatches,
            input_tensor, step.state.forward_data_store, b_model, b_input, b_output, b_grad,
            ctx.config, f_model_chunk_id=f_chunk if chunks > 1 else None,
            collect_non_loss_data=ctx.call.collect_non_loss_data,
            checkpoint_activations_microbatch=None,
            is_first_microbatch=forward is not None
            and check_first_val_step(ctx.call.first_val_step, ctx.call.forward_only, mb == 0),
            current_microbatch=mb,
        )  # fmt: skip
    if forward is not None:
        end_forward(step, forward, input_tensor, output, num_tokens)
    if backward is not None:
        assert key is not None
        end_backward(step, key, backward, input_grad)


def check_forward_step_func(forward_step_func: Any) -> None:
    """The combined step builds each forward's schedule plan through the user's function."""
    if "return_schedule_plan" not in inspect.signature(forward_step_func).parameters:
        raise ValueError(
            "--overlap-moe-expert-parallel-comm runs each forward as megatron-core's schedule "
            "plan: forward_step_func must take return_schedule_plan and then return "
            "(model.build_schedule_plan(...), loss_func), as Megatron-LM's pretrain_gpt.py does"
        )
