"""BPipe's transfers on the runtime: a micro-batch's stored activations go to the partner rank
and come back before its backward.

The evictor's EV packs a micro-batch's stored activations (see runtime.activations) into one
buffer and sends it to the acceptor; the acceptor's AC posts the receive, its RS sends the
payload back (waiting for it first) and the evictor's LD posts the receive that the
micro-batch's backward waits for before rebuilding its tensors. The payload travels as an 8-byte
size header and part A of the size both ends last agreed for the stage in the EV's batch, and
part B, the rest when it grew, in the next tick's batch: the *rest* handlers (``evict_rest``,
``accept_rest``) run there, the acceptor's after reading the header (see runtime.p2p and the
lock-step posting in megatron_bfpp.nccl).

This module registers those four kinds and the two rests in the executor's dispatch table
together with its per-step part, :class:`Transfers`; the core knows BPipe only through that
part's answers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_bfpp.ir import Action, ActionKind
from megatron_bfpp.messages import Message
from megatron_bfpp.runtime.p2p import Receive, Send
from megatron_bfpp.runtime.step import Handlers, Key, RankStep, StepPart

__all__ = ["HANDLERS", "Transfers"]

K = ActionKind


@dataclass
class Transfers(StepPart):
    """The evictor's side of BPipe in one step: how each payload went out, the loads posted."""

    # (part A, part B) bytes of each evicted payload, until its LD posts the receive.
    evicted_parts: dict[Key, tuple[int, int]] = field(default_factory=dict)
    # Part B of each eviction until the next tick's batch sends it (None: nothing grew).
    rests: dict[Key, torch.Tensor | None] = field(default_factory=dict)
    # Buffer and acceptor of each posted LD, until the micro-batch's backward brings it back.
    loads: dict[Key, tuple[torch.Tensor, int]] = field(default_factory=dict)

    def before_backward(self, step: RankStep, key: Key) -> None:
        """Wait for an evicted micro-batch's payload and rebuild its tensors from it."""
        if key not in self.loads:
            return
        buffer, acceptor = self.loads.pop(key)
        step.ctx.comm.wait_parts(Message("restore", *key), acceptor)
        step.store.restore(key, buffer)

    def held_tensors(self, step: RankStep) -> Iterable[torch.Tensor]:
        return [buffer for buffer, _ in self.loads.values()]

    def held_microbatches(self, step: RankStep) -> Iterable[Key]:
        """Own micro-batches on their way back, and the partner's payloads held or in flight."""
        comm = step.ctx.comm
        held = set(self.loads)
        held.update(
            (message.stage, message.microbatch)
            for message in comm.receives
            if message.what == "evict"
        )
        held.update(
            (p.message.stage, p.message.microbatch)
            for p in comm.sends
            if p.message.what in ("evict", "restore")
        )
        return held

    def leftovers(self) -> dict[str, Collection[Any]]:
        return {"loads never consumed": self.loads, "eviction rests never sent": self.rests}


def evict(step: RankStep, position: int, action: Action) -> None:
    """EV: pack the micro-batch's stored activations and send the size header and part A."""
    comm, stage = step.ctx.comm, action.stage
    key, acceptor = _key_and_peer(action)
    if key not in step.state.inputs:
        raise RuntimeError(f"EV of stage {stage}, micro-batch {key[1]}: nothing is stored")
    pipeline = [step.state.inputs[key]]
    if not step.frees_outputs(stage):  # a deallocated output keeps only its autograd node
        pipeline.append(step.state.outputs[key])
    agreed = comm.eviction_sizes.get(stage, 0)
    buffer, record = step.store.evict(key, [t for t in pipeline if t is not None], min_bytes=agreed)
    nbytes = record.nbytes
    comm.eviction_sizes[stage] = nbytes
    rest = max(0, nbytes - agreed)
    step.part(Transfers).evicted_parts[key] = (agreed, rest)
    # torch.full, not torch.tensor([nbytes]): no host-to-device copy that syncs the stream.
    header = torch.full((1,), nbytes, dtype=torch.int64, device=comm.device)
    sends = step.window.sends
    sends.append(Send(Message("evict-size", *key), header, acceptor))
    if agreed:
        sends.append(Send(Message("evict", *key), buffer.narrow(0, 0, agreed), acceptor))
    step.part(Transfers).rests[key] = buffer.narrow(0, agreed, rest) if rest else None


def evict_rest(step: RankStep, position: int, action: Action) -> None:
    """EV's part B, a tick after the header: the payload's growth past the agreed size."""
    key, acceptor = _key_and_peer(action)
    rest = step.part(Transfers).rests.pop(key)
    if rest is not None:
        step.window.sends.append(Send(Message("evict-rest", *key), rest, acceptor))


def accept(step: RankStep, position: int, action: Action) -> None:
    """AC: post the header's receive and, at the size last agreed, part A's."""
    comm = step.ctx.comm
    key, evictor = _key_and_peer(action)
    agreed = comm.eviction_sizes.get(key[0], 0)
    header = torch.empty(1, dtype=torch.int64, device=comm.device)
    parts = (torch.empty(agreed, dtype=torch.uint8, device=comm.device),) if agreed else ()
    step.window.receives.append(Receive(Message("evict", *key), evictor, parts, header=header))


def accept_rest(step: RankStep, position: int, action: Action) -> None:
    """AC's part B: read the header (it came a tick ago) and receive what part A lacked."""
    comm = step.ctx.comm
    key, evictor = _key_and_peer(action)
    message = Message("evict", *key)
    nbytes, posted = comm.read_header(message, evictor)
    if nbytes > posted:
        rest = torch.empty(nbytes - posted, dtype=torch.uint8, device=comm.device)
        step.window.receives.append(Receive(message, evictor, (rest,), more=True))


def restore(step: RankStep, position: int, action: Action) -> None:
    """RS: send the partner's payload back, once it has arrived (two ticks after the EV)."""
    comm = step.ctx.comm
    key, evictor = _key_and_peer(action)
    parts = comm.wait_parts(Message("evict", *key), evictor)
    step.window.sends.extend(Send(Message("restore", *key), part, evictor) for part in parts)


def load(step: RankStep, position: int, action: Action) -> None:
    """LD: post the receive of an evicted payload coming back, as the parts it went out in."""
    transfers = step.part(Transfers)
    key, acceptor = _key_and_peer(action)
    agreed, rest = transfers.evicted_parts.pop(key)
    buffer = torch.empty(agreed + rest, dtype=torch.uint8, device=step.ctx.comm.device)
    transfers.loads[key] = (buffer, acceptor)
    parts = tuple(
        buffer.narrow(0, start, size) for start, size in ((0, agreed), (agreed, rest)) if size
    )
    step.window.receives.append(Receive(Message("restore", *key), acceptor, parts))


def _key_and_peer(action: Action) -> tuple[Key, int]:
    # Transfers carry a micro-batch and a peer (ir.Action checks both at construction).
    assert action.microbatch is not None and action.peer is not None
    return (action.stage, action.microbatch), action.peer


HANDLERS = Handlers(
    kinds={K.EVICT: evict, K.ACCEPT: accept, K.RESTORE: restore, K.LOAD: load},
    rests={K.EVICT: evict_rest, K.ACCEPT: accept_rest},
    part=Transfers,
    captures=frozenset({K.EVICT}),
)
