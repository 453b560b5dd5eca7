"""Schedule generators, one module per family; ``registry`` maps user-facing names to them."""

from megatron_bfpp.schedules.registry import (
    SCHEDULES,
    ScheduleSpec,
    build_schedule,
    get_spec,
    schedule_names,
)

__all__ = ["SCHEDULES", "ScheduleSpec", "build_schedule", "get_spec", "schedule_names"]
