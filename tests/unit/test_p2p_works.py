"""The runtime's messages on a backend that returns one Work per batch (NCCL's coalescing), and
every wait bounded by the process group's timeout."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from megatron_bfpp.messages import Message  # noqa: E402
from megatron_bfpp.runtime.p2p import PipeComm, PipelineTimeout, Receive, Send  # noqa: E402


class BatchWork:
    """One Work for a whole batch: waiting delivers every receive (what the peers sent)."""

    def __init__(self, ops: list[Any], incoming: list[torch.Tensor]) -> None:
        self.ops, self.incoming, self.waits = ops, incoming, 0

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits += 1
        self._deliver()
        return True

    def is_completed(self) -> bool:
        self._deliver()  # the peers sent it: NCCL completes the batch on its own
        return True

    def _deliver(self) -> None:
        receives = [op.tensor for op in self.ops if op.op is dist.irecv]
        for buffer, data in zip(receives, self.incoming, strict=True):
            buffer.copy_(data.view_as(buffer))


class Backend:
    """A coalescing backend: each batch_isend_irecv returns [one Work]; ``incoming`` queues
    what each batch's receives get."""

    def __init__(self) -> None:
        self.batches: list[BatchWork] = []
        self.incoming: list[list[torch.Tensor]] = []

    def batch_isend_irecv(self, ops: list[Any]) -> list[BatchWork]:
        work = BatchWork(ops, self.incoming.pop(0))
        self.batches.append(work)
        return [work]


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Backend:
    fake = Backend()
    monkeypatch.setattr(dist, "batch_isend_irecv", fake.batch_isend_irecv)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "P2POp", _P2POp)
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    return fake


class _P2POp:
    def __init__(self, op: Any, tensor: torch.Tensor, peer: int, group: Any) -> None:
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group


def _comm(timeout_s: float = 60.0) -> PipeComm:
    return PipeComm(
        group=_Group(),  # type: ignore[arg-type]
        shape=(2,),
        dtype=torch.float32,
        device=torch.device("cpu"),
        timeout_s=timeout_s,
    )


class _Group:
    def rank(self) -> int:
        return 1


def test_a_batch_with_one_work_feeds_every_receive_and_send(backend: Backend) -> None:
    incoming = backend.incoming
    comm = _comm()
    act, grad = Message("act", 0, 1), Message("grad", 2, 0)
    buffers = (torch.zeros(2), torch.zeros(2))
    incoming.append([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    comm.post(
        [Send(Message("act", 1, 0), torch.ones(2), peer=1)],
        [Receive(act, 0, (buffers[0],)), Receive(grad, 1, (buffers[1],))],
    )
    (work,) = backend.batches
    assert comm.wait_receive(act, 0).tolist() == [1.0, 2.0]
    assert comm.wait_receive(grad, 1).tolist() == [3.0, 4.0]
    assert comm.sends[0].work is work  # the send's Work is the batch's
    comm.reap()
    assert comm.sends == []


def test_an_eviction_size_is_read_from_its_batch_then_the_payload_posted(
    backend: Backend,
) -> None:
    comm = _comm()
    evict = Message("evict", 0, 0)
    header = torch.zeros(1, dtype=torch.int64)
    backend.incoming.append([torch.tensor([6])])
    comm.post([], [Receive(evict, 3, (), header=header)])
    assert comm.read_header(evict, 3) == 6
    payload = torch.zeros(6, dtype=torch.uint8)
    backend.incoming.append([torch.arange(6, dtype=torch.uint8)])
    comm.post([], [Receive(evict, 3, (payload,), more=True)])
    (part,) = comm.wait_parts(evict, 3)
    assert part.tolist() == [0, 1, 2, 3, 4, 5]


def test_a_backend_with_an_unexpected_number_of_works_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [object(), object()])
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "P2POp", _P2POp)
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    comm = _comm()
    receives = [Receive(Message("act", 0, mb), 0, (torch.zeros(2),)) for mb in range(3)]
    with pytest.raises(RuntimeError, match="returned 2 works for 3 ops"):
        comm.post([], receives)


class _Never:
    """A Work whose peer never sends (a stopped rank). As gloo: ``wait(timeout)`` raises once
    the timeout passes; as NCCL: ``is_completed()`` stays False (``wait()`` would only order a
    stream)."""

    def __init__(self) -> None:
        self.timeouts: list[timedelta | None] = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.timeouts.append(timeout)
        if timeout is None:
            raise AssertionError("an unbounded wait")
        time.sleep(timeout.total_seconds())
        raise RuntimeError("Timed out waiting 200ms for recv operation to complete")

    def is_completed(self) -> bool:
        return False


@pytest.mark.parametrize("backend_name", ["gloo", "nccl"])
def test_a_message_that_never_comes_fails_within_the_groups_timeout(
    monkeypatch: pytest.MonkeyPatch, backend_name: str
) -> None:
    """A receive from a stopped rank ends in one line naming the message and the peer, within
    the group's timeout (gloo: passed to wait(); NCCL: is_completed() polled to a deadline)."""
    work = _Never()
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [work])
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank + 4)
    monkeypatch.setattr(dist, "P2POp", _P2POp)
    monkeypatch.setattr(dist, "get_backend", lambda group: backend_name)
    comm = _comm(timeout_s=0.2)
    message = Message("grad", 2, 3)
    comm.post([], [Receive(message, 0, (torch.zeros(2),))])
    with pytest.raises(PipelineTimeout) as error:
        comm.wait_receive(message, 0)
    text = str(error.value)
    assert "\n" not in text
    assert text.startswith(
        "pipeline rank 1: receiving the gradient of stage 2, micro-batch 3 from pipeline rank 0 "
        "(global rank 4) did not complete in "
    )
    assert "--distributed-timeout-minutes" in text and "rank 0 is stopped, hung" in text
    if backend_name == "gloo":
        (timeout,) = work.timeouts
        assert timeout is not None and timeout.total_seconds() <= 0.2
    else:
        assert work.timeouts == []  # never a blocking wait on NCCL before completion


def test_a_send_never_taken_fails_within_the_groups_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    work = _Never()
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [work])
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "P2POp", _P2POp)
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    comm = _comm(timeout_s=0.1)
    comm.post([Send(Message("act", 1, 0), torch.ones(2), peer=2)], [])
    with pytest.raises(PipelineTimeout, match="sending the activation of stage 1, micro-batch 0 to "
                       "pipeline rank 2"):  # fmt: skip
        comm.reap(wait=True)
