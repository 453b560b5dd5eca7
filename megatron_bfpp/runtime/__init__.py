"""Execute schedules on megatron-core model chunks (needs torch and megatron-core)."""

from megatron_bfpp.runtime.api import (
    get_forward_backward_func,
    gradients_finite,
    plan_schedule,
    sharded_optimizer_step,
)

__all__ = [
    "get_forward_backward_func",
    "gradients_finite",
    "plan_schedule",
    "sharded_optimizer_step",
]
