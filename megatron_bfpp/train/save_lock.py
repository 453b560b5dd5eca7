"""One run at a time per ``--save`` directory (two runs mixed their checkpoints): an exclusive
``flock`` on ``DIR/.bfpp_save.lock``, which the kernel releases when its holder dies (a stale file
is taken over). Torch-free: the command line takes the lock before any rank starts."""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
from pathlib import Path

from megatron_bfpp.files import make_dirs
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
        """Take ``root``'s lock (``root`` made first, a symbolic link followed) or raise
        :class:`CheckpointError` in one line naming the holder or why, leaving nothing behind."""
        root = Path(root)
        path = root / LOCK_FILE
        try:
            make_dirs(root)
        except OSError as error:
            raise CheckpointError(_directory_problem(root, error)) from None
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW  # never through a symbolic link
        try:
            try:
                fd, created = os.open(path, flags | os.O_EXCL, 0o666), True
            except FileExistsError:
                fd, created = os.open(path, flags, 0o666), False
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
            _give_up(fd, path, created)
            raise CheckpointError(
                f"--save {root}: cannot lock {LOCK_FILE} ({error.strerror})"
            ) from None
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        line = f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode()
        try:  # written before the old line is cut: a failed write never leaves an empty file
            os.pwrite(fd, line, 0)
            os.ftruncate(fd, len(line))
        except OSError as error:
            _give_up(fd, path, created)
            raise CheckpointError(
                f"--save {root}: cannot write its lock file {LOCK_FILE} ({error.strerror}); "
                "free space there or choose another --save directory"
            ) from None
        return cls(fd, path)

    def release(self) -> None:
        """Unlock; the file stays lest a third run lock a new one while another waits on the old."""
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _directory_problem(root: Path, error: OSError) -> str:
    if error.errno == errno.ELOOP:
        return (
            f"--save {root}: a symbolic link that loops (too many levels of symbolic links); "
            "point it at a directory or remove it"
        )
    where = "" if error.filename in (None, str(root)) else f" ({error.filename})"
    return f"--save {root}: cannot create the directory{where} ({error.strerror})"


def _give_up(fd: int, path: Path, created: bool) -> None:
    """Close the lock file; remove it if this call created it (then nobody else holds it)."""
    if created:
        path.unlink(missing_ok=True)
    os.close(fd)


def _holder(fd: int) -> str:
    """The holder's own line, printable and bounded (the file is data another run wrote)."""
    try:
        raw = os.pread(fd, _MAX_HOLDER_BYTES, 0)
    except OSError:
        return "holder unknown"
    text = raw.decode("utf-8", "replace").splitlines()[0] if raw.strip() else ""
    text = "".join(c if c.isprintable() else "?" for c in text)[:200]
    return text or "holder unknown"
