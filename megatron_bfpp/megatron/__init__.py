"""Integration with megatron-core and Megatron-LM: the only package that patches anything
(``install()`` for Megatron-LM's ``--pipeline-schedule``, ``set_schedule()`` for core loops)."""

from megatron_bfpp.megatron.plugin import (
    current_schedule,
    install,
    is_installed,
    set_schedule,
    uninstall,
)

__all__ = ["current_schedule", "install", "is_installed", "set_schedule", "uninstall"]
