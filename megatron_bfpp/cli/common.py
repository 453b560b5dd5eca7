"""What every CLI shares: one-line errors, argument types, output-path checks and strict JSON."""

from __future__ import annotations

import argparse
import errno
import functools
import importlib
import json
import math
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from megatron_bfpp.files import follow_links
from megatron_bfpp.flags import positive_int, printable_output
from megatron_bfpp.ir import first_line


def fail(prog: str, error: BaseException | str) -> int:
    sys.stderr.write(f"{prog}: error: {first_line(error)}\n")
    return 2


Main = Callable[..., int]  # a command's main: its arguments (sys.argv[1:] if None) to an exit code


def closed_pipe_ends_quietly(main: Main) -> Main:
    """``bfpp-plan ... | head -3``: when the reader closes the pipe, exit 141 (as SIGPIPE would)
    without a traceback, stdout pointed at /dev/null so the flush at exit does not raise again."""

    @functools.wraps(main)
    def run(argv: Sequence[str] | None = None) -> int:
        printable_output()
        try:
            code = main(argv)
            sys.stdout.flush()  # a closed pipe shows here when the output fit in the buffer
            return code
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 141  # what a shell reports for a command killed by SIGPIPE (128 + 13)

    return run


def ends_without_teardown(main: Main) -> Callable[[], NoReturn]:
    """The console script of a command that may leave millions of small objects behind: once
    ``main`` returned and the output is flushed, ``os._exit`` skips their teardown (seconds)."""

    def command() -> NoReturn:
        code = main()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    return command


def matplotlib_problem(flag: str) -> str | None:
    """One line when ``flag`` draws and matplotlib does not import, checked before any work."""
    try:
        importlib.import_module("matplotlib")
    except Exception as error:  # a broken install fails in its own ways; any is "not usable"
        reason = "not installed" if isinstance(error, ModuleNotFoundError) else "broken"
        return f"{flag} needs matplotlib ({reason}): pip install 'megatron-bfpp[plot]'"
    return None


def positive_int_up_to(limit: int, why: str) -> Callable[[str], int]:
    """``positive_int`` bounded (``why`` says by what): past it the command ran for minutes."""

    def parse(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"at most {limit:,} ({why}), got {value:,}")
        return value

    return parse


def finite_float(text: str, least: float = -math.inf, *, strict: bool = False) -> float:
    """A float flag: ``inf`` and ``nan`` parse as floats, but no run can use them; ``least``: the
    smallest value taken (``strict``: only those above it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if value < least or (strict and value == least):
        bound = f"{'>' if strict else '>='} {least:g}"
        raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text}")
    return value


non_negative_float = functools.partial(finite_float, least=0.0)
positive_float = functools.partial(finite_float, least=0.0, strict=True)


def json_text(data: Any) -> str:
    """Strict JSON (RFC 8259 has no Infinity or NaN): a number that is not finite becomes null."""
    return json.dumps(_finite_or_null(data), indent=2, allow_nan=False)


def _finite_or_null(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite_or_null(value) for key, value in data.items()}
    return [_finite_or_null(value) for value in data] if isinstance(data, list | tuple) else data


_LOOP = "a symbolic link that loops (too many levels of symbolic links)"
_WRITE_TEST = ".bfpp-write-test-"  # the file or directory made and removed to try a write


def output_file_problem(flag: str, path: str, *, replaced: bool = True) -> str | None:
    """Why ``flag path`` could not be written, known before any work starts (``replaced``: by a new
    file beside it, so its directory must take files; else appended to). Writes nothing the run
    would not: an existing file is opened for appending, a new one tried and removed."""
    if not path:
        return f"{flag}: empty path"
    try:
        info: os.stat_result | None = os.stat(path)
        target = follow_links(path)
    except (FileNotFoundError, NotADirectoryError):  # named below: the directory's problem
        info, target = None, follow_links(path)
    except OSError as error:
        if error.errno == errno.ELOOP:
            return f"{flag} {path}: {_LOOP}; point it at a file or remove it"
        return f"{flag} {path}: {error.strerror or error}"
    if info is not None and stat.S_ISDIR(info.st_mode):
        return f"{flag} {path}: is a directory"
    parent = target.parent
    if info is None or stat.S_ISREG(info.st_mode):
        if not parent.exists():
            return f"{flag} {path}: directory {parent} does not exist"
        if not parent.is_dir():
            return f"{flag} {path}: {parent} is not a directory"
    try:
        if info is not None:
            # O_NONBLOCK: a FIFO without a reader fails here instead of blocking the check.
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        if info is None or (replaced and stat.S_ISREG(info.st_mode)):
            handle, name = tempfile.mkstemp(prefix=_WRITE_TEST, dir=parent)
            os.close(handle)
            os.unlink(name)
    except OSError as error:
        where = path if info is not None and error.filename == path else f"files in {parent}"
        return f"{flag} {path}: cannot write {where} ({error.strerror or error})"
    return None


def write_problem(flag: str, path: str, write: Callable[[str], object]) -> str | None:
    """Run ``write(path)``; a failure the checks could not foresee (a full disk) as one line."""
    try:
        write(path)
    except OSError as error:
        return f"{flag} {path}: cannot write it ({error.strerror or error})"
    return None


def output_dir_problem(flag: str, path: str) -> str | None:
    """Why ``flag path``, a directory the run creates (with its parents) and fills, could not
    be, known before any work starts (a temporary directory tried in the nearest existing one)."""
    if not path:
        return f"{flag}: empty path"
    try:
        target = follow_links(path)
    except OSError:  # a loop
        return f"{flag} {path}: {_LOOP}; point it at a directory or remove it"
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        return f"{flag} {path}: {existing} is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=_WRITE_TEST, dir=existing))
    except OSError as error:
        return f"{flag} {path}: cannot create files in {existing} ({error.strerror or error})"
    return None
