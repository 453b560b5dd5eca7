"""The NCCL emulation on gloo ranks (megatron_bfpp.testing.nccl_emulation): one Work per batch,
the batches of a group in order, sends that wait for the receiver's batch, megatron-core's per-tick
batches complete, crossing windows are reported as a one-line stall (and run on plain gloo),
non-batched isend / irecv FIFO per pair of ranks, megatron-core's own schedules (batched or not)
give plain gloo's losses, subprocesses get the emulation through the sitecustomize, and an
optional transfer time delays each op once, the ops of a batch in parallel (and the time a
wait() blocked for it is counted).

Every ordering claim is proved by an outcome (a stall the emulation must report, or a run that
must finish, where the other rule would give the opposite), never by timing; the transfer time's
test reads the emulation's own record of what it decided (``batch_timing``: when each send was
let go, when the batch completed, what its wait charged), never a bound on wall time, which a
loaded machine stretches.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("megatron.core")

import torch
import torch.distributed as dist

from megatron_bfpp.testing import models as M
from megatron_bfpp.testing import nccl_emulation as E
from megatron_bfpp.testing.multirank import run_ranks

RANK_TIMEOUT = 60.0
STALL = 2.0  # seconds before the emulation reports a stuck batch
LONG = timedelta(seconds=30)  # a wait() that outlasts STALL, so the batch's own report comes out
pytestmark = [pytest.mark.megatron, pytest.mark.timeout(2 * RANK_TIMEOUT + 30)]
MODES = pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "plain-gloo"])


# --------------------------------------------------------------------------- helpers (in ranks)


def _mode(emulate: bool, stall: float = STALL) -> None:
    if emulate:
        E.install(stall_seconds=stall)
    else:
        E.uninstall()


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _wait_any(*keys: str) -> str:
    """The first of ``keys`` some rank sets in the store."""
    while True:
        for key in keys:
            if _store().check([key]):
                return key
        time.sleep(0.01)


def _payload(src: int, tick: int, j: int) -> torch.Tensor:
    return torch.tensor([src, tick, j], dtype=torch.float32)


def _send(peer: int, tensor: torch.Tensor) -> dist.P2POp:
    return dist.P2POp(dist.isend, tensor, peer)


def _recv(peer: int, tensor: torch.Tensor) -> dist.P2POp:
    return dist.P2POp(dist.irecv, tensor, peer)


def _outcome(work: Any, timeout: timedelta = LONG) -> str:
    """ "ok", or the error a wait() raised."""
    try:
        work.wait(timeout)
    except RuntimeError as error:
        return str(error)
    return "ok"


# --------------------------------------------------------------------------- rank functions


def one_work_per_batch() -> tuple[int, int, list[float]]:
    """(Works of a plain gloo batch, Works of an emulated one, what the emulated one received)."""
    me, other = dist.get_rank(), 1 - dist.get_rank()
    E.uninstall()
    got = torch.empty(3)
    plain = dist.batch_isend_irecv([_send(other, _payload(me, 0, 0)), _recv(other, got)])
    for work in plain:
        work.wait()
    E.install(stall_seconds=STALL)
    sends = [_send(other, _payload(me, 1, j)) for j in range(2)]
    recvs = [_recv(other, torch.empty(3)) for _ in range(2)]
    works = dist.batch_isend_irecv([sends[0], recvs[0], sends[1], recvs[1]])
    (works[0] if len(works) == 1 else works[-1]).wait()
    assert works[0].is_completed() and works[0].exception() is None
    return len(plain), len(works), [x for r in recvs for x in r.tensor.tolist()]


def transfer_time(seconds: float) -> tuple[E.BatchTiming, list[float], float]:
    """Rank 0 posts one batch [send to 1, send to 2], the others [recv from 0]: (the
    emulation's record of this rank's batch, what this rank received, the seconds
    ``blocked_seconds`` charged for its wait()) under an emulated transfer time."""
    E.install(stall_seconds=10 * seconds + STALL, transfer_seconds=seconds)
    me = dist.get_rank()
    got = torch.zeros(3)
    sends = [_send(1, _payload(0, 0, 1)), _send(2, _payload(0, 0, 2))]
    ops = sends if me == 0 else [_recv(0, got)]
    dist.barrier()
    blocked = E.blocked_seconds()
    work = dist.batch_isend_irecv(ops)[0]
    work.wait(LONG)
    return E.batch_timing(work), got.tolist(), E.blocked_seconds() - blocked


def batches_in_order(emulate: bool) -> str:
    """Rank 0 posts [recv from 1] then [send to 2]; rank 2 must get that send before rank 1
    sends. Under NCCL's one stream per group, rank 0's second batch waits for its first: stall."""
    _mode(emulate)
    me = dist.get_rank()
    if me == 0:
        first = dist.batch_isend_irecv([_recv(1, torch.empty(3))])[0]
        second = dist.batch_isend_irecv([_send(2, _payload(0, 0, 0))])[0]
        outcome = _outcome(first)
        _outcome(second)
        _store().set("0 finished", "1")
        return outcome
    if me == 2:
        got = torch.empty(3)
        outcome = _outcome(dist.batch_isend_irecv([_recv(0, got)])[0])
        _store().set("2 got it" if outcome == "ok" else "2 gave up", "1")
        return outcome
    if _wait_any("2 got it", "2 gave up") == "2 got it":
        return _outcome(dist.batch_isend_irecv([_send(0, _payload(1, 0, 0))])[0])
    _wait_any("0 finished")  # rank 0's stream is dead: sending would only stall again
    return "ok"


def send_waits_for_receivers_batch(emulate: bool) -> str:
    """Rank 1 posts [recv from 2] then [recv from 0]; rank 0's send to 1 must complete before
    rank 2 sends. Gloo matches it with the posted receive; NCCL waits for rank 1's second batch
    to start, which waits for rank 2: a stall (rank 1 is given time to outlast it)."""
    me = dist.get_rank()
    _mode(emulate, STALL if me == 0 else 10 * STALL)
    if me == 0:
        message = _payload(0, 0, 0)
        outcome = _outcome(dist.batch_isend_irecv([_send(1, message)])[0])
        _store().set("0 done", "1")
        if outcome != "ok":  # its stream is dead: deliver on plain gloo to rank 1's 2nd batch
            E.uninstall()
            work = dist.isend(message, 1)
            assert work is not None
            work.wait()
        return outcome
    if me == 2:
        _wait_any("0 done")
        return _outcome(dist.batch_isend_irecv([_send(1, _payload(2, 0, 0))])[0])
    got = torch.empty(3)
    first = dist.batch_isend_irecv([_recv(2, torch.empty(3))])[0]
    second = dist.batch_isend_irecv([_recv(0, got)])[0]
    outcomes = {_outcome(first), _outcome(second)}
    return "ok" if outcomes == {"ok"} and got.tolist() == [0.0, 0.0, 0.0] else str(outcomes)


def send_incomplete_until_receiver_posts() -> bool:
    """Rank 1 posts its receive only when rank 0 says so; returns whether rank 0's send was
    still incomplete before that (always True under rendezvous)."""
    me = dist.get_rank()
    E.install(stall_seconds=RANK_TIMEOUT)
    if me == 0:
        work = dist.batch_isend_irecv([_send(1, _payload(0, 0, 0))])[0]
        incomplete = not work.is_completed()
        _store().set("go", "1")
        work.wait()
        return incomplete and work.is_completed()
    _store().wait(["go"])
    got = torch.empty(3)
    dist.batch_isend_irecv([_recv(0, got)])[0].wait()
    return got.tolist() == [0.0, 0.0, 0.0]


def megatron_ticks(ticks: int) -> list[list[float]]:
    """megatron-core's _batched_p2p_ops each tick: send/recv with both ring neighbours in one
    batch, waited for; the k-th receive from a peer holds its k-th send of that tick."""
    E.install(stall_seconds=RANK_TIMEOUT)
    me, n = dist.get_rank(), dist.get_world_size()
    prev, nxt = (me - 1) % n, (me + 1) % n
    got: list[list[float]] = []
    for tick in range(ticks):
        sent = {prev: 0, nxt: 0}
        send_prev = _payload(me, tick, sent[prev])
        sent[prev] += 1
        send_next = _payload(me, tick, sent[nxt])
        recv_prev, recv_next = torch.empty(3), torch.empty(3)
        ops = [_send(prev, send_prev), _recv(prev, recv_prev), _send(nxt, send_next)]
        works = dist.batch_isend_irecv([*ops, _recv(nxt, recv_next)])
        assert len(works) == 1
        works[0].wait()
        got += [recv_prev.tolist(), recv_next.tolist()]
    return got


def crossing_windows(emulate: bool) -> tuple[str, str, list[float]]:
    """Both ranks post [send to the other] then [recv from the other]: (a short wait() on the
    second batch, the first batch's outcome, what was received)."""
    _mode(emulate)
    me, other = dist.get_rank(), 1 - dist.get_rank()
    got = torch.empty(3)
    first = dist.batch_isend_irecv([_send(other, _payload(me, 0, 0))])[0]
    second = dist.batch_isend_irecv([_recv(other, got)])[0]
    short = _outcome(second, timedelta(seconds=0.5)) if emulate else "skipped"
    outcome = _outcome(first)
    _outcome(second)
    return short, outcome, got.tolist()


def pairs_fifo(emulate: bool, head_to_head: bool) -> list[str]:
    """Non-batched isend / irecv between ranks 0 and 1, megatron-core's even/odd order (or both
    sending first), and rank 0 to rank 2 meanwhile: rank 1 sends to 0 only once rank 2 got
    rank 0's message, which needs the 0-2 pair to run apart from the 0-1 pair."""
    _mode(emulate)
    me = dist.get_rank()
    got = torch.empty(3)
    if me == 2:
        outcome = _outcome(dist.irecv(got, 0))
        _store().set("2 got it", "1")
        return [outcome, str(got.tolist())]
    if me == 0:
        first = dist.isend(_payload(0, 0, 0), 1)
        second = dist.irecv(got, 1)
        to_two = dist.isend(_payload(0, 0, 2), 2)
        outcomes = [_outcome(to_two), _outcome(first), _outcome(second)]
        _store().set("0 finished", "1")
        return [*outcomes, str(got.tolist())]
    _wait_any("2 got it")
    if head_to_head:
        first, second = dist.isend(_payload(1, 0, 0), 0), dist.irecv(got, 0)
    else:
        first, second = dist.irecv(got, 0), dist.isend(_payload(1, 0, 0), 0)
    outcomes = [_outcome(first), _outcome(second)]
    return [*outcomes, str(got.tolist())]


def megatron_schedule(batches: list[M.Batch], batched: bool, emulate: bool) -> list[float]:
    """megatron-core's own schedule (batch_isend_irecv per tick, or its even/odd isend/irecv);
    this rank's losses."""
    _mode(emulate, RANK_TIMEOUT / 2)
    chunks = M.build_model_chunks(M.tiny_gpt_config(batch_p2p_comm=batched))
    losses = M.losses_from_store(M.run_schedule(chunks, batches))
    assert (E.batches_posted() > 0) == emulate
    return losses


def patching() -> list[bool]:
    """install/uninstall swap torch's functions (both modules); a P2POp made with torch's own
    isend before install is still accepted."""
    c10d = dist.distributed_c10d
    E.uninstall()
    original = dist.isend
    seen = [E.installed(), dist.isend is c10d.isend]
    E.install()
    dist.P2POp(original, torch.zeros(1), 0)
    seen += [
        E.installed(),
        dist.isend is not original,
        c10d.batch_isend_irecv is E._batch_isend_irecv,
    ]
    E.install()  # idempotent
    E.uninstall()
    return [*seen, not E.installed(), dist.isend is original, c10d.isend is original]


# --------------------------------------------------------------------------- tests


def _single_line(message: str) -> None:
    assert "\n" not in message, message


def test_a_batch_returns_one_work_where_gloo_returns_one_per_op() -> None:
    results = run_ranks(one_work_per_batch, world_size=2, timeout=RANK_TIMEOUT)
    for me, (plain, emulated, got) in enumerate(results):
        assert (plain, emulated) == (2, 1)
        assert got == [*_payload(1 - me, 1, 0).tolist(), *_payload(1 - me, 1, 1).tolist()]


def test_a_transfer_time_delays_each_op_and_the_ops_of_a_batch_overlap() -> None:
    """Rule 7, checked on what the emulation decides, not on wall time: each send is let go the
    transfer time after both halves' batches started, each from its own receiver's start (the
    two sends of one batch in parallel, as ``nccl.posting_timer`` models them; one after the
    other, the second would wait for the first's post), never before; a receive completes only
    after its send was posted, the batch after its last send. Rule 5: the wait lasted until the
    batch completed, and ``blocked_seconds`` charged exactly that wait."""
    seconds = 0.5
    (sender, _, blocked), (one, got_one, _), (two, got_two, _) = run_ranks(
        transfer_time, world_size=3, timeout=RANK_TIMEOUT, args=(seconds,)
    )
    assert (got_one, got_two) == (_payload(0, 0, 1).tolist(), _payload(0, 0, 2).tolist())
    assert sorted(send.peer for send in sender.sends) == [1, 2]
    receivers = {1: one, 2: two}
    for send in sender.sends:
        receiver = receivers[send.peer]
        assert send.receiver_started == receiver.started  # the stamp its receiver's batch left
        assert send.due == max(sender.started, receiver.started) + seconds, (send, sender)
        assert send.due <= send.posted <= sender.completed
        assert send.posted <= receiver.completed  # the data came after the send was posted
    assert (one.sends, two.sends) == ((), ())
    ((began, ended),) = sender.waits
    assert ended >= sender.completed
    assert blocked == pytest.approx(ended - began, abs=1e-9)


@MODES
def test_a_groups_next_batch_starts_only_after_the_previous_completed(emulate: bool) -> None:
    zero, one, two = run_ranks(
        batches_in_order, world_size=3, timeout=RANK_TIMEOUT, args=(emulate,)
    )
    if not emulate:
        assert (zero, one, two) == ("ok", "ok", "ok")
        return
    for message in (zero, two):
        _single_line(message)
    assert zero.startswith("NCCL emulation: rank 0, group ")
    assert "batch #0 [recv from rank 1 (#0, nothing arrived)] not completed 2 s after" in zero
    assert "waiting for rank 1 to send its #0 to rank 0 (1 more batches queued behind it)" in zero
    assert "rank 2" in two and "batch #0 [recv from rank 0 (#0, nothing arrived)]" in two


@MODES
def test_a_send_completes_only_once_the_receivers_batch_started(emulate: bool) -> None:
    zero, one, two = run_ranks(
        send_waits_for_receivers_batch, world_size=3, timeout=RANK_TIMEOUT, args=(emulate,)
    )
    assert (one, two) == ("ok", "ok")
    if not emulate:
        assert zero == "ok"
        return
    _single_line(zero)
    assert "rank 0" in zero
    assert "batch #0 [send 12 B to rank 1 (#0 on 0>1, receiver's batch not started)]" in zero
    assert "waiting for rank 1 to start its batch holding receive #0 from rank 0" in zero


def test_a_send_is_incomplete_while_the_receiver_has_not_posted() -> None:
    assert run_ranks(send_incomplete_until_receiver_posts, world_size=2, timeout=RANK_TIMEOUT) == [
        True,
        True,
    ]


@pytest.mark.parametrize("world_size", [2, 3])
def test_megatron_cores_per_tick_batches_complete_with_the_right_data(world_size: int) -> None:
    ticks = 3
    results = run_ranks(megatron_ticks, world_size=world_size, timeout=RANK_TIMEOUT, args=(ticks,))
    for me, got in enumerate(results):
        prev, nxt = (me - 1) % world_size, (me + 1) % world_size
        # the k-th receive from a peer holds its k-th send to me; on 2 ranks prev is next
        second = 1 if prev == nxt else 0
        expected = []
        for tick in range(ticks):
            expected += [_payload(prev, tick, 0).tolist(), _payload(nxt, tick, second).tolist()]
        assert got == expected


@MODES
def test_crossing_windows_stall_on_each_rank_and_run_on_plain_gloo(emulate: bool) -> None:
    results = run_ranks(crossing_windows, world_size=2, timeout=RANK_TIMEOUT, args=(emulate,))
    for me, (short, outcome, got) in enumerate(results):
        other = 1 - me
        if not emulate:
            assert outcome == "ok" and got == _payload(other, 0, 0).tolist()
            continue
        for message in (short, outcome):
            _single_line(message)
            assert message.startswith(f"NCCL emulation: rank {me}, group ")
        assert "wait() on batch #1 blocked 0.5 s; the stream is at batch #0 [send 12 B" in short
        assert (
            f"batch #0 [send 12 B to rank {other} (#0 on {me}>{other}, receiver's batch not "
            f"started)] not completed 2 s after it started; waiting for rank {other} to start "
            f"its batch holding receive #0 from rank {me} (1 more batches queued behind it)"
        ) in outcome


@MODES
@pytest.mark.parametrize("head_to_head", [False, True], ids=["even-odd", "head-to-head"])
def test_non_batched_ops_are_fifo_per_pair_of_ranks(emulate: bool, head_to_head: bool) -> None:
    zero, one, two = run_ranks(
        pairs_fifo, world_size=3, timeout=RANK_TIMEOUT, args=(emulate, head_to_head)
    )
    assert two == ["ok", str(_payload(0, 0, 2).tolist())]  # the 0-2 pair never waits for 0-1
    assert zero[0] == "ok"
    if not emulate or not head_to_head:
        assert zero[1:] == ["ok", "ok", str(_payload(1, 0, 0).tolist())]
        assert one == ["ok", "ok", str(_payload(0, 0, 0).tolist())]
        return
    for me, message in ((0, zero[1]), (1, one[0])):
        _single_line(message)
        other = 1 - me
        assert f"rank {me}, group " in message and "pair0-1 stream: batch #0 [send 12 B" in message
        assert f"to rank {other} (#0 on {me}>{other}, receiver's batch not started)]" in message


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "isend-irecv"])
@pytest.mark.parametrize(
    "pp, vp, m", [(4, None, 8), (2, 2, 4)], ids=["1f1b-pp4", "interleaved-pp2"]
)
def test_megatron_cores_own_schedules_run_under_the_emulation(
    pp: int, vp: int | None, m: int, batched: bool
) -> None:
    batches = M.make_batches(m, seed=3)
    runs = [
        run_ranks(megatron_schedule, world_size=pp, pp=pp, vp=vp, args=(batches, batched, emulate))
        for emulate in (True, False)
    ]
    assert runs[0][-1] and runs[0] == runs[1]


