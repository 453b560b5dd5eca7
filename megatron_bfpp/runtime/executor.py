"""Run one rank's program of a validated Schedule on megatron-core model chunks.

The core handlers (compute through megatron-core's ``forward_step`` / ``backward_step``, pipeline
messages, data-parallel sync) live here; a protocol with state of its own is a module in ``TABLE``.
Actions run in program order, one ``batch_isend_irecv`` per tick of the lock-step posting proven
when the schedule is planned (:class:`PlannedSchedule`); docs/design-notes.md, "Runtime"."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from megatron_bfpp.ir import Action, ActionKind, Schedule, parts
from megatron_bfpp.messages import Message, What, message_of
from megatron_bfpp.nccl import Batch, Posting, release_models, validate_nccl
from megatron_bfpp.runtime import bpipe, combined, sharding, split_backward
from megatron_bfpp.runtime.activations import unique_storage_bytes
from megatron_bfpp.runtime.backward import microbatch, overlaps_grad_reduce, whole_backward
from megatron_bfpp.runtime.p2p import Receive, Send, pair_group, pseudo_free
from megatron_bfpp.runtime.step import (
    DispatchTable,
    Handlers,
    MemoryReport,
    RankStep,
    StepContext,
    StepState,
    dispatch_table,
    key_and_peer,
)

__all__ = [
    "CORE",
    "TABLE",
    "MemoryReport",
    "PlannedSchedule",
    "StepContext",
    "planned",
    "run_rank_program",
]

K = ActionKind


def forward(step: RankStep, position: int, action: Action) -> None:
    # forward_step's signature is the same in 0.16.1 to 0.20.0 (docs/architecture.md)
    from megatron.core.pipeline_parallel.schedules import check_first_val_step, forward_step

    if (action.stage, action.microbatch) in step.planned:
        return combined.run(step, position, action, None)
    ctx, stage, mb = step.ctx, action.stage, microbatch(action)
    chunk = step.layout.chunk_of(stage)
    input_tensor = begin_forward(step, action)
    with step.store.capture((stage, mb)) if step.measuring else contextlib.nullcontext():
        output, num_tokens = forward_step(
            ctx.call.forward_step_func,
            ctx.data_iterators[chunk],
            ctx.model[chunk],
            ctx.call.num_microbatches,
            input_tensor,
            step.state.forward_data_store,
            ctx.config,
            ctx.cp_group_size,
            collect_non_loss_data=ctx.call.collect_non_loss_data,
            checkpoint_activations_microbatch=None,
            is_first_microbatch=check_first_val_step(
                ctx.call.first_val_step, ctx.call.forward_only, mb == 0
            ),
            current_microbatch=mb,
            vp_stage=chunk if len(ctx.model) > 1 else None,
            is_last_stage=step.layout.is_last(stage),
        )
    end_forward(step, action, input_tensor, output, num_tokens)


def begin_forward(step: RankStep, action: Action) -> torch.Tensor | None:
    """What every forward starts with: its input (received, handed over, or none), the parts'
    hooks; returns the input."""
    input_tensor = _forward_input(step, action.stage, microbatch(action))
    for part in step.parts.values():
        part.before_compute(step, action.stage)
    return input_tensor


def end_forward(
    step: RankStep, action: Action, input_tensor: torch.Tensor | None, output: Any, num_tokens: Any
) -> None:
    """What every forward ends with: its tokens counted, its input and output kept for its
    backward (forward-only: the output for the next stage only)."""
    assert step.state.total_num_tokens is not None
    step.state.total_num_tokens += num_tokens
    step.state.trace.append(str(action))
    key = (action.stage, microbatch(action))
    if not (step.ctx.call.forward_only and step.layout.is_last(action.stage)):
        step.state.outputs[key] = output
    if not step.ctx.call.forward_only:
        step.state.inputs[key] = input_tensor


def _forward_input(step: RankStep, stage: int, mb: int) -> torch.Tensor | None:
    if stage == 0:
        return None
    previous = step.layout.rank_of(stage - 1)
    if previous == step.rank:
        # Same-rank handoff (V-shape turn): a leaf like a received tensor, same storage.
        produced = step.state.outputs[(stage - 1, mb)]
        if step.ctx.call.forward_only:
            step.state.outputs.pop((stage - 1, mb))
        handed = produced.detach().requires_grad_(not step.ctx.call.forward_only)
        if step.frees_outputs(stage - 1):
            # as a sent output once sent: the receiver's leaf keeps the storage, the producer only
            # its autograd node (megatron's custom_backward checks for exactly that)
            pseudo_free(produced)
        return handed
    return step.ctx.comm.wait_receive(Message(What.ACT, stage - 1, mb), previous)


def overlapped(step: RankStep, position: int, action: Action) -> None:
    """An overlapped pair (``OVERLAP_F_B``, ``3F5&1B2``), both receives already posted
    (``semantics``' composite rule): one of ``combined_pairs`` as megatron-core's combined step
    (``runtime.combined``, which hides each part's all-to-all), any other its forward, then its
    backward, each via its ``TABLE`` handler.
    Memory is measured between the parts too: run overlapped, the forward's activations and
    those the backward has not freed yet are live at once (the planner's walk counts that)."""
    forward, backward = parts(action)
    if backward.kind is K.BACKWARD and (forward.stage, forward.microbatch) in step.planned:
        return combined.run(step, position, forward, backward)  # semantics.combined_pairs
    TABLE.handlers[forward.kind](step, position, forward)
    _measure(step)
    TABLE.handlers[backward.kind](step, position, backward)


def send_act(step: RankStep, position: int, action: Action) -> None:
    key, peer = key_and_peer(action)
    tensor = step.state.outputs[key]
    release = tensor if step.frees_outputs(action.stage) else None
    if step.ctx.call.forward_only:
        step.state.outputs.pop(key)
    # Detached now: a later EV in this window may empty the output's .data.
    step.window.sends.append(Send(message_of(action), tensor.detach(), peer, release))


def send_grad(step: RankStep, position: int, action: Action) -> None:
    key, peer = key_and_peer(action)
    step.window.sends.append(Send(message_of(action), step.state.grads_to_send.pop(key), peer))


def receive(step: RankStep, position: int, action: Action) -> None:
    """RECV_ACT / RECV_GRAD: post a buffer; only a training activation takes a gradient."""
    message, peer = message_of(action), key_and_peer(action)[1]
    requires_grad = action.kind is K.RECV_ACT and not step.ctx.call.forward_only
    step.window.receives.append(Receive(message, peer, (step.ctx.comm.new_buffer(requires_grad),)))


def grad_sync(step: RankStep, position: int, action: Action) -> None:
    chunk = step.layout.chunk_of(action.stage)
    sharded, forward_only = step.ctx.sharded, step.ctx.call.forward_only
    last = position in step.last_grad_sync
    if sharded is None or last:
        step.leave_no_sync(chunk)
        func = step.grad_sync_funcs[chunk]
        if func is not None and not forward_only:
            func(step.ctx.model[chunk].parameters())
        step.state.synced_chunks.add(chunk)
    if sharded is not None and not forward_only:
        # fully sharded: landed into the kept shard at the next GS if overlapped, else now; a GS
        # before the chunk's last is a run's partial reduction (grads_synced's ``partial``)
        overlapped = overlaps_grad_reduce(step.ctx.model[chunk])
        sharded.grads_synced(chunk, overlapped=overlapped, partial=not last)
    step.state.trace.append(str(action))


CORE = Handlers(
    kinds={
        K.FORWARD: forward,
        K.BACKWARD: whole_backward,
        K.OVERLAP_F_B: overlapped,
        K.SEND_ACT: send_act,
        K.RECV_ACT: receive,
        K.SEND_GRAD: send_grad,
        K.RECV_GRAD: receive,
        K.GRAD_SYNC: grad_sync,
    }
)
TABLE: DispatchTable = dispatch_table(
    CORE, bpipe.HANDLERS, sharding.HANDLERS, split_backward.HANDLERS
)


@dataclass(frozen=True, eq=False)
class PlannedSchedule:
    """A validated schedule with its proven NCCL-safe lock-step posting, made once (``planned``) and
    handed to every step (``eq=False``: identity is the key, so no step re-derives or hashes it)."""

    schedule: Schedule
    posting: Posting


def planned(schedule: Schedule) -> PlannedSchedule:
    """``schedule`` with its lock-step posting proven under NCCL's rules (``nccl.validate_nccl``,
    the same on every rank, before any message); the proof's model is not kept."""
    posting = validate_nccl(schedule)
    release_models()
    return PlannedSchedule(schedule, posting)


def _rank_step(plan: PlannedSchedule, rank: int, ctx: StepContext) -> RankStep:
    """This rank's step, measuring memory when asked or when an action ships stored tensors."""
    captures = any(action.kind in TABLE.captures for action in plan.schedule.per_rank[rank])
    measuring = not ctx.call.forward_only and (ctx.measure_memory or captures)
    parts = [make() for make in TABLE.parts]
    return RankStep(plan.schedule, rank, ctx, measuring=measuring, parts=parts)


def _run(step: RankStep, plan: PlannedSchedule) -> StepState:
    """Dispatch the program through the table, posting each tick's batch between actions."""
    handlers = TABLE.handlers
    comm = step.ctx.comm
    step.state.total_num_tokens = torch.zeros([], dtype=torch.int, device=comm.device)
    sharded = step.ctx.sharded
    if sharded is not None:
        sharded.begin_step()
    with contextlib.ExitStack() as stack:
        for part in step.parts.values():
            part.begin(step)
            stack.callback(part.end, step)
        # every chunk's gradient reduction held until its last backward
        for chunk, func in enumerate(step.per_chunk(step.ctx.config.no_sync_func)):
            if func is not None:
                context = func()
                context.__enter__()
                step.state.no_sync[chunk] = context
        # the pair's group before the first payload batch (own stream); job-collective: all join
        if plan.posting.has_side and comm.side_group is None:  # partners x and p-1-x only
            comm.side_group = pair_group(comm.group, comm.device)
        settle = not comm.sends_pollable
        program = step.program
        for item in plan.posting.per_rank[step.rank]:
            if isinstance(item, Batch):  # a tick: its items' handlers, then one batch
                for position, rest in item.items:
                    action = program[position]
                    (TABLE.rests if rest else handlers)[action.kind](step, position, action)
                step.window.post(comm, side=item.side)
                _measure(step)
                continue
            if not isinstance(item, int):  # a deferred Wait: not in lock-step postings
                raise TypeError(f"the runtime posts lock-step batches only, not {item}")
            action = program[item]
            handlers[action.kind](step, item, action)
            if settle and action.kind.is_compute:
                comm.settle_transfers()
            comm.reap()
            _measure(step)
        comm.reap(wait=True)
        for chunk in sorted(step.state.no_sync):
            step.leave_no_sync(chunk)
        if not step.ctx.call.forward_only:
            for chunk, func in enumerate(step.grad_sync_funcs):
                if func is not None and chunk not in step.state.synced_chunks:
                    func(step.ctx.model[chunk].parameters())
    if sharded is not None:
        step.state.memory.peak_parameter_bytes = sharded.peak_bytes
    if step.measuring and comm.device.type == "cuda":
        step.state.memory.cuda_max_memory_allocated = torch.cuda.max_memory_allocated(comm.device)
    return step.state


def _measure(step: RankStep) -> None:
    if not step.measuring:
        return
    state, store, parts = step.state, step.store, step.parts.values()
    nbytes = unique_storage_bytes(
        [
            *store.live_tensors(),
            *state.inputs.values(),
            *state.outputs.values(),
            *step.ctx.comm.transfer_tensors(),
            *(tensor for part in parts for tensor in part.held_tensors(step)),
        ]
    )
    resident = {key for key in state.inputs if key not in store.evicted}
    for part in parts:
        resident.update(part.held_microbatches(step))
    state.memory.observe(nbytes, len(resident))


def _check_drained(step: RankStep) -> None:
    """Post-conditions of a step: nothing stored, pending or buffered is left behind."""
    comm = step.ctx.comm
    leftovers: dict[str, Any] = {
        "stored inputs": step.state.inputs,
        "stored outputs": step.state.outputs,
        "gradients not sent": step.state.grads_to_send,
        "same-rank gradients not consumed": step.state.local_grads,
        "receives never consumed": comm.receives,
        "evicted and never loaded back": step.store.evicted,
    }
    for part in step.parts.values():
        leftovers.update(part.leftovers())
    problems = [
        f"{what}: {sorted(map(str, items))[:6]}" for what, items in leftovers.items() if items
    ]
    if comm.sends:
        problems.append(f"sends still pending: {len(comm.sends)}")
    if comm.headers:
        problems.append(f"eviction headers never read: {len(comm.headers)}")
    if problems:
        raise RuntimeError(
            f"pipeline rank {step.rank} ended the step with state left behind ("
            + "; ".join(problems)
            + "); the schedule and the executor disagree: please report this bug"
        )


def run_rank_program(
    plan: PlannedSchedule, rank: int, ctx: StepContext
) -> tuple[list[Any], Any, list[str], MemoryReport]:
    """Execute ``rank``'s program; return (forward_data_store, total_num_tokens, trace, memory)."""
    step = _rank_step(plan, rank, ctx)
    state = _run(step, plan)
    _check_drained(step)
    return state.forward_data_store, state.total_num_tokens, state.trace, state.memory
