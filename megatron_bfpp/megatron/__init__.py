"""Integration with megatron-core and Megatron-LM: the only package that patches anything.

``install()`` adds ``--pipeline-schedule`` to Megatron-LM and routes its forward-backward
function to megatron_bfpp; ``set_schedule()`` does the same for megatron-core-only loops.
"""

from megatron_bfpp.megatron.plugin import (
    current_schedule,
    install,
    is_installed,
    set_schedule,
    uninstall,
)

__all__ = ["current_schedule", "install", "is_installed", "set_schedule", "uninstall"]
