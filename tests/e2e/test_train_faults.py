"""``bfpp-train`` under faults, as users meet them: a signal to the launcher, a rank killed or
stopped, Ctrl-C, the launcher killed outright. Each ends in bounded time with one line that says
what happened (naming the rank), and leaves no rank process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.processes import alive, descendants, left_alive

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]


def _popen(*command: str) -> subprocess.Popen[str]:
    """``command`` as a terminal job: its own process group, SIGINT at its default, outside any
    launcher's rank environment, its output piped. A suite started in the background by a
    non-interactive shell (``.ci/run &``) inherits SIGINT ignored, which a child keeps across
    exec; a handler (here Python's own) is reset to the default instead, as a terminal's job
    has it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGINT, saved)


def _start(*flags: str) -> subprocess.Popen[str]:
    """bfpp-train started by hand (it forks its own ranks), training until stopped."""
    return _popen(
        "megatron_bfpp.cli.train",
        *("--no-progress", "--train-iters", "100000", "--log-interval", "1"),
        *flags,
    )


def _ranks_when_training(proc: subprocess.Popen[str]) -> list[int]:
    """Wait for the first logged iteration; return the rank processes' pids."""
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if line.startswith("iteration"):
            break
        assert time.monotonic() < deadline, "no iteration within 120 s"
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    ranks = [int(pid) for pid in children]
    assert len(ranks) == 4
    return ranks


def _finish(proc: subprocess.Popen[str], ranks: list[int], within: float) -> tuple[int, list[str]]:
    """The launcher's exit code and error lines once it ends. ``within`` only tells a hang from
    a slow stop: it is generous (90 s where the launcher needs a few seconds), because on a
    machine with many times more runnable processes than cores the launcher's own exit, torch's
    tear-down included, took over 20 s (a full suite at load average 28)."""
    _, err = proc.communicate(timeout=within)  # raises if the launcher is still running then
    time.sleep(0.5)
    left = [pid for pid in ranks if alive(pid)]
    for pid in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"rank processes left behind: {left}"
    return proc.returncode, [line for line in err.splitlines() if line.strip()]


def test_sigterm_to_the_launcher_stops_every_rank() -> None:
    proc = _start()
    ranks = _ranks_when_training(proc)
    proc.send_signal(signal.SIGTERM)
    code, lines = _finish(proc, ranks, within=90)
    assert code == 128 + signal.SIGTERM
    assert lines == ["bfpp-train: error: SIGTERM: stopped all 4 ranks"]


def test_ctrl_c_is_one_line() -> None:
    proc = _start()
    ranks = _ranks_when_training(proc)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal sends it to the whole job
    code, lines = _finish(proc, ranks, within=90)
    assert code == 130
    assert lines == ["bfpp-train: error: interrupted; stopped all 4 ranks"]


def test_killed_rank_is_named_in_one_line() -> None:
    proc = _start()
    ranks = _ranks_when_training(proc)
    os.kill(ranks[2], signal.SIGKILL)
    code, lines = _finish(proc, ranks, within=90)
    assert code == 1
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "bfpp-train: error: rank 2 died without a result (killed by SIGKILL)"
    )


def test_stopped_rank_is_found_by_the_heartbeat() -> None:
    proc = _start("--heartbeat-timeout", "3")
    ranks = _ranks_when_training(proc)
    os.kill(ranks[1], signal.SIGSTOP)
    code, lines = _finish(proc, ranks, within=90)
    assert code == 1
    assert len(lines) == 1, lines
    assert lines[0].startswith("bfpp-train: error: rank 1 stopped responding: no heartbeat for")


@pytest.mark.timeout(420)  # start-up takes minutes on a loaded machine
def test_stopped_rank_is_named_by_the_waiting_rank_within_the_distributed_timeout() -> None:
    """With the launcher's heartbeat limit far away, the bound is --distributed-timeout-minutes:
    the ranks waiting on the stopped one (and on them, a cascade) fail after 15 s; the launcher,
    seeing rank 1 silent while others fail, names it, not the cascade's peers, in one line, and
    ends every rank, the stopped one included."""
    proc = _start("--heartbeat-timeout", "600", "--distributed-timeout-minutes", "0.25")
    ranks = _ranks_when_training(proc)
    os.kill(ranks[1], signal.SIGSTOP)
    code, lines = _finish(proc, ranks, within=150)
    assert code == 1
    assert len(lines) == 1, lines
    assert lines[0].startswith("bfpp-train: error: rank 1 stopped responding: no heartbeat for")


def test_ranks_die_with_a_killed_launcher() -> None:
    proc = _start()
    ranks = _ranks_when_training(proc)
    proc.kill()
    proc.communicate(timeout=10)
    left = left_alive(ranks)
    assert not left, f"orphaned ranks: {left}"


# --------------------------------------------------------------------------- torchrun / srun


