"""NCCL's point-to-point rules on gloo groups, so that a CPU test fails where NCCL would; the rules,
numbered as the comments cite them: docs/design-notes.md, "Testing NCCL's rules on CPU"."""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from queue import SimpleQueue
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch.distributed import distributed_c10d as c10d

__all__ = [
    "ENV",
    "TRANSFER_ENV",
    "BatchTiming",
    "SendTiming",
    "batch_timing",
    "batches_posted",
    "blocked_seconds",
    "install",
    "installed",
    "uninstall",
]

ENV = "BFPP_NCCL_EMULATION"  # "1": the tests install the emulation in every rank
_STALL_ENV = "BFPP_NCCL_EMULATION_STALL_S"
TRANSFER_ENV = "BFPP_NCCL_EMULATION_TRANSFER_S"
DEFAULT_STALL_S = 60.0
MAX_POLL_S = 0.02  # the longest a sender sleeps between looks at its receivers' keys

_originals: dict[tuple[Any, str], Any] = {}  # (module, name) -> what install replaced
_NAMES = ("batch_isend_irecv", "isend", "irecv", "_check_op")
# torch's own functions, for the workers even after uninstall (None: torch without distributed)
_torch: dict[str, Any] = {name: getattr(c10d, name, None) for name in _NAMES}
_stall_s = DEFAULT_STALL_S
_transfer_s = 0.0
_lock = threading.Lock()
_streams: dict[tuple[str, str], _Stream] = {}  # this process's, by (group name, stream name)
_blocked_s = 0.0  # this process's time blocked in Work.wait() (rule 5)


def install(*, stall_seconds: float | None = None, transfer_seconds: float | None = None) -> None:
    """Route gloo p2p through the emulation (again: only sets the limits); a limit not given is its
    environment variable's, else 60 s of stall and no transfer time (rule 7)."""
    global _stall_s, _transfer_s
    if stall_seconds is None:
        stall_seconds = float(os.environ.get(_STALL_ENV, DEFAULT_STALL_S))
    if transfer_seconds is None:
        transfer_seconds = float(os.environ.get(TRANSFER_ENV, 0.0))
    if transfer_seconds < 0:
        raise ValueError(
            f"NCCL emulation: the transfer time must be >= 0 seconds, not {transfer_seconds}"
        )
    _stall_s, _transfer_s = stall_seconds, transfer_seconds
    if _originals or not dist.is_available():
        return
    patches = {"batch_isend_irecv": _batch_isend_irecv, "isend": _isend, "irecv": _irecv}
    targets = [(module, name, new) for module in (dist, c10d) for name, new in patches.items()]
    # _check_op: P2POp accepts ops made before install
    for module, name, replacement in [*targets, (c10d, "_check_op", _check_op)]:
        _originals[module, name] = getattr(module, name)
        setattr(module, name, replacement)


def uninstall() -> None:
    """Restore torch's functions; batches already posted still run on their workers."""
    for (module, name), original in _originals.items():
        setattr(module, name, original)
    _originals.clear()


def installed() -> bool:
    return bool(_originals)


def batches_posted() -> int:
    """Batches this process has run through the emulation (tests check that it was used)."""
    return sum(stream.posted for stream in list(_streams.values()))


def blocked_seconds() -> float:
    """Seconds this process's threads have spent blocked in a batch's ``wait()`` so far."""
    return _blocked_s


@dataclass(frozen=True, slots=True)
class SendTiming:
    """When the emulation let one send of a batch go (rule 7), on ``time.monotonic``'s clock."""

    peer: int
    receiver_started: float | None  # the stamp the receiver's batch left (None: no transfer time)
    due: float  # max(this batch's start, receiver_started) + the transfer time (0.0: none)
    posted: float  # when the real gloo isend was posted (never before ``due``)


@dataclass(frozen=True, slots=True)
class BatchTiming:
    """What the emulation decided for one batch, so tests check the rules it controls (send delays,
    completion after sends, the wait charged) without bounding wall time."""

    started: float
    completed: float
    sends: tuple[SendTiming, ...]  # in the order they were let go
    waits: tuple[tuple[float, float], ...]  # (began, ended) of each wait() on its Work


