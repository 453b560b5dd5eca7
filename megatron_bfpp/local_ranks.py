"""Fork N ranks on this machine that meet on one ``TCPStore``: the one local process launcher,
bfpp-train's without torchrun and every multi-rank test's, so tests launch what users do (why it
forks, never hangs and reaps every descendant: docs/architecture.md#the-local-launcher)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import hashlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, TextIO, cast

__all__ = ["LocalRun", "Stopped", "fork_ranks"]

PORT_TIMEOUT = 120.0  # seconds rank 0 may take to report its port when there is no deadline
HEARTBEAT_INTERVAL = 1.0
SILENT_AFTER_FAILURE = 10 * HEARTBEAT_INTERVAL  # silence marking a rank stopped once one failed
STOP_GRACE = 2.0  # seconds ranks get to exit after a forwarded SIGTERM before SIGKILL
_STACK_DUMP_WAIT = 0.5
_PR_SET_PDEATHSIG = 1
_DECIDED = "bfpp_first_to_say"  # a log record's attribute: whether this rank prints it


class Stopped(BaseException):
    """The launcher got SIGTERM or SIGHUP; every rank was stopped and reaped. A BaseException,
    like KeyboardInterrupt, so no ``except Exception`` on the way up swallows it."""

    def __init__(self, signum: int, num_ranks: int) -> None:
        self.signum = signum
        self.num_ranks = num_ranks
        super().__init__(f"{signal.Signals(signum).name}: stopped {num_ranks} ranks")


@dataclasses.dataclass(frozen=True)
class LocalRun:
    """How the ranks ended: ``results`` by rank; ``errors``: failed ranks' tracebacks (or how they
    died), at ``failed_at``; ``killed``: ranks still running at the end, with ``stacks``."""

    results: dict[int, Any]
    errors: dict[int, str]
    failed_at: dict[int, float]
    killed: tuple[int, ...]
    stacks: dict[int, str]
    lost: tuple[int, ...] = ()

    @property
    def first_failed(self) -> int | None:
        """The rank whose failure came first (the others often fail because it left)."""
        return min(self.failed_at, key=self.failed_at.__getitem__) if self.failed_at else None

    @property
    def culprit(self) -> int | None:
        """The rank to blame: the first lost (no result, or no heartbeat), since its peers fail soon
        after and may report first; otherwise the first to fail."""
        return min(self.lost, key=self.failed_at.__getitem__) if self.lost else self.first_failed


@dataclasses.dataclass(frozen=True)
class _Rank:
    rank: int
    world_size: int
    port: int
    store_timeout: float
    stack_path: str | None
    launcher: int
    warn_once: bool = False


@dataclasses.dataclass(frozen=True)
class _Watch:
    """When to stop waiting: the deadline, the grace after a failure, silent ranks."""

    deadline: float | None
    error_grace: float
    failed: Callable[[Any], bool] | None
    heartbeat_timeout: float | None
    beats: Any


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
    heartbeat_timeout: float | None = None,
    warn_once: bool = False,
) -> LocalRun:
    """Run ``target(rank, store)`` in ``world_size`` forked processes and collect how each ended.

    Each rank gets torchrun's environment and, for ``init_process_group(store=...)``, the
    ``TCPStore``; ``target`` comes through fork, its result must pickle. ``failed(result)``: whether
    a returned result failed (a raise always has); ``after()`` runs in the rank once its result is
    sent (tear-down whose errors must not hide it). Every rank is dead when this returns or raises
    (:class:`Stopped` on SIGTERM / SIGHUP, ``KeyboardInterrupt`` on Ctrl-C)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    import torch.distributed  # noqa: F401  (once, here: each rank would import it again)

    deadline = None if timeout is None else time.monotonic() + timeout
    ctx = multiprocessing.get_context("fork")
    procs: list[Any] = []
    readers: dict[Connection, int] = {}
    beats: Any = ctx.RawArray("d", world_size)  # shared: each rank's last heartbeat (monotonic)

    def start(rank: int, port: int, port_writer: Connection | None) -> None:
        stack_path = None if stack_dir is None else str(stack_dir / f"stack.{rank}")
        spec = _Rank(rank, world_size, port, store_timeout, stack_path, os.getpid(), warn_once)
        reader, writer = ctx.Pipe(duplex=False)
        beats[rank] = time.monotonic()
        child = (spec, target, writer, port_writer, after, beats)
        proc = ctx.Process(target=_child, args=child, name=f"{name}-{rank}", daemon=daemon)
        proc.start()
        writer.close()  # the child holds the only write end: EOF means it died
        procs.append(proc)
        readers[reader] = rank

    watch = _Watch(deadline, error_grace, failed, heartbeat_timeout, beats)
    with _forward_stop_signals() as stop:
        gentle = False  # the launcher is being stopped: let the ranks take SIGTERM first
        try:
            port_reader, port_writer = ctx.Pipe(duplex=False)
            port = None
            with port_reader:
                start(0, 0, port_writer)
                port_writer.close()
                wait_s = PORT_TIMEOUT if deadline is None else max(0.0, deadline - time.monotonic())
                with contextlib.suppress(EOFError, OSError):
                    if port_reader.poll(wait_s):
                        port = int(port_reader.recv_bytes().decode())
            if port is not None:  # otherwise rank 0 failed or hung: collecting reports it
                for rank in range(1, world_size):
                    start(rank, port, None)
            return _collect(procs, readers, watch, stack_dir)
        except _StopSignal as signalled:
            stop.signum, gentle = signalled.signum, True
            raise
        except BaseException:  # KeyboardInterrupt, or a bug here
            gentle = True
            raise
        finally:
            stop.stopping = True
            _stop_all(procs, gentle=gentle)
            for reader in readers:
                reader.close()
            if stop.signum is not None:
                raise Stopped(stop.signum, len(procs)) from None


