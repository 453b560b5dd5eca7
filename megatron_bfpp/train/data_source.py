"""What ``--data-path`` names, checked before any rank starts: a text file (byte-level tokens) or
Megatron's indexed datasets (one prefix or Megatron-LM's blend ``W1 P1 W2 P2 ...``). Torch-free and
reading only sizes and ``.idx`` headers, so a bad file is one line, not an error per rank."""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import struct
from collections.abc import Sequence

__all__ = [
    "DEFAULT_SPLIT",
    "DataPathError",
    "IndexedSource",
    "TextSource",
    "data_source",
    "default_cache_dir",
]

# Megatron-LM's default --split (train, validation, test weights; bfpp-train reads the train part)
DEFAULT_SPLIT = "969,30,1"
_INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 34  # magic 9, version <Q, dtype code <B, sequence count <Q, document count <Q
# megatron-core's DType codes -> token bytes (uint8 int8 int16 int32 int64 float64 float32 uint16)
_TOKEN_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
_SNIFF_BYTES = 1 << 16  # how much of a text file is looked at for NUL bytes
_NEITHER = "give a text file or the prefix of a Megatron indexed dataset (PREFIX.bin + PREFIX.idx)"


class DataPathError(ValueError):
    """``--data-path`` cannot be read; the message is the one line users see."""


@dataclasses.dataclass(frozen=True, slots=True)
class TextSource:
    path: str


@dataclasses.dataclass(frozen=True, slots=True)
class IndexedSource:
    """Megatron-LM's blend; ``weights`` ``None``: megatron-core weighs datasets by their size."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None
    split: str
    tokens: int  # in all prefixes together, from their index files

    def blend(self) -> tuple[list[str], list[float] | None]:
        """megatron-core's ``BlendedMegatronDatasetConfig.blend``."""
        return list(self.prefixes), None if self.weights is None else list(self.weights)


def default_cache_dir(prefix: str) -> str:
    """Where megatron-core's ``GPTDataset`` caches its indices without ``--data-cache-path``."""
    return os.path.join(prefix, "cache")


def data_source(
    paths: str | Sequence[str], *, seq_length: int, split: str | None = None
) -> TextSource | IndexedSource:
    """The data ``--data-path`` names, checked; raises :class:`DataPathError`."""
    items = [paths] if isinstance(paths, str) else list(paths)
    if not items:
        raise DataPathError("--data-path: give a text file or a dataset prefix")
    if len(items) == 1:
        if (prefix := _indexed_prefix(items[0])) is None:
            return TextSource(_checked_text(items[0], seq_length))
        prefixes, weights = [prefix], None
    else:
        prefixes, weights = _blend(items)
    split = DEFAULT_SPLIT if split is None else split
    _check_split(split)
    tokens = sum(_checked_indexed(prefix) for prefix in prefixes)
    return IndexedSource(tuple(prefixes), weights, split, tokens)


def _indexed_prefix(path: str) -> str | None:
    """The dataset prefix ``path`` names (``P``, ``P.bin`` or ``P.idx``); ``None``: a text file."""
    if path.endswith((".bin", ".idx")):
        return path[: -len(".bin")]
    return path if os.path.lexists(path + ".idx") or os.path.lexists(path + ".bin") else None


def _blend(items: list[str]) -> tuple[list[str], tuple[float, ...] | None]:
    """Megatron-LM's rule (``get_blend_from_list``): an even list whose odd entries are all
    numbers is weights and prefixes, anything else is prefixes only."""
    if len(items) % 2 == 0:
        weights = [_number(item) for item in items[0::2]]
        if all(weight is not None for weight in weights):
            values = tuple(float(weight or 0.0) for weight in weights)
            if any(not math.isfinite(w) or w < 0 for w in values) or not sum(values) > 0:
                raise DataPathError(
                    f"--data-path: blend weights must be finite, >= 0 and not all 0, got "
                    f"{' '.join(items[0::2])}"
                )
            return [_indexed_prefix(p) or p for p in items[1::2]], values
    return [_indexed_prefix(p) or p for p in items], None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _check_split(split: str) -> None:
    parts = split.replace("/", ",").split(",")
    values = [_number(part) for part in parts]
    if (
        len(parts) > 3
        or any(v is None or not math.isfinite(v) or v < 0 for v in values)
        or not float(values[0] or 0.0) > 0
    ):
        raise DataPathError(
            f"--split {split}: give up to three weights for train, validation and test, "
            "e.g. 969,30,1; bfpp-train trains on the first, which must be > 0"
        )


