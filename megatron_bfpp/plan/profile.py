"""A measured pipeline stage as ``bfpp-plan profile`` writes it and ``recommend --profile`` reads
it: JSON only (a file users hand us is data), checked field by field. One stage is enough (the BPipe
re-evaluation, section 4): the pipeline follows from the schedule, messages from the bandwidth."""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.plan.presets import Model

__all__ = ["Measurement", "StageProfile", "load_profile", "profile_from_dict", "profile_to_dict"]

_FORMAT = "bfpp-stage-profile"
VERSION = 1
MAX_BYTES = 1 << 20  # a profile is a few hundred bytes; refuse anything that is not one


@dataclass(frozen=True, slots=True)
class Measurement:
    """Seconds per micro-batch through the profiled layers at one size; ``backward_input_s`` /
    ``backward_weight_s``: the split backward's halves (V-shapes); ``embedding_s`` /
    ``output_s``: the first stage's word embedding and the last stage's final norm, output layer
    and loss, forward and backward (uneven stages are weighed by them); ``None``: not measured."""

    micro_batch_size: int
    forward_s: float
    backward_s: float
    backward_input_s: float | None = None
    backward_weight_s: float | None = None
    embedding_s: float | None = None
    output_s: float | None = None

    def end_weights(self, num_layers: int) -> tuple[float, float] | None:
        """(embedding, output and loss) against one profiled layer's forward and backward: the
        simulator's ``--embedding-weight`` / ``--loss-weight``; ``None`` when not measured."""
        if self.embedding_s is None or self.output_s is None:
            return None
        layer = (self.forward_s + self.backward_s) / num_layers
        return self.embedding_s / layer, self.output_s / layer


@dataclass(frozen=True, slots=True)
class StageProfile:
    """What was measured, where, on which model slice."""

    device: str
    device_type: str
    model: Model
    num_layers: int
    tensor_parallel: int
    dtype: str
    measurements: tuple[Measurement, ...]
    torch_version: str = ""
    megatron_core_version: str = ""
    t_host: float | None = None  # seconds per compute action; None: not measured


# A profile file lists the (dense: no MoE defaults) model's fields in order, ``num_layers`` last.
_DENSE = [f.name for f in fields(Model) if f.default is MISSING]
_MODEL_KEYS = [name for name in _DENSE if name != "num_layers"] + ["num_layers"]
_MODEL_TEXT = {"name": str, "arch": str, "dropout": bool}  # the rest: positive integers


def profile_to_dict(profile: StageProfile) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "version": VERSION,
        "device": profile.device,
        "device_type": profile.device_type,
        "torch_version": profile.torch_version,
        "megatron_core_version": profile.megatron_core_version,
        "model": {key: getattr(profile.model, key) for key in _MODEL_KEYS},
        "num_layers": profile.num_layers,
        "tensor_parallel": profile.tensor_parallel,
        "dtype": profile.dtype,
        "measurements": [asdict(m) for m in profile.measurements],
        **({} if profile.t_host is None else {"t_host": profile.t_host}),
    }