def batch_timing(work: dist.Work) -> BatchTiming:
    """The record of a completed batch posted through the emulation (its one Work)."""
    if not isinstance(work, _Work) or not work.is_completed():
        raise ValueError(f"NCCL emulation: {work!r} is not a completed batch of the emulation")
    batch = work._batch
    return BatchTiming(batch.started_at, batch.completed_at, tuple(batch.sends), work._waits)


def _check_op(op: Callable[..., Any]) -> None:
    if op not in (_torch["isend"], _torch["irecv"]):
        _torch["_check_op"](op)


def _batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:
    c10d._check_p2p_op_list(p2p_op_list)
    first = p2p_op_list[0]
    group = _gloo_group(first.group, first.tensor)
    if group is None:  # torch's own, which tells sends by ``op.op is isend`` (ours now)
        for op in p2p_op_list:
            op.op = {_torch["isend"]: _isend, _torch["irecv"]: _irecv}.get(op.op, op.op)
        works: list[dist.Work] = _torch["batch_isend_irecv"](p2p_op_list)
        return works
    ops = [
        _Op(
            op.op in (_isend, _torch["isend"]),
            op.tensor,
            int(op.peer) if op.peer is not None else dist.get_global_rank(group, op.group_peer),
            op.tag,
        )
        for op in p2p_op_list
    ]
    return [_stream(group, "batch").submit(ops)]


def _isend(
    tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0, **kw: Any
) -> dist.Work | None:
    return _single(True, tensor, dst, group, tag, kw, "group_dst")


def _irecv(
    tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **kw: Any
) -> dist.Work | None:
    return _single(False, tensor, src, group, tag, kw, "group_src")


def _single(
    send: bool, tensor: torch.Tensor, peer: int | None, group: Any, tag: int, kw: Any, gkey: str
) -> dist.Work | None:
    gloo = _gloo_group(group, tensor)
    if gloo is None:
        work: dist.Work | None = _torch["isend" if send else "irecv"](
            tensor, group=group, tag=tag, **{"dst" if send else "src": peer}, **kw
        )
        return work
    if kw.get(gkey) is not None:
        peer = dist.get_global_rank(gloo, kw[gkey])
    if peer is None:
        raise RuntimeError("NCCL emulation: NCCL cannot receive from any source (irecv src=None)")
    low, high = sorted((dist.get_rank(), peer))
    return _stream(gloo, f"pair{low}-{high}").submit([_Op(send, tensor, peer, tag)])


def _gloo_group(group: Any, tensor: torch.Tensor) -> Any:
    """The group if its backend for ``tensor`` is gloo (and this rank is in it), else None."""
    group = c10d._get_default_group() if group is None else group
    if c10d._rank_not_in_group(group):
        return None
    try:
        return (
            group if isinstance(group._get_backend(tensor.device), dist.ProcessGroupGloo) else None
        )
    except (AttributeError, RuntimeError):
        return group if dist.get_backend(group) == "gloo" else None


@dataclass
class _Op:
    send: bool
    tensor: torch.Tensor
    peer: int  # global rank
    tag: int
    k: int = -1  # index among the stream's sends to / receives from the peer
    state: str = "not started"  # what it waits for; "" once completed

    def describe(self, me: int) -> str:
        state = f", {self.state}" if self.state else ""
        if self.send:
            nbytes = self.tensor.numel() * self.tensor.element_size()
            return f"send {nbytes} B to rank {self.peer} (#{self.k} on {me}>{self.peer}{state})"
        return f"recv from rank {self.peer} (#{self.k}{state})"

    def waits_for(self, me: int) -> str:
        if not self.send:
            return f"rank {self.peer} to send its #{self.k} to rank {me}"
        if self.state == "receiver's batch not started":
            return f"rank {self.peer} to start its batch holding receive #{self.k} from rank {me}"
        return f"rank {self.peer} to take send #{self.k}"


