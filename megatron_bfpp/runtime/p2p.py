"""Point-to-point messages between pipeline ranks, posted as the NCCL-safe posting says.

One lock-step tick's messages (``megatron_bfpp.nccl``) are one ``batch_isend_irecv``. gloo returns
one Work per op, NCCL one per batch; a send's buffer is released only after its Work completes
(gloo reads send buffers from a background thread). A BPipe eviction is an 8-byte size *header*
in the tick's batch, then the payload in a batch of its own on the partners' group
(:func:`pair_group`: on NCCL another stream, so transfers do not hold the tick batches). Every wait
is bounded by the group's timeout; on NCCL by polling ``is_completed()`` until the timeout less
:data:`_NCCL_LEAD`, before the watchdog aborts naming no peer (docs/train.md)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_bfpp.messages import Message, What

__all__ = [
    "PendingSend",
    "PipeComm",
    "PipelineTimeout",
    "Receive",
    "Send",
    "pair_group",
    "pseudo_free",
]

_NCCL_LEAD = 0.05  # of the group's timeout: our deadline comes this much before NCCL's watchdog
_POLL_MAX_S = 0.01  # longest sleep between two is_completed() polls


class PipelineTimeout(RuntimeError):
    """A message not in within the process group's timeout; the message is one line."""


def _group_timeout_s(group: dist.ProcessGroup, device: torch.device) -> float:
    """The group's timeout in seconds (``--distributed-timeout-minutes``), else torch's default."""
    try:
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        from torch.distributed import distributed_c10d as c10d

        timeout = c10d._get_default_timeout(dist.get_backend(group))
    seconds = float(timeout.total_seconds())
    return seconds if seconds > 0 else 1800.0


# pipeline group id -> (the group, compared lest a reused id() match; its BPipe pair group or None)
_PAIR_GROUPS: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup | None]] = {}


