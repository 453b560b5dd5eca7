"""Run megatron-core on CPU with gloo, without a GPU: each redirect maps a CUDA-only call onto its
CPU meaning (docs/architecture.md#megatron-integration). Use with ``use_cpu_initialization=True``,
fp32, dropout 0 and ``batch_p2p_comm=False`` (batched p2p gave wrong gradients on gloo)."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_bfpp.megatron.patches import Patches

__all__ = ["disable_cpu_megatron", "enable_cpu_megatron", "is_cpu_megatron_enabled"]

_CPU = torch.device("cpu")
# Constructors megatron-core calls with a literal CUDA device (``*_like`` follow their input).
_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange")
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"

_lock = threading.Lock()
_patches = Patches()


def is_cpu_megatron_enabled() -> bool:
    """True while the redirects are installed."""
    return bool(_patches)


def enable_cpu_megatron() -> None:
    """Install every redirect (a no-op if already installed)."""
    with _lock:
        if _patches:
            return
        import megatron.core.tensor_parallel as tp_pkg
        import megatron.core.tensor_parallel.random as mrandom
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        _patches.patch(torch.cuda, "current_device", lambda: _CPU)
        _patches.patch(torch.cuda, "synchronize", _own(_nothing))
        _patches.patch(torch.cuda, "Stream", _Synchronous)
        _patches.patch(torch.cuda, "Event", _Synchronous)
        _patches.patch(torch.cuda, "stream", _stream_context)
        _patches.patch(torch.cuda, "current_stream", _current_stream)
        _patches.patch(torch.cuda, "default_stream", _own(_current_stream))
        _patches.patch(torch.cuda, "set_stream", _own(_nothing))
        for name in _FACTORIES:
            _patches.patch(torch, name, _on_cpu(getattr(torch, name)))
        _patches.patch(torch.Tensor, "record_stream", _own(_nothing))  # combined 1F1B's streams
        for name in ("range_push", "range_pop"):  # and its ranges (a CPU build has no NVTX)
            _patches.patch(torch.cuda.nvtx, name, _own(_nothing))
        _patches.patch(torch.Tensor, "cuda", _itself)
        _patches.patch(torch.nn.Module, "cuda", _itself)
        _patches.patch(torch.Tensor, "type", _tensor_type(torch.Tensor.type))
        dist = torch.distributed
        _patches.patch(dist, "all_to_all_single", _listed_splits(dist.all_to_all_single))

        _patches.patch(mrandom, "_get_cuda_rng_state", _get_rng_state)
        _patches.patch(mrandom, "_set_cuda_rng_state", _set_rng_state)
        _patches.patch(mrandom.CudaRNGStatesTracker, "add", _tracker_add)
        seed_fn = _manual_seed(mrandom.model_parallel_cuda_manual_seed)
        _patches.patch(mrandom, "model_parallel_cuda_manual_seed", seed_fn)
        _patches.patch(tp_pkg, "model_parallel_cuda_manual_seed", seed_fn)

        _patches.patch(WrappedTorchNorm, "__new__", _torch_norm_new(WrappedTorchNorm.__new__))

        logging.getLogger(mrandom.__name__).addFilter(_without_rng_warning)


def disable_cpu_megatron() -> None:
    """Restore every original installed by :func:`enable_cpu_megatron` (no-op if not enabled)."""
    with _lock:
        if not _patches:
            return
        _patches.restore()
        logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(_without_rng_warning)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA index for torch factories (bool is no device).
    return isinstance(device, int) and not isinstance(device, bool)


def _nothing(*args: Any, **kwargs: Any) -> None:
    """``synchronize``, ``set_stream`` and the like: CPU work is synchronous."""


def _listed_splits(all_to_all_single: Callable[..., Any]) -> Callable[..., Any]:
    """megatron-core's MoE dispatcher moves its split sizes to host arrays only from a GPU
    (``maybe_move_tensor_to_cpu``); on CPU they stay tensors, which the binding refuses."""
    signature = inspect.signature(all_to_all_single)

    @functools.wraps(all_to_all_single)
    def listed(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        for name in ("output_split_sizes", "input_split_sizes"):
            if isinstance(sizes := bound.arguments.get(name), torch.Tensor):
                bound.arguments[name] = sizes.tolist()
        return all_to_all_single(*bound.args, **bound.kwargs)

    return listed


class _Synchronous:
    """A CUDA stream or event stand-in: CPU work is synchronous, so syncing and waiting do
    nothing (``elapsed_time`` is 0: time CPU runs with the timers instead)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    synchronize = wait_stream = wait_event = record = wait = __exit__ = _nothing

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Synchronous()

    def __enter__(self) -> _Synchronous:
        return self

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_STREAM = _Synchronous()


@contextlib.contextmanager
def _stream_context(stream: Any = None) -> Iterator[None]:
    yield


def _current_stream(device: Any = None) -> _Synchronous:
    return _STREAM


def _own(function: Callable[..., Any]) -> Callable[..., Any]:
    """One object per torch name: torch.compile refuses one under two (megatron-core's router)."""

    @functools.wraps(function)
    def own(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return own


def _on_cpu(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    return wrapper


def _itself(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.cuda()`` / ``Module.cuda()``: already "on the device"."""
    return self


def _tensor_type(original: Callable[..., Any]) -> Callable[..., Any]:
    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any) -> Any:
        if dtype is None:
            name: str = original(self)
            if self.device.type == "cpu" and not name.startswith("torch.cuda."):
                return "torch.cuda." + name.removeprefix("torch.")
            return name
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = "torch." + dtype.removeprefix("torch.cuda.")
        return original(self, dtype, non_blocking, **kw)

    return type_


def _get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> Any:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _tracker_add(self: Any, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` with the CPU default generator as the device generator."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    original = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(original)


def _manual_seed(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def model_parallel_cuda_manual_seed(seed: int, *args: Any, **kwargs: Any) -> Any:
        torch.manual_seed(seed)  # what torch.cuda.manual_seed(data_parallel_seed) does on GPU
        return original(seed, *args, **kwargs)

    return model_parallel_cuda_manual_seed


def _torch_norm_new(original: Callable[..., Any]) -> Callable[..., Any]:
    def __new__(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)  # a shallow copy: no __post_init__, the model's config intact
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True  # what FusedLayerNorm marks; finalize reduces it
        return norm

    return staticmethod(__new__)


def _without_rng_warning(record: logging.LogRecord) -> bool:
    return _RNG_WARNING not in record.getMessage()
