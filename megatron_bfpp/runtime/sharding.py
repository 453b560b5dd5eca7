"""Sharded parameters (ZeRO-3) on megatron-core's own buffers, driven by the schedule.

``--data-parallel-sharding-strategy optim_grads_params`` lowers a schedule with a gather (PS)
before a chunk's parameters are needed and a release (RL) when they are not (see
``passes.grad_sync``). This module executes those two actions on megatron-core DDP chunks built
for the distributed optimizer, whose parameters are views into one flat buffer per dtype, split
into buckets the optimizer already shards over the data-parallel group:

- a release keeps this rank's shard of every bucket in a small buffer of its own and frees the
  storage of the full buffer (``untyped_storage().resize_(0)``): the parameters' views, and the
  tensors autograd saved for a later backward, keep pointing at that storage;
- a gather re-allocates the storage and all-gathers every bucket from the kept shards, posted
  asynchronously when the PS runs and waited on by the chunk's first compute after it, so the
  next chunk's gather overlaps this chunk's compute; once it has landed the kept shards are
  freed, so a gathered chunk is not held twice.

Why this mechanism (``docs/design-notes.md``, "Sharded parameters"): megatron-core's
distributed optimizer, its mixed precision and its checkpoint format keep working unchanged,
on both megatron-core versions we serve; PyTorch FSDP2 gave the same collective counts but its
DTensor parameters do not work with that optimizer, and Megatron-FSDP cannot be built with
pipeline parallelism.

Between steps every chunk is released. The optimizer step needs this rank's shard regions of the
full buffers (it writes the updated shard there, and for fp32 parameters its parameters are views
of them): :meth:`ShardedParameters.optimizer_step` re-allocates the buffers for the step's
duration, copies the kept shards in, runs the step without its closing all-gather (the schedule
gathers each chunk when it needs it) and keeps the new shards. That transient allocation is
the stated gap of this runtime: during the optimizer step (no activations alive) the rank
holds its full parameters once more. Gradient buffers stay whole, as megatron-core's
distributed optimizer keeps them; each chunk's reduce-scatter runs at its GS, as without
sharding.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_bfpp.compat import param_gather_suppressed, sharded_param_buckets
from megatron_bfpp.ir import Action, ActionKind
from megatron_bfpp.runtime.step import Handlers, RankStep, StepPart

__all__ = [
    "HANDLERS",
    "ShardedParameters",
    "ShardingError",
    "sharded_parameters",
]

K = ActionKind


class ShardingError(ValueError):
    """The model cannot run with sharded parameters as built; the message says what to change."""


@dataclass
class _Bucket:
    full: torch.Tensor  # the bucket's flat view into its buffer (megatron-core's param_data)
    shard: torch.Tensor  # this rank's part, kept while the full buffer is released
    group: Any
    size: int
    rank: int

    def local_view(self) -> torch.Tensor:
        numel = self.shard.numel()
        return self.full.view(-1)[self.rank * numel : (self.rank + 1) * numel]

    def keep_shard(self) -> None:
        """Allocate the kept shard and copy this rank's part of the full buffer into it."""
        self.shard.untyped_storage().resize_(self.shard.numel() * self.shard.element_size())
        with torch.no_grad():
            self.shard.copy_(self.local_view())

    def drop_shard(self) -> None:
        """Free the kept shard while the full buffer holds the same values."""
        self.shard.untyped_storage().resize_(0)


@dataclass
class _Chunk:
    buckets: list[_Bucket]
    storages: list[torch.UntypedStorage]  # distinct storages of the chunk's full buffers
    full_nbytes: list[int]
    resident: bool = True
    shards_kept: bool = True  # the kept shards are allocated (released, or a gather in flight)
    pending: list[Any] = field(default_factory=list)  # async all-gather works in flight


