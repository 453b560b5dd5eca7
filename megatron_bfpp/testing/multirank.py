"""Run a function on N gloo ranks with megatron-core's parallel state set up; fast, never hangs.

The parent imports megatron-core once (:func:`preload_megatron`), then every :func:`run_ranks`
call forks one process per rank (``multiprocessing`` "fork" context), so a test pays for process
start-up and process groups, not for importing torch and megatron again. Each call gets a fresh
rendezvous port without a race: rank 0 is forked first and hosts the ``TCPStore`` on
``127.0.0.1:0`` (the kernel picks a free port), reports the port through a pipe, and only then
are the other ranks forked to join it. The parent itself starts no threads (a store server
thread in the parent was inherited mid-lock by forked children and hung them in ``TCPStore``).

Each child: sets ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; one
intra-op thread; enables the CPU adapter (:mod:`megatron_bfpp.testing.cpu`); initialises gloo and
``parallel_state.initialize_model_parallel(tp, pp, vp)``; seeds (``random``, ``torch``,
``model_parallel_cuda_manual_seed``); runs ``fn(*args)``; sends the picklable result, or the
formatted exception, through its own pipe; destroys the groups and ``os._exit``-s.

The parent collects the results until a deadline. On a child error it waits a short grace period
for the other ranks, then kills the rest; on timeout it kills every child still running. Either
way it raises :class:`RanksFailed` with each rank's traceback, and for ranks that were still
running, their Python stacks at the moment they were killed (dumped by ``faulthandler`` on
``SIGUSR1``), so a deadlock shows where every rank was waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import multiprocessing
import os
import pickle
import random
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

__all__ = ["RanksFailed", "preload_megatron", "run_ranks"]

DEFAULT_TIMEOUT = 120.0
ERROR_GRACE = 1.0  # seconds the other ranks get to report after the first error
_STACK_DUMP_WAIT = 0.5


class RanksFailed(RuntimeError):
    """One or more ranks raised, died or timed out. ``reports`` maps every rank to its
    traceback, its stacks when killed, or "finished normally"; ``first_failed`` is the rank whose
    failure came first (the others often fail because it left)."""

    def __init__(
        self, summary: str, reports: dict[int, str], first_failed: int | None = None
    ) -> None:
        self.summary = summary
        self.reports = dict(reports)
        self.first_failed = first_failed  # None: nothing failed, something timed out
        body = "\n".join(
            f"----- rank {rank} -----\n{text.rstrip()}" for rank, text in sorted(reports.items())
        )
        super().__init__(f"{summary}\n{body}")


def preload_megatron() -> None:
    """Import torch and the megatron-core modules the tests use, once, in the parent."""
    import megatron.core.distributed
    import megatron.core.models.gpt
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.optimizer
    import megatron.core.parallel_state
    import megatron.core.pipeline_parallel.schedules
    import megatron.core.tensor_parallel  # noqa: F401

    from megatron_bfpp.testing import cpu, models  # noqa: F401


def run_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    vp: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    args: Sequence[Any] = (),
    seed: int = 1234,
    parallel_kwargs: dict[str, Any] | None = None,
    error_grace: float = ERROR_GRACE,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` forked gloo ranks; return the results by global rank.

    ``fn`` and ``args`` are inherited through ``fork`` (closures and lambdas are fine); each
    result must be picklable. ``world_size`` must be a multiple of ``tp * pp`` (the rest is data
    parallel). ``parallel_kwargs`` go to ``initialize_model_parallel`` as extra keywords.
    After the first failure the other ranks get ``error_grace`` seconds to report their own
    (raise it to test how the survivors of a failure fail).
    Raises :class:`RanksFailed` if any rank raises, dies, or is still running after ``timeout``
    seconds; every child is killed before this returns or raises.
    """
    if world_size < 1 or world_size % (tp * pp):
        raise ValueError(f"world_size={world_size} is not a multiple of tp*pp={tp * pp}")
    preload_megatron()
    deadline = time.monotonic() + timeout
    ctx = multiprocessing.get_context("fork")
    procs: list[Any] = []
    readers: dict[Connection, int] = {}
    with tempfile.TemporaryDirectory(prefix="bfpp-ranks-") as tmp:
        stacks = [Path(tmp, f"stack.{rank}") for rank in range(world_size)]

        def start(rank: int, port: int, port_writer: Connection | None) -> None:
            reader, writer = ctx.Pipe(duplex=False)
            spec = _ChildSpec(rank, world_size, port, tp, pp, vp, seed, timeout)
            proc = ctx.Process(
                target=_child,
                args=(spec, fn, tuple(args), writer, port_writer, str(stacks[rank])),
                kwargs={"parallel_kwargs": parallel_kwargs or {}},
                name=f"bfpp-rank-{rank}",
                daemon=True,
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
            if port is not None:  # otherwise rank 0 failed or hung: _collect reports it
                for rank in range(1, world_size):
                    start(rank, port, None)
            results = _collect(procs, readers, stacks, deadline, timeout, error_grace)
            if len(results) != world_size:  # rank 0 returned without ever reporting its port
                raise RanksFailed("rank 0 never reported the rendezvous port", {})
        finally:
            _kill_all(procs)
            for reader in readers:
                reader.close()
    return [results[rank] for rank in range(world_size)]


def _read_port(port_reader: Connection, deadline: float) -> int | None:
    try:
        if port_reader.poll(max(0.0, deadline - time.monotonic())):
            return int(port_reader.recv_bytes().decode())
    except (EOFError, OSError):
        pass
    return None


@dataclasses.dataclass(frozen=True)
class _ChildSpec:
    rank: int
    world_size: int
    port: int
    tp: int
    pp: int
    vp: int | None
    seed: int
    timeout: float


def _child(
    spec: _ChildSpec,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    writer: Connection,
    port_writer: Connection | None,
    stack_path: str,
    *,
    parallel_kwargs: dict[str, Any],
) -> None:
    code = 0
    try:
        with open(stack_path, "w") as stack_file:
            faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
            try:
                message: tuple[Any, ...] = (
                    "ok",
                    _run_child(spec, fn, args, port_writer, parallel_kwargs),
                )
            except BaseException:
                message = ("error", traceback.format_exc(), time.time())
            try:
                payload = pickle.dumps(message)
            except Exception:  # the result did not pickle
                text = "result not picklable:\n" + traceback.format_exc()
                payload = pickle.dumps(("error", text, time.time()))
            # Plain pickle bytes, not Connection.send: torch registers ForkingPickler reducers that
            # pass tensors as shared-memory handles, which die with this process.
            writer.send_bytes(payload)
            _teardown()
    except BaseException:
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_child(
    spec: _ChildSpec,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    port_writer: Connection | None,
    parallel_kwargs: dict[str, Any],
) -> Any:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_bfpp.testing.cpu import enable_cpu_megatron

    torch.set_num_threads(1)
    enable_cpu_megatron()
    store = dist.TCPStore(
        "127.0.0.1",
        spec.port,  # 0 on rank 0: the kernel picks a free port
        spec.world_size,
        is_master=spec.rank == 0,
        timeout=timedelta(seconds=spec.timeout),
        wait_for_workers=False,
    )
    if port_writer is not None:
        port_writer.send_bytes(str(store.port).encode())
        port_writer.close()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.rank),
    )
    dist.init_process_group(
        "gloo",
        store=store,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout),
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vp,
        **parallel_kwargs,
    )
    random.seed(spec.seed)
    torch.manual_seed(spec.seed)
    mrandom.model_parallel_cuda_manual_seed(spec.seed)
    return fn(*args)


