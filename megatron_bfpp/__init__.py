"""megatron_bfpp: pipeline-parallel schedules for megatron-core that upstream lacks.

Importing the package is cheap and torch-free: the schedule layers (``ir``, ``passes``,
``validate``, ``schedules``, ``sim``) plan, check and draw schedules anywhere."""

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
    "build_schedule": "megatron_bfpp.schedules",
    "schedule_names": "megatron_bfpp.schedules",
    "get_forward_backward_func": "megatron_bfpp.runtime",
    "install": "megatron_bfpp.megatron",
    "uninstall": "megatron_bfpp.megatron",
    "set_schedule": "megatron_bfpp.megatron",
}


def __getattr__(name: str) -> object:
    """The catalogue, the runtime and the Megatron integration (torch, megatron-core) are imported
    only when asked, so importing the package stays cheap and torch-free."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_bfpp' has no attribute {name!r}")