class _Batch:
    def __init__(self, stream: _Stream, index: int, ops: list[_Op]) -> None:
        self.stream, self.index, self.ops = stream, index, ops
        self.started = False
        self.started_at = self.completed_at = math.nan
        self.sends: list[SendTiming] = []
        self.done = threading.Event()
        self.error: str | None = None
        self.cause: BaseException | None = None

    def describe(self) -> str:
        return f"batch #{self.index} [{'; '.join(op.describe(self.stream.me) for op in self.ops)}]"

    def finish(self, error: str | None = None, cause: BaseException | None = None) -> None:
        self.error, self.cause = error, cause
        self.completed_at = time.monotonic()  # before done: a wait() returns after this
        self.done.set()


class _Stalled(Exception):
    pass


class _Stream:
    """The batches one process posts on one communicator of a group, run in order by a thread."""

    def __init__(self, group: Any, name: str) -> None:
        self.group, self.name = group, name
        self.me = dist.get_rank()
        desc = getattr(group, "group_desc", "")
        desc = f" ({desc})" if desc and desc != "undefined" else ""
        self.label = (
            f"NCCL emulation: rank {self.me}, group {group.group_name}{desc}, {name} stream"
        )
        self.store = PrefixStore(f"bfpp-nccl-emulation/{group.group_name}/{name}/", _own_store())
        self.queue: SimpleQueue[_Batch] = SimpleQueue()
        self.counts: Counter[tuple[bool, int]] = Counter()
        self.posted = 0
        self.head: _Batch | None = None
        self.failure: str | None = None
        self.lock = threading.Lock()
        threading.Thread(target=self._loop, name=f"nccl-emulation {name}", daemon=True).start()

    def submit(self, ops: list[_Op]) -> _Work:
        with self.lock:
            for op in ops:
                op.k = self.counts[op.send, op.peer]
                self.counts[op.send, op.peer] += 1
            batch = _Batch(self, self.posted, ops)
            self.posted += 1
            self.queue.put(batch)
        return _Work(batch)

    def _loop(self) -> None:
        while True:
            batch = self.queue.get()
            self.head = batch
            if self.failure is not None:
                batch.finish(f"{self.label}: {batch.describe()} never ran: {self.failure}")
                continue
            try:
                self._run(batch)
            except _Stalled:
                queued = self.queue.qsize()
                self.failure = (
                    f"{self.label}: {batch.describe()} not completed {_stall_s:g} s after it "
                    f"started; waiting for {self.waits_for(batch)}"
                    + (f" ({queued} more batches queued behind it)" if queued else "")
                )
                batch.finish(self.failure)
            except Exception as error:  # a peer died, the store went away
                first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
                self.failure = f"{self.label}: {batch.describe()} failed: {first}"
                batch.finish(self.failure, error)
            else:
                batch.finish()

    def waits_for(self, batch: _Batch) -> str:
        if not batch.started:
            return "the batch before it to complete"
        return ", ".join(op.waits_for(self.me) for op in batch.ops if op.state) or "nothing"

    def _run(self, batch: _Batch) -> None:
        started = time.monotonic()
        deadline = started + _stall_s
        transfer = _transfer_s
        batch.started, batch.started_at = True, started
        posted: list[tuple[_Op, dist.Work]] = []
        sends: dict[int, deque[_Op]] = {}
        for op in batch.ops:
            if op.send:
                op.state = "receiver's batch not started"
                sends.setdefault(op.peer, deque()).append(op)
                continue
            # announce: this batch started, and when (rule 7)
            self.store.set(f"{op.peer}>{self.me}/{op.k}", repr(started))
            posted.append((op, _torch["irecv"](op.tensor, op.peer, self.group, op.tag)))
            op.state = "nothing arrived"
        delay, longest = 0.0005, min(MAX_POLL_S, transfer / 4) if transfer else MAX_POLL_S
        due: list[tuple[float, _Op, float | None]] = []  # receiver started: post time, its stamp
        while any(sends.values()) or due:  # each peer's sends in order, once its receiver started
            for peer, queue in sends.items():
                while queue and self.store.check([key := f"{self.me}>{peer}/{queue[0].k}"]):
                    op = queue.popleft()
                    if transfer:
                        stamp = float(self.store.get(key))
                        due.append((max(started, stamp) + transfer, op, stamp))
                    else:
                        due.append((0.0, op, None))
                    op.state = "in transfer"
                    self.store.delete_key(key)
                    delay = 0.0005
            now = time.monotonic()
            for when, op, stamp in due:
                if when <= now:
                    posted.append((op, _torch["isend"](op.tensor, op.peer, self.group, op.tag)))
                    op.state = "not taken"
                    batch.sends.append(SendTiming(op.peer, stamp, when, now))
            due = [entry for entry in due if entry[0] > now]
            if any(sends.values()) or due:
                if now >= deadline:
                    _refresh(posted)
                    raise _Stalled
                waiting = any(sends.values())
                time.sleep(min([entry[0] - now for entry in due] + ([delay] if waiting else [])))
                if waiting:
                    delay = min(2 * delay, longest)
        for op, work in posted:
            try:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError:
                if time.monotonic() < deadline:
                    raise
                _refresh([(other, w) for other, w in posted if other is not op])
                raise _Stalled from None
            op.state = ""