def _teardown() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _collect(
    procs: list[Any],
    readers: dict[Connection, int],
    stacks: list[Path],
    deadline: float,
    timeout: float,
    error_grace: float = ERROR_GRACE,
) -> dict[int, Any]:
    results: dict[int, Any] = {}
    reports: dict[int, str] = {}
    pending = dict(readers)
    first_error: float | None = None
    failed_at: dict[int, float] = {}  # wall-clock time of each failure, to name the first
    while pending:
        now = time.monotonic()
        limit = deadline if first_error is None else min(deadline, first_error + error_grace)
        if now >= limit:
            break
        for conn in wait(list(pending), timeout=limit - now):
            assert isinstance(conn, Connection)
            rank = pending.pop(conn)
            try:
                status, payload, *when = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                procs[rank].join(1.0)
                status, when = "error", [time.time()]
                payload = f"rank {rank} died without a result (exit code {procs[rank].exitcode})"
            if status == "ok":
                results[rank] = payload
            else:
                reports[rank] = payload
                failed_at[rank] = when[0]
                if first_error is None:
                    first_error = time.monotonic()
    if not pending and not reports:
        return results
    stuck = sorted(pending.values())
    for rank, stack in zip(
        stuck, _dump_stacks([procs[r] for r in stuck], [stacks[r] for r in stuck]), strict=True
    ):
        reports[rank] = "still running when killed; its stacks:\n" + stack
    for rank in results:
        reports[rank] = "finished normally"
    first = min(failed_at, key=failed_at.__getitem__) if failed_at else None
    if first is None:
        summary = f"timed out after {timeout:g} s; ranks still running: {stuck}"
    else:
        summary = f"rank {first} failed first"
        if len(failed_at) > 1:
            summary += f"; then ranks {sorted(set(failed_at) - {first})} failed"
        if stuck:
            summary += f"; killed ranks {stuck}"
    raise RanksFailed(summary, reports, first_failed=first)


def _dump_stacks(procs: list[Any], paths: list[Path]) -> list[str]:
    """Ask each live process for its Python stacks (faulthandler on SIGUSR1) and read them."""
    signalled = False
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGUSR1)
                signalled = True
    if signalled:
        time.sleep(_STACK_DUMP_WAIT)
    texts = []
    for path in paths:
        try:
            text = path.read_text()
        except OSError:
            text = ""
        texts.append(text or "(no stack dump)")
    return texts


def _kill_all(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5.0)
