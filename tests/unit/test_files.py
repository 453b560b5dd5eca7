"""Every write lands where the user said (``megatron_bfpp.files``): a device or FIFO is written
in place, never replaced by a regular file; a symbolic link is followed to its target (a
dangling one's target created), never replaced; a regular file is replaced atomically, keeps
its permissions and survives a failed write. Then every product writer is checked to go
through it.

Devices here are made with ``mknod`` in the test's own directory (the same numbers as
``/dev/null`` and ``/dev/full``): a broken writer run as root must not be able to replace the
machine's own device nodes."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from megatron_bfpp.cli.common import write_problem
from megatron_bfpp.files import follow_links, make_dirs, write_output

NULL, FULL = os.makedev(1, 3), os.makedev(1, 7)  # Linux's /dev/null and /dev/full


def _device(where: Path, name: str, number: int) -> Path:
    path = where / name
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, number)
    except (PermissionError, AttributeError, OSError) as error:
        pytest.skip(f"cannot make a device node here ({error})")
    return path


class _Reader:
    """A FIFO's reader in a thread, its read end opened before any writer: the test holds a
    write end of its own (``O_RDWR`` never blocks), so opening either end never waits, and the
    reader sees the end only at :meth:`result`; a writer that replaced the FIFO instead
    leaves it empty-handed at once."""

    def __init__(self, fifo: Path) -> None:
        self.data = b""
        self.keeper = os.open(fifo, os.O_RDWR)
        self.fd = os.open(fifo, os.O_RDONLY)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with open(self.fd, "rb") as file:
            self.data = file.read()

    def result(self) -> bytes:
        os.close(self.keeper)
        self.thread.join(timeout=60)
        return self.data


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    yield path


def _entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# --------------------------------------------------------------------------- the helper


def test_a_device_is_written_in_place_not_replaced(tmp_path: Path) -> None:
    null = _device(tmp_path, "null", NULL)
    write_output(null, b"report")
    assert stat.S_ISCHR(os.lstat(null).st_mode) and os.lstat(null).st_rdev == NULL
    assert _entries(tmp_path) == ["null"]


def test_a_full_device_is_an_oserror_and_stays_a_device(tmp_path: Path) -> None:
    full = _device(tmp_path, "full", FULL)
    with pytest.raises(OSError) as info:
        write_output(full, b"report")
    assert info.value.errno == errno.ENOSPC
    assert stat.S_ISCHR(os.lstat(full).st_mode)
    assert _entries(tmp_path) == ["full"]


def test_a_fifo_gets_the_bytes_and_stays_a_fifo(fifo: Path) -> None:
    reader = _Reader(fifo)
    write_output(fifo, b"through the pipe")
    assert reader.result() == b"through the pipe"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_symlink_is_followed_and_kept(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "report.json"
    target.write_text("old")
    link = tmp_path / "report.json"
    link.symlink_to(target)
    write_output(link, b"new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == b"new"
    assert _entries(tmp_path) == ["real", "report.json"]
    assert _entries(tmp_path / "real") == ["report.json"]  # no temporary file left


def test_a_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "out.csv"
    link.symlink_to("elsewhere.csv")  # relative, as ln -s writes it
    write_output(link, b"a,b\n")
    assert link.is_symlink()
    assert (tmp_path / "elsewhere.csv").read_bytes() == b"a,b\n"


def test_a_looping_symlink_is_eloop_naming_it(tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(OSError) as info:
        write_output(loop, b"x")
    assert info.value.errno == errno.ELOOP and info.value.filename == str(loop)
    with pytest.raises(OSError, match="symbolic links"):
        follow_links(loop)
    assert _entries(tmp_path) == ["loop"]


def test_a_regular_file_is_replaced_keeping_its_permissions(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text("old")
    path.chmod(0o640)
    write_output(path, b"new")
    assert path.read_bytes() == b"new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert _entries(tmp_path) == ["profile.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills at the sync: the old content stays, the temporary file goes."""
    path = tmp_path / "latest_checkpointed_iteration.txt"
    path.write_text("2\n")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_output(path, b"3\n")
    assert path.read_text() == "2\n"
    assert _entries(tmp_path) == [path.name]