def test_install_and_uninstall_swap_torchs_functions() -> None:
    (seen,) = run_ranks(patching, world_size=1, timeout=RANK_TIMEOUT)
    assert seen == [False, True, True, True, True, True, True, True]


def test_subprocesses_get_the_emulation_once_they_import_torch() -> None:
    site = os.path.join(os.path.dirname(E.__file__), "nccl_site")
    env = {**os.environ, E.ENV: "1", "PYTHONPATH": site}
    code = (
        "import sys; before = 'torch' in sys.modules\n"
        "import torch.distributed as dist\n"
        "from megatron_bfpp.testing import nccl_emulation as E\n"
        "print(before, E.installed(), dist.isend is E._isend)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.stdout.split() == ["False", "True", "True"], run.stderr
    env[E.ENV] = "0"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.stdout.split() == ["False", "False", "False"], run.stderr


# --- the runtime: what the model predicts, the emulation shows ----------------------------------
def runtime_posted(batches: list[M.Batch], as_written: bool) -> str:
    """v-zb pp=2 m=3 through our runtime, posted as written (one batch per run of messages
    between computes, the runtime's posting before lock-step) or in lock-step."""
    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.nccl import written_posting
    from megatron_bfpp.runtime import api
    from megatron_bfpp.runtime.executor import PlannedSchedule

    E.install(stall_seconds=STALL)
    if as_written:  # the posting plan_schedule hands the executor (this rank process only)
        api.planned = lambda schedule: PlannedSchedule(schedule, written_posting(schedule))
    config = M.tiny_gpt_config(num_layers=4, vp=2)
    chunks = M.build_model_chunks(config, placement="v-shape")
    try:
        M.run_schedule(chunks, batches, forward_backward_func=get_forward_backward_func("v-zb"))
    except RuntimeError as error:
        return str(error)
    return "completed"


@pytest.mark.parametrize("as_written", [True, False], ids=["as-written", "lock-step"])
def test_the_runtime_stalls_where_the_model_finds_a_cycle_and_lockstep_completes(
    as_written: bool,
) -> None:
    from megatron_bfpp.ir import ScheduleError
    from megatron_bfpp.nccl import check_posting, written_posting
    from megatron_bfpp.schedules.registry import build_schedule

    schedule = build_schedule("v-zb", num_ranks=2, num_microbatches=3)
    with pytest.raises(ScheduleError, match="deadlocks on NCCL when posted as written") as cycle:
        check_posting(schedule, written_posting(schedule))
    assert "rank 0's batch #5 [S grad3.1>1]" in str(cycle.value)
    assert "rank 1's batch #3 [S grad1.0>0]" in str(cycle.value)
    outcomes = run_ranks(
        runtime_posted,
        world_size=2,
        pp=2,
        vp=2,
        timeout=RANK_TIMEOUT,
        error_grace=RANK_TIMEOUT,
        args=(M.make_batches(3, seed=4), as_written),
    )
    if as_written:
        # Both ranks stop at the batches of the model's cycle (v-zb pp=2 m=3): rank 0's batch #5
        # sends grad 3.1, rank 1's batch #3 sends grad 1.0, each to a receiver queued behind.
        for outcome, batch in zip(outcomes, ("#5", "#3"), strict=True):
            assert "NCCL emulation" in outcome, outcome
            assert f"batch {batch} [send" in outcome, outcome
            assert "receiver's batch not started" in outcome, outcome
    else:
        assert outcomes == ["completed", "completed"]
