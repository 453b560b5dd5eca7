"""Run megatron-core 0.16-0.20 on CPU with gloo: the one place that redirects its CUDA-only calls.

Used by the tests, bfpp-train's CPU ranks and the Megatron-LM CPU launcher
(:mod:`megatron_bfpp.megatron.cpu_launch`), and only when there is no GPU: the GPU path never
calls it, and the runtime and the plugin never import it. ``enable_cpu_megatron()`` installs
every redirect below (idempotent); ``disable_cpu_megatron()`` puts every original back.
On CPU the "current device" *is* the CPU, so each redirect maps a CUDA call onto its CPU meaning:

``torch.cuda.current_device()`` -> ``torch.device("cpu")``
    megatron allocates with ``device=torch.cuda.current_device()``: p2p receive buffers
    (``pipeline_parallel.p2p_communication``), TP all-gather / reduce-scatter outputs
    (``tensor_parallel.mappings``, ``.layers``, ``.utils``), DDP grad buffers
    (``distributed.param_and_grad_buffer``), distributed-optimizer shards, ``GPTModel`` /
    ``Attention`` helpers, rotary embeddings.
``torch.cuda.synchronize()`` -> no-op
    ``p2p_communication`` (``batch_p2p_sync``), ``DistributedDataParallel`` buffer offload.
``torch.cuda.Stream`` / ``Event`` / ``stream`` / ``current_stream`` / ``default_stream`` /
``set_stream`` -> stand-ins that do nothing (everything on CPU is synchronous)
    megatron-core 0.19+ DDP (``param_and_grad_buffer.start_grad_sync`` waits on the current
    stream), overlapped p2p, Megatron-LM's timers and rerun machinery.
``device="cuda"`` (or ``"cuda:N"``, a CUDA ``torch.device``, an int index) in the factories
``torch.tensor``, ``as_tensor``, ``zeros``, ``ones``, ``empty``, ``full``, ``arange`` -> CPU
    ``schedules`` (``total_num_tokens``), ``optimizer.optimizer`` (``found_inf``,
    ``_scale_one``, ``_dummy_overflow_buf``), ``grad_scaler``, ``clip_grads`` (grad norm),
    ``transformer.utils`` (default causal masks), ``tensor_parallel.data``.
``Tensor.cuda()`` / ``Module.cuda()`` -> the tensor / module itself (it already is "on device")
    ``LanguageModule`` tied-embedding sync (``weight.data.cuda()``), ``tensor_parallel.data``,
    optimizer state reload, ``grad_scaler.load_state_dict``, Megatron-LM's ``get_model``.
``Tensor.type()`` (no argument) reports a CPU tensor as ``torch.cuda.<T>Tensor``
    the optimizers dispatch on ``param.type() == 'torch.cuda.FloatTensor'``
    (``DistributedOptimizer._build_model_and_main_param_groups``,
    ``Float16OptimizerWithFloat16Params``) and ``clip_grads`` asserts it; ``Tensor.type(T)`` with a
    ``torch.cuda.*`` name converts to the CPU type.
CUDA RNG in ``megatron.core.tensor_parallel.random`` -> the CPU default generator
    ``_get_cuda_rng_state`` (raises on a CPU build) and ``_set_cuda_rng_state`` (silently queues a
    lazy CUDA call that never runs) are what ``get_cuda_rng_tracker().fork()`` and activation
    checkpointing use; ``CudaRNGStatesTracker.add`` calls ``torch.cuda.get_rng_state``;
    ``model_parallel_cuda_manual_seed``'s ``torch.cuda.manual_seed`` is a silent no-op on CPU, so
    the wrapper seeds the CPU generator with the data-parallel seed as that call seeds the device.
    ``fork()`` then switches the CPU generator to the tensor-parallel stream and back. Its
    "CPU RNG state changed within GPU RNG context" warning is expected here (device and CPU
    generator are one) and is filtered out while enabled.
``WrappedTorchNorm`` (``transformer.torch_norm``) accepts ``sequence_parallel``
    without Apex the local spec's norms are ``torch.nn.LayerNorm`` via ``WrappedTorchNorm``, which
    asserts ``not config.sequence_parallel``. A torch norm is correct on a sequence shard; what
    sequence parallelism needs is the ``sequence_parallel`` mark on the norm's parameters (as
    Apex's ``FusedLayerNorm`` sets it) so ``finalize_model_grads`` all-reduces their gradients
    across tensor-parallel ranks. The redirect builds the norm from a copy of the config with
    ``sequence_parallel=False`` and sets that mark.

Use with ``use_cpu_initialization=True``, fp32, dropout 0 and ``batch_p2p_comm=False``: with
``batch_p2p_comm=True`` megatron-core's interleaved schedule at pp=2 (activation and gradient to
the same peer) gives wrong gradients on gloo (measured: every gradient off), while 1F1B passes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_bfpp.megatron.patches import Patches

__all__ = ["cpu_megatron", "disable_cpu_megatron", "enable_cpu_megatron", "is_cpu_megatron_enabled"]

_CPU = torch.device("cpu")
# Constructors megatron-core calls with a literal CUDA device (``*_like`` follow their input).
_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange")
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"

_lock = threading.Lock()
_patches = Patches()
_log_filter: logging.Filter | None = None


def is_cpu_megatron_enabled() -> bool:
    """True while the redirects are installed."""
    return bool(_patches)


def enable_cpu_megatron() -> None:
    """Install every redirect listed in the module docstring (a no-op if already installed)."""
    global _log_filter
    with _lock:
        if _patches:
            return
        import megatron.core.tensor_parallel as tp_pkg
        import megatron.core.tensor_parallel.random as mrandom
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        _patches.patch(torch.cuda, "current_device", _current_device)
        _patches.patch(torch.cuda, "synchronize", _synchronize)
        _patches.patch(torch.cuda, "Stream", _Stream)
        _patches.patch(torch.cuda, "Event", _Event)
        _patches.patch(torch.cuda, "stream", _stream_context)
        _patches.patch(torch.cuda, "current_stream", _current_stream)
        _patches.patch(torch.cuda, "default_stream", _current_stream)
        _patches.patch(torch.cuda, "set_stream", _set_stream)
        for name in _FACTORIES:
            _patches.patch(torch, name, _on_cpu(getattr(torch, name)))
        _patches.patch(torch.Tensor, "cuda", _tensor_cuda)
        _patches.patch(torch.nn.Module, "cuda", _module_cuda)
        _patches.patch(torch.Tensor, "type", _tensor_type(torch.Tensor.type))

        _patches.patch(mrandom, "_get_cuda_rng_state", _get_rng_state)
        _patches.patch(mrandom, "_set_cuda_rng_state", _set_rng_state)
        _patches.patch(mrandom.CudaRNGStatesTracker, "add", _tracker_add)
        seed_fn = _manual_seed(mrandom.model_parallel_cuda_manual_seed)
        _patches.patch(mrandom, "model_parallel_cuda_manual_seed", seed_fn)
        _patches.patch(tp_pkg, "model_parallel_cuda_manual_seed", seed_fn)

        _patches.patch(WrappedTorchNorm, "__new__", _torch_norm_new(WrappedTorchNorm.__new__))

        _log_filter = _DropMessage(_RNG_WARNING)
        logging.getLogger(mrandom.__name__).addFilter(_log_filter)


def disable_cpu_megatron() -> None:
    """Restore every original installed by :func:`enable_cpu_megatron` (no-op if not enabled)."""
    global _log_filter
    with _lock:
        _patches.restore()
        if _log_filter is not None:
            import megatron.core.tensor_parallel.random as mrandom

            logging.getLogger(mrandom.__name__).removeFilter(_log_filter)
            _log_filter = None


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """``with cpu_megatron(): ...`` enables the redirects and restores them on exit (if this
    call was the one that enabled them)."""
    was_enabled = is_cpu_megatron_enabled()
    enable_cpu_megatron()
    try:
        yield
    finally:
        if not was_enabled:
            disable_cpu_megatron()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA index for torch factories (bool is no device).
    return isinstance(device, int) and not isinstance(device, bool)


def _current_device() -> torch.device:
    return _CPU


def _synchronize(device: Any = None) -> None:
    return None


class _Stream:
    """A CUDA stream stand-in: CPU work is synchronous, so waiting and syncing do nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Event:
    """A CUDA event stand-in (``elapsed_time`` is 0: time CPU runs with the timers instead)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_STREAM = _Stream()


@contextlib.contextmanager
def _stream_context(stream: Any = None) -> Iterator[None]:
    yield


def _current_stream(device: Any = None) -> _Stream:
    return _STREAM


def _set_stream(stream: Any) -> None:
    return None


def _on_cpu(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    return wrapper


def _tensor_cuda(
    self: torch.Tensor, device: Any = None, non_blocking: bool = False, **_: Any
) -> Any:
    return self


def _module_cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
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


class _DropMessage(logging.Filter):
    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return self.message not in record.getMessage()
