"""How long each action takes, in one abstract time unit, timed in integers (``CostModel.exact``)
since a stage's 1/3 summed as a float drifts (13 came out as 12.999999999999996)."""

from __future__ import annotations

import math
from dataclasses import Field, dataclass, field, fields
from fractions import Fraction
from itertools import chain
from typing import Any, NamedTuple

from megatron_bfpp.ir import ActionKind, ScheduleError
from megatron_bfpp.semantics import Timing, compute_durations

__all__ = ["CostModel", "ExactTiming", "cost_fields"]


class ExactTiming(NamedTuple):
    """A replay's integer durations; a replay time ``t`` is ``t / per_unit`` cost-model units."""

    timing: Timing
    per_unit: int


# The replay's unit timing (a full stage): the defaults of the costs below.
_UNIT = Timing()


def _cost(default: float, text: str) -> Any:
    """A cost field with the help its bfpp-sim flag shows, declared once for both."""
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True, slots=True)
class CostModel:
    """Durations in one abstract time unit, each field's ``help`` saying what it times: compute
    (one micro-batch through one full 1F1B stage) and ``t_evict`` scale with the stage fraction;
    ``t_host``, the host's time per compute action (0: a GPU's host runs ahead), does not, so it
    weighs ``v`` times as much with ``v`` chunks per rank."""

    t_forward: float = _cost(_UNIT.forward, "forward time")
    t_backward: float = _cost(_UNIT.backward, "backward time (input + weight gradients)")
    t_weight: float = _cost(
        _UNIT.backward_weight, "weight-gradient part of --t-backward (split schedules)"
    )
    t_p2p: float = _cost(_UNIT.p2p, "one pipeline message")
    t_grad_reduce: float = _cost(_UNIT.grad_sync, "one chunk's data-parallel gradient reduction")
    t_param_gather: float = _cost(_UNIT.param_sync, "one chunk's data-parallel parameter gather")
    t_evict: float = _cost(
        _UNIT.transfer, "BPipe: moving one micro-batch's activations to the partner"
    )
    t_host: float = _cost(
        0.0, "host time per compute action (F, B, I, W) on top of its compute, not scaled"
    )
    t_a2a: float = _cost(
        0.0, "MoE: all-to-all in one forward, and in one backward; a combined F&B pair hides it"
    )
    # Uneven stages: each global stage's compute against an even stage's (1.0: as even; the
    # embedding, output layer and loss, other layer counts), t_host unweighted; empty: all even.
    # Not a cost of its own (``cost_fields`` leaves it out): one per stage of the schedule timed.
    stage_weights: tuple[float, ...] = ()
    # Uneven stages: each global stage's stored activations against an even stage's, what its
    # BPipe evict / restore moves (t_evict times it; a layout's layer shares); empty: all 1.
    stage_activations: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for weight in (*self.stage_weights, *self.stage_activations):
            if not _number(weight):
                raise ScheduleError(f"stage weights must be finite numbers >= 0, got {weight!r}")
        for cost in cost_fields():
            value = getattr(self, cost.name)
            if not _number(value):
                raise ScheduleError(
                    f"CostModel.{cost.name} must be a finite number >= 0, got {value!r}"
                )
        if self.t_weight > self.t_backward:
            raise ScheduleError(
                f"CostModel.t_weight ({self.t_weight}) is the weight-gradient part of t_backward "
                f"({self.t_backward}) and must be <= it"
            )
        if self.t_a2a > min(self.t_forward, self.t_backward - self.t_weight):
            raise ScheduleError(
                f"CostModel.t_a2a ({self.t_a2a}) is part of a forward and of a backward's input "
                f"gradient and must be <= both (t_forward {self.t_forward}, t_backward - t_weight "
                f"{self.t_backward - self.t_weight})"
            )

    def compute_time(self, kind: ActionKind, stage_fraction: float = 1.0) -> float:
        """One compute action's duration on a stage of ``stage_fraction``, ``t_host`` included."""
        split = self.t_backward - self.t_weight  # I, the input-gradient part
        full = compute_durations(Timing(self.t_forward, self.t_backward, split, self.t_weight))
        if kind not in full:
            raise ScheduleError(f"{kind.name} is not a compute action (F, B, I or W)")
        return full[kind] * stage_fraction + self.t_host

    def exact(self, stage_fraction: Fraction = Fraction(1)) -> ExactTiming:
        """Integer-unit durations: the printed decimals times their least common denominator;
        with ``stage_weights``, each stage's compute (F, B, I, W) as ``Timing.stages``, and with
        ``stage_activations`` each stage's transfer as ``Timing.stage_transfers``."""
        full = {cost.name: _decimal(getattr(self, cost.name)) for cost in cost_fields()}
        host = full["t_host"]  # per compute action, whatever the stage's size
        compute = (  # F, B, I, W of an even stage, less the host's time
            full["t_forward"] * stage_fraction,
            full["t_backward"] * stage_fraction,
            (full["t_backward"] - full["t_weight"]) * stage_fraction,
            full["t_weight"] * stage_fraction,
        )
        durations = {
            **dict(zip(_COMPUTE, compute, strict=True)),
            "p2p": full["t_p2p"],
            "transfer": full["t_evict"] * stage_fraction,
            "grad_sync": full["t_grad_reduce"],
            "param_sync": full["t_param_gather"],
            "a2a": full["t_a2a"] * stage_fraction,
        }
        durations = {name: d + host * (name in _COMPUTE) for name, d in durations.items()}
        stages = [[c * _decimal(w) + host for c in compute] for w in self.stage_weights]
        moved = [durations["transfer"] * _decimal(w) for w in self.stage_activations]
        denominators = [d.denominator for d in (*durations.values(), *chain(*stages), *moved)]
        per_unit = math.lcm(*denominators)
        scaled = {name: int(d * per_unit) for name, d in durations.items()}
        rows = tuple(tuple(int(d * per_unit) for d in row) for row in stages)
        transfers = tuple(int(d * per_unit) for d in moved)
        return ExactTiming(
            Timing(**scaled, stages=rows, stage_transfers=transfers),  # type: ignore[arg-type]
            per_unit,
        )


_COMPUTE = ("forward", "backward", "backward_input", "backward_weight")  # Timing's, in order


def _number(value: object) -> bool:
    """A finite number >= 0 (not a bool): what every cost and weight must be."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def cost_fields() -> tuple[Field[Any], ...]:
    """CostModel's costs (default, ``metadata["help"]``): what front ends derive flags from."""
    return tuple(f for f in fields(CostModel) if "help" in f.metadata)


def _decimal(value: float) -> Fraction:
    """``value`` as the shortest decimal that reads back as it: small denominators."""
    return Fraction(value) if isinstance(value, int) else Fraction(repr(value))
