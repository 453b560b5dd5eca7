"""``bfpp-train`` under faults, as users meet them: a signal to the launcher, a rank killed or
stopped, Ctrl-C, the launcher killed outright. Each ends in bounded time with one line that says
what happened (naming the rank), and leaves no rank process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(180)]


def _start(*flags: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_bfpp.cli.train",
            "--no-progress",
            "--train-iters",
            "100000",
            "--log-interval",
            "1",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, as a terminal job would have
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


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _finish(proc: subprocess.Popen[str], ranks: list[int], within: float) -> tuple[int, list[str]]:
    start = time.monotonic()
    _, err = proc.communicate(timeout=within)
    took = time.monotonic() - start
    time.sleep(0.5)
    left = [pid for pid in ranks if _alive(pid)]
    for pid in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"rank processes left behind: {left}"
    assert took < within
    return proc.returncode, [line for line in err.splitlines() if line.strip()]


def test_sigterm_to_the_launcher_stops_every_rank() -> None:
    proc = _start()
    ranks = _ranks_when_training(proc)
    proc.send_signal(signal.SIGTERM)
    code, lines = _finish(proc, ranks, within=20)
    assert code == 128 + signal.SIGTERM
    assert lines == ["bfpp-train: error: SIGTERM: stopped all 4 ranks"]


def test_ctrl_c_is_one_line() -> None:
    proc = _start()
    ranks = _ranks_when_training(proc)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal sends it to the whole job
    code, lines = _finish(proc, ranks, within=20)
    assert code == 130
    assert lines == ["bfpp-train: error: interrupted; stopped all 4 ranks"]


def test_killed_rank_is_named_in_one_line() -> None:
    proc = _start()
    ranks = _ranks_when_training(proc)
    os.kill(ranks[2], signal.SIGKILL)
    code, lines = _finish(proc, ranks, within=30)
    assert code == 1
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "bfpp-train: error: rank 2 died without a result (killed by SIGKILL)"
    )


def test_stopped_rank_is_found_by_the_heartbeat() -> None:
    proc = _start("--heartbeat-timeout", "3")
    ranks = _ranks_when_training(proc)
    os.kill(ranks[1], signal.SIGSTOP)
    code, lines = _finish(proc, ranks, within=40)
    assert code == 1
    assert len(lines) == 1, lines
    assert lines[0].startswith("bfpp-train: error: rank 1 stopped responding: no heartbeat for")


def test_ranks_die_with_a_killed_launcher() -> None:
    proc = _start()
    ranks = _ranks_when_training(proc)
    proc.kill()
    proc.communicate(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in ranks if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"orphaned ranks: {left}"
