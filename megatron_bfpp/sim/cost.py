"""How long each action takes: a handful of numbers in one abstract time unit.

Compute times are given for one micro-batch through one *full* 1F1B stage (``num_layers / pp``
layers); a stage of a looped layout with ``v`` chunks per rank takes ``1 / v`` of that and a
V-shape stage ``1 / 2``, which is ``StageLayout.stage_fraction``. Communication times are per
message (p2p), per chunk (data-parallel gradient reduce / parameter gather) or per full-stage
micro-batch of stored activations (BPipe eviction).

The simulator times in integers (``CostModel.exact``): a stage's share 1/3 of 1.0 is not a
float, and summing 0.333... thousands of times drifts (pp=2, vp=3, m=4 interleaved gave
12.999999999999996 for 13). Every duration is scaled by one common denominator to an integer,
the replay adds and compares integers exactly, and each result is divided back once, so a
result that is mathematically an integer comes out as one and any other is correctly rounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import NamedTuple

from megatron_bfpp.ir import ActionKind, ScheduleError
from megatron_bfpp.semantics import Timing

__all__ = ["CostModel", "ExactTiming"]


class ExactTiming(NamedTuple):
    """A replay's durations as integers and how many of them make one cost-model unit: a
    replay time ``t`` is ``t / per_unit`` in the cost model's unit."""

    timing: Timing
    per_unit: int


@dataclass(frozen=True, slots=True)
class CostModel:
    """Durations in one abstract time unit (``chrome_trace`` maps it to milliseconds).

    ``t_forward``: one micro-batch through one full 1F1B stage. ``t_backward``: the full backward
    of the same (B); a split schedule's input-gradient part I takes ``t_backward - t_weight`` and
    its weight-gradient part W ``t_weight``. ``t_p2p``: one activation or gradient message from
    sender to receiver. ``t_grad_reduce`` / ``t_param_gather``: one chunk's data-parallel
    gradient reduce-scatter / parameter all-gather (per chunk, not scaled by the chunk size).
    ``t_evict``: BPipe's transfer of one full-stage micro-batch's stored activations (scaled by
    the stage fraction).
    """

    t_forward: float = 1.0
    t_backward: float = 2.0
    t_weight: float = 1.0
    t_p2p: float = 0.0
    t_grad_reduce: float = 0.0
    t_param_gather: float = 0.0
    t_evict: float = 0.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise ScheduleError(
                    f"CostModel.{field.name} must be a finite number >= 0, got {value!r}"
                )
        if self.t_weight > self.t_backward:
            raise ScheduleError(
                f"CostModel.t_weight ({self.t_weight}) is the weight-gradient part of t_backward "
                f"({self.t_backward}) and must be <= it"
            )

    def compute_time(self, kind: ActionKind, stage_fraction: float = 1.0) -> float:
        """Duration of one compute action on a stage holding ``stage_fraction`` of a full stage."""
        if kind == ActionKind.FORWARD:
            full = self.t_forward
        elif kind == ActionKind.BACKWARD:
            full = self.t_backward
        elif kind == ActionKind.BACKWARD_INPUT:
            full = self.t_backward - self.t_weight
        elif kind == ActionKind.BACKWARD_WEIGHT:
            full = self.t_weight
        else:
            raise ScheduleError(f"{kind.name} is not a compute action (F, B, I or W)")
        return full * stage_fraction

    def exact(self, stage_fraction: Fraction = Fraction(1)) -> ExactTiming:
        """The replay's durations for stages of ``stage_fraction`` (``StageLayout.
        exact_stage_fraction``) in integer units: each duration is taken as the decimal it
        prints as (0.05 is 1/20, the number the user wrote, not the binary float nearest it) and
        all are scaled by the least common denominator."""
        full = {name: _decimal(getattr(self, name)) for name in _FIELDS}
        durations = {
            "forward": full["t_forward"] * stage_fraction,
            "backward": full["t_backward"] * stage_fraction,
            "backward_input": (full["t_backward"] - full["t_weight"]) * stage_fraction,
            "backward_weight": full["t_weight"] * stage_fraction,
            "p2p": full["t_p2p"],
            "transfer": full["t_evict"] * stage_fraction,
            "grad_sync": full["t_grad_reduce"],
            "param_sync": full["t_param_gather"],
        }
        per_unit = math.lcm(*(d.denominator for d in durations.values()))
        scaled = {name: int(d * per_unit) for name, d in durations.items()}
        return ExactTiming(Timing(**scaled), per_unit)


_FIELDS = tuple(field.name for field in fields(CostModel))


def _decimal(value: float) -> Fraction:
    """``value`` as the shortest decimal that reads back as it (``repr``): exact, and small
    denominators for the numbers people type."""
    return Fraction(value) if isinstance(value, int) else Fraction(repr(value))