class ShardedParameters:
    """One rank's model chunks with parameters sharded over their data-parallel groups.

    Made once per model (:func:`sharded_parameters`) and kept across steps: it owns the kept
    shards. The resident-byte high-water mark is read per step by the runtime (the gather counts
    come from its trace).
    """

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        self.chunks = [_chunk_of(index, chunk) for index, chunk in enumerate(chunks)]
        self.modules = list(chunks)
        self.peak_bytes = 0
        for index in range(len(self.chunks)):
            self.release(index)

    # --- the two actions ------------------------------------------------------------------
    def gather(self, chunk: int, *, async_op: bool = True) -> None:
        """Allocate the chunk's full buffers and all-gather them from the kept shards (which
        are freed once the gather has landed, see :meth:`wait`)."""
        state = self.chunks[chunk]
        if state.resident:
            raise RuntimeError(
                f"model chunk {chunk} is gathered twice without a release in between; the "
                "schedule and the sharding runtime disagree: please report this bug"
            )
        for storage, nbytes in zip(state.storages, state.full_nbytes, strict=True):
            storage.resize_(nbytes)
        state.resident = True
        self._observe()
        for bucket in state.buckets:
            work = dist.all_gather_into_tensor(
                bucket.full, bucket.shard, group=bucket.group, async_op=async_op
            )
            if async_op and work is not None:
                state.pending.append(work)
        if not async_op:
            self.wait(chunk)

    def wait(self, chunk: int) -> None:
        """Block until the chunk's gather has landed, then free its kept shards (the full
        buffer holds them); an error if the chunk was never gathered."""
        state = self.chunks[chunk]
        if not state.resident:
            raise RuntimeError(
                f"model chunk {chunk} computes while its parameters are released (no gather "
                "before it); the schedule and the sharding runtime disagree: please report this bug"
            )
        if state.pending or state.shards_kept:
            while state.pending:
                state.pending.pop(0).wait()
            for bucket in state.buckets:
                bucket.drop_shard()
            state.shards_kept = False

    def release(self, chunk: int) -> None:
        """Keep this rank's shard of the chunk's buffers and free the full buffers."""
        state = self.chunks[chunk]
        self.wait(chunk)
        for bucket in state.buckets:
            bucket.keep_shard()
        state.shards_kept = True
        self._observe()
        for storage in state.storages:
            storage.resize_(0)
        state.resident = False

    # --- outside the schedule ---------------------------------------------------------------
    def optimizer_step(self, step: Callable[[], Any]) -> Any:
        """Run ``step`` (an optimizer's ``step``) on the shards: buffers allocated for the step,
        the kept shards copied in, no closing all-gather, the updated shards kept and the
        buffers freed."""
        for state in self.chunks:
            self._materialize(state)
        try:
            with param_gather_suppressed(self.modules):
                return step()
        finally:
            for index in range(len(self.chunks)):
                self.release(index)

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every chunk gathered (to save a checkpoint, or to load one into the parameters);
        released again after, keeping whatever the parameters then hold."""
        released = [i for i, state in enumerate(self.chunks) if not state.resident]
        for index in released:
            self.gather(index, async_op=False)
        try:
            yield
        finally:
            for index in released:
                self.release(index)

    def resident_bytes(self) -> int:
        """Parameter bytes this rank holds now: the kept shards and the gathered buffers."""
        total = 0
        for state in self.chunks:
            total += sum(b.shard.untyped_storage().nbytes() for b in state.buckets)
            total += sum(storage.nbytes() for storage in state.storages)
        return total

    def full_bytes(self) -> int:
        """Parameter bytes of this rank's chunks unsharded (the buffers' full size)."""
        return sum(sum(state.full_nbytes) for state in self.chunks)

    def reset_peak(self) -> None:
        self.peak_bytes = self.resident_bytes()

    def _observe(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes())

    def _materialize(self, state: _Chunk) -> None:
        """Allocate the buffers and put this rank's shard in place, without communication."""
        if state.resident:
            return
        for storage, nbytes in zip(state.storages, state.full_nbytes, strict=True):
            storage.resize_(nbytes)
        state.resident = True
        self._observe()
        with torch.no_grad():
            for bucket in state.buckets:
                bucket.local_view().copy_(bucket.shard)
                bucket.drop_shard()
        state.shards_kept = False


_REGISTRY: weakref.WeakKeyDictionary[torch.nn.Module, ShardedParameters] = (
    weakref.WeakKeyDictionary()
)


def sharded_parameters(chunks: Sequence[torch.nn.Module]) -> ShardedParameters:
    """The model's :class:`ShardedParameters`, made (and every chunk released) on first use.

    Keyed by the model's first chunk, so the forward-backward function, the optimizer step and
    checkpointing all find the same kept shards.
    """
    if not chunks:
        raise ShardingError("sharded parameters need at least one model chunk")
    found = _REGISTRY.get(chunks[0])
    if found is not None:
        if found.modules != list(chunks):
            raise ShardingError(
                "these model chunks were sharded as part of a different model chunk list; pass "
                "the same list of chunks to every step"
            )
        return found
    made = ShardedParameters(chunks)
    _REGISTRY[chunks[0]] = made
    return made


