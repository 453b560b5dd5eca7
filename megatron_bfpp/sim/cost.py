"""How long each action takes: a handful of numbers in one abstract time unit.

Compute times are given for one micro-batch through one *full* 1F1B stage (``num_layers / pp``
layers); a stage of a looped layout with ``v`` chunks per rank takes ``1 / v`` of that and a
V-shape stage ``1 / 2``, which is ``StageLayout.stage_fraction``. Communication times are per
message (p2p), per chunk (data-parallel gradient reduce / parameter gather) or per full-stage
micro-batch of stored activations (BPipe eviction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from megatron_bfpp.ir import ActionKind, ScheduleError

__all__ = ["CostModel"]


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
