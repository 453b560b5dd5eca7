"""BPipe's transfers on the runtime: a micro-batch's stored activations go to the partner rank
and come back before its backward.

The evictor's EV packs a micro-batch's stored activations (see runtime.activations) into one
buffer and sends it to the acceptor; the acceptor's AC pre-posts the receive, its RS sends the
payload back (waiting for it first, at its place in program order) and the evictor's LD posts
the receive that the micro-batch's backward waits for before rebuilding its tensors. The payload
travels as an 8-byte size header, part A of the size both ends last agreed for the stage and
part B, the rest when it grew (see runtime.p2p for how the acceptor reads the header).

This module registers those four kinds in the executor's dispatch table together with its
per-step part, :class:`Transfers`; the core knows BPipe only through that part's answers.
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
        return {"loads never consumed": self.loads}


def evict(step: RankStep, position: int, action: Action) -> None:
    """EV: pack and send the micro-batch's stored activations: size header, part A, part B."""
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
    header = torch.tensor([nbytes], dtype=torch.int64, device=comm.device)
    sends = step.window.sends
    sends.append(Send(Message("evict-size", *key), header, acceptor))
    if agreed:
        sends.append(Send(Message("evict", *key), buffer.narrow(0, 0, agreed), acceptor))
    if rest:
        # With no agreed size the acceptor reads the header at once and posts it all; a grown
        # payload's rest is posted when the acceptor next reads headers.
        what = "evict-rest" if agreed else "evict"
        sends.append(Send(Message(what, *key), buffer.narrow(0, agreed, rest), acceptor))


def accept(step: RankStep, position: int, action: Action) -> None:
    """AC: pre-post the header and, at the size last agreed, part A of an eviction."""
    comm = step.ctx.comm
    key, evictor = _key_and_peer(action)
    agreed = comm.eviction_sizes.get(key[0], 0)
    header = torch.empty(1, dtype=torch.int64, device=comm.device)
    parts = (torch.empty(agreed, dtype=torch.uint8, device=comm.device),) if agreed else ()
    # The first eviction of a stage in a run has no agreed size: read its header now.
    step.window.receives.append(
        Receive(Message("evict", *key), evictor, parts, header=header, read_header=not agreed)
    )


def restore(step: RankStep, position: int, action: Action) -> None:
    """RS: send the partner's payload back, once it has arrived (posting what precedes it)."""
    comm = step.ctx.comm
    key, evictor = _key_and_peer(action)
    step.window.post(comm)
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
    part=Transfers,
    captures=frozenset({K.EVICT}),
)
