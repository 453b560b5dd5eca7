"""Point-to-point messages between pipeline ranks, posted in the order the schedule proved.

Every message of a step goes through here. The communication actions between two consecutive
compute actions form one *window*, posted together with ``batch_isend_irecv`` as soon as the
earlier compute finishes: on NCCL that groups a send with the receive next to it (what
megatron-core's ``send_forward_recv_backward`` does), so neither blocks the other on the pair's
stream; on gloo it simply posts each one. A receive is waited for only by the action that
consumes it, and a send's buffer is released only after its work completes: gloo reads send
buffers from a background thread after ``isend`` returns.

BPipe's evictions carry a payload whose size only the evictor knows (whatever autograd saved), so
an eviction is up to three messages: an 8-byte *header* with the payload size, *part A* of the size
both sides last agreed for that stage (pre-posted by the acceptor, so the transfer starts as soon as
the evictor sends; padded when the payload shrank), and *part B*, the rest when it grew (the
acceptor posts it once the header has arrived). Every channel stays FIFO: before the acceptor posts
any later receive from the evictor it resolves the earlier headers (blocking if it must), which the
validator models by letting an AC wait for its evict. The agreed sizes live across steps
(``eviction_sizes``), so from the second eviction of a stage on, part B never exists.
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
    read_header: bool = False  # wait for the header right away and post the whole payload


@dataclass
class PendingSend:
    work: dist.Work
    tensor: torch.Tensor
    message: Message
    release: torch.Tensor | None = None


@dataclass
class _Header:
    message: Message  # the eviction payload it announces
    peer: int
    work: dist.Work
    size: torch.Tensor  # int64[1]
    posted: int  # bytes already pre-posted (part A)


@dataclass
class PipeComm:
    """Messages of one rank in one step: posted receives and sends still in flight."""

    group: dist.ProcessGroup
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    # Eviction payload bytes last agreed per evictor stage; shared by the steps of one run.
    eviction_sizes: dict[int, int] = field(default_factory=dict)
    receives: dict[Message, list[tuple[dist.Work, torch.Tensor]]] = field(default_factory=dict)
    sends: list[PendingSend] = field(default_factory=list)
    headers: list[_Header] = field(default_factory=list)

    def global_rank(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank)

    def new_buffer(self, requires_grad: bool) -> torch.Tensor:
        """A receive buffer for one activation or gradient message."""
        return torch.empty(
            self.shape, dtype=self.dtype, device=self.device, requires_grad=requires_grad
        )

    # --- posting ----------------------------------------------------------------------------
    def post(self, sends: Sequence[Send], receives: Sequence[Receive]) -> None:
        """One window, receives and sends each in program order. A receive from a peer whose
        eviction header is still unresolved (announced earlier in this window) starts a new
        batch after the header is resolved; the window's sends go with the first batch."""
        segments: list[list[Receive]] = [[]]
        announced: set[int] = set()
        for receive in receives:
            if receive.peer in announced:
                segments.append([])
                announced = set()
            segments[-1].append(receive)
            if receive.header is not None:
                announced.add(receive.peer)
        for index, segment in enumerate(segments):
            for peer in dict.fromkeys(r.peer for r in segment):
                self.resolve_headers(peer, block=True)
            self._post_batch(segment, sends if index == 0 else ())
            for peer in dict.fromkeys(r.peer for r in segment if r.read_header):
                self.resolve_headers(peer, block=True)

    def _post_batch(self, receives: Sequence[Receive], sends: Sequence[Send]) -> None:
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
        # Receives before sends: a pair exchanging both ways matches them in order.
        if not ops:
            return
        works = iter(dist.batch_isend_irecv(ops))
        for receive in receives:
            if receive.message in self.receives:
                raise RuntimeError(f"receive of {receive.message} posted twice in one step")
            parts = self.receives[receive.message] = []
            if receive.header is not None:
                posted = sum(buffer.numel() for buffer in receive.buffers)
                self.headers.append(
                    _Header(receive.message, receive.peer, next(works), receive.header, posted)
                )
            parts.extend((next(works), buffer) for buffer in receive.buffers)
        for send, op in zip(sends, ops[received:], strict=True):
            self.sends.append(PendingSend(next(works), op.tensor, send.message, send.release))

    def resolve_headers(self, peer: int, *, block: bool) -> None:
        """Read the eviction headers from ``peer`` in arrival order and post any part B; without
        ``block`` stop at the first header that has not arrived."""
        for header in [h for h in self.headers if h.peer == peer]:
            if not block and not header.work.is_completed():
                return
            self._wait(header.work, header.message, peer)
            self.headers.remove(header)
            nbytes = int(header.size.item())
            self.eviction_sizes[header.message.stage] = nbytes
            if nbytes > header.posted:
                rest = torch.empty(nbytes - header.posted, dtype=torch.uint8, device=self.device)
                op = dist.P2POp(dist.irecv, rest, self.global_rank(peer), self.group)
                (work,) = dist.batch_isend_irecv([op])
                self.receives[header.message].append((work, rest))

    # --- consuming --------------------------------------------------------------------------
    def wait_receive(self, message: Message, peer: int) -> torch.Tensor:
        """The one tensor of an activation or gradient message, once it has arrived."""
        (buffer,) = self.wait_parts(message, peer)
        return buffer

    def wait_parts(self, message: Message, peer: int) -> list[torch.Tensor]:
        """Every part of a message, once all have arrived (an eviction's header first)."""
        if any(h.message == message for h in self.headers):
            self.resolve_headers(peer, block=True)
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
        """Release the buffers of completed sends (all of them, waiting, when ``wait``), and
        post the part B of any eviction whose header has arrived."""
        for peer in dict.fromkeys(h.peer for h in self.headers):
            self.resolve_headers(peer, block=wait)
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
        posted at its AC / LD (not a grown eviction's rest, posted later). Called after the
        compute that follows them on backends whose sends cannot be polled (gloo reports a send
        complete only once waited for); the validator proves the partner gets there."""
        still: list[PendingSend] = []
        for pending in self.sends:
            if pending.message.what in _SETTLED:
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


_SETTLED = frozenset({"evict", "evict-size", "restore"})
_TRANSFERS = _SETTLED | {"evict-rest"}


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