def _regular_problem(path: str) -> str | None:
    try:
        mode = os.stat(path)
    except FileNotFoundError:
        return "no such file"
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    if stat.S_ISDIR(mode.st_mode):
        return "is a directory"
    if not stat.S_ISREG(mode.st_mode):
        return "is not a regular file (a FIFO, socket or device)"
    return None if os.access(path, os.R_OK) else "permission denied"


def _checked_text(path: str, seq_length: int) -> str:
    """A text file for byte-level tokens: readable, long enough, no NUL byte in its first 64 KiB."""
    flag, problem = f"--data-path {path}", _regular_problem(path)
    if problem == "is a directory":
        raise DataPathError(f"{flag}: is a directory; {_NEITHER}")
    if problem is not None:
        raise DataPathError(f"{flag}: {problem}")
    size = os.path.getsize(path)
    need = seq_length + 2  # one sample is seq_length + 1 tokens, at one offset at least
    if size == 0:
        raise DataPathError(f"{flag}: is empty; it needs at least seq_length + 2 = {need} bytes")
    if size < need:
        raise DataPathError(
            f"{flag}: has {size} bytes; it needs at least seq_length + 2 = {need} "
            "(or lower --seq-length)"
        )
    try:
        with open(path, "rb") as file:
            head = file.read(_SNIFF_BYTES)
    except OSError as error:
        raise DataPathError(f"{flag}: cannot be read ({error.strerror})") from None
    if b"\x00" in head:
        what = "a Megatron index file" if head.startswith(_INDEX_HEADER) else "binary data"
        raise DataPathError(
            f"{flag}: is neither a text file nor a dataset prefix ({what}); {_NEITHER}"
        )
    return path


def _checked_indexed(prefix: str) -> int:
    """An indexed dataset's tokens once its ``.idx`` header and both file sizes it implies agree."""
    flag = f"--data-path {prefix}"
    for suffix in (".idx", ".bin"):
        if (problem := _regular_problem(prefix + suffix)) is not None:
            raise DataPathError(
                f"{flag}: {prefix}{suffix} {problem}; a Megatron indexed dataset is PREFIX.bin "
                "and PREFIX.idx (give the prefix, without the suffix)"
            )
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    try:
        with open(idx, "rb") as file:
            header = file.read(_HEADER_BYTES)
            if len(header) < _HEADER_BYTES or not header.startswith(_INDEX_HEADER):
                raise DataPathError(
                    f"{flag}: {idx} is not a Megatron index file (no MMIDIDX header); {_NEITHER}"
                )
            version, code, sequences, documents = struct.unpack("<QBQQ", header[9:])
            if version != 1 or code not in _TOKEN_BYTES:
                raise DataPathError(
                    f"{flag}: {idx} has index version {version}, token type {code}; "
                    "megatron-core reads version 1 with token types 1-8"
                )
            base = _HEADER_BYTES + sequences * 12 + documents * 8
            size = os.fstat(file.fileno()).st_size
            if size not in (base, base + sequences):  # + one mode byte each: multimodal
                raise DataPathError(
                    f"{flag}: {idx} has {size:,} bytes, its header implies {base:,} "
                    "(truncated or not written by megatron-core's IndexedDatasetBuilder)"
                )
            if sequences == 0:
                raise DataPathError(f"{flag}: {idx} holds no sequences")
            file.seek(_HEADER_BYTES + (sequences - 1) * 4)
            (last_length,) = struct.unpack("<i", file.read(4))
            file.seek(_HEADER_BYTES + sequences * 4 + (sequences - 1) * 8)
            (last_pointer,) = struct.unpack("<q", file.read(8))
    except OSError as error:
        raise DataPathError(f"{flag}: {idx} cannot be read ({error.strerror})") from None
    expected = last_pointer + last_length * _TOKEN_BYTES[code]
    if (actual := os.path.getsize(bin_)) != expected:
        raise DataPathError(
            f"{flag}: {bin_} has {actual:,} bytes, its index implies {expected:,} (truncated, "
            "or the .bin and .idx of different datasets)"
        )
    return int(expected) // _TOKEN_BYTES[code]