def load_profile(path: str | Path) -> StageProfile:
    """Read and check a profile file; every problem is one line naming the file."""
    where = str(path)
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_BYTES + 1)
    except OSError as error:
        raise ScheduleError(
            f"--profile {where}: cannot read it ({error.strerror or error})"
        ) from None
    if len(raw) > MAX_BYTES:
        raise ScheduleError(f"--profile {where}: larger than 1 MiB, not a stage profile")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as error:
        first = str(error).splitlines()[0]
        raise ScheduleError(f"--profile {where}: not a JSON stage profile ({first})") from None
    except RecursionError:
        raise ScheduleError(
            f"--profile {where}: nested too deeply to be a stage profile (a few levels)"
        ) from None
    try:
        return profile_from_dict(data)
    except ScheduleError as error:
        raise ScheduleError(f"--profile {where}: {error}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def profile_from_dict(data: Any) -> StageProfile:
    if not isinstance(data, dict):
        raise ScheduleError("the file holds no JSON object")
    if data.get("format") != _FORMAT:
        raise ScheduleError(f"'format' must be {_FORMAT!r} (write one with 'bfpp-plan profile')")
    if data.get("version") != VERSION:
        raise ScheduleError(f"'version' must be {VERSION}, got {data.get('version')!r}")
    model_data = _field(data, "model", dict)
    checked: dict[str, Any] = {  # the model's fields, in their order
        name: _field(model_data, name, _MODEL_TEXT[name], where="model.")
        if name in _MODEL_TEXT
        else _positive(model_data, name, where="model.")
        for name in _DENSE
    }
    model = Model(**checked)
    if model.arch not in ("gpt", "llama"):
        raise ScheduleError(f"'model.arch' must be 'gpt' or 'llama', got {model.arch!r}")
    rows = _field(data, "measurements", list)
    if not rows:
        raise ScheduleError("'measurements' is empty: measure at least one micro-batch size")
    # On a CPU a split backward's machinery can outcost a small stage's whole backward, so only
    # a GPU's halves are held to "no longer than the whole".
    cpu = data.get("device_type") == "cpu"
    measurements = tuple(
        _measurement(row, index, split_bounded=not cpu) for index, row in enumerate(rows)
    )
    sizes = [m.micro_batch_size for m in measurements]
    if len(set(sizes)) != len(sizes):
        raise ScheduleError(f"'measurements' repeats a micro-batch size: {sizes}")
    return StageProfile(
        device=_field(data, "device", str),
        device_type=_field(data, "device_type", str),
        model=model,
        num_layers=_positive(data, "num_layers"),
        tensor_parallel=_positive(data, "tensor_parallel"),
        dtype=_field(data, "dtype", str),
        measurements=tuple(sorted(measurements, key=lambda m: m.micro_batch_size)),
        torch_version=str(data.get("torch_version", "")),
        megatron_core_version=str(data.get("megatron_core_version", "")),
        t_host=_optional_seconds(data, "t_host", ""),
    )


def _measurement(row: Any, index: int, *, split_bounded: bool = True) -> Measurement:
    where = f"measurements[{index}]."
    if not isinstance(row, dict):
        raise ScheduleError(f"'measurements[{index}]' must be an object")
    forward, backward = _seconds(row, "forward_s", where), _seconds(row, "backward_s", where)
    split_input = _optional_seconds(row, "backward_input_s", where)
    split_weight = _optional_seconds(row, "backward_weight_s", where)
    if (split_input is None) != (split_weight is None):
        raise ScheduleError(
            f"'{where}backward_input_s' and 'backward_weight_s' come together or not at all"
        )
    for key, part in (("backward_input_s", split_input), ("backward_weight_s", split_weight)):
        # a half longer than the whole is a broken measurement the planner would rank by
        if split_bounded and part is not None and part > backward:
            raise ScheduleError(
                f"'{where}{key}' ({part:.6g} s) exceeds '{where}backward_s' ({backward:.6g} s): "
                "half of a split backward cannot take longer than the whole backward; measure "
                "again with 'bfpp-plan profile'"
            )
    size = _positive(row, "micro_batch_size", where=where)
    ends = (_optional_seconds(row, key, where) for key in ("embedding_s", "output_s"))
    return Measurement(size, forward, backward, split_input, split_weight, *ends)


def _field(
    data: dict[str, Any], key: str, kind: type | tuple[type, ...], *, where: str = ""
) -> Any:
    if key not in data:
        raise ScheduleError(f"'{where}{key}' is missing")
    value = data[key]
    named = "number" if isinstance(kind, tuple) else kind.__name__
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ScheduleError(f"'{where}{key}' must be a {named}, got {value!r}")
    return value


def _positive(data: dict[str, Any], key: str, *, where: str = "") -> int:
    value = _field(data, key, int, where=where)
    if value < 1 or value > 2**31:
        raise ScheduleError(f"'{where}{key}' must be a positive integer, got {value}")
    return int(value)


# A timing lies between a nanosecond and a day; outside, the planner's arithmetic overflows.
MIN_SECONDS = 1e-9
MAX_SECONDS = 86_400.0


def _optional_seconds(row: dict[str, Any], key: str, where: str) -> float | None:
    """Optional timing: zero is a measurement too (W too small to time, a host its kernels hide)."""
    return None if row.get(key) is None else _seconds(row, key, where, zero=True)


def _seconds(row: dict[str, Any], key: str, where: str, *, zero: bool = False) -> float:
    value = _field(row, key, (int, float), where=where)
    timing = MIN_SECONDS <= value <= MAX_SECONDS or (zero and value == 0)
    if not math.isfinite(value) or not timing:
        allowed = "0 or between" if zero else "between"
        raise ScheduleError(
            f"'{where}{key}' must be {allowed} {MIN_SECONDS:g} and {MAX_SECONDS:g} seconds, got "
            f"{value!r:.40}"
        )
    return float(value)
