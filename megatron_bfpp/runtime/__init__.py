"""Execute schedules on megatron-core model chunks (needs torch and megatron-core)."""

from megatron_bfpp.runtime.api import RUNNABLE_SCHEDULES, get_forward_backward_func, plan_schedule

__all__ = ["RUNNABLE_SCHEDULES", "get_forward_backward_func", "plan_schedule"]
