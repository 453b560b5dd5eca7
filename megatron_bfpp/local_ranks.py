"""Fork N ranks on this machine that meet on one ``TCPStore``: the one local process launcher.

bfpp-train uses it when it is not started by torchrun (``--nproc-per-node``, CPU ranks by
default), and the test harness (``megatron_bfpp.testing.multirank``) for every multi-rank test,
so what the tests launch is what users launch.

Why it is built this way:

* **fork, after the caller imported torch and megatron-core once**: a rank pays for process
  start-up and its process groups, not for importing them again.
* **a rendezvous port without a race**: rank 0 is forked first and hosts the ``TCPStore`` on
  ``127.0.0.1:0`` (the kernel picks a free port), reports the port through a pipe, and only then
  are the other ranks forked to join it. The parent starts no threads (a store thread in the
  parent was inherited mid-lock by forked children and hung them).
* **results as plain pickle bytes** through one pipe per rank, not ``Connection.send``: torch
  registers reducers that pass tensors as shared-memory handles, which die with the rank.
* **never hangs**: after the first failure the other ranks get ``error_grace`` seconds to report
  their own, then every rank still running is killed; the same at ``timeout``. With
  ``stack_dir`` the parent first asks each of them for its Python stacks (``faulthandler`` on
  ``SIGUSR1``), so a deadlock shows where every rank waited; without it ``kill -USR1 <pid>``
  prints a rank's stacks to its stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

__all__ = ["LocalRun", "fork_ranks"]

PORT_TIMEOUT = 120.0  # seconds rank 0 may take to report its port when there is no deadline
_STACK_DUMP_WAIT = 0.5


@dataclasses.dataclass(frozen=True)
class LocalRun:
    """How the ranks ended. ``results``: what ``target`` returned, by rank. ``errors``: the
    traceback (or how the rank died) of each rank that failed, with ``failed_at`` its wall-clock
    time. ``killed``: ranks still running when the grace period or the timeout ended, with their
    ``stacks`` when a ``stack_dir`` was given."""

    results: dict[int, Any]
    errors: dict[int, str]
    failed_at: dict[int, float]
    killed: tuple[int, ...]
    stacks: dict[int, str]
    timed_out: bool

    @property
    def first_failed(self) -> int | None:
        """The rank whose failure came first (the others often fail because it left)."""
        return min(self.failed_at, key=self.failed_at.__getitem__) if self.failed_at else None


@dataclasses.dataclass(frozen=True)
class _Rank:
    rank: int
    world_size: int
    port: int
    store_timeout: float
    stack_path: str | None


def fork_ranks(
    target: Callable[[int, Any], Any],
    world_size: int,
    *,
    timeout: float | None = None,
    error_grace: float = 1.0,
    store_timeout: float = 300.0,
    failed: Callable[[Any], bool] | None = None,
    after: Callable[[], None] | None = None,
    stack_dir: Path | None = None,
    daemon: bool = False,
    name: str = "bfpp-rank",
) -> LocalRun:
    """Run ``target(rank, store)`` in ``world_size`` forked processes and collect how each ended.

    Each rank has ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` set and gets the ``TCPStore`` for ``init_process_group(store=...)``.
    ``target`` and what it closes over are inherited through fork; its result must pickle.
    ``failed(result)`` says whether a returned result is a failure (an exit code, say); a raised
    exception always is. ``after()`` runs in the rank once its result is sent (tear-down whose
    errors must not hide the result). Every rank is dead when this returns.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    import torch.distributed  # noqa: F401  (once, here: each rank would import it again)

    deadline = None if timeout is None else time.monotonic() + timeout
    ctx = multiprocessing.get_context("fork")
    procs: list[Any] = []
    readers: dict[Connection, int] = {}

    def start(rank: int, port: int, port_writer: Connection | None) -> None:
        stack_path = None if stack_dir is None else str(stack_dir / f"stack.{rank}")
        spec = _Rank(rank, world_size, port, store_timeout, stack_path)
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_child,
            args=(spec, target, writer, port_writer, after),
            name=f"{name}-{rank}",
            daemon=daemon,
        )
        proc.start()
        writer.close()  # the child holds the only write end: EOF means it died
        procs.append(proc)
        readers[reader] = rank

    try:
        port_reader, port_writer = ctx.Pipe(duplex=False)
        with port_reader:
            start(0, 0, port_writer)
            port_writer.close()
            port = _read_port(port_reader, deadline)
        if port is not None:  # otherwise rank 0 failed or hung: collecting reports it
            for rank in range(1, world_size):
                start(rank, port, None)
        return _collect(procs, readers, deadline, error_grace, failed, stack_dir)
    finally:
        _kill_all(procs)
        for reader in readers:
            reader.close()


def _read_port(port_reader: Connection, deadline: float | None) -> int | None:
    wait_s = PORT_TIMEOUT if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        if port_reader.poll(wait_s):
            return int(port_reader.recv_bytes().decode())
    except (EOFError, OSError):
        pass
    return None


def _child(
    spec: _Rank,
    target: Callable[[int, Any], Any],
    writer: Connection,
    port_writer: Connection | None,
    after: Callable[[], None] | None,
) -> None:
    code = 0
    try:
        with contextlib.ExitStack() as stack:
            dump = (
                sys.stderr
                if spec.stack_path is None
                else stack.enter_context(open(spec.stack_path, "w"))
            )
            faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
            try:
                message: tuple[Any, ...] = ("ok", _run(spec, target, port_writer))
            except BaseException:
                message = ("error", traceback.format_exc(), time.time())
            try:
                payload = pickle.dumps(message)
            except Exception:  # the result did not pickle
                text = "result not picklable:\n" + traceback.format_exc()
                payload = pickle.dumps(("error", text, time.time()))
            writer.send_bytes(payload)
            if after is not None:
                after()
    except BaseException:
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(spec: _Rank, target: Callable[[int, Any], Any], port_writer: Connection | None) -> Any:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.rank),
        LOCAL_WORLD_SIZE=str(spec.world_size),
    )
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        spec.port,  # 0 on rank 0: the kernel picks a free port
        spec.world_size,
        is_master=spec.rank == 0,
        timeout=timedelta(seconds=spec.store_timeout),
        wait_for_workers=False,
    )
    if port_writer is not None:
        port_writer.send_bytes(str(store.port).encode())
        port_writer.close()
    os.environ["MASTER_PORT"] = str(store.port)
    return target(spec.rank, store)


def _collect(
    procs: list[Any],
    readers: dict[Connection, int],
    deadline: float | None,
    error_grace: float,
    failed: Callable[[Any], bool] | None,
    stack_dir: Path | None,
) -> LocalRun:
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    failed_at: dict[int, float] = {}
    pending = dict(readers)
    first_error: float | None = None
    while pending:
        limit = deadline
        if first_error is not None:
            grace_end = first_error + error_grace
            limit = grace_end if limit is None else min(limit, grace_end)
        wait_s = None if limit is None else limit - time.monotonic()
        if wait_s is not None and wait_s <= 0:
            break
        for conn in wait(list(pending), timeout=wait_s):
            if not isinstance(conn, Connection):  # wait() returns what it was given
                raise TypeError(f"unexpected object from wait(): {conn!r}")
            rank = pending.pop(conn)
            status, payload, when = _receive(conn, rank, procs[rank])
            if status == "ok":
                results[rank] = payload
                if failed is None or not failed(payload):
                    continue
                when = time.time()
            else:
                errors[rank] = payload
            failed_at[rank] = when
            if first_error is None:
                first_error = time.monotonic()
    killed = tuple(sorted(pending.values()))
    stacks = _dump_stacks(procs, killed, stack_dir) if killed and stack_dir is not None else {}
    return LocalRun(
        results=results,
        errors=errors,
        failed_at=failed_at,
        killed=killed,
        stacks=stacks,
        timed_out=bool(killed) and not failed_at,
    )


def _receive(conn: Connection, rank: int, proc: Any) -> tuple[str, Any, float]:
    try:
        status, payload, *when = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        proc.join(1.0)
        return (
            "error",
            f"rank {rank} died without a result (exit code {proc.exitcode})",
            time.time(),
        )
    return status, payload, (when[0] if when else time.time())


def _dump_stacks(procs: list[Any], ranks: tuple[int, ...], stack_dir: Path) -> dict[int, str]:
    """Ask each live rank for its Python stacks (faulthandler on SIGUSR1) and read them."""
    signalled = False
    for rank in ranks:
        proc = procs[rank]
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGUSR1)
                signalled = True
    if signalled:
        time.sleep(_STACK_DUMP_WAIT)
    stacks = {}
    for rank in ranks:
        try:
            text = (stack_dir / f"stack.{rank}").read_text()
        except OSError:
            text = ""
        stacks[rank] = text or "(no stack dump)"
    return stacks


def _kill_all(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5.0)
