"""Run Megatron-LM's own training scripts without CUDA: the redirects its training code needs on
top of :mod:`megatron_bfpp.megatron.cpu` (docs/architecture.md#megatron-integration)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from megatron_bfpp.megatron.patches import Patches

__all__ = ["disable_cpu_megatron_lm", "enable_cpu_megatron_lm"]

log = logging.getLogger(__name__)

_patches = Patches()


def enable_cpu_megatron_lm() -> None:
    """Install the redirects (no-op when already installed)."""
    if _patches:
        return
    from megatron_bfpp.megatron import cpu

    cpu.enable_cpu_megatron()
    _patches.patch(torch.cuda, "set_device", cpu._own(cpu._nothing))
    _patches.patch(torch.cuda, "device_count", lambda: 1)
    _patches.patch(torch.cuda, "get_rng_state", cpu._get_rng_state)
    _patches.patch(torch.cuda, "set_rng_state", cpu._set_rng_state)
    dist = torch.distributed
    _patches.patch(dist, "init_process_group", _gloo_init(dist.init_process_group))
    with contextlib.suppress(ImportError):
        fused_kernels = importlib.import_module("megatron.legacy.fused_kernels")
        _patches.patch(fused_kernels, "load", cpu._nothing)
    with contextlib.suppress(ImportError):
        initialize = importlib.import_module("megatron.training.initialize")
        if hasattr(initialize, "_warmup_jit_function"):
            _patches.patch(initialize, "_warmup_jit_function", cpu._nothing)
        wrapped = _allow_no_cuda(initialize.initialize_megatron)
        _patches.patch(initialize, "initialize_megatron", wrapped)
        training = importlib.import_module("megatron.training.training")
        if hasattr(training, "initialize_megatron"):
            _patches.patch(training, "initialize_megatron", wrapped)
        _patches.wrap(training, "load_checkpoint", _with_torch_adam_state)


def disable_cpu_megatron_lm() -> None:
    """Restore the originals (megatron-core's CPU adapter is disabled too)."""
    from megatron_bfpp.megatron.cpu import disable_cpu_megatron

    _patches.restore()
    disable_cpu_megatron()


def _gloo_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = ("gloo", *args[1:])
        elif kwargs.get("backend") != "fake":
            kwargs["backend"] = "gloo"
        device = kwargs.get("device_id")
        if device is not None and torch.device(device).type == "cuda":
            kwargs.pop("device_id")
        return original(*args, **kwargs)

    return init_process_group


def _with_torch_adam_state(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_checkpoint(model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        from megatron_bfpp.compat import restore_torch_adam_steps, torch_adam_state_for_load

        if optimizer is not None:
            torch_adam_state_for_load(optimizer)
        with torch.no_grad():
            result = original(model, optimizer, *args, **kwargs)
        if optimizer is not None:
            restore_torch_adam_steps(optimizer)
        return result

    return load_checkpoint


def _allow_no_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        if len(args) < 4:  # (extra_args_provider, args_defaults, ignore_unknown_args, allow_...)
            kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron
