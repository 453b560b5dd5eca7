"""BPipe's transfers on the runtime: a micro-batch's stored activations go to the partner rank
and come back before its backward; each payload travels in a batch of its own right after its
size's (the *rest* handlers), on the partners' own group (``p2p.pair_group``)."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_bfpp.ir import Action, ActionKind
from megatron_bfpp.messages import Message, What
from megatron_bfpp.runtime.p2p import Receive, Send
from megatron_bfpp.runtime.step import Handlers, Key, RankStep, StepPart, key_and_peer

__all__ = ["HANDLERS", "Transfers"]

K = ActionKind


@dataclass
class Transfers(StepPart):
    """The evictor's side of BPipe in one step: how each payload went out, the loads posted."""

    # Bytes of each evicted payload, until its LD posts the receive.
    evicted_bytes: dict[Key, int] = field(default_factory=dict)
    # Each eviction's payload, from its EV until the payload batch right after sends it.
    payloads: dict[Key, torch.Tensor] = field(default_factory=dict)
    # Buffer and acceptor of each posted LD, until the micro-batch's backward brings it back.
    loads: dict[Key, tuple[torch.Tensor, int]] = field(default_factory=dict)

    def before_backward(self, step: RankStep, key: Key) -> None:
        """Wait for an evicted micro-batch's payload and rebuild its tensors from it."""
        if key not in self.loads:
            return
        buffer, acceptor = self.loads.pop(key)
        step.ctx.comm.wait_parts(Message(What.RESTORE, *key), acceptor)
        step.store.restore(key, buffer)

    def held_tensors(self, step: RankStep) -> Iterable[torch.Tensor]:
        return [buffer for buffer, _ in self.loads.values()]

    def held_microbatches(self, step: RankStep) -> Iterable[Key]:
        """Own micro-batches on their way back, and the partner's payloads held or in flight."""
        comm = step.ctx.comm
        received = [m for m in comm.receives if m.what == What.EVICT]
        sent = [p.message for p in comm.sends if p.message.what in (What.EVICT, What.RESTORE)]
        return {*self.loads, *((m.stage, m.microbatch) for m in (*received, *sent))}

    def leftovers(self) -> dict[str, Collection[Any]]:
        return {"loads never consumed": self.loads, "payloads never sent": self.payloads}


def evict(step: RankStep, position: int, action: Action) -> None:
    """EV: pack the micro-batch's stored activations and send their size."""
    comm, stage = step.ctx.comm, action.stage
    key, acceptor = key_and_peer(action)
    if key not in step.state.inputs:
        raise RuntimeError(f"EV of stage {stage}, micro-batch {key[1]}: nothing is stored")
    pipeline = [step.state.inputs[key]]
    if not step.frees_outputs(stage):  # a deallocated output keeps only its autograd node
        pipeline.append(step.state.outputs[key])
    buffer, record = step.store.evict(key, [t for t in pipeline if t is not None])
    transfers = step.part(Transfers)
    transfers.evicted_bytes[key] = record.nbytes
    transfers.payloads[key] = buffer
    # torch.full, not torch.tensor([nbytes]): no host-to-device copy that syncs the stream.
    header = torch.full((1,), record.nbytes, dtype=torch.int64, device=comm.device)
    step.window.sends.append(Send(Message(What.EVICT_SIZE, *key), header, acceptor))


def evict_rest(step: RankStep, position: int, action: Action) -> None:
    """EV's payload, in the batch right after its size's."""
    key, acceptor = key_and_peer(action)
    payload = step.part(Transfers).payloads.pop(key)
    step.window.sends.append(Send(Message(What.EVICT, *key), payload, acceptor))


def accept(step: RankStep, position: int, action: Action) -> None:
    """AC: post the receive of an eviction's size."""
    key, evictor = key_and_peer(action)
    header = torch.empty(1, dtype=torch.int64, device=step.ctx.comm.device)
    step.window.receives.append(Receive(Message(What.EVICT, *key), evictor, (), header=header))


def accept_rest(step: RankStep, position: int, action: Action) -> None:
    """AC's payload: read the size (it came in the batch before) and receive that many bytes."""
    comm = step.ctx.comm
    key, evictor = key_and_peer(action)
    message = Message(What.EVICT, *key)
    payload = torch.empty(comm.read_header(message, evictor), dtype=torch.uint8, device=comm.device)
    step.window.receives.append(Receive(message, evictor, (payload,), more=True))


def restore(step: RankStep, position: int, action: Action) -> None:
    """RS: send the partner's payload back, once it has arrived (a tick after the EV or later)."""
    key, evictor = key_and_peer(action)
    parts = step.ctx.comm.wait_parts(Message(What.EVICT, *key), evictor)
    step.window.sends.extend(Send(Message(What.RESTORE, *key), part, evictor) for part in parts)


def load(step: RankStep, position: int, action: Action) -> None:
    """LD: post the receive of an evicted payload coming back."""
    transfers = step.part(Transfers)
    key, acceptor = key_and_peer(action)
    buffer = torch.empty(
        transfers.evicted_bytes.pop(key), dtype=torch.uint8, device=step.ctx.comm.device
    )
    transfers.loads[key] = (buffer, acceptor)
    step.window.receives.append(Receive(Message(What.RESTORE, *key), acceptor, (buffer,)))


HANDLERS = Handlers(
    kinds={K.EVICT: evict, K.ACCEPT: accept, K.RESTORE: restore, K.LOAD: load},
    rests={K.EVICT: evict_rest, K.ACCEPT: accept_rest},
    part=Transfers,
    captures=frozenset({K.EVICT}),
)
