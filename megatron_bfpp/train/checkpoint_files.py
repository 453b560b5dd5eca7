"""A checkpoint directory's files in Megatron-LM's layout (the tracker, ``iter_NNNNNNN/``) and the
atomic steps that publish one, so a save killed at any moment keeps the last complete checkpoint
(docs/train.md, "Checkpoints"). Torch-free: the command line reads a checkpoint before any rank."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from megatron_bfpp.files import TEMP_INFIX, fsync_dir, make_dirs, write_output

__all__ = [
    "LOCK_FILE",
    "METADATA_FILE",
    "TRACKER",
    "CheckpointError",
    "checkpoint_dir",
    "clean_stale",
    "complete_checkpoint",
    "fresh_start_reason",
    "fsync_dir",
    "fsync_file",
    "make_temp_dir",
    "publish",
    "read_bounded",
    "read_tracker",
    "regular_file_problem",
    "remove_old",
    "save_path_problem",
    "write_tracker",
]

TRACKER = "latest_checkpointed_iteration.txt"
METADATA_FILE = "bfpp_checkpoint.json"
_TEMP = TEMP_INFIX  # the tracker's temporary file, as files.write_output names it
_OLD = ".old-"
_SIDE_DIR = re.compile(r"^iter_(\d{7})\.(tmp|old)-[A-Za-z0-9_]+$")
LOCK_FILE = ".bfpp_save.lock"  # :mod:`.save_lock`'s
# Left before a save's first publish: its temporary directory and tracker file, and the save lock.
_LEFT_BEFORE_FIRST_CHECKPOINT = re.compile(
    rf"^(iter_\d{{7}}\.tmp-[A-Za-z0-9_]+|{re.escape(TRACKER + _TEMP)}[A-Za-z0-9_]+"
    rf"|{re.escape(LOCK_FILE)})$"
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, written or resumed; the message names the file or flags."""


def checkpoint_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


TRACKER_LIMIT = 64  # an iteration number and a newline, with room to spare
_MAX_ITERATION_DIGITS = 15


