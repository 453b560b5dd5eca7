"""megatron_bfpp: pipeline-parallel schedules for megatron-core that upstream lacks.

Importing the package is cheap and torch-free: the schedule layers (``ir``, ``passes``,
``validate``, ``schedules``, ``sim``) plan, check and draw schedules anywhere.
"""

from __future__ import annotations

from megatron_bfpp.ir import Action, ActionKind, Schedule, ScheduleError, StageLayout

# The one place the version is written (setup.py reads it from here). A beta: every schedule runs
# on megatron-core, verified on CPU ranks; none has been measured on GPUs yet.
__version__ = "0.9.0b1"

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "StageLayout",
    "__version__",
    "build_schedule",
    "get_forward_backward_func",
    "install",
    "schedule_names",
    "set_schedule",
    "uninstall",
]

_LAZY = {
    "get_forward_backward_func": "megatron_bfpp.runtime",
    "install": "megatron_bfpp.megatron",
    "uninstall": "megatron_bfpp.megatron",
    "set_schedule": "megatron_bfpp.megatron",
}


def __getattr__(name: str) -> object:
    """The runtime and the Megatron integration need torch and megatron-core: import them only
    when asked, so planning and simulating schedules stays torch-free."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_bfpp' has no attribute {name!r}")


def build_schedule(name: str, **kwargs: object) -> Schedule:
    """Shortcut for ``megatron_bfpp.schedules.registry.build_schedule`` (imported lazily)."""
    from megatron_bfpp.schedules import build_schedule as build

    return build(name, **kwargs)  # type: ignore[arg-type]


def schedule_names() -> tuple[str, ...]:
    from megatron_bfpp.schedules import schedule_names as names

    return names()
