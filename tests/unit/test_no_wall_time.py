"""No test asserts on wall time (CONTRIBUTING.md says so; CI machines are loaded, and a timing that
passes on an idle machine fails on a busy one). A duration measured with ``time`` and then
compared in an ``assert`` is what this looks for; deadlines that only bound a wait for a hang
(``while ... < deadline``, subprocess timeouts) are not durations and are left alone."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CLOCKS = {"monotonic", "perf_counter", "process_time", "time", "monotonic_ns", "perf_counter_ns"}


def _is_clock(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in CLOCKS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "time"
    )


def _durations(tree: ast.AST) -> list[tuple[int, str]]:
    """``assert`` statements that subtract a clock reading (directly, or through a name that
    holds a clock reading or such a difference)."""
    clocked: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(_is_clock(n) for n in ast.walk(node.value)):
            clocked.update(t.id for t in node.targets if isinstance(t, ast.Name))

    def measured(sub: ast.AST) -> bool:
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Sub):
            return any(
                _is_clock(n) or (isinstance(n, ast.Name) and n.id in clocked)
                for n in (sub.left, sub.right)
            )
        return isinstance(sub, ast.Name) and sub.id in clocked and sub.id != "deadline"

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and any(measured(sub) for sub in ast.walk(node.test)):
            found.append((node.lineno, ast.unparse(node.test)))
    return found


def test_no_assert_compares_a_measured_duration() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        offenders += [
            f"{path.relative_to(TESTS)}:{line}: assert {text}" for line, text in _durations(tree)
        ]
    assert not offenders, "\n".join(offenders)


def test_the_check_finds_a_timed_assert() -> None:
    code = (
        "import time\n"
        "start = time.monotonic()\n"
        "elapsed = time.monotonic() - start\n"
        "assert elapsed < 1\n"
        "assert time.perf_counter() - start < 2\n"
        "deadline = time.monotonic() + 5\n"
        "assert time.monotonic() < deadline\n"
    )
    assert [line for line, _ in _durations(ast.parse(code))] == [4, 5]