class _StopSignal(BaseException):
    def __init__(self, signum: int) -> None:
        self.signum = signum


@dataclasses.dataclass
class _StopState:
    signum: int | None = None
    stopping: bool = False  # already reaping: a second signal must not interrupt that


@contextlib.contextmanager
def _forward_stop_signals() -> Any:
    """While ranks run, SIGTERM / SIGHUP raise in the launcher (which stops its ranks) instead of
    killing it and orphaning them; only the main thread can set handlers."""
    state = _StopState()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    def handler(signum: int, frame: Any) -> None:
        if not state.stopping:
            raise _StopSignal(signum)

    saved = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield state
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


def _child(
    spec: _Rank,
    target: Callable[[int, Any], Any],
    writer: Connection,
    port_writer: Connection | None,
    after: Callable[[], None] | None,
    beats: Any,
) -> None:
    code = 0
    try:
        _supervised(spec, beats)
        with contextlib.ExitStack() as stack:
            path = spec.stack_path
            dump = sys.stderr if path is None else stack.enter_context(open(path, "w"))
            faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
            hosted: list[Any] = []  # rank 0's store: its server lives as long as the object
            try:
                message: tuple[Any, ...] = ("ok", _run(spec, target, port_writer, hosted))
            except BaseException:
                message = ("error", traceback.format_exc(), time.time())
            # before the result: once it has every result the launcher kills what is left
            with contextlib.suppress(Exception):
                _stop_children()
            try:
                payload = pickle.dumps(message)
            except Exception:  # the result did not pickle
                text = "result not picklable:\n" + traceback.format_exc()
                payload = pickle.dumps(("error", text, time.time()))
            sys.stdout.flush()  # the launcher may kill the rank once it has the result
            sys.stderr.flush()
            writer.send_bytes(payload)
            if after is not None:
                after()
            while hosted and spec.world_size > 1:
                # the others may still use the store (NCCL emulation, said-once warnings): rank
                # 0 leaves when the launcher, holding every result or a failure, kills it
                time.sleep(3600)
    except BaseException:
        code = 1
    finally:
        with contextlib.suppress(Exception):  # nothing may keep the rank from exiting
            _stop_children()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop_children() -> None:
    """Stop this rank's ``multiprocessing`` children: SIGTERM, a short wait, then SIGKILL."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + STOP_GRACE
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(1.0)


def _supervised(spec: _Rank, beats: Any) -> None:
    """Signals as the launcher wants them, death with the launcher, and a heartbeat."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's handler came with the fork
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != spec.launcher:  # the launcher died before prctl took effect
            os._exit(1)
        _guard_descendants()  # before the heartbeat thread: fork a single-threaded process

    def beat() -> None:
        while True:
            beats[spec.rank] = time.monotonic()
            time.sleep(HEARTBEAT_INTERVAL)

    threading.Thread(target=beat, name="bfpp-heartbeat", daemon=True).start()