def pair_group(group: dist.ProcessGroup, device: torch.device) -> dist.ProcessGroup | None:
    """The process group of this rank and its BPipe partner (pipeline ranks x and p-1-x) alone,
    with the pipeline group's backend and timeout; None on the middle rank of an odd pipeline.
    Collective over the whole job, once per pipeline group: every rank makes every pair's group
    in one order, as ``new_group`` requires (``use_local_synchronization`` would name groups by
    how many each member has, which differs between pipeline ranks)."""
    kept = _PAIR_GROUPS.get(id(group))
    if kept is not None and kept[0] is group:
        return kept[1]
    size, me = group.size(), dist.get_rank()
    mine = torch.tensor(
        [dist.get_global_rank(group, r) for r in range(size)], dtype=torch.int64, device=device
    )
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    timeout = timedelta(seconds=_group_timeout_s(group, device))
    own: dist.ProcessGroup | None = None
    own_peer = -1  # the partner's global rank
    for ranks in sorted({tuple(int(r) for r in t.tolist()) for t in gathered}):
        for x in range(size // 2):
            pair = [ranks[x], ranks[size - 1 - x]]
            made: object = dist.new_group(pair, timeout=timeout, backend=dist.get_backend(group))
            if me in pair:
                if not isinstance(made, dist.ProcessGroup):  # torch's non-member marker
                    raise RuntimeError(f"could not make the process group of global ranks {pair}")
                own, own_peer = made, pair[0] + pair[1] - me
    if own is not None:
        # One element each way while both ranks are known to be here: NCCL sets up a communicator
        # at its first op, so a partner failing later fails a bounded, named payload wait instead.
        ops = [
            (dist.isend, torch.zeros(1, device=device)),
            (dist.irecv, torch.empty(1, device=device)),
        ]
        works = dist.batch_isend_irecv([dist.P2POp(op, t, own_peer, own) for op, t in ops])
        for work in works or ():
            work.wait()
    _PAIR_GROUPS[id(group)] = (group, own)
    return own


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
    peer: int = -1  # pipeline rank
    posted_at: float = 0.0  # time.monotonic() when posted


@dataclass
class PipeComm:
    """Messages of one rank in one step: posted receives and sends still in flight."""

    group: dist.ProcessGroup
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    receives: dict[Message, list[tuple[dist.Work, torch.Tensor]]] = field(default_factory=dict)
    sends: list[PendingSend] = field(default_factory=list)
    # an eviction's size header: its Work, the int64[1] size, when it was posted
    headers: dict[Message, tuple[dist.Work, torch.Tensor, float]] = field(default_factory=dict)
    timeout_s: float | None = None  # None: the group's (_group_timeout_s)
    side_group: dist.ProcessGroup | None = None  # BPipe's partner pair (pair_group)
    posted_at: dict[Message, float] = field(default_factory=dict)  # receives' posting times
    sends_pollable: bool = field(init=False, default=False)  # not gloo: poll is_completed()

    def __post_init__(self) -> None:
        if self.timeout_s is None:
            self.timeout_s = _group_timeout_s(self.group, self.device)
        self.sends_pollable = dist.get_backend(self.group) != "gloo"

    def global_rank(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank)

    def new_buffer(self, requires_grad: bool) -> torch.Tensor:
        """A receive buffer for one activation or gradient message."""
        return torch.empty(
            self.shape, dtype=self.dtype, device=self.device, requires_grad=requires_grad
        )

    def post(
        self, sends: Sequence[Send], receives: Sequence[Receive], *, side: bool = False
    ) -> None:
        """One batch: receives, then sends, each in the posting's canonical order; ``side``: on
        the partner pair's group (BPipe's payloads), which ``side_group`` must hold by then."""
        group = self.side_group if side else self.group
        if group is None:
            raise RuntimeError(
                "a BPipe payload batch is posted before its pair's process group was made "
                "(this is a bug in megatron_bfpp, please report it)"
            )
        ops: list[dist.P2POp] = []
        for receive in receives:
            source = self.global_rank(receive.peer)
            header = () if receive.header is None else (receive.header,)
            for buffer in (*header, *receive.buffers):
                ops.append(dist.P2POp(dist.irecv, buffer, source, group))
        received = len(ops)
        for send in sends:
            if send.message.what in _PIPELINE and tuple(send.tensor.shape) != self.shape:
                raise RuntimeError(
                    f"pipeline message {send.message} has shape {tuple(send.tensor.shape)} but "
                    f"the receiver expects {self.shape} (seq_length / micro_batch_size / "
                    "hidden_size or sequence parallelism do not match the model)"
                )
            payload = send.tensor.detach().contiguous()
            ops.append(dist.P2POp(dist.isend, payload, self.global_rank(send.peer), group))
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
        posted = list(batch_works or ())
        if len(posted) == 1:  # NCCL's one Work for the batch: one wait waits for all
            posted *= len(ops)
        if len(posted) != len(ops):
            raise RuntimeError(
                f"batch_isend_irecv returned {len(posted)} works for {len(ops)} ops; expected one "
                "per op or one for the batch (is the process group's backend supported?)"
            )
        works = iter(posted)
        now = time.monotonic()
        for receive in receives:
            if receive.more:
                parts = self.receives[receive.message]
            elif receive.message in self.receives:
                raise RuntimeError(f"receive of {receive.message} posted twice in one step")
            else:
                parts = self.receives[receive.message] = []
                self.posted_at[receive.message] = now
            if receive.header is not None:
                self.headers[receive.message] = (next(works), receive.header, now)
            parts.extend((next(works), buffer) for buffer in receive.buffers)
        for send, op in zip(sends, ops[received:], strict=True):
            self.sends.append(
                PendingSend(next(works), op.tensor, send.message, send.release, send.peer, now)
            )

    def read_header(self, message: Message, peer: int) -> int:
        """An eviction's payload size, once its header is in (blocking)."""
        work, size, posted_at = self.headers.pop(message)
        self._wait(work, message, peer, posted_at)
        return int(size.item())

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
        posted_at = self.posted_at.pop(message, time.monotonic())
        for work, _ in parts:
            self._wait(work, message, peer, posted_at)
        return [buffer for _, buffer in parts]

    def _wait(
        self, work: dist.Work, message: Message, peer: int, posted_at: float, *, send: bool = False
    ) -> None:
        """Wait for ``work`` until the group's timeout after ``posted_at`` (module docstring)."""
        assert self.timeout_s is not None  # set by __post_init__
        try:
            if self.sends_pollable:
                limit = self.timeout_s * (1.0 - _NCCL_LEAD)
                if not _poll(work, posted_at + limit):
                    raise self._late(message, peer, send, limit, ", less its NCCL lead")
                work.wait()  # the stream order (completed: does not block)
                return
            work.wait(timedelta(seconds=max(posted_at + self.timeout_s - time.monotonic(), 0.001)))
        except PipelineTimeout:
            raise
        except RuntimeError as error:
            # gloo's words for it vary by op; the clock does not
            if time.monotonic() >= posted_at + self.timeout_s - 0.01:
                raise self._late(message, peer, send, self.timeout_s) from error
            raise RuntimeError(
                f"{self._who(message, peer, send)} failed: {error}. Rank {peer} has "
                "probably failed or been killed: look at its log first"
            ) from error

    def _who(self, message: Message, peer: int, send: bool) -> str:
        """The start of a failed wait's one line: this rank, the message, its peer."""
        verb, way = ("sending", "to") if send else ("receiving", "from")
        what = _DESCRIPTIONS.get(message.what, message.what)
        return (
            f"pipeline rank {self.group.rank()}: {verb} {what} of stage {message.stage}, "
            f"micro-batch {message.microbatch} {way} pipeline rank {peer} (global rank "
            f"{self.global_rank(peer)})"
        )

    def _late(
        self, message: Message, peer: int, send: bool, seconds: float, lead: str = ""
    ) -> PipelineTimeout:
        return PipelineTimeout(
            f"{self._who(message, peer, send)} did not complete in {seconds:.0f} s (the process "
            f"group's timeout, --distributed-timeout-minutes{lead}): rank {peer} is stopped, "
            "hung or far slower; look at it first"
        )

    def _finish_sends(self, done: Callable[[PendingSend], bool], *, wait: bool = True) -> None:
        """Drop the sends ``done`` picks in order (waiting if ``wait``), releasing their outputs."""
        still: list[PendingSend] = []
        for pending in self.sends:
            if not done(pending):
                still.append(pending)
                continue
            if wait:
                self._wait(
                    pending.work, pending.message, pending.peer, pending.posted_at, send=True
                )
            if pending.release is not None:
                pseudo_free(pending.release)
        self.sends = still

    def reap(self, *, wait: bool = False) -> None:
        """Release the buffers of completed sends (all of them, waiting, when ``wait``)."""
        self._finish_sends(lambda pending: wait or pending.work.is_completed(), wait=wait)

    def settle_transfers(self) -> None:
        """Wait for the payloads sent so far (receives posted in the same tick), after the compute
        following them: gloo sends cannot be polled; the NCCL model (``nccl``) has this wait."""
        self._finish_sends(lambda pending: pending.message.what in _TRANSFERS)

    def finish_send_of(self, message: Message) -> None:
        """Wait for one message's send (its output must be freed before a custom backward)."""
        self._finish_sends(lambda pending: pending.message == message)

    def transfer_tensors(self) -> list[torch.Tensor]:
        """Eviction payloads in communication (posted receives, sends in flight), for memory."""
        held = [p.tensor for p in self.sends if p.message.what in _TRANSFERS]
        for message, parts in self.receives.items():
            if message.what in _TRANSFERS:
                held.extend(buffer for _, buffer in parts)
        return held


_PIPELINE = frozenset({What.ACT, What.GRAD})  # one tensor of the pipeline's message shape
_TRANSFERS = frozenset({What.EVICT, What.EVICT_SIZE, What.RESTORE})  # BPipe's, of any size


def _poll(work: dist.Work, deadline: float) -> bool:
    """Poll ``work.is_completed()`` until it is or ``time.monotonic()`` passes ``deadline``;
    sleeps grow from nothing to :data:`_POLL_MAX_S`, so a message already in costs one poll."""
    pause = 0.0
    while not work.is_completed():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(_POLL_MAX_S, pause * 2 or 1e-5)
    return True


_DESCRIPTIONS = {
    What.ACT: "the activation",
    What.GRAD: "the gradient",
    What.EVICT: "the evicted activations",
    What.RESTORE: "the returned activations",
    What.EVICT_SIZE: "the size of the evicted activations",
}


def pseudo_free(tensor: torch.Tensor) -> None:
    """megatron-core's deallocate_output_tensor: keep the autograd node, drop the storage."""
    tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)