def regular_file_problem(path: Path) -> str | None:
    """Why ``path`` is not a regular file of the checkpoint (a symlink, which could point
    anywhere, a FIFO, a directory), from ``lstat`` alone: checked before anything opens it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "is missing"
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    if stat.S_ISLNK(mode):
        return "is a symbolic link (a checkpoint holds only its own regular files)"
    return None if stat.S_ISREG(mode) else "is not a regular file"


def read_bounded(path: Path, limit: int, *, label: str) -> bytes:
    """A small file's bytes: a regular file (not followed through a symlink, a FIFO never
    waited on) of at most ``limit`` bytes, else :class:`CheckpointError` naming ``label``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as error:
        problem = regular_file_problem(path) or f"cannot be read ({error.strerror})"
        raise CheckpointError(f"{label} {problem}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{label} is not a regular file")
        if info.st_size > limit:
            raise CheckpointError(
                f"{label} has {info.st_size:,} bytes, more than such a file holds ({limit:,}); "
                "it was not written by bfpp-train"
            )
        data = os.read(fd, limit + 1)
    except OSError as error:
        raise CheckpointError(f"{label} cannot be read ({error.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew after the fstat
        raise CheckpointError(
            f"{label} has more than {limit:,} bytes; it was not written by bfpp-train"
        )
    return data


def read_tracker(root: str | Path) -> int:
    """The iteration ``root``'s tracker names (read bounded: a tracker is one short line)."""
    tracker, label = Path(root) / TRACKER, f"--load {root}: {TRACKER}"
    try:
        raw = read_bounded(tracker, TRACKER_LIMIT, label=label)
    except FileNotFoundError:
        raise CheckpointError(
            f"--load {root}: no {TRACKER} (not a bfpp-train checkpoint)"
        ) from None
    text = raw.decode("ascii", "replace").strip()
    if not (text.isascii() and text.isdigit()) or len(text) > _MAX_ITERATION_DIGITS:
        shown = "".join(c if c.isprintable() else "?" for c in text[:40])
        raise CheckpointError(f"{label} holds {shown!r}, not an iteration number")
    return int(text)


def fresh_start_reason(root: str | Path) -> str | None:
    """Why ``--load root`` starts from iteration 0 as Megatron-LM does with no tracker (a requeued
    job's first start): only when missing or holding just what a first save leaves (other files
    suggest a wrong path); ``None``: something to resume, or :func:`read_tracker` refuses it."""
    root = Path(root)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return "does not exist yet"
    except OSError:
        return None  # not a directory, unreadable: read_tracker names it
    if not names:
        return "is empty"
    if all(_LEFT_BEFORE_FIRST_CHECKPOINT.match(name) for name in names):
        return "holds no complete checkpoint yet (only what an interrupted first save left)"
    return None


_SUFFIX_CHARS = 12  # hex digits of a temporary directory's random suffix


def save_path_problem(root: str, *, world_size: int, iterations: int) -> str | None:
    """Whether every file a save creates under ``root`` has a path the file system takes, checked
    at start: a valid but too long ``--save`` path failed only at the first save, after training."""
    # the longest: a set-aside checkpoint's file (rank, __RANK_N.distcp, metadata) or tracker temp
    top = os.path.abspath(root)
    aside = f"iter_{'0' * max(7, len(str(iterations)))}{_OLD}{'f' * _SUFFIX_CHARS}"
    last = max(world_size - 1, 0)
    inner = max(f"rank_{last:05d}.pt", f"__{last}_99.distcp", METADATA_FILE, key=len)
    longest = max(
        os.path.join(top, aside, inner),
        os.path.join(top, f"{TRACKER}{_TEMP}{'f' * _SUFFIX_CHARS}"),
        key=len,
    )
    start = Path(top)
    existing = next((p for p in (start, *start.parents) if os.path.exists(p)), Path("/"))
    try:
        path_max = os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        path_max = 4096
    if (size := len(os.fsencode(longest))) >= path_max:
        return (
            f"--save {root}: too long for the checkpoint files a save creates there ({size:,} "
            f"bytes for {os.path.relpath(longest, start)}, the file system takes "
            f"{path_max - 1:,}); choose a shorter path"
        )
    return None


def fsync_file(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def write_tracker(root: str | Path, iteration: int) -> None:
    """Replace the tracker atomically (:func:`megatron_bfpp.files.write_output`: never torn)."""
    write_output(Path(root) / TRACKER, f"{iteration}\n".encode())


def make_temp_dir(root: str | Path, iteration: int) -> Path:
    """A fresh directory beside ``iter_N`` (same file system: an atomic rename) with ``mkdir``'s
    umask permissions (``root`` made first; a symbolic link there is followed)."""
    make_dirs(root)
    name = checkpoint_dir(root, iteration).name
    while True:
        temp = Path(root) / f"{name}{_TEMP}{secrets.token_hex(_SUFFIX_CHARS // 2)}"
        with contextlib.suppress(FileExistsError):
            temp.mkdir()
            return temp


def _is_complete(path: Path) -> bool:
    return (path / METADATA_FILE).is_file()


def publish(temp: Path, final: Path, *, between: Callable[[], None] | None = None) -> Path | None:
    """Rename the complete ``temp`` to ``final``, an existing ``final`` moved aside first (returned
    for :func:`remove_old` after the tracker update); ``between`` runs in between (a kill point)."""
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}{_OLD}{temp.name.rsplit(_TEMP, 1)[-1]}")
        os.rename(final, old)
        if between is not None:
            between()
    os.rename(temp, final)
    fsync_dir(final.parent)
    return old


def remove_old(old: Path | None) -> None:
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def complete_checkpoint(root: str | Path, iteration: int) -> Path | None:
    """``iteration``'s complete checkpoint: ``iter_N``, or the copy a killed re-save set aside."""
    final = checkpoint_dir(root, iteration)
    if _is_complete(final):
        return final
    if final.exists():
        return None
    aside = sorted(Path(root).glob(f"{final.name}{_OLD}*"))
    return next((path for path in aside if _is_complete(path)), None)


def clean_stale(root: str | Path) -> None:
    """Before a save: put back a complete copy a kill left aside (its ``iter_N`` missing), then
    delete what interrupted saves left (temporary directories, copies aside of complete ones)."""
    root = Path(root)
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        match = _SIDE_DIR.match(path.name)
        if match is None or not path.is_dir():
            continue
        final = checkpoint_dir(root, int(match.group(1)))
        if match.group(2) == "old" and not final.exists() and _is_complete(path):
            os.rename(path, final)
            fsync_dir(root)
        else:
            shutil.rmtree(path, ignore_errors=True)