def _guard_descendants() -> None:
    """Kill whatever this rank started once the rank is gone, however it went: a guard outside
    the rank's own process group waits for its death, then kills the group (see the docs)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    group = os.getpgid(0)
    if group != os.getpid():
        return  # could not lead a group of our own: killing the group would kill others
    rank, wanted = os.getpid(), {signal.SIGUSR2}
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    try:
        guard = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, wanted)
        return
    if guard != 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, wanted)
        return
    # The guard: no Python beyond these calls (it is a fork of a large process).
    try:
        os.setpgid(0, 0)
        quiet = os.open(os.devnull, os.O_RDWR)  # hold none of the job's pipes open
        for fd in (0, 1, 2):
            os.dup2(quiet, fd)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGUSR2, 0, 0, 0)
        if os.getppid() == rank:  # else the rank died before prctl took effect
            signal.sigwait(wanted)
        os.killpg(group, signal.SIGKILL)
    finally:
        os._exit(0)


def _run(
    spec: _Rank,
    target: Callable[[int, Any], Any],
    port_writer: Connection | None,
    hosted: list[Any],
) -> Any:
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
    if spec.rank == 0:
        hosted.append(store)
    if port_writer is not None:
        port_writer.send_bytes(str(store.port).encode())
        port_writer.close()
    os.environ["MASTER_PORT"] = str(store.port)
    if spec.warn_once:
        _say_once(store)
    return target(spec.rank, store)


def _say_once(store: Any) -> None:
    """Print this rank's warnings and log records unless another rank printed the text first."""
    pid, show = os.getpid(), warnings.showwarning

    def first(text: str) -> bool:
        """True for the first rank of the job to ask about ``text``."""
        if os.getpid() != pid:  # a process the rank forked: the store's socket is not its
            return True
        key = "bfpp-said/" + hashlib.sha256(text.encode()).hexdigest()
        try:
            return int(store.add(key, 1)) == 1
        except Exception:  # the store is gone (rank 0 left): better twice than never
            return True

    def showwarning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if first(f"{category.__name__}:{filename}:{lineno}:{message}"):
            show(message, category, filename, lineno, file, line)

    def once(record: logging.LogRecord) -> bool:
        decided = record.__dict__.get(_DECIDED)  # a record passes several handlers: decide once
        if decided is None:
            text = f"{record.levelname}:{record.name}:{record.getMessage()}"
            decided = record.__dict__[_DECIDED] = first(text)
        return bool(decided)

    warnings.showwarning = showwarning
    for handler in (*logging.getLogger().handlers, logging.lastResort):
        if handler is not None:
            handler.addFilter(once)


