"""How work grows with input size, measured without a clock (CI machines are loaded; a test must
not assert on wall time): the Python lines a call executes, and the bytes it allocates at its
peak. Both are deterministic for a given input, so "linear in m" becomes "doubling m at most
``limit`` times the lines", which a quadratic scan (4x) fails whatever the machine's load."""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Callable
from types import FrameType
from typing import Any


def python_lines(call: Callable[[], Any]) -> int:
    """Lines of Python executed by ``call()`` (every frame it enters, library code included)."""
    count = 0

    def per_line(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return per_line

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: per_line)
    try:
        call()
    finally:
        sys.settrace(previous)
    return count


def peak_bytes(call: Callable[[], Any]) -> int:
    """The most bytes Python allocated at once during ``call()``, above what was live before."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - before


def growth(
    measure: Callable[[Callable[[], Any]], int], make: Callable[[int], Any], n: int
) -> float:
    """``measure`` of ``make(2 n)`` over that of ``make(n)``: 2 for linear work, 4 for
    quadratic."""
    return measure(lambda: make(2 * n)) / measure(lambda: make(n))
