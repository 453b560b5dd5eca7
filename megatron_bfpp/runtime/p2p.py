"""Point-to-point messages between pipeline ranks, posted in the order the schedule proved.

Every message of a step goes through here. The communication actions between two consecutive
compute actions form one *window*, posted together with ``batch_isend_irecv`` as soon as the
earlier compute finishes: on NCCL that groups a send with the receive next to it (what
megatron-core's ``send_forward_recv_backward`` does), so neither blocks the other on the pair's
stream; on gloo it simply posts each one. A receive is waited for only by the action that
consumes it, and a send's buffer is released only after its work completes: gloo reads send
buffers from a background thread after ``isend`` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_bfpp.validate import Message

__all__ = ["PendingSend", "PipeComm"]


@dataclass
class PendingSend:
    work: dist.Work
    tensor: torch.Tensor
    message: Message
    release: torch.Tensor | None = None  # output to pseudo-free once the send has completed


@dataclass
class PipeComm:
    """Messages of one rank in one step: posted receives and sends still in flight."""

    group: dist.ProcessGroup
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    receives: dict[Message, tuple[dist.Work, torch.Tensor]] = field(default_factory=dict)
    sends: list[PendingSend] = field(default_factory=list)

    def global_rank(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank)

    def post(
        self,
        sends: Sequence[tuple[Message, torch.Tensor, int, torch.Tensor | None]],
        receives: Sequence[tuple[Message, int, bool]],
    ) -> None:
        """One window: ``sends`` are (message, tensor, peer, release), ``receives`` are
        (message, peer, requires_grad); both in program order."""
        ops: list[dist.P2POp] = []
        buffers: list[tuple[Message, torch.Tensor]] = []
        for message, peer, requires_grad in receives:
            if message in self.receives:
                raise RuntimeError(f"receive of {message} posted twice in one step")
            buffer = torch.empty(
                self.shape, dtype=self.dtype, device=self.device, requires_grad=requires_grad
            )
            ops.append(dist.P2POp(dist.irecv, buffer, self.global_rank(peer), self.group))
            buffers.append((message, buffer))
        send_ops = []
        for message, tensor, peer, _ in sends:
            if tuple(tensor.shape) != self.shape:
                raise RuntimeError(
                    f"pipeline message {message} has shape {tuple(tensor.shape)} but the "
                    f"receiver expects {self.shape} (seq_length / micro_batch_size / "
                    "hidden_size or sequence parallelism do not match the model)"
                )
            payload = tensor.detach().contiguous()
            send_ops.append(dist.P2POp(dist.isend, payload, self.global_rank(peer), self.group))
        # Receives and sends keep program order within each kind; a window's receives are
        # posted before its sends so that a pair exchanging both ways matches them in order.
        ops = ops + send_ops
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        for (message, buffer), work in zip(buffers, works[: len(buffers)], strict=True):
            self.receives[message] = (work, buffer)
        for (message, _, _, release), op, work in zip(
            sends, send_ops, works[len(buffers) :], strict=True
        ):
            self.sends.append(PendingSend(work, op.tensor, message, release))

    def wait_receive(self, message: Message) -> torch.Tensor:
        try:
            work, buffer = self.receives.pop(message)
        except KeyError:
            raise RuntimeError(
                f"{message} is consumed but its receive was never posted; the schedule and the "
                "executor disagree (this is a bug in megatron_bfpp, please report it)"
            ) from None
        work.wait()
        return buffer

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
                _pseudo_free(pending.release)
        self.sends = still

    def finish_send_of(self, message: Message) -> None:
        """Wait for one message's send (its output must be freed before a custom backward)."""
        for pending in [p for p in self.sends if p.message == message]:
            pending.work.wait()
            if pending.release is not None:
                _pseudo_free(pending.release)
            self.sends.remove(pending)


def _pseudo_free(tensor: torch.Tensor) -> None:
    """megatron-core's deallocate_output_tensor: keep the autograd node, drop the storage."""
    tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)
