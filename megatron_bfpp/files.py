"""Every file the product writes (:func:`write_output`) and directory it fills (:func:`make_dirs`)
lands where the user said: a device, FIFO or socket written in place, a symbolic link followed (a
rename would replace either), a regular or new file replaced atomically, permissions kept."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

__all__ = ["TEMP_INFIX", "follow_links", "fsync_dir", "make_dirs", "write_output"]

TEMP_INFIX = ".tmp-"  # name + TEMP_INFIX + 12 hex digits: the temporary file beside the target
_MAX_LINKS = 40  # as many links as Linux follows in one lookup
_MAX_STEM = 200  # of the target's name in its temporary file's (the file system takes 255)


def follow_links(path: str | Path) -> Path:
    """``path`` with its last component's symbolic links followed as ``open`` does (dangling: the
    path it names); a loop: ``OSError(ELOOP)`` naming ``path``; directories above: the kernel's."""
    target = Path(path)
    for _ in range(_MAX_LINKS):
        try:
            link = os.readlink(target)
        except OSError:  # not a link (EINVAL), missing, or a lookup the caller's call reports
            return target
        target = target.parent / link  # an absolute link replaces the whole path
    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))


def make_dirs(path: str | Path) -> Path:
    """``mkdir -p path`` following a symbolic link at ``path`` (a dangling one's target is made)
    instead of "File exists"; returns the directory. A looping link: ``OSError(ELOOP)``."""
    target = follow_links(path)
    target.mkdir(parents=True, exist_ok=True)
    return target


def write_output(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` as the module docstring says (a device in place, a link's target,
    a regular file atomically); OSError naming the file, leaving no temporary file behind."""
    info: os.stat_result | None = None
    with contextlib.suppress(FileNotFoundError):
        info = os.stat(path)  # follows links as the kernel does
    if info is not None and not stat.S_ISREG(info.st_mode):
        fd = os.open(path, os.O_WRONLY)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        return
    _replace(follow_links(path), data, None if info is None else stat.S_IMODE(info.st_mode))


def _replace(target: Path, data: bytes, mode: int | None) -> None:
    """A temporary file beside ``target`` (same file system: the rename is atomic), synced,
    renamed over it. (Not ``tempfile``: its files are private to the user; these get the
    permissions ``open`` gives under the umask, or the replaced file's.)"""
    while True:
        temp = target.with_name(target.name[:_MAX_STEM] + TEMP_INFIX + secrets.token_hex(6))
        with contextlib.suppress(FileExistsError):
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
    try:
        with os.fdopen(fd, "wb") as file:
            if mode is not None:
                os.fchmod(file.fileno(), mode)
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def fsync_dir(path: str | Path) -> None:
    """Make renames and new entries in ``path`` durable (no-op where directories cannot open)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
