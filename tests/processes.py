"""Processes a test started, seen through Linux /proc: alive or not, what is below a pid, and
the check that a set of them is gone (killing any left, so no test leaves one to the next)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent's wait() counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found.extend(children)
            todo.extend(children)
    return found


def left_alive(pids: Iterable[int], *, within: float = 10.0) -> list[int]:
    """The pids still running after up to ``within`` seconds of waiting for them to go (a bound
    on the wait for a hang, not a timing); those are killed before this returns."""
    pids = list(pids)
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left
