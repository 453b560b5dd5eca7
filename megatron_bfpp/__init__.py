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
    "schedule_names",
]


def build_schedule(name: str, **kwargs: object) -> Schedule:
    """Shortcut for ``megatron_bfpp.schedules.registry.build_schedule`` (imported lazily)."""
    from megatron_bfpp.schedules import build_schedule as build

    return build(name, **kwargs)  # type: ignore[arg-type]


def schedule_names() -> tuple[str, ...]:
    from megatron_bfpp.schedules import schedule_names as names

    return names()
