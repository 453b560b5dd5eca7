"""Point-to-point messages between pipeline ranks, posted as the NCCL-safe posting says.

Every message of a step goes through here. The executor posts the messages of one lock-step
tick (``megatron_bfpp.nccl``) as one ``batch_isend_irecv``, whose partners are in the peers'
batches of the same tick, so the batches never cross under NCCL's rules (one communicator and
stream per process group, a batch done only when all its ops are matched). A backend may return
one Work per op (gloo) or one for the whole batch (NCCL): a receive is waited for by the action
that consumes it, through its own Work where there is one and the batch's otherwise, and a
send's buffer is released only after its Work completes (gloo reads send buffers from a
background thread after ``isend`` returns).

BPipe's evictions carry a payload whose size only the evictor knows (whatever autograd saved),
so an eviction is two messages of one tick: an 8-byte *header* with the payload size in the
tick's batch, then the payload in a batch of its own that only the evictor and the acceptor post
right after it. The acceptor reads the header in between (``read_header``, which blocks: on a
GPU a CPU sync per eviction) and posts a receive of exactly that size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_bfpp.messages import Message

__all__ = ["PendingSend", "PipeComm", "Receive", "Send", "pseudo_free"]


@dataclass(frozen=True)
class Send:
    message: Message
    tensor: torch.Tensor
    peer: int  # pipeline rank
    release: torch.Tensor | None = None  # output to pseudo-free once the send has completed


@dataclass(frozen=True)
class Receive:
    message: Message
    peer: int
    buffers: tuple[torch.Tensor, ...]  # the message's parts, posted in order (may be none)
    header: torch.Tensor | None = None  # an eviction's size header, posted before the parts
    more: bool = False  # more parts of a message already posted (an eviction's payload)


@dataclass
class PendingSend:
    work: dist.Work
    tensor: torch.Tensor
    message: Message
    release: torch.Tensor | None = None


@dataclass
class _Header:
    work: dist.Work
    size: torch.Tensor  # int64[1]


@dataclass
class PipeComm:
    """Messages of one rank in one step: posted receives and sends still in flight."""

    group: dist.ProcessGroup
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    receives: dict[Message, list[tuple[dist.Work, torch.Tensor]]] = field(default_factory=dict)
    sends: list[PendingSend] = field(default_factory=list)
    headers: dict[Message, _Header] = field(default_factory=dict)

    def global_rank(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank)

    def new_buffer(self, requires_grad: bool) -> torch.Tensor:
        """A receive buffer for one activation or gradient message."""
        return torch.empty(
            self.shape, dtype=self.dtype, device=self.device, requires_grad=requires_grad
        )

    # --- posting ----------------------------------------------------------------------------
    def post(self, sends: Sequence[Send], receives: Sequence[Receive]) -> None:
        """One batch: receives, then sends, each in the posting's canonical order."""
        ops: list[dist.P2POp] = []
        for receive in receives:
            source = self.global_rank(receive.peer)
            header = () if receive.header is None else (receive.header,)
            for buffer in (*header, *receive.buffers):
                ops.append(dist.P2POp(dist.irecv, buffer, source, self.group))
        received = len(ops)
        for send in sends:
            if send.message.what in ("act", "grad") and tuple(send.tensor.shape) != self.shape:
                raise RuntimeError(
                    f"pipeline message {send.message} has shape {tuple(send.tensor.shape)} but "
                    f"the receiver expects {self.shape} (seq_length / micro_batch_size / "
                    "hidden_size or sequence parallelism do not match the model)"
                )
            payload = send.tensor.detach().contiguous()
            ops.append(dist.P2POp(dist.isend, payload, self.global_rank(send.peer), self.group))
        if not ops:
            return
        try:
            batch_works = dist.batch_isend_irecv(ops)
        except RuntimeError as error:
            peers = sorted({r.peer for r in receives} | {s.peer for s in sends})
            who = " or rank ".join(map(str, peers))
            raise RuntimeError(
                f"pipeline rank {self.group.rank()}: posting messages to or from pipeline "
                f"rank(s) {peers} failed: {error}. Rank {who} has probably failed or been "
                "killed: look at its log first"
            ) from error
        works = iter(_works_per_op(batch_works, len(ops)))
        for receive in receives:
            if receive.more:
                parts = self.receives[receive.message]
            elif receive.message in self.receives:
                raise RuntimeError(f"receive of {receive.message} posted twice in one step")
            else:
                parts = self.receives[receive.message] = []
            if receive.header is not None:
                self.headers[receive.message] = _Header(next(works), receive.header)
            parts.extend((next(works), buffer) for buffer in receive.buffers)
        for send, op in zip(sends, ops[received:], strict=True):
            self.sends.append(PendingSend(next(works), op.tensor, send.message, send.release))

    def read_header(self, message: Message, peer: int) -> int:
        """An eviction's payload size, once its header is in (blocking)."""
        header = self.headers.pop(message)
        self._wait(header.work, message, peer)
        return int(header.size.item())

    # --- consuming --------------------------------------------------------------------------
    def wait_receive(self, message: Message, peer: int) -> torch.Tensor:
        """The one tensor of an activation or gradient message, once it has arrived."""
        (buffer,) = self.wait_parts(message, peer)
        return buffer

    def wait_parts(self, message: Message, peer: int) -> list[torch.Tensor]:
        """Every part of a message, once all have arrived."""
        try:
            parts = self.receives.pop(message)
        except KeyError:
            raise RuntimeError(
                f"{message} is consumed but its receive was never posted; the schedule and the "
                "executor disagree (this is a bug in megatron_bfpp, please report it)"
            ) from None
        for work, _ in parts:
            self._wait(work, message, peer)
        return [buffer for _, buffer in parts]

    def _wait(self, work: dist.Work, message: Message, peer: int) -> None:
        try:
            work.wait()
        except RuntimeError as error:
            me = self.group.rank()
            raise RuntimeError(
                f"pipeline rank {me}: receiving {_describe(message)} from pipeline rank {peer} "
                f"(global rank {self.global_rank(peer)}) failed: {error}. Rank {peer} has "
                "probably failed or been killed: look at its log first"
            ) from error

    def reap(self, *, wait: bool = False) -> None:
        """Release the buffers of completed sends (all of them, waiting, when ``wait``)."""
        still: list[PendingSend] = []
        for pending in self.sends:
            if wait:
                pending.work.wait()
            elif not pending.work.is_completed():
                still.append(pending)
                continue
            if pending.release is not None:
                pseudo_free(pending.release)
        self.sends = still

    def settle_transfers(self) -> None:
        """Wait for the eviction and restore payloads sent so far, whose receives the partner
        posted in the same tick. Called after the compute that follows them on
        backends whose sends cannot be polled (gloo reports a send complete only once waited
        for); the NCCL model (``megatron_bfpp.nccl``) includes this wait in what it proves."""
        still: list[PendingSend] = []
        for pending in self.sends:
            if pending.message.what in _TRANSFERS:
                pending.work.wait()
            else:
                still.append(pending)
        self.sends = still

    @property
    def sends_pollable(self) -> bool:
        return dist.get_backend(self.group) != "gloo"

    def finish_send_of(self, message: Message) -> None:
        """Wait for one message's send (its output must be freed before a custom backward)."""
        for pending in [p for p in self.sends if p.message == message]:
            pending.work.wait()
            if pending.release is not None:
                pseudo_free(pending.release)
            self.sends.remove(pending)

    def transfer_tensors(self) -> list[torch.Tensor]:
        """Eviction payloads this rank holds in communication: posted receive buffers and sends
        in flight (what the memory accounting adds to the store)."""
        held = [p.tensor for p in self.sends if p.message.what in _TRANSFERS]
        for message, parts in self.receives.items():
            if message.what in _TRANSFERS:
                held.extend(buffer for _, buffer in parts)
        return held


_TRANSFERS = frozenset({"evict", "evict-size", "restore"})


def _works_per_op(posted: Sequence[dist.Work] | None, num_ops: int) -> list[dist.Work]:
    """One Work per op: gloo gives one per op, a coalescing backend (NCCL) one for the batch,
    which then stands for each of its ops (waiting for one waits for all)."""
    works = list(posted or ())
    if len(works) == num_ops:
        return works
    if len(works) == 1:
        return works * num_ops
    raise RuntimeError(
        f"batch_isend_irecv returned {len(works)} works for {num_ops} ops; expected one per op "
        "or one for the batch (is the process group's backend supported?)"
    )


def _describe(message: Message) -> str:
    what = {
        "act": "the activation",
        "grad": "the gradient",
        "evict": "the evicted activations",
        "restore": "the returned activations",
    }.get(message.what, message.what)
    return f"{what} of stage {message.stage}, micro-batch {message.microbatch}"


def pseudo_free(tensor: torch.Tensor) -> None:
    """megatron-core's deallocate_output_tensor: keep the autograd node, drop the storage."""
    tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)