def _chunk_of(index: int, module: torch.nn.Module) -> _Chunk:
    """The chunk's buckets and buffers, or a one-line error naming what the model lacks."""
    ddp_config = getattr(module, "ddp_config", None)
    if ddp_config is None or not hasattr(module, "bucket_groups"):
        raise ShardingError(
            f"model chunk {index} is a {type(module).__name__}, not megatron-core's "
            "DistributedDataParallel; sharded parameters (optim_grads_params) run on DDP chunks "
            "built with use_distributed_optimizer=True"
        )
    if not ddp_config.use_distributed_optimizer:
        raise ShardingError(
            "sharded parameters (optim_grads_params) need the distributed optimizer: build DDP "
            "with use_distributed_optimizer=True (Megatron-LM: --use-distributed-optimizer)"
        )
    if ddp_config.overlap_param_gather:
        raise ShardingError(
            "sharded parameters (optim_grads_params) gather each chunk where the schedule says "
            "and overlap that gather themselves; turn overlap_param_gather off "
            "(Megatron-LM: drop --overlap-param-gather)"
        )
    buckets: list[_Bucket] = []
    storages: dict[int, torch.UntypedStorage] = {}
    for full, group, size, rank in sharded_param_buckets(module):
        if full is None:
            raise ShardingError(
                f"model chunk {index} has a bucket without a parameter buffer; sharded "
                "parameters need the distributed optimizer's parameter buffers"
            )
        if full.numel() % size:
            raise ShardingError(
                f"model chunk {index}: a bucket of {full.numel()} elements does not split into "
                f"{size} equal shards (megatron-core pads buckets for the distributed optimizer)"
            )
        storage = full.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
        shard = torch.empty(full.numel() // size, dtype=full.dtype, device=full.device)
        buckets.append(_Bucket(full=full, shard=shard, group=group, size=size, rank=rank))
    grads = (getattr(param, "main_grad", None) for param in module.parameters())
    grad_storages = {grad.untyped_storage().data_ptr() for grad in grads if grad is not None}
    if grad_storages & storages.keys():
        raise ShardingError(
            "sharded parameters cannot release a parameter buffer that shares storage with the "
            "gradient buffer (reuse_grad_buf_for_mxfp8_param_ag); turn that option off"
        )
    kept = list(storages.values())
    return _Chunk(buckets=buckets, storages=kept, full_nbytes=[s.nbytes() for s in kept])


# --- the executor's handlers ------------------------------------------------------------------
class ShardingPart(StepPart):
    """The step's view of the sharded parameters: the first compute on a chunk after its
    gather waits for it."""

    def __init__(self) -> None:
        self.sharded: ShardedParameters | None = None

    def before_compute(self, step: RankStep, stage: int) -> None:
        if self.sharded is not None:
            self.sharded.wait(step.layout.chunk_of(stage))

    def leftovers(self) -> dict[str, Any]:
        if self.sharded is None:
            return {}
        gathered = [i for i, state in enumerate(self.sharded.chunks) if state.resident]
        return {"model chunks left gathered": gathered}


def param_sync(step: RankStep, position: int, action: Action) -> None:
    """PS: with sharded parameters, post the chunk's all-gather (forward-only steps need the
    parameters too); otherwise megatron-core's ``param_sync_func`` for the chunk, if any."""
    chunk = step.layout.chunk_of(action.stage)
    sharded = step.ctx.sharded
    if sharded is not None:
        step.part(ShardingPart).sharded = sharded
        sharded.gather(chunk)
    else:
        func = step.per_chunk(step.ctx.config.param_sync_func)[chunk]
        if func is not None and not step.ctx.forward_only:
            func(step.ctx.model[chunk].parameters())
    step.state.trace.append(str(action))


def release(step: RankStep, position: int, action: Action) -> None:
    """RL: free the chunk's full parameters (its shard is kept)."""
    sharded = step.ctx.sharded
    if sharded is None:
        raise RuntimeError(
            f"pipeline rank {step.rank}: schedule {step.schedule.name!r} releases parameters "
            f"({action} at position {position}) but the step runs without sharded parameters; "
            "pass sharding='optim_grads_params' to get_forward_backward_func"
        )
    sharded.release(step.layout.chunk_of(action.stage))
    step.state.trace.append(str(action))


HANDLERS = Handlers(kinds={K.PARAM_SYNC: param_sync, K.RELEASE: release}, part=ShardingPart)
