"""Where bfpp-train's per-iteration record goes: the JSONL file, TensorBoard, Weights & Biases, all
from rank 0's one record with Megatron-LM's scalar names; ``tensorboard`` and ``wandb`` are imported
only when their writer is built (:func:`missing_packages`: refused before any rank starts)."""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from megatron_bfpp.files import make_dirs

__all__ = [
    "GuardedWriter",
    "JsonlWriter",
    "MetricWriteError",
    "MetricWriter",
    "TensorBoardWriter",
    "WandbWriter",
    "missing_packages",
    "scalars",
]

# Record key -> scalar name (Megatron-LM's names where it has one).
SCALARS = {
    "lm_loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "step_time_s": "iteration-time",
    "tokens_per_s": "tokens-per-sec",
    "consumed_samples": "consumed-samples",
}
# Record keys holding one value per pipeline rank.
PER_PIPELINE_RANK = (
    "peak_activation_bytes",
    "peak_activations",
    "peak_parameter_bytes",
    "peak_gradient_bytes",
    "cuda_max_memory_allocated",
)
# What each logging flag needs installed, and the extra that installs it.
PACKAGES = {
    "--tensorboard-dir": ("tensorboard", "megatron-bfpp[tensorboard]"),
    "--wandb-project": ("wandb", "megatron-bfpp[wandb]"),
}


class MetricWriter(Protocol):
    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricWriteError(ValueError):
    """A logging destination failed; the message is the one line users see (flag, path, why)."""


def _reason(error: BaseException) -> str:
    """Why a write failed, in brief: the chain's first OS error (full disk), else its first line."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


class GuardedWriter:
    """A writer whose failures are one line naming its flag (a full disk under ``--metrics-file``
    gave 30 lines of chained tracebacks); after a failure, closing is quiet."""

    def __init__(self, flag: str, target: str, build: Callable[[], MetricWriter]) -> None:
        self.flag, self.target = flag, target
        self.failed = False
        try:
            self.writer = build()
        except Exception as error:  # a package installed broken, a directory that vanished
            raise MetricWriteError(
                f"{flag} {target}: cannot start writing ({_reason(error)})"
            ) from None

    def write(self, record: Mapping[str, Any]) -> None:
        try:
            self.writer.write(record)
        except Exception as error:
            self.failed = True
            raise MetricWriteError(
                f"{self.flag} {self.target}: cannot write iteration {record.get('iteration')} "
                f"({_reason(error)}); training stopped there (checkpoints saved before it are "
                "complete)"
            ) from None

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception as error:
            if not self.failed:
                self.failed = True
                raise MetricWriteError(
                    f"{self.flag} {self.target}: cannot finish writing ({_reason(error)})"
                ) from None


def scalars(record: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """The record's numbers as (name, value) scalars; absent or null values (a grad norm whose
    squares overflow the sum, which clipping scales to zero) are left out."""
    for key, name in SCALARS.items():
        if isinstance(value := record.get(key), (int, float)):
            yield name, float(value)
    for key in PER_PIPELINE_RANK:
        for rank, value in enumerate(record.get(key) or ()):
            yield f"memory/{key}/pp-rank-{rank}", float(value)


def missing_packages(flags: Mapping[str, object]) -> str | None:
    """One line naming the first logging flag given whose package is not installed, or None."""
    for flag, (package, extra) in PACKAGES.items():
        if flags.get(flag) and not _importable(package):
            return f"{flag} needs the {package} package: pip install '{extra}'"
    return None


def _importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken install is as good as none
        return False


def _wandb_mode(environ: Mapping[str, str] = os.environ, netrc_path: str | None = None) -> str:
    """``WANDB_MODE`` when set, else online only with an API key (environment or ~/.netrc), so a
    machine without one writes offline runs instead of failing at the first iteration."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    if environ.get("WANDB_API_KEY"):
        return "online"
    try:
        return "online" if netrc.netrc(netrc_path).authenticators("api.wandb.ai") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


@dataclass
class JsonlWriter:
    """One strict JSON object per line, flushed each iteration; a stream, not
    :func:`megatron_bfpp.files.write_output`, which would rewrite the whole file each time."""

    stream: TextIO

    @classmethod
    def open(cls, path: str, *, append: bool) -> JsonlWriter:
        return cls(open(path, "a" if append else "w", encoding="utf-8"))

    def write(self, record: Mapping[str, Any]) -> None:
        self.stream.write(json.dumps(dict(record), allow_nan=False) + "\n")
        self.stream.flush()

    def close(self) -> None:
        self.stream.close()


class TensorBoardWriter:
    """TensorBoard event files in ``log_dir`` (torch's ``SummaryWriter``), step = iteration."""

    def __init__(self, log_dir: str, *, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        make_dirs(log_dir)  # a symbolic link there is followed (its target made if missing)
        self._writer = SummaryWriter(log_dir=log_dir)
        self._writer.add_text("config", json.dumps(dict(config), sort_keys=True, default=str))

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["iteration"])
        for name, value in scalars(record):
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """A W&B run (``wandb.init(project, name, dir)``), offline when no API key is configured."""

    def __init__(
        self, project: str, *, name: str | None, save_dir: str | None, config: Mapping[str, Any]
    ) -> None:
        import wandb

        if save_dir:
            make_dirs(save_dir)
        self._run = wandb.init(
            project=project,
            name=name,
            dir=save_dir,
            config=dict(config),
            mode=_wandb_mode(),  # type: ignore[arg-type]
        )

    def write(self, record: Mapping[str, Any]) -> None:
        self._run.log(dict(scalars(record)), step=int(record["iteration"]))

    def close(self) -> None:
        self._run.finish()
