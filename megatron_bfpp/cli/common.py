"""What every CLI shares: one-line errors and a parser that does not print usage on error."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; users asked for one clear line and a non-zero exit."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)


def fail(prog: str, error: BaseException) -> int:
    """Print the first line of an error (schedule errors carry a grid after it) and return 2."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    sys.stderr.write(f"{prog}: error: {first}\n")
    return 2


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value
