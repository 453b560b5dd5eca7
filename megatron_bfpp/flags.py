"""The argument parser every command line of the package shares, standard library only: the
Megatron-LM pre-flight and the CLIs read a flag, and refuse a bad one, the same way."""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["OneLineParser", "positive_int", "printable_output"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` names each flag's default, as Megatron users expect, unless its help says it or
    the default is an absence (``None``, an unset switch): "(default: None)" says nothing."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and _shows_default(action):  # argparse skips help-less flags
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or not _shows_default(action):
            return action.help
        return super()._get_help_string(action)


def _shows_default(action: argparse.Action) -> bool:
    hidden = (None, False, argparse.SUPPRESS)
    return bool(action.option_strings) and all(action.default is not h for h in hidden)


class OneLineParser(argparse.ArgumentParser):
    """One clear line and exit 2 instead of argparse's usage plus the error; ``raises``: raise it
    with the message instead, for a caller checking a command line it does not own (pre-flight)."""

    def __init__(
        self, *args: Any, raises: Callable[[str], Exception] | None = None, **kwargs: Any
    ) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.raises = raises

    def error(self, message: str) -> NoReturn:
        if self.raises is not None:
            raise self.raises(message)
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def printable_output() -> None:
    """A path or name stdout and stderr cannot encode (an ASCII locale, a SLURM log) comes out as
    ``\\xe9`` escapes instead of ending the run with a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if (reconfigure := getattr(stream, "reconfigure", None)) is not None:
            reconfigure(errors="backslashreplace")


# How long a rank leaving its node's error line to local rank 0 waits (torchrun ends it once rank
# 0 exits): torchrun stops every worker at the first exit, which could cut rank 0's line off.
QUIET_RANK_GRACE_S = 10.0


def quiet_exit(code: int = 2) -> NoReturn:
    """End a rank whose error its node's local rank 0 prints (``QUIET_RANK_GRACE_S``)."""
    time.sleep(QUIET_RANK_GRACE_S)
    raise SystemExit(code)