def _start_launched_ranks(port: int, *flags: str) -> list[subprocess.Popen[str]]:
    """Four ranks as srun starts them (or torchrun on several nodes: no launcher of ours above
    them): one process each, told its place by the environment; rank 0 hosts the store.

    On plain gloo: these tests are about how gloo's fast failure is reported. Under NCCL's rules
    (the tests' emulation) a send to a dead rank waits until a timeout, as NCCL's watchdog does,
    so a survivor would only fail at the emulation's stall limit (60 s)."""
    procs = []
    for rank in range(4):
        env = dict(
            os.environ,
            BFPP_NCCL_EMULATION="0",
            RANK=str(rank),
            WORLD_SIZE="4",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="4",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "megatron_bfpp.cli.train",
                    *("--no-progress", "--train-iters", "100000", "--log-interval", "1"),
                    *flags,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    return procs


@pytest.mark.parametrize(
    ("victim", "expected"),
    [
        (2, "bfpp-train: error: rank 2 is gone: its heartbeat stopped"),
        (0, "bfpp-train: error: lost the job's rendezvous store at 127.0.0.1:"),
    ],
    ids=["rank-2", "rank-0-hosting-the-store"],
)
def test_killed_launched_rank_is_one_line_from_the_survivors(victim: int, expected: str) -> None:
    """Under srun (and torchrun across nodes) every surviving rank used to print a gloo
    traceback, most blaming the wrong rank; now the job says once which rank is gone."""
    import threading

    procs = _start_launched_ranks(free_port())
    errors: dict[int, list[str]] = {rank: [] for rank in range(4)}
    readers = [
        threading.Thread(target=lambda r=r, p=p: errors[r].extend(p.stderr), daemon=True)
        for r, p in enumerate(procs)
    ]
    for reader in readers:
        reader.start()
    for proc in procs[1:]:
        threading.Thread(target=proc.stdout.read, daemon=True).start()
    try:
        assert procs[0].stdout is not None
        deadline = time.monotonic() + 120
        for line in procs[0].stdout:
            if line.startswith("iteration"):
                break
            assert time.monotonic() < deadline, "no iteration within 120 s"
        threading.Thread(target=procs[0].stdout.read, daemon=True).start()
        start = time.monotonic()
        procs[victim].kill()
        for proc in procs:
            proc.wait(timeout=max(1.0, 60 - (time.monotonic() - start)))
        for reader in readers:
            reader.join(5)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = [line.rstrip() for rank in range(4) for line in errors[rank] if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(expected), lines[0]
    assert all(proc.returncode != 0 for proc in procs)


def test_nothing_outlives_a_launcher_killed_while_saving_torch_dist(tmp_path: Path) -> None:
    """megatron-core's torch_dist writer starts processes in every rank (a Manager server,
    multiprocessing's resource tracker). With the launcher killed by SIGKILL they used to
    outlive the job, holding its output pipes (3 of 3 times, one set alive after 32 minutes):
    now every process of the job is gone and the pipes close."""
    pytest.importorskip("psutil")
    proc = _start("--ckpt-format", "torch_dist", "--save", str(tmp_path / "ckpt"),
                  "--save-interval", "1")  # fmt: skip
    assert proc.stdout is not None
    seen = 0
    for line in proc.stdout:  # two iterations: the writer's processes exist after the first save
        seen += line.startswith("iteration")
        if seen == 2:
            break
    everything = descendants(proc.pid)
    assert len(everything) > 4, everything  # the ranks and what they started
    proc.kill()
    proc.communicate(timeout=60)  # returns only once every holder of the pipes is gone
    left = left_alive(everything)
    assert not left, f"processes left behind: {left}"


# --------------------------------------------------------------------------- a stopped rank


def _torchrun(*flags: str) -> subprocess.Popen[str]:
    """Four CPU ranks under torchrun (its agent hosts the store), pipeline size 4."""
    return _popen(
        "torch.distributed.run",
        *("--nproc-per-node", "4", "--master-port", str(free_port())),
        "-m",
        "megatron_bfpp.cli.train",
        *("--no-progress", "--log-interval", "1", "--pipeline-model-parallel-size", "4"),
        *flags,
    )


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [e[5:] for e in environ if e.startswith(b"RANK=")]
    return int(found[0]) if found else None


def _workers(proc: subprocess.Popen[str], count: int) -> dict[int, int]:
    """rank -> pid of torchrun's workers, once all ``count`` have started."""
    deadline = time.monotonic() + 120
    while True:
        workers = {r: pid for pid in descendants(proc.pid) if (r := _rank_of(pid)) is not None}
        if len(workers) >= count:
            return workers
        assert proc.poll() is None and time.monotonic() < deadline, "workers never started"
        time.sleep(0.05)


def _bfpp_lines(proc: subprocess.Popen[str], pids: list[int], within: float) -> list[str]:
    """bfpp-train's error lines once torchrun ended (``within``: a bound on a hang, not a
    timing); every process it started is gone."""
    try:
        _, err = proc.communicate(timeout=within)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = left_alive(pids)
    assert not left, f"processes left behind: {left}"
    assert proc.returncode != 0
    return [line for line in err.splitlines() if line.startswith("bfpp-train:")]


@pytest.mark.timeout(420)  # start-up takes minutes on a loaded machine
def test_stopped_rank_under_torchrun_is_named_within_the_timeout() -> None:
    """A rank stopped with SIGSTOP used to leave the others in a pipeline receive for good
    (megatron-core's groups kept their default 30 minutes, and no wait was bounded); with
    --distributed-timeout-minutes 0.25 the receive fails after 15 s, the heartbeats say which
    rank stopped, one line names it, and torchrun ends every worker."""
    proc = _torchrun("--train-iters", "100000", "--distributed-timeout-minutes", "0.25")
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        if line.startswith("iteration"):
            break
        assert time.monotonic() < deadline, "no iteration within 240 s"
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    workers = _workers(proc, 4)
    os.kill(workers[2], signal.SIGSTOP)
    lines = _bfpp_lines(proc, [*workers.values()], within=180)
    assert len(lines) == 1, lines
    assert lines[0].startswith("bfpp-train: error: rank 2 is gone: its heartbeat stopped"), lines


@pytest.mark.timeout(420)  # start-up takes minutes on a loaded machine
def test_rank_stopped_during_start_up_under_torchrun_is_one_line() -> None:
    """A rank stopped before it joins the rendezvous: the others used to print a DistStoreError
    traceback each; now one line says the rendezvous did not complete, within the timeout."""
    proc = _torchrun("--train-iters", "2", "--distributed-timeout-minutes", "0.25")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
    workers = _workers(proc, 4)
    os.kill(workers[3], signal.SIGSTOP)  # before its imports are done: it never joins
    lines = _bfpp_lines(proc, [*workers.values()], within=180)
    assert len(lines) == 1, lines
    assert "the job's rendezvous at " in lines[0], lines
    assert "did not complete within 15 s (--distributed-timeout-minutes)" in lines[0], lines


@pytest.mark.timeout(420)  # start-up takes minutes on a loaded machine
def test_stopped_rank_under_srun_is_named_within_the_timeout() -> None:
    """Ranks as srun starts them (rank 0 hosts the store): a rank stopped with SIGSTOP is named
    in one line once the waits on it pass --distributed-timeout-minutes, and every other rank
    exits (srun then ends the step, the stopped rank with it; here the test kills it)."""
    procs = _start_launched_ranks(free_port(), "--distributed-timeout-minutes", "0.25")
    errors: dict[int, list[str]] = {rank: [] for rank in range(4)}
    for rank, proc in enumerate(procs):
        threading.Thread(
            target=lambda r=rank, p=proc: errors[r].extend(p.stderr), daemon=True
        ).start()
    for proc in procs[1:]:
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
    try:
        assert procs[0].stdout is not None
        deadline = time.monotonic() + 240
        for line in procs[0].stdout:
            if line.startswith("iteration"):
                break
            assert time.monotonic() < deadline, "no iteration within 240 s"
        threading.Thread(target=procs[0].stdout.read, daemon=True).start()
        os.kill(procs[2].pid, signal.SIGSTOP)
        for rank, proc in enumerate(procs):
            if rank != 2:
                proc.wait(timeout=150)  # a bound on a hang, not a timing
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    time.sleep(1)
    lines = [line.rstrip() for rank in range(4) for line in errors[rank] if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("bfpp-train: error: rank 2 is gone: its heartbeat stopped"), lines


# A store whose host (rank 0) has left, met by another rank's store call: what a forked rank's
# last warn-once bookkeeping met under load once, rank 0 having reported and exited first.
_STORE_GONE = """
import datetime, os, signal, sys, time
from megatron_bfpp.cli import train

def spawn(args, world_size):
    import torch.distributed as dist
    reader, writer = os.pipe()
    host = os.fork()
    if host == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        os.write(writer, str(store.port).encode())
        time.sleep(60)
        os._exit(0)
    port = int(os.read(reader, 32))
    client = dist.TCPStore("127.0.0.1", port, timeout=datetime.timedelta(seconds=10))
    client.add("said", 1)
    os.kill(host, signal.SIGKILL)
    os.waitpid(host, 0)
    try:
        client.add("said", 1)
    except Exception as error:
        print(type(error).__name__)
    return 0

train._spawn = spawn
sys.exit(train.main([]))
"""


def test_a_store_call_after_the_store_host_left_adds_no_cpp_warning() -> None:
    # bfpp-train sets torch's C++ log level to errors before torch is imported, so that its
    # forked ranks (as ranks under torchrun) print no C++ warning and stack of frames when the
    # store's host is gone: at torch's default level this prints a warning and its stack of
    # frames (16 lines with torch 2.13.0).
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    run = subprocess.run(
        [sys.executable, "-c", _STORE_GONE], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["DistNetworkError"]
    assert "TCPStore" not in run.stderr and "frame #" not in run.stderr, run.stderr
