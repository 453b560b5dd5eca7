"""megatron_bfpp: pipeline-parallel schedules for megatron-core that upstream lacks.

Importing the package is cheap and torch-free: the schedule layers (``ir``, ``passes``,
``validate``, ``schedules``, ``sim``) plan, check and draw schedules anywhere.
"""

from __future__ import annotations

from megatron_bfpp.ir import Action, ActionKind, Schedule, ScheduleError, StageLayout

__version__ = "0.1.0"

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "StageLayout",
    "__version__",
    "build_schedule",
    "get_forward_backward_func",
    "schedule_names",
]


def __getattr__(name: str) -> object:
    """``get_forward_backward_func`` needs torch and megatron-core: import it only when asked."""
    if name == "get_forward_backward_func":
        from megatron_bfpp.runtime import get_forward_backward_func

        return get_forward_backward_func
    raise AttributeError(f"module 'megatron_bfpp' has no attribute {name!r}")


def build_schedule(name: str, **kwargs: object) -> Schedule:
    """Shortcut for ``megatron_bfpp.schedules.registry.build_schedule`` (imported lazily)."""
    from megatron_bfpp.schedules import build_schedule as build

    return build(name, **kwargs)  # type: ignore[arg-type]


def schedule_names() -> tuple[str, ...]:
    from megatron_bfpp.schedules import schedule_names as names

    return names()