def _after_fork_in_child() -> None:
    """The parent's workers did not survive the fork, and a lock held then would stay held."""
    global _lock, _streams, _blocked_s
    _lock, _streams, _blocked_s = threading.Lock(), {}, 0.0


os.register_at_fork(after_in_child=_after_fork_in_child)


def _refresh(posted: list[tuple[_Op, dist.Work]]) -> None:
    """Mark the posted ops that have completed after all, for the stall report."""
    for op, work in posted:
        with contextlib.suppress(RuntimeError):
            if op.state and work.wait(timedelta(milliseconds=1)):
                op.state = ""


def _own_store() -> Store:
    """A connection of its own to the default store's TCPStore: a blocking ``wait`` / ``get`` on
    a shared client holds its lock, and would stall the worker's polls (other stores: shared)."""
    store = c10d._get_default_store()
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if not isinstance(store, TCPStore):
        return store
    timeout = timedelta(seconds=max(_stall_s, 60.0))
    return TCPStore(
        store.host, store.port, is_master=False, timeout=timeout, wait_for_workers=False
    )


def _stream(group: Any, name: str) -> _Stream:
    with _lock:
        key = (group.group_name, name)
        if key not in _streams:
            _streams[key] = _Stream(group, name)
        return _streams[key]


class _Work(dist.Work):
    """One batch's Work, like ProcessGroupNCCL's coalesced one (megatron-core waits; some poll)."""

    def __init__(self, batch: _Batch) -> None:
        super().__init__()
        self._batch = batch
        self._waits: tuple[tuple[float, float], ...] = ()

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        batch = self._batch
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout or 0.0
        limit = seconds if seconds > 0 else _stall_s  # torch's default timedelta(0): no limit
        began = time.monotonic()
        done = batch.done.wait(limit)
        ended = time.monotonic()
        self._waits += ((began, ended),)
        global _blocked_s
        with _lock:
            _blocked_s += ended - began
        if not done:
            stream, head = batch.stream, batch.stream.head
            at = head.describe() if head is not None else "nothing"
            waits = stream.waits_for(head) if head is not None else "its worker"
            raise RuntimeError(
                f"{stream.label}: wait() on batch #{batch.index} blocked {limit:g} s; the stream "
                f"is at {at}, waiting for {waits}"
            )
        if batch.error is not None:
            raise RuntimeError(batch.error) from batch.cause
        return True

    def is_completed(self) -> bool:
        return self._batch.done.is_set()

    def exception(self) -> BaseException | None:
        error = self._batch.error
        return None if error is None else RuntimeError(error)
