"""One run per ``--save`` directory (megatron_bfpp.train.save_lock): a second is refused naming
the holder, a dead holder's lock is taken over, and the lock file is never followed through a
symlink."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bfpp.train.checkpoint_files import CheckpointError
from megatron_bfpp.train.save_lock import LOCK_FILE, SaveLock


def test_a_second_run_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = SaveLock.acquire(tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as info:
        SaveLock.acquire(tmp_path / "ckpt")
    message = str(info.value)
    assert message.startswith(f"--save {tmp_path / 'ckpt'}: another run is saving there (pid ")
    assert f"pid {os.getpid()} on " in message and "\n" not in message
    first.release()
    SaveLock.acquire(tmp_path / "ckpt").release()  # free again once released


def test_a_dead_runs_lock_is_taken_over(tmp_path: Path) -> None:
    """The holder killed with SIGKILL (no clean-up ran): its file stays, its lock does not."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from megatron_bfpp.train.save_lock import SaveLock; "
         f"SaveLock.acquire({str(tmp_path)!r}); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    with pytest.raises(CheckpointError, match=f"pid {holder.pid} on "):
        SaveLock.acquire(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    assert f"pid {holder.pid}" in (tmp_path / LOCK_FILE).read_text()  # stale file left behind
    taken = SaveLock.acquire(tmp_path)
    assert f"pid {os.getpid()}" in (tmp_path / LOCK_FILE).read_text()
    taken.release()


def test_a_symlinked_lock_file_is_refused_without_following_it(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("not ours")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / LOCK_FILE).symlink_to(target)
    with pytest.raises(CheckpointError, match=f"cannot create its lock file {LOCK_FILE}"):
        SaveLock.acquire(tmp_path / "ckpt")
    assert target.read_text() == "not ours"


def test_what_the_holder_wrote_is_shown_bounded_and_printable(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_bytes(b"pid 1 \x1b[31mred\n" + b"x" * 100_000)
    first = SaveLock.acquire(tmp_path)  # overwrites it with its own line
    fd = os.open(tmp_path / LOCK_FILE, os.O_WRONLY)
    os.pwrite(fd, b"pid 1 \x1b[31m" + b"y" * 1000, 0)
    os.close(fd)
    with pytest.raises(CheckpointError) as info:
        SaveLock.acquire(tmp_path)
    holder = str(info.value).split("(", 1)[1].split(")", 1)[0]
    assert "\x1b" not in holder and len(holder) <= 200
    first.release()


def _full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)


def test_a_full_disk_is_one_line_and_leaves_no_empty_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It raised a bare OSError (a 10-line traceback) after truncating the file to 0 bytes."""
    _full_disk(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        SaveLock.acquire(tmp_path / "ckpt")
    assert str(info.value) == (
        f"--save {tmp_path / 'ckpt'}: cannot write its lock file {LOCK_FILE} (No space left on "
        "device); free space there or choose another --save directory"
    )
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_full_disk_keeps_an_earlier_runs_lock_file_and_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / LOCK_FILE).write_text("pid 1 on elsewhere, started earlier\n")
    _full_disk(monkeypatch)
    with pytest.raises(CheckpointError, match="No space left on device"):
        SaveLock.acquire(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text() == "pid 1 on elsewhere, started earlier\n"
    monkeypatch.undo()
    SaveLock.acquire(tmp_path).release()  # not left locked


def test_a_dangling_save_symlink_is_followed_and_kept(tmp_path: Path) -> None:
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "disk" / "ckpt")
    lock = SaveLock.acquire(link)
    assert link.is_symlink() and (tmp_path / "disk" / "ckpt" / LOCK_FILE).is_file()
    lock.release()


def test_a_looping_save_symlink_is_one_line_naming_it(tmp_path: Path) -> None:
    loop = tmp_path / "ckpt"
    loop.symlink_to(loop)
    with pytest.raises(CheckpointError) as info:
        SaveLock.acquire(loop)
    assert str(info.value) == (
        f"--save {loop}: a symbolic link that loops (too many levels of symbolic links); "
        "point it at a directory or remove it"
    )