def _collect(
    procs: list[Any], readers: dict[Connection, int], watch: _Watch, stack_dir: Path | None
) -> LocalRun:
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    failed_at: dict[int, float] = {}
    lost: list[int] = []
    pending = dict(readers)
    first_error: float | None = None
    while pending:
        wait_s = _wait_time(watch, first_error)
        if wait_s is not None and wait_s <= 0:
            break
        for conn in cast(list[Connection], wait(list(pending), timeout=wait_s)):
            rank = pending.pop(conn)
            status, payload, when = _receive(conn, rank, procs[rank])
            if status == "ok":
                results[rank] = payload
                if watch.failed is None or not watch.failed(payload):
                    continue
                when = time.time()
            else:
                errors[rank] = payload
                if status == "died":
                    lost.append(rank)
            failed_at[rank] = when
        for conn, rank, silence in _silent(pending, watch, failing=bool(failed_at)):
            del pending[conn]
            errors[rank] = (
                f"rank {rank} stopped responding: no heartbeat for {silence:.0f} s "
                "(stopped, or frozen)"
            )
            failed_at[rank] = time.time()
            lost.append(rank)
        if failed_at and first_error is None:
            first_error = time.monotonic()
    killed = tuple(sorted(pending.values()))
    stacks = _dump_stacks(procs, killed, stack_dir) if killed and stack_dir is not None else {}
    return LocalRun(results, errors, failed_at, killed, stacks, tuple(lost))


def _wait_time(watch: _Watch, first_error: float | None) -> float | None:
    """Seconds until the deadline, the end of the grace period or the next heartbeat check."""
    grace_end = None if first_error is None else first_error + watch.error_grace
    limits = [end for end in (watch.deadline, grace_end) if end is not None]
    wait_s = min(limits) - time.monotonic() if limits else None
    if watch.heartbeat_timeout is not None:
        wait_s = HEARTBEAT_INTERVAL if wait_s is None else min(wait_s, HEARTBEAT_INTERVAL)
    return wait_s


def _silent(
    pending: dict[Connection, int], watch: _Watch, *, failing: bool = False
) -> list[tuple[Connection, int, float]]:
    """Ranks silent past the heartbeat limit, or after any failure past
    :data:`SILENT_AFTER_FAILURE`, lest a rank failing on a stopped one's wait be blamed for it."""
    if watch.heartbeat_timeout is None:
        return []
    limit = (
        min(watch.heartbeat_timeout, SILENT_AFTER_FAILURE) if failing else watch.heartbeat_timeout
    )
    now = time.monotonic()
    silences = [(conn, rank, now - watch.beats[rank]) for conn, rank in pending.items()]
    return [(conn, rank, silence) for conn, rank, silence in silences if silence > limit]


def _receive(conn: Connection, rank: int, proc: Any) -> tuple[str, Any, float]:
    try:
        status, payload, *when = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        proc.join(1.0)
        how = f"exit code {proc.exitcode}"
        if proc.exitcode is not None and proc.exitcode < 0:
            with contextlib.suppress(ValueError):
                how = f"killed by {signal.Signals(-proc.exitcode).name}"
        return "died", f"rank {rank} died without a result ({how})", time.time()
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


def _stop_all(procs: list[Any], *, gentle: bool) -> None:
    """Reap every rank: SIGTERM first when the launcher is being stopped (a rank may flush
    output), then SIGKILL for whatever is left; SIGKILL at once otherwise."""
    if gentle:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped rank cannot act on SIGTERM
                    os.kill(proc.pid, signal.SIGTERM)
        end = time.monotonic() + STOP_GRACE
        for proc in procs:
            proc.join(max(0.0, end - time.monotonic()))
    left = [proc for proc in procs if proc.is_alive() and proc.pid is not None]
    descendants = [pid for proc in left for pid in _descendants(proc.pid)]
    for proc in left:
        proc.kill()
    for pid in descendants:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for proc in procs:
        proc.join(5.0)


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux ``/proc``), read before its kill orphans them to init."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            with contextlib.suppress(OSError, ValueError):
                children = [int(c) for c in (task / "children").read_text().split()]
                found.extend(children)
                todo.extend(children)
    return found
