"""One run at a time per ``--save`` directory.

Two runs saving into one directory used to both exit 0 with the first run's checkpoint
directories holding the second run's weights and metadata, and, started together, one's
clean-up deleted the other's temporary directory. A run now holds an exclusive lock on
``DIR/.bfpp_save.lock`` from before its ranks start to its end; a second run is refused in one
line naming the holder (process, host, start time: written into the file by the holder).

The lock is ``flock`` on an open file: the kernel releases it when the holder's last process
dies, however it dies (SIGKILL included), so a stale file from a dead run is simply taken over:
there is no pid to check and no race between checking and taking. ``flock`` covers the
processes of one machine and, on Linux, NFS (it is emulated with POSIX locks there); on file
systems that ignore it (Lustre mounted without ``flock``) the lock does not protect (the README
says so): keep one run per ``--save`` there.

Torch-free: the command line takes the lock before any rank starts.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
from pathlib import Path

from megatron_bfpp.train.checkpoint_files import LOCK_FILE, CheckpointError

__all__ = ["LOCK_FILE", "SaveLock"]

_MAX_HOLDER_BYTES = 512  # what a holder writes is one short line; read no more than this


class SaveLock:
    """Held from :meth:`acquire` to :meth:`release` (or the process's end)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, root: str | Path) -> SaveLock:
        """Take ``root``'s lock or raise :class:`CheckpointError` naming the run that holds it."""
        root = Path(root)
        path = root / LOCK_FILE
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError as error:
            raise CheckpointError(
                f"--save {root}: cannot create its lock file {LOCK_FILE} ({error.strerror})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise CheckpointError(
                f"--save {root}: another run is saving there ({holder}); give this run "
                "another --save directory, or wait for that one to end"
            ) from None
        except OSError as error:
            os.close(fd)
            raise CheckpointError(
                f"--save {root}: cannot lock {LOCK_FILE} ({error.strerror})"
            ) from None
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        line = f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, line.encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        """Unlock (the file stays: removing it would let a third run lock a fresh file while a
        second still waits on the old one)."""
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _holder(fd: int) -> str:
    """The holder's own line, printable and bounded (the file is data another run wrote)."""
    try:
        raw = os.pread(fd, _MAX_HOLDER_BYTES, 0)
    except OSError:
        return "holder unknown"
    text = raw.decode("utf-8", "replace").splitlines()[0] if raw.strip() else ""
    text = "".join(c if c.isprintable() else "?" for c in text)[:200]
    return text or "holder unknown"
