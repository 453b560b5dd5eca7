"""What Megatron-Bridge needs on CPU ranks beyond ``megatron.cpu`` / ``cpu_launch``, for tests and
examples/bridge_pretrain.py; each redirect and the error it answers: docs/bridge.md."""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

from megatron_bfpp.megatron.patches import Patches

__all__ = [
    "EXACT_PREFIX",
    "bridge_imports",
    "disable_cpu_bridge",
    "enable_cpu_bridge",
    "record_losses",
]

# Bridge modules that import transformer_engine at module level, unconditionally.
TE_IMPORTERS = frozenset({"megatron.bridge.peft.lora_layers"})
# What the exact-loss lines start with: "<prefix> <iteration> <loss.hex()> <grad norm repr>".
EXACT_PREFIX = "BFPP_EXACT"

_patches = Patches()


class _Unavailable:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("transformer_engine is not installed on this CPU machine")


def _te_stub() -> types.ModuleType:
    """The names lora_layers evaluates at import (annotations such as ``-> te.ops.Sequential``)
    and in isinstance checks: distinct classes, so nothing is ever an instance of them."""
    te = types.ModuleType("transformer_engine")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    ops = types.ModuleType("transformer_engine.pytorch.ops")
    names = {
        ops: "Sequential Linear LayerNorm RMSNorm Quantize MakeExtraOutput Dropout ConstantScale "
        "AddExtraInput",
        pytorch: "Linear LayerNormLinear TransformerLayer",
    }
    for module in names:
        for name in names[module].split():
            setattr(module, name, type(name, (_Unavailable,), {}))
    pytorch.fp8_autocast = _Unavailable  # type: ignore[attr-defined]
    pytorch.ops = ops  # type: ignore[attr-defined]
    te.pytorch = pytorch  # type: ignore[attr-defined]
    return te


@contextlib.contextmanager
def bridge_imports() -> Iterator[None]:
    """Import Bridge inside this block: only :data:`TE_IMPORTERS` see the TE stub."""
    stub, original = _te_stub(), builtins.__import__

    def scoped(
        name: str,
        globals: dict[str, Any] | None = None,
        locals: dict[str, Any] | None = None,
        fromlist: Any = (),
        level: int = 0,
    ) -> Any:
        importer = (globals or {}).get("__name__", "")
        if level == 0 and name.split(".")[0] == "transformer_engine" and importer in TE_IMPORTERS:
            module = stub
            for part in name.split(".")[1:] if fromlist else ():
                module = getattr(module, part)
            return module
        return original(name, globals, locals, fromlist, level)

    builtins.__import__ = scoped
    try:
        yield
    finally:
        builtins.__import__ = original


def enable_cpu_bridge() -> None:
    """The megatron-core and Megatron-LM CPU redirects, then Bridge's own (no-op if on)."""
    if _patches:
        return
    from megatron_bfpp.megatron.cpu import _nothing
    from megatron_bfpp.megatron.cpu_launch import _allow_no_cuda, enable_cpu_megatron_lm

    enable_cpu_megatron_lm()
    with bridge_imports():
        initialize = importlib.import_module("megatron.bridge.training.initialize")
        setup = importlib.import_module("megatron.bridge.training.setup")
    wrapped = _allow_no_cuda(initialize.initialize_megatron)
    for module in (initialize, setup):
        _patches.patch(module, "initialize_megatron", wrapped)
    _patches.patch(initialize, "_warmup_jit_function", _nothing)
    _patches.patch(initialize, "compile_helpers", _nothing)


def disable_cpu_bridge() -> None:
    from megatron_bfpp.megatron.cpu_launch import disable_cpu_megatron_lm

    _patches.restore()
    disable_cpu_megatron_lm()


def record_losses() -> None:
    """Print each iteration's exact lm loss (``float.hex``) and grad norm on the last rank."""
    import torch.distributed as dist

    train = importlib.import_module("megatron.bridge.training.train")
    original = train.training_log
    signature = inspect.signature(original)

    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs).arguments
        loss = bound["loss_dict"].get("lm loss")
        # one printer: the last global rank (a last pipeline stage) has every iteration's loss
        if loss is not None and dist.get_rank() == dist.get_world_size() - 1:
            value = float(loss.item() if hasattr(loss, "item") else loss)
            step = bound["global_state"].train_state.step
            line = f"{EXACT_PREFIX} {step} {value.hex()} {bound['grad_norm']!r}\n"
            sys.stdout.write(line)  # one write: lines of other processes stay whole
            sys.stdout.flush()
        return original(*args, **kwargs)

    _patches.patch(train, "training_log", training_log)
