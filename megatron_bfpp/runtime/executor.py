"""Run one rank's program of a validated Schedule on megatron-core model chunks.

The executor is a dispatch table of small handlers, one per action kind, over an explicit
per-step state. Compute reuses megatron-core's own ``forward_step`` / ``backward_step`` (loss
scaling, per-token loss, autocast, input-tensor plumbing), and behaviour comes from the model
config exactly as megatron-core reads it: ``no_sync_func``, ``grad_sync_func``,
``param_sync_func``, ``finalize_model_grads_func``, ``deallocate_pipeline_outputs``, timers.

Data parallelism is per chunk: a chunk's ``no_sync`` context is left just before its last
backward (megatron-core DDP's hooks then dispatch its gradient reduction during that backward),
``grad_sync_func[chunk]`` runs at the chunk's GS action and ``param_sync_func[chunk]`` at its PS
action. With breadth-first, the first chunk to finish does so long before the step ends, so its
reduction overlaps the other chunks' backward.

BPipe's transfers (see runtime.activations and runtime.p2p): EV packs a micro-batch's stored
activations into one buffer and sends it to the acceptor, AC pre-posts the acceptor's receive, RS
sends the payload back (waiting for it first, at its place in program order) and LD posts the
evictor's receive, which the micro-batch's backward waits for before rebuilding its tensors.

Memory accounting (``StepContext.measure_memory``, always on for a rank that evicts): after every
window of messages and every compute action the executor adds up the distinct storages this rank
holds for pipelining: tensors saved for backward, stage inputs and outputs, eviction payloads
received, posted or in flight. ``MemoryReport`` keeps the peak bytes and, separately, the most
micro-batches resident at once; on CUDA it also reads ``torch.cuda.max_memory_allocated`` (the
process's high-water mark, which this runtime does not reset).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_bfpp.compat import backward_step, forward_step
from megatron_bfpp.ir import Action, ActionKind, Schedule
from megatron_bfpp.messages import Message, message_of
from megatron_bfpp.runtime.activations import ActivationStore, unique_storage_bytes
from megatron_bfpp.runtime.p2p import PipeComm, Receive, Send

__all__ = ["MemoryReport", "StepContext", "run_rank_program"]

K = ActionKind
Key = tuple[int, int]  # (stage, micro-batch)


@dataclass
class StepContext:
    """Everything one step needs besides the schedule: what megatron-core passes around."""

    forward_step_func: Callable[..., Any]
    data_iterators: list[Iterator[Any] | None]
    model: list[torch.nn.Module]
    num_microbatches: int
    config: Any
    model_type: Any
    cp_group_size: int
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: bool | None
    comm: PipeComm
    measure_memory: bool = False


@dataclass
class MemoryReport:
    """Measured activation memory of one rank in one step (bytes of distinct storages)."""

    peak_activation_bytes: int = 0
    peak_stored_microbatches: int = 0  # most resident at once: own and the partner's
    cuda_max_memory_allocated: int | None = None

    def observe(self, nbytes: int, microbatches: int) -> None:
        if nbytes > self.peak_activation_bytes:
            self.peak_activation_bytes = nbytes
        if microbatches > self.peak_stored_microbatches:
            self.peak_stored_microbatches = microbatches


@dataclass
class _State:
    """Per-step bookkeeping; ``check_drained`` proves it is empty at the end."""

    inputs: dict[Key, torch.Tensor | None] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    grads_to_send: dict[Key, torch.Tensor] = field(default_factory=dict)
    local_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # same-rank handoff
    no_sync: dict[int, contextlib.AbstractContextManager[Any]] = field(default_factory=dict)
    synced_chunks: set[int] = field(default_factory=set)
    forward_data_store: list[Any] = field(default_factory=list)
    total_num_tokens: torch.Tensor | None = None
    trace: list[str] = field(default_factory=list)
    # BPipe: (part A, part B) bytes of each evicted payload, buffers and peers of posted loads.
    evicted_parts: dict[Key, tuple[int, int]] = field(default_factory=dict)
    loads: dict[Key, tuple[torch.Tensor, int]] = field(default_factory=dict)
    memory: MemoryReport = field(default_factory=MemoryReport)


class _Executor:
    def __init__(self, schedule: Schedule, rank: int, ctx: StepContext) -> None:
        self.schedule = schedule
        self.layout = schedule.layout
        self.rank = rank
        self.ctx = ctx
        self.state = _State()
        self.program = schedule.per_rank[rank]
        self.last_backward = _last_backward_positions(self.program)
        # With explicit sync functions (overlap_grad_reduce in Megatron-LM) the chunk keeps its
        # no_sync context through its last backward and GS dispatches the reduction, as
        # megatron-core's interleaved schedule does; otherwise DDP's hooks dispatch it.
        self._grad_sync_funcs = self._per_chunk(ctx.config.grad_sync_func)
        evicts = any(action.kind is K.EVICT for action in self.program)
        self.measuring = not ctx.forward_only and (ctx.measure_memory or evicts)
        modules = ctx.model if self.measuring else []
        self.store = ActivationStore.for_modules(modules, ctx.comm.device)
        self.handlers: dict[ActionKind, Callable[[int, Action], None]] = {
            K.FORWARD: self.forward,
            K.BACKWARD: self.backward,
            K.GRAD_SYNC: self.grad_sync,
            K.PARAM_SYNC: self.param_sync,
        }

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> _State:
        device = self.ctx.comm.device
        self.state.total_num_tokens = torch.zeros([], dtype=torch.int, device=device)
        self._enter_no_sync()
        window: list[Action] = []
        settle = not self.ctx.comm.sends_pollable
        for position, action in enumerate(self.program):
            if action.kind.is_p2p:
                window.append(action)
                continue
            self._flush(window)
            window = []
            handler = self.handlers.get(action.kind)
            if handler is None:
                raise RuntimeError(f"{action.kind.name} actions are not runnable yet ({action})")
            handler(position, action)
            if settle and action.kind.is_compute:
                self.ctx.comm.settle_transfers()
            self.ctx.comm.reap()
            self._measure()
        self._flush(window)
        self._finish()
        if self.measuring and self.ctx.comm.device.type == "cuda":
            self.state.memory.cuda_max_memory_allocated = torch.cuda.max_memory_allocated(
                self.ctx.comm.device
            )
        return self.state

    def _flush(self, window: list[Action]) -> None:
        """Post one window of messages (see runtime.p2p): sends and receives together."""
        if not window:
            return
        comm = self.ctx.comm
        sends: list[Send] = []
        receives: list[Receive] = []
        for action in window:
            message = message_of(action)
            peer = action.peer
            assert peer is not None  # every p2p action has one (ir.Action checks it)
            key = (action.stage, message.microbatch)
            kind = action.kind
            if kind is K.SEND_ACT:
                tensor = self.state.outputs[key]
                release = tensor if self._frees_outputs(action.stage) else None
                if self.ctx.forward_only:
                    self.state.outputs.pop(key)
                # Detached now: a later EV in this window may empty the output's .data.
                sends.append(Send(message, tensor.detach(), peer, release))
            elif kind is K.SEND_GRAD:
                sends.append(Send(message, self.state.grads_to_send.pop(key), peer))
            elif kind is K.RECV_ACT:
                receives.append(
                    Receive(message, peer, (comm.new_buffer(not self.ctx.forward_only),))
                )
            elif kind is K.RECV_GRAD:
                receives.append(Receive(message, peer, (comm.new_buffer(False),)))
            elif kind is K.EVICT:
                sends.extend(self._evict(key, peer))
            elif kind is K.ACCEPT:
                receives.append(self._accept(key, peer))
            elif kind is K.LOAD:
                receives.append(self._load(key, peer))
            elif kind is K.RESTORE:
                # RS waits for the payload at its place in program order: post what precedes it.
                comm.post(sends, receives)
                sends, receives = [], []
                parts = comm.wait_parts(Message("evict", *key), peer)
                sends.extend(Send(Message("restore", *key), part, peer) for part in parts)
            else:
                raise RuntimeError(f"{kind.name} actions are not runnable yet ({action})")
        comm.post(sends, receives)
        self._measure()

    # --- BPipe transfers ---------------------------------------------------------------------
    def _evict(self, key: Key, acceptor: int) -> list[Send]:
        """Pack and send ``key``'s stored activations: size header, part A, part B."""
        comm, stage = self.ctx.comm, key[0]
        if key not in self.state.inputs:
            raise RuntimeError(f"EV of stage {stage}, micro-batch {key[1]}: nothing is stored")
        pipeline = [self.state.inputs[key]]
        if not self._frees_outputs(stage):  # a deallocated output keeps only its autograd node
            pipeline.append(self.state.outputs[key])
        agreed = comm.eviction_sizes.get(stage, 0)
        buffer, record = self.store.evict(
            key, [t for t in pipeline if t is not None], min_bytes=agreed
        )
        nbytes = record.nbytes
        comm.eviction_sizes[stage] = nbytes
        rest = max(0, nbytes - agreed)
        self.state.evicted_parts[key] = (agreed, rest)
        header = torch.tensor([nbytes], dtype=torch.int64, device=comm.device)
        sends = [Send(Message("evict-size", *key), header, acceptor)]
        if agreed:
            sends.append(Send(Message("evict", *key), buffer.narrow(0, 0, agreed), acceptor))
        if rest:
            # With no agreed size the acceptor reads the header at once and posts it all; a
            # grown payload's rest is posted when the acceptor next reads headers.
            what = "evict-rest" if agreed else "evict"
            sends.append(Send(Message(what, *key), buffer.narrow(0, agreed, rest), acceptor))
        return sends

    def _accept(self, key: Key, evictor: int) -> Receive:
        """Pre-post the header and, at the size last agreed, part A of an eviction."""
        comm = self.ctx.comm
        agreed = comm.eviction_sizes.get(key[0], 0)
        header = torch.empty(1, dtype=torch.int64, device=comm.device)
        parts = (torch.empty(agreed, dtype=torch.uint8, device=comm.device),) if agreed else ()
        # The first eviction of a stage in a run has no agreed size: read its header now.
        return Receive(
            Message("evict", *key), evictor, parts, header=header, read_header=not agreed
        )

    def _load(self, key: Key, acceptor: int) -> Receive:
        """Post the receive of an evicted payload coming back, as the parts it went out in."""
        agreed, rest = self.state.evicted_parts.pop(key)
        buffer = torch.empty(agreed + rest, dtype=torch.uint8, device=self.ctx.comm.device)
        self.state.loads[key] = (buffer, acceptor)
        parts = tuple(
            buffer.narrow(0, start, size) for start, size in ((0, agreed), (agreed, rest)) if size
        )
        return Receive(Message("restore", *key), acceptor, parts)

    def _bring_back(self, key: Key) -> None:
        """Before an evicted micro-batch's backward: wait for its payload and rebuild it."""
        buffer, acceptor = self.state.loads.pop(key)
        self.ctx.comm.wait_parts(Message("restore", *key), acceptor)
        self.store.restore(key, buffer)

    # --- memory accounting --------------------------------------------------------------------
    def _measure(self) -> None:
        if not self.measuring:
            return
        state, comm = self.state, self.ctx.comm
        transfers = comm.transfer_tensors()
        nbytes = unique_storage_bytes(
            [
                *self.store.live_tensors(),
                *state.inputs.values(),
                *state.outputs.values(),
                *transfers,
                *(buffer for buffer, _ in state.loads.values()),
            ]
        )
        own = {key for key in state.inputs if key not in self.store.evicted}
        own.update(state.loads)
        partner = {
            (message.stage, message.microbatch)
            for message in comm.receives
            if message.what == "evict"
        }
        partner.update(
            (p.message.stage, p.message.microbatch)
            for p in comm.sends
            if p.message.what in ("evict", "restore")
        )
        state.memory.observe(nbytes, len(own | partner))

    def _frees_outputs(self, stage: int) -> bool:
        """Pseudo-free a sent output once its send completes, as megatron-core does."""
        return bool(self.ctx.config.deallocate_pipeline_outputs) and not self.ctx.forward_only

    # --- compute ----------------------------------------------------------------------------
    def forward(self, position: int, action: Action) -> None:
        from megatron.core.pipeline_parallel.schedules import check_first_val_step

        ctx, stage, mb = self.ctx, action.stage, _mb(action)
        chunk = self.layout.chunk_of(stage)
        input_tensor = self._forward_input(stage, mb)
        capture = self.store.capture((stage, mb)) if self.measuring else contextlib.nullcontext()
        with capture:
            output, num_tokens = forward_step(
                ctx.forward_step_func,
                ctx.data_iterators[chunk],
                ctx.model[chunk],
                ctx.num_microbatches,
                input_tensor,
                self.state.forward_data_store,
                ctx.config,
                ctx.cp_group_size,
                collect_non_loss_data=ctx.collect_non_loss_data,
                is_first_microbatch=check_first_val_step(
                    ctx.first_val_step, ctx.forward_only, mb == 0
                ),
                current_microbatch=mb,
                vp_stage=chunk if len(ctx.model) > 1 else None,
                is_last_stage=self.layout.is_last(stage),
            )
        assert self.state.total_num_tokens is not None
        self.state.total_num_tokens += num_tokens
        self.state.trace.append(str(action))
        key = (stage, mb)
        if self.layout.is_last(stage):
            if not ctx.forward_only:
                self.state.inputs[key] = input_tensor
                self.state.outputs[key] = output
            return
        self.state.outputs[key] = output
        if not ctx.forward_only:
            self.state.inputs[key] = input_tensor

    def _forward_input(self, stage: int, mb: int) -> torch.Tensor | None:
        if stage == 0:
            return None
        if self.layout.rank_of(stage - 1) == self.rank:
            # Same-rank handoff (V-shape turn): a leaf like a received tensor, same storage.
            produced = self.state.outputs[(stage - 1, mb)]
            if self.ctx.forward_only:
                self.state.outputs.pop((stage - 1, mb))
            return produced.detach().requires_grad_(not self.ctx.forward_only)
        previous = self.layout.rank_of(stage - 1)
        return self.ctx.comm.wait_receive(Message("act", stage - 1, mb), previous)

    def backward(self, position: int, action: Action) -> None:
        ctx, stage, mb = self.ctx, action.stage, _mb(action)
        key = (stage, mb)
        chunk = self.layout.chunk_of(stage)
        output_grad = self._output_grad(stage, mb)
        if self._frees_outputs(stage) and not self.layout.is_last(stage):
            ctx.comm.finish_send_of(Message("act", stage, mb))
        if position in self.last_backward and self._grad_sync_funcs[chunk] is None:
            # No explicit sync function: megatron-core DDP's hooks dispatch the chunk's reduction
            # during its last backward once its no_sync context is left.
            self._leave_no_sync(chunk)
        if key in self.state.loads:
            self._bring_back(key)
        input_tensor = self.state.inputs.pop(key)
        output = self.state.outputs.pop(key)
        input_grad = backward_step(
            input_tensor, output, output_grad, model_type=ctx.model_type, config=ctx.config
        )
        self.store.drop(key)
        self.state.trace.append(str(action))
        if stage == 0:
            return
        if self.layout.rank_of(stage - 1) == self.rank:
            self.state.local_grads[(stage - 1, mb)] = input_grad
        else:
            self.state.grads_to_send[key] = input_grad

    def _output_grad(self, stage: int, mb: int) -> torch.Tensor | None:
        if self.layout.is_last(stage):
            return None
        if self.layout.rank_of(stage + 1) == self.rank:
            return self.state.local_grads.pop((stage, mb))
        following = self.layout.rank_of(stage + 1)
        return self.ctx.comm.wait_receive(Message("grad", stage + 1, mb), following)

    # --- data parallel ----------------------------------------------------------------------
    def _enter_no_sync(self) -> None:
        """Hold every chunk's gradient reduction until its last backward."""
        funcs = self._per_chunk(self.ctx.config.no_sync_func)
        for chunk, func in enumerate(funcs):
            if func is not None:
                context = func()
                context.__enter__()
                self.state.no_sync[chunk] = context

    def _leave_no_sync(self, chunk: int) -> None:
        context = self.state.no_sync.pop(chunk, None)
        if context is not None:
            context.__exit__(None, None, None)

    def grad_sync(self, position: int, action: Action) -> None:
        chunk = self.layout.chunk_of(action.stage)
        self._leave_no_sync(chunk)
        func = self._grad_sync_funcs[chunk]
        if func is not None and not self.ctx.forward_only:
            func(self.ctx.model[chunk].parameters())
        self.state.synced_chunks.add(chunk)
        self.state.trace.append(str(action))

    def param_sync(self, position: int, action: Action) -> None:
        chunk = self.layout.chunk_of(action.stage)
        func = self._per_chunk(self.ctx.config.param_sync_func)[chunk]
        if func is not None and not self.ctx.forward_only:
            func(self.ctx.model[chunk].parameters())
        self.state.trace.append(str(action))

    def _per_chunk(self, func: Any) -> list[Any]:
        """megatron-core accepts one callable for all chunks or one per chunk."""
        chunks = len(self.ctx.model)
        if func is None:
            return [None] * chunks
        if isinstance(func, list | tuple):
            if len(func) != chunks:
                raise ValueError(
                    f"config has {len(func)} per-chunk sync functions for {chunks} model chunks"
                )
            return list(func)
        if chunks == 1:
            return [func]
        # One callable for every chunk: megatron-core's interleaved schedule enters it once for
        # all chunks; entering it per chunk would nest the same context, so only chunk 0 holds it.
        return [func] + [None] * (chunks - 1)

    def _finish(self) -> None:
        self.ctx.comm.reap(wait=True)
        for chunk in sorted(self.state.no_sync):
            self._leave_no_sync(chunk)
        if not self.ctx.forward_only:
            for chunk, func in enumerate(self._grad_sync_funcs):
                if func is not None and chunk not in self.state.synced_chunks:
                    func(self.ctx.model[chunk].parameters())

    def check_drained(self) -> None:
        """Post-conditions of a step: nothing stored, pending or buffered is left behind."""
        leftovers: dict[str, dict[Any, Any]] = {
            "stored inputs": self.state.inputs,
            "stored outputs": self.state.outputs,
            "gradients not sent": self.state.grads_to_send,
            "same-rank gradients not consumed": self.state.local_grads,
            "receives never consumed": self.ctx.comm.receives,
            "evicted and never loaded back": self.store.evicted,
            "loads never consumed": self.state.loads,
        }
        problems = [
            f"{what}: {sorted(map(str, items))[:6]}" for what, items in leftovers.items() if items
        ]
        if self.ctx.comm.sends:
            problems.append(f"sends still pending: {len(self.ctx.comm.sends)}")
        if self.ctx.comm.headers:
            problems.append(f"eviction headers never read: {len(self.ctx.comm.headers)}")
        if problems:
            raise RuntimeError(
                f"pipeline rank {self.rank} ended the step with state left behind ("
                + "; ".join(problems)
                + "); the schedule and the executor disagree: please report this bug"
            )


def _mb(action: Action) -> int:
    assert action.microbatch is not None  # compute actions always carry one
    return action.microbatch


def _last_backward_positions(program: tuple[Action, ...]) -> set[int]:
    """Position of each chunk's last backward on this rank: where its reduction may start."""
    last: dict[int, int] = {}
    for position, action in enumerate(program):
        if action.kind in (K.BACKWARD, K.BACKWARD_WEIGHT):
            last[action.stage] = position
    return set(last.values())


def run_rank_program(
    schedule: Schedule, rank: int, ctx: StepContext
) -> tuple[list[Any], Any, list[str], MemoryReport]:
    """Execute ``rank``'s program; return (forward_data_store, total_num_tokens, trace, memory)."""
    executor = _Executor(schedule, rank, ctx)
    state = executor.run()
    executor.check_drained()
    return state.forward_data_store, state.total_num_tokens, state.trace, state.memory
