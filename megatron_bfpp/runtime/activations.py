"""The activations a rank stores between a micro-batch's forward and its backward: exactly what
autograd keeps per (stage, micro-batch), held by autograd alone, so BPipe ships and the accounting
counts that. Metadata is read at eviction, not at pack: megatron-core's recomputation may replace
a saved tensor's data after saving it (docs/design-notes.md, "BPipe runtime")."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["ALIGNMENT", "ActivationStore", "Evicted", "unique_storage_bytes"]

Key = tuple[int, int]  # (stage, micro-batch)
ALIGNMENT = 64  # bytes; every storage starts aligned in a payload, for any dtype's view


@dataclass(eq=False, slots=True, weakref_slot=True)
class _Saved:
    """What autograd holds instead of a saved tensor: the tensor, or None while it is evicted."""

    tensor: torch.Tensor | None


@dataclass(frozen=True)
class _View:
    storage: int  # index of the storage in the payload
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # storage offset, in elements


@dataclass
class Evicted:
    """What the evictor keeps of an evicted micro-batch: how to rebuild it, never its data."""

    nbytes: int  # payload bytes that carry data (the buffer may be padded beyond them)
    storage_offsets: list[int]  # byte offset of each storage in the payload
    targets: list[tuple[_Saved | torch.Tensor, _View]]


@dataclass
class ActivationStore:
    """One rank's stored activations in one step, keyed by (stage, micro-batch)."""

    device: torch.device
    excluded: set[int]  # data_ptr of parameter and buffer storages: never captured
    entries: dict[Key, list[weakref.ref[_Saved]]] = field(default_factory=dict)
    evicted: dict[Key, Evicted] = field(default_factory=dict)

    @classmethod
    def for_modules(
        cls, modules: Iterable[torch.nn.Module], device: torch.device
    ) -> ActivationStore:
        """A store that never captures the modules' parameters or buffers (nor their aliases)."""
        excluded: set[int] = set()
        for module in modules:
            # Unbound: megatron-core's DDP shadows ``buffers`` with its gradient buffers.
            tensors = (*torch.nn.Module.parameters(module), *torch.nn.Module.buffers(module))
            for tensor in tensors:
                excluded.add(tensor.untyped_storage().data_ptr())
        excluded.discard(0)
        return cls(device=device, excluded=excluded)

    @contextlib.contextmanager
    def capture(self, key: Key) -> Iterator[None]:
        """Route every tensor the forward of ``key`` saves for backward through this store."""
        handles = self.entries.setdefault(key, [])
        device, excluded = self.device, self.excluded

        def pack(tensor: torch.Tensor) -> object:
            if (
                type(tensor) is not torch.Tensor
                or tensor.layout is not torch.strided
                or tensor.device != device
            ):
                return tensor
            pointer = tensor.untyped_storage().data_ptr()
            if pointer == 0 or pointer in excluded:
                return tensor
            handle = _Saved(tensor)
            handles.append(weakref.ref(handle))
            return handle

        def unpack(packed: object) -> torch.Tensor:
            if isinstance(packed, _Saved):
                if packed.tensor is None:
                    raise RuntimeError(
                        f"a saved activation of stage {key[0]}, micro-batch {key[1]} is used "
                        "while evicted to the partner rank (its LOAD has not run); the schedule "
                        "and the executor disagree: please report this bug"
                    )
                return packed.tensor
            assert isinstance(packed, torch.Tensor)
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def drop(self, key: Key) -> None:
        """Forget ``key`` after its backward (autograd has released its handles by then)."""
        self.entries.pop(key, None)
        if key in self.evicted:
            raise RuntimeError(
                f"stage {key[0]}, micro-batch {key[1]} ran its backward while evicted"
            )

    def live_tensors(self) -> Iterator[torch.Tensor]:
        """Tensors held for backward right now (evicted ones excluded)."""
        for handles in self.entries.values():
            for ref in handles:
                handle = ref()
                if handle is not None and handle.tensor is not None:
                    yield handle.tensor

    def evict(
        self, key: Key, pipeline_tensors: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, Evicted]:
        """Pack ``key``'s saved tensors and ``pipeline_tensors`` into one uint8 buffer, release
        them locally; returns the buffer and the recipe."""
        if key in self.evicted:
            raise RuntimeError(f"stage {key[0]}, micro-batch {key[1]} is already evicted")
        handles = [ref() for ref in self.entries.get(key, [])]
        targets: list[tuple[_Saved | torch.Tensor, torch.Tensor]] = [
            (h, h.tensor) for h in handles if h is not None and h.tensor is not None
        ]
        targets += [(t, t) for t in pipeline_tensors if t.untyped_storage().nbytes() > 0]
        index: dict[int, int] = {}
        storages: list[torch.UntypedStorage] = []
        views: list[tuple[_Saved | torch.Tensor, _View]] = []
        for target, tensor in targets:
            storage = tensor.untyped_storage()
            position = index.setdefault(storage.data_ptr(), len(storages))
            if position == len(storages):
                storages.append(storage)
            view = _View(
                position,
                tensor.dtype,
                tuple(tensor.shape),
                tuple(tensor.stride()),
                int(tensor.storage_offset()),
            )
            views.append((target, view))
        offsets: list[int] = []  # each storage's aligned start in the payload
        nbytes = 0
        for storage in storages:
            offsets.append(-(-nbytes // ALIGNMENT) * ALIGNMENT)
            nbytes = offsets[-1] + storage.nbytes()
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        for storage, offset in zip(storages, offsets, strict=True):
            source = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
            buffer.narrow(0, offset, storage.nbytes()).copy_(source)
        for target, _ in targets:
            if isinstance(target, _Saved):
                target.tensor = None
            else:
                target.data = torch.empty(0, dtype=target.dtype, device=target.device)
        record = Evicted(nbytes, offsets, views)
        self.evicted[key] = record
        return buffer, record

    def restore(self, key: Key, buffer: torch.Tensor) -> None:
        """Rebuild ``key``'s tensors as views of ``buffer`` (the payload that came back)."""
        record = self.evicted.pop(key)
        if buffer.numel() < record.nbytes:
            raise RuntimeError(
                f"stage {key[0]}, micro-batch {key[1]}: {buffer.numel()} bytes came back for "
                f"{record.nbytes} evicted"
            )
        storage = buffer.untyped_storage()
        base = buffer.storage_offset()
        for target, view in record.targets:
            element = torch.empty(0, dtype=view.dtype).element_size()
            start = (base + record.storage_offsets[view.storage]) // element + view.offset
            rebuilt = torch.empty(0, dtype=view.dtype, device=buffer.device).set_(
                storage, start, view.size, view.stride
            )
            if isinstance(target, _Saved):
                target.tensor = rebuilt
            else:
                target.data = rebuilt


def unique_storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors``: what they keep allocated together."""
    storages = (tensor.untyped_storage() for tensor in tensors if tensor is not None)
    seen = {storage.data_ptr(): storage.nbytes() for storage in storages}
    seen.pop(0, None)  # data_ptr 0: an empty storage, nothing allocated
    return sum(seen.values())
