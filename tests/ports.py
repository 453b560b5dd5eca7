"""Ports for the rendezvous stores the tests' launches host.

A port found free and then closed can be taken before torchrun's agent (or rank 0) binds it
again. The kernel hands out ports for outgoing connections (gloo's, the other lane's) from
``ip_local_port_range`` (32768-60999 on Linux), so a port chosen below that range races only
with another test choosing the same number; a launch that still loses the race is started again
on another port (:func:`run_launch`), never passed as a result."""

from __future__ import annotations

import random
import socket
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

_LOW, _HIGH = 20000, 32000  # below Linux's ephemeral range
TAKEN = "EADDRINUSE"  # what torch's TCPStore prints when the port was taken


def free_port() -> int:
    """A port that no socket on this machine holds now, outside the ephemeral range."""
    for _ in range(200):
        port = random.randrange(_LOW, _HIGH)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_LOW}-{_HIGH} after 200 tries")


def run_launch(
    command: Callable[[int], Sequence[str]], *, attempts: int = 3, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command(port), **kwargs)`` on a fresh port, started again (up to
    ``attempts`` times) only when the store could not bind its port."""
    for attempt in range(attempts):
        result = subprocess.run(list(command(free_port())), **kwargs)
        output = (result.stdout or "") + (result.stderr or "")
        if result.returncode == 0 or TAKEN not in output or attempt == attempts - 1:
            return result
    raise AssertionError("unreachable")
