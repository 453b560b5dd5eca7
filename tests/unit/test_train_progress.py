"""bfpp-train's progress display: a redrawn bar on a terminal, lines everywhere else."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.train.trainer import _logs_lines, _Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("no_progress", "stream", "lines"),
    [
        (False, _Terminal(), False),
        (True, _Terminal(), True),
        (False, io.StringIO(), True),
        (True, io.StringIO(), True),
        (False, object(), True),  # a stream without isatty() is not a terminal
    ],
    ids=["terminal", "terminal-no-progress", "file", "file-no-progress", "no-isatty"],
)
def test_bar_only_on_a_terminal(no_progress: bool, stream: object, lines: bool) -> None:
    assert _logs_lines(no_progress, stream) is lines  # type: ignore[arg-type]


def test_lines_follow_the_log_interval_and_always_show_the_last() -> None:
    out = io.StringIO()
    progress = _Progress(True, False, total=5, log_interval=2, stream=out)  # a file: lines
    for i in range(1, 6):
        progress.update(i, 5.0 - i / 10, 0.25, 1e-3)
    progress.close()
    logged = out.getvalue().splitlines()
    assert [line.split("|")[0].split()[1] for line in logged] == ["2/5", "4/5", "5/5"]
    assert "\r" not in out.getvalue()


def test_no_progress_logs_lines_on_a_terminal_too() -> None:
    out = _Terminal()
    progress = _Progress(True, True, total=2, log_interval=1, stream=out)
    for i in (1, 2):
        progress.update(i, 5.0, 0.25, 1e-3)
    progress.close()
    assert len(out.getvalue().splitlines()) == 2 and "\r" not in out.getvalue()


def test_bar_redraws_one_line_and_ends_it() -> None:
    out = _Terminal()
    progress = _Progress(True, False, total=3, log_interval=1, stream=out)  # a terminal: a bar
    for i in range(1, 4):
        progress.update(i, 5.0, 0.25, 1e-3)
    progress.close()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith(
        "3/3 | lm loss 5.000000 | step   250.0 ms | lr 1.000e-03\n"
    )