def test_make_dirs_follows_a_dangling_link_and_names_a_loop(tmp_path: Path) -> None:
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "disk" / "ckpt")
    assert make_dirs(link) == tmp_path / "disk" / "ckpt"
    assert link.is_symlink() and (tmp_path / "disk" / "ckpt").is_dir()
    make_dirs(link)  # made already: fine
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(OSError) as info:
        make_dirs(loop)
    assert info.value.errno == errno.ELOOP


# --------------------------------------------------------------------------- every writer


def _csv(path: Path) -> None:
    from megatron_bfpp.ir import dump_csv
    from megatron_bfpp.schedules.registry import build_schedule

    dump_csv(build_schedule("1f1b", num_ranks=2, num_microbatches=2), path)


def _simulated() -> object:
    from megatron_bfpp.schedules.registry import build_schedule
    from megatron_bfpp.sim import CostModel, simulate

    return simulate(build_schedule("1f1b", num_ranks=2, num_microbatches=2), CostModel())


def _trace(path: Path) -> None:
    from megatron_bfpp.sim import dump_chrome_trace

    dump_chrome_trace(_simulated(), path)  # type: ignore[arg-type]


def _png(path: Path) -> None:
    pytest.importorskip("matplotlib")
    from megatron_bfpp.sim import render_png

    render_png(_simulated(), path)  # type: ignore[arg-type]


def _auto_report(path: Path) -> None:
    from megatron_bfpp.plan.auto import decide, write_report
    from tests.unit.test_auto import request

    write_report(str(path), decide(request()))


def _tracker(path: Path) -> None:
    from megatron_bfpp.train.checkpoint_files import TRACKER, write_tracker

    if path.name != TRACKER:
        (path.parent / TRACKER).symlink_to(path.name)  # the tracker's name, pointing at path
    write_tracker(path.parent, 7)


def _profile(path: Path) -> None:
    pytest.importorskip("torch")
    from megatron_bfpp.stage_timing import write_profile
    from tests.unit.test_plan_model import _table5_profile

    write_profile(_table5_profile(), path)


WRITERS: dict[str, Callable[[Path], None]] = {
    "csv": _csv,
    "chrome-trace": _trace,
    "png": _png,
    "auto-report": _auto_report,
    "tracker": _tracker,
    "profile": _profile,
}


@pytest.mark.parametrize("name", WRITERS)
def test_every_writer_follows_a_symlink(tmp_path: Path, name: str) -> None:
    """``--pipeline-schedule-auto-report``, ``bfpp-plan profile --output`` and the tracker
    used to rename over the link (the target never written)."""
    target = tmp_path / "target"
    target.write_bytes(b"")
    link = tmp_path / "link"
    link.symlink_to(target)
    WRITERS[name](link)
    assert link.is_symlink()
    assert target.stat().st_size > 0


@pytest.mark.parametrize("name", WRITERS)
def test_every_writer_writes_a_fifo_in_place(fifo: Path, name: str) -> None:
    """What ``/dev/null`` and other devices get: written, not replaced by a regular file."""
    reader = _Reader(fifo)
    WRITERS[name](fifo)
    data = reader.result()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), f"{name} replaced the FIFO"
    assert data
    if name in ("auto-report", "profile", "chrome-trace"):
        json.loads(data)


@pytest.mark.parametrize("name", WRITERS)
def test_every_writer_leaves_a_device_node_a_device(tmp_path: Path, name: str) -> None:
    null = _device(tmp_path, "null", NULL)
    WRITERS[name](null)
    assert stat.S_ISCHR(os.lstat(null).st_mode)


@pytest.mark.parametrize("name", WRITERS)
def test_every_writer_on_a_full_device_is_one_line_for_the_command(
    tmp_path: Path, name: str
) -> None:
    """What ``bfpp-plan profile --output /dev/full`` (a traceback) and the other outputs say."""
    full = _device(tmp_path, "full", FULL)
    assert write_problem("--output", str(full), lambda path: WRITERS[name](Path(path))) == (
        f"--output {full}: cannot write it (No space left on device)"
    )
    assert stat.S_ISCHR(os.lstat(full).st_mode)
