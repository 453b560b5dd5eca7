"""Fully sharded data parallelism (ZeRO-3) on megatron-core's own buffers, driven by the schedule.

A schedule's gathers (PS), releases (RL) and gradient reductions (GS) on DDP chunks built for the
distributed optimizer: each bucket keeps this rank's shard of its parameters and reduced gradients,
and the full buffers' storages are allocated only while the schedule needs them (``resize_``: views
and saved tensors keep pointing at them). Why and each buffer's life: docs/design-notes.md,
"Sharded parameters (ZeRO-3)"."""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_bfpp.compat import (
    extra_main_grad_params,
    finish_partial_grad_sync,
    guard_zero_grad_buffer,
    optimizer_on_shards,
    param_bucket_ranges,
    param_gather_suppressed,
    sharded_param_buckets,
    shared_embedding_chunk,
    tensor_parallel_reduced_params,
    uses_position_embedding_group,
)
from megatron_bfpp.ir import Action, ActionKind
from megatron_bfpp.runtime.step import Handlers, Key, RankStep, StepPart

__all__ = ["HANDLERS", "ShardedParameters", "ShardingError", "sharded_parameters"]

K = ActionKind


class ShardingError(ValueError):
    """The model cannot run fully sharded as built; the message says what to change."""


@dataclass
class _Bucket:
    full: torch.Tensor  # the bucket's flat view into its parameter buffer (param_data)
    shard: torch.Tensor  # this rank's part of the parameters, kept for good
    grad_full: torch.Tensor  # the bucket's flat view into its gradient buffer (grad_data)
    grad_shard: torch.Tensor  # this rank's part of the reduced gradients, kept for good
    group: Any
    rank: int
    megatron_bucket: Any  # the bucket object the distributed optimizer's buffers point at

    def local_view(self, grad: bool = False) -> torch.Tensor:
        """This rank's part of the full parameter (``grad``: gradient) buffer."""
        full, shard = (self.grad_full, self.grad_shard) if grad else (self.full, self.shard)
        return _part(full, self.rank, shard.numel())


@dataclass
class _Chunk:
    module: torch.nn.Module
    buckets: list[_Bucket]
    storages: list[torch.UntypedStorage]  # distinct storages of the chunk's parameter buffers
    full_nbytes: list[int]
    grad_storages: list[torch.UntypedStorage]  # ... and of its gradient buffers
    grad_nbytes: list[int]
    resident: bool = True
    pending: list[Any] = field(default_factory=list)  # async all-gather works in flight
    grads_resident: bool = True
    # param -> (bucket, start, end): where its elements lie in the bucket
    ranges: dict[Any, tuple[_Bucket, int, int]] = field(default_factory=dict)


class ShardedParameters:
    """One rank's chunks with parameters and gradients sharded over their data-parallel groups;
    made once per model (:func:`sharded_parameters`), it owns the kept shards and high-water
    marks (reset at each forward-backward, covering the optimizer step too)."""

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        self.chunks = [_chunk_of(index, chunk) for index, chunk in enumerate(chunks)]
        self.modules = list(chunks)
        self.by_bucket = {
            id(bucket.megatron_bucket): bucket for state in self.chunks for bucket in state.buckets
        }
        self.peak_bytes = 0
        self.peak_grad_bytes = 0
        self.zeroing_grad_bytes = 0  # the most held while zero_grad_buffer ran since the reset
        self.pending_grads: list[int] = []  # chunks whose reduction is in flight, in order
        self.partial: set[int] = set()  # ... of which reductions of a run before the last
        self.landed: set[int] = set()  # chunks whose kept gradient shard has this step's sum
        self.deferred: int | None = None  # the chunk kept whole until the embedding all-reduce
        for index, state in enumerate(self.chunks):
            state.ranges = {
                param: (self.by_bucket[id(megatron_bucket)], start, end)
                for param, (megatron_bucket, start, end) in param_bucket_ranges(
                    state.module
                ).items()
            }
            guard_zero_grad_buffer(state.module, self._zero_around(index))
            self.release(index)
            _resize(state.grad_storages)
            state.grads_resident = False
        sizes = [n for state in self.chunks for n in (*state.full_nbytes, *state.grad_nbytes)]
        if sizes and all(s.device.type == "cpu" for st in self.chunks for s in st.storages):
            return_freed_buffers(min(sizes))

    def gather(self, chunk: int) -> None:
        """Allocate the chunk's full parameter buffers and all-gather them (see :meth:`wait`)."""
        state = self.chunks[chunk]
        if state.resident:
            raise RuntimeError(
                f"model chunk {chunk} is gathered twice without a release in between; the "
                "schedule and the sharding runtime disagree: please report this bug"
            )
        _resize(state.storages, state.full_nbytes)
        state.resident = True
        self._observe()
        for bucket in state.buckets:
            work = dist.all_gather_into_tensor(
                bucket.full, bucket.shard, group=bucket.group, async_op=True
            )
            if work is not None:
                state.pending.append(work)

    def wait(self, chunk: int) -> None:
        """Block until the chunk's gather has landed; an error if it was never gathered."""
        state = self.chunks[chunk]
        if not state.resident:
            raise RuntimeError(
                f"model chunk {chunk} computes while its parameters are released (no gather "
                "before it); the schedule and the sharding runtime disagree: please report this bug"
            )
        while state.pending:
            state.pending.pop(0).wait()

    def release(self, chunk: int) -> None:
        """Keep this rank's part of the chunk's parameters and free the full buffers."""
        state = self.chunks[chunk]
        self.wait(chunk)
        with torch.no_grad():
            for bucket in state.buckets:
                bucket.shard.copy_(bucket.local_view())
        _resize(state.storages)
        state.resident = False

    def allocate_grads(self, chunk: int) -> None:
        """Before the first backward of each run of the chunk's backwards: its gradient buffer,
        zeroed (after landing the previous run's reduction if still in flight)."""
        state = self.chunks[chunk]
        if chunk in self.pending_grads:
            self.pending_grads.remove(chunk)
            self._land(chunk)
        if state.grads_resident:
            return
        _resize(state.grad_storages, state.grad_nbytes, zero=True)
        state.grads_resident = True
        self._observe()

    def grads_synced(self, chunk: int, *, overlapped: bool, partial: bool = False) -> None:
        """At the chunk's GS (reduction just started; with ``overlapped`` False not started, as
        megatron-core then reduces in ``finish_grad_sync``): land earlier reductions, and this one
        unless in flight. ``partial``: a GS before the chunk's last (grouped breadth-first), whose
        reduction this starts, the chunk staying in ``no_sync``."""
        if not self.chunks[chunk].grads_resident:
            raise RuntimeError(
                f"model chunk {chunk} reduces gradients it never accumulated (GS without a "
                "backward before it); the schedule and the sharding runtime disagree: please "
                "report this bug"
            )
        if chunk == self.deferred:
            return
        self._land_pending()
        if partial:
            self.partial.add(chunk)
        if overlapped:
            if partial:  # inside no_sync, where DDP's hooks would not start it
                self.chunks[chunk].module.start_grad_sync()  # type: ignore[operator]
            self.pending_grads.append(chunk)
        else:
            self._land(chunk)

    def finalize_grads(
        self, config: Any, groups: Any, num_tokens: torch.Tensor | None, force_all_reduce: bool
    ) -> None:
        """``finalize_model_grads``' work after the data-parallel reduction, on the kept shards (the
        sequence-parallel tensor-parallel all-reduce, the tied-embedding all-reduce, per-token
        scaling), with the same arithmetic element for element as without sharding."""
        from megatron.core.pipeline_parallel.utils import get_pp_last_rank

        if force_all_reduce:
            raise ShardingError(
                "fully sharded training reduce-scatters gradients into shards; force_all_reduce "
                "asks for whole gradients on every rank: use data_parallel_sharding_strategy "
                "'optim' for it"
            )
        self._land_pending()
        if self.deferred is not None:
            self.chunks[self.deferred].module.finish_grad_sync()  # type: ignore[operator]
        summed, averaged = tensor_parallel_reduced_params(self.modules, config)
        if groups.tp.size() > 1:
            for params, op in ((summed, dist.ReduceOp.SUM), (averaged, dist.ReduceOp.AVG)):
                views = [v for v in map(self._reduced_grad_view, params) if v is not None]
                if views:
                    flat = torch.cat(views)
                    dist.all_reduce(flat, op=op, group=groups.tp)
                    with torch.no_grad():
                        for view, synced in zip(
                            views, torch.split(flat, [v.numel() for v in views]), strict=True
                        ):
                            view.copy_(synced)
        shared = shared_embedding_chunk(self.modules, config, groups)
        if shared is not None:
            index, weight = shared
            if index != self.deferred:
                raise RuntimeError(
                    "the tied word embedding's chunk was not kept whole for its all-reduce; "
                    "please report this bug"
                )
            dist.all_reduce(weight.main_grad, group=groups.embd)
        if self.deferred is not None:
            self._land(self.deferred)
        if num_tokens is not None:
            dist.broadcast(num_tokens, src=get_pp_last_rank(groups.pp), group=groups.pp)
            dist.all_reduce(num_tokens, group=groups.dp_cp)
            scaling = 1.0 / torch.clamp(num_tokens, min=1)
            with torch.no_grad():
                for state in self.chunks:
                    for bucket in state.buckets:
                        bucket.grad_shard *= scaling

    def prepare_step(self, config: Any, groups: Any) -> None:
        """Before a training step: which chunk keeps its full gradients to the end (the one
        with the tied word embedding, if this rank all-reduces it), and one line for what
        ``finalize_model_grads`` would do that shards cannot."""
        if uses_position_embedding_group(groups):
            raise ShardingError(
                "fully sharded training does not support position embeddings shared across "
                "the pipeline (encoder-decoder models split at a pipeline rank)"
            )
        if getattr(config, "has_cond_embedder", False) or getattr(
            config, "moe_router_enable_expert_bias", False
        ):
            raise ShardingError(
                "fully sharded training does not support conditional embedders or MoE router "
                "expert bias (their finalize steps read full gradients); use "
                "--data-parallel-sharding-strategy optim"
            )
        shared = shared_embedding_chunk(self.modules, config, groups)
        self.deferred = None if shared is None else shared[0]

    def _land_pending(self) -> None:
        earlier, self.pending_grads = self.pending_grads, []
        for index in earlier:
            self._land(index)

    def _land(self, chunk: int) -> None:
        """Wait for the chunk's reduction, keep (add) this rank's part, free the buffer."""
        state = self.chunks[chunk]
        if chunk in self.partial:
            self.partial.discard(chunk)
            finish_partial_grad_sync(state.module)
        elif chunk != self.deferred:
            state.module.finish_grad_sync()  # type: ignore[operator]
        with torch.no_grad():
            for bucket in state.buckets:
                keep = bucket.grad_shard.add_ if chunk in self.landed else bucket.grad_shard.copy_
                keep(bucket.local_view(grad=True))
        self.landed.add(chunk)
        _resize(state.grad_storages)
        state.grads_resident = False

    def _reduced_grad_view(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """This rank's reduced elements of ``param``'s gradient: in the kept shard, or in the
        full buffer of a chunk not landed yet (the tied-embedding one)."""
        for state in self.chunks:
            found = state.ranges.get(param)
            if found is None:
                continue
            bucket, start, end = found
            numel = bucket.grad_shard.numel()
            lo, hi = max(start - bucket.rank * numel, 0), min(end - bucket.rank * numel, numel)
            if hi <= lo:
                return None
            source = bucket.local_view(grad=True) if state.grads_resident else bucket.grad_shard
            return source[lo:hi]
        return None

    def _zero_around(self, chunk: int) -> Callable[[Callable[[], None]], None]:
        """DDP's ``zero_grad_buffer`` on a released buffer, allocated for the call (one chunk at
        a time) so megatron-core resets its flags and bucket state; re-zeroed at first backward."""

        def around(original: Callable[[], None]) -> None:
            state = self.chunks[chunk]
            if state.grads_resident:
                original()
                return
            _resize(state.grad_storages, state.grad_nbytes)
            # zeroing opens the iteration, before the peaks reset: remembered, counted in by it
            self.zeroing_grad_bytes = max(self.zeroing_grad_bytes, self.resident_bytes(grad=True))
            try:
                original()
            finally:
                _resize(state.grad_storages)

        return around

    def optimizer_step(self, step: Callable[[], Any], optimizer: Any) -> Any:
        """The optimizer's ``step`` on the kept shards (see :func:`sharded_optimizer_step`)."""
        for index, state in enumerate(self.chunks):
            if state.resident or state.grads_resident:
                raise RuntimeError(
                    f"model chunk {index} is still gathered at the optimizer step; run the "
                    "step after the forward-backward function has returned"
                )
        with (
            optimizer_on_shards(
                optimizer, lambda b: self._bucket(b).shard, lambda b: self._bucket(b).grad_shard
            ),
            param_gather_suppressed(self.modules),
        ):
            return step()

    @contextlib.contextmanager
    def whole(self, chunks: Sequence[int] | None = None) -> Iterator[None]:
        """The given chunks (all by default) gathered, to save a checkpoint or load one into
        the parameters; released again after, keeping whatever the parameters then hold."""
        wanted = range(len(self.chunks)) if chunks is None else chunks
        released = [i for i in wanted if not self.chunks[i].resident]
        for index in released:
            self.gather(index)
            self.wait(index)
        try:
            yield
        finally:
            for index in released:
                self.release(index)

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's reduced gradients, as the optimizer step reads them: the kept shards."""
        return [bucket.grad_shard for state in self.chunks for bucket in state.buckets]

    def resident_bytes(self, grad: bool = False) -> int:
        """Parameter (``grad``: gradient) bytes held now: the kept shards and the full buffers."""
        return sum(
            sum((b.grad_shard if grad else b.shard).untyped_storage().nbytes() for b in st.buckets)
            + sum(storage.nbytes() for storage in (st.grad_storages if grad else st.storages))
            for st in self.chunks
        )

    def full_bytes(self) -> int:
        """Parameter bytes of this rank's chunks unsharded (the buffers' full size)."""
        return sum(sum(state.full_nbytes) for state in self.chunks)

    def begin_step(self) -> None:
        """A forward-backward starts: no kept gradient shard holds this step's sum yet, and the
        high-water marks start (the zeroing just before counted in)."""
        self.landed.clear()
        self.peak_bytes = self.resident_bytes()
        self.peak_grad_bytes = max(self.resident_bytes(grad=True), self.zeroing_grad_bytes)
        self.zeroing_grad_bytes = 0

    def _observe(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes())
        self.peak_grad_bytes = max(self.peak_grad_bytes, self.resident_bytes(grad=True))

    def _bucket(self, megatron_bucket: Any) -> _Bucket:
        found = self.by_bucket.get(id(megatron_bucket))
        if found is None:
            raise ShardingError(
                "the optimizer steps parameters of a model chunk that is not part of this "
                "sharded model; build the optimizer over the same chunks the step runs"
            )
        return found


_MMAP_THRESHOLD = -3  # glibc's M_MMAP_THRESHOLD
_MMAP_THRESHOLD_MAX = 32 * 2**20  # its largest value on 64-bit
_threshold: list[int] = []  # the value this process set, if any


def return_freed_buffers(nbytes: int) -> None:
    """On CPU with glibc, fix the mmap threshold at the smallest chunk buffer's size (at least
    128 KiB), so a freed chunk buffer goes back to the system instead of staying on the heap
    (docs/design-notes.md, "The process's own peak"); once per process, a no-op without glibc."""
    threshold = max(128 * 2**10, min(nbytes, _MMAP_THRESHOLD_MAX))
    if _threshold and _threshold[0] <= threshold:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: mallopt's numbering is its own)
    except (OSError, AttributeError):
        return
    if libc.mallopt(_MMAP_THRESHOLD, threshold) == 1:
        _threshold[:] = [threshold]


def _resize(
    storages: list[torch.UntypedStorage], nbytes: list[int] | None = None, *, zero: bool = False
) -> None:
    """Free the storages (``nbytes`` None) or re-allocate at ``nbytes`` (``zero``: bytes zeroed)."""
    for storage, size in zip(storages, nbytes or [0] * len(storages), strict=True):
        storage.resize_(size)
        if zero:
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()


def _part(full: torch.Tensor, rank: int, numel: int) -> torch.Tensor:
    return full.view(-1)[rank * numel : (rank + 1) * numel]


_REGISTRY: weakref.WeakKeyDictionary[torch.nn.Module, ShardedParameters] = (
    weakref.WeakKeyDictionary()
)


def sharded_parameters(chunks: Sequence[torch.nn.Module]) -> ShardedParameters:
    """The model's :class:`ShardedParameters`, made (and every chunk released) on first use; keyed
    by the first chunk, so forward-backward, optimizer step and checkpointing share the shards."""
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
    if getattr(ddp_config, "num_distributed_optimizer_instances", 1) > 1:
        raise ShardingError(
            "fully sharded training (optim_grads_params) shards over one distributed-optimizer "
            "instance; drop --num-distributed-optimizer-instances"
        )
    if extra_main_grad_params(module):
        raise ShardingError(
            f"model chunk {index} has parameters whose main_grad lives outside the gradient "
            "buffer; fully sharded training (optim_grads_params) cannot release it"
        )
    buckets: list[_Bucket] = []
    storages: dict[int, torch.UntypedStorage] = {}
    grad_storages: dict[int, torch.UntypedStorage] = {}
    for found in sharded_param_buckets(module):
        full, grad, size = found.param_data, found.grad_data, found.size
        if full is None or grad is None:
            raise ShardingError(
                f"model chunk {index} has a bucket without a parameter or gradient buffer; "
                "sharded parameters need the distributed optimizer's buffers"
            )
        if full.numel() % size:
            raise ShardingError(
                f"model chunk {index}: a bucket of {full.numel()} elements does not split into "
                f"{size} equal shards (megatron-core pads buckets for the distributed optimizer)"
            )
        for distinct, tensor in ((storages, full), (grad_storages, grad)):
            distinct.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage())
        buckets.append(
            _Bucket(
                full=full,
                shard=_part(full, found.rank, full.numel() // size).clone(),
                grad_full=grad,
                grad_shard=torch.zeros(grad.numel() // size, dtype=grad.dtype, device=grad.device),
                group=found.group,
                rank=found.rank,
                megatron_bucket=found.bucket,
            )
        )
    if set(grad_storages) & set(storages):
        raise ShardingError(
            "sharded parameters cannot release a parameter buffer that shares storage with the "
            "gradient buffer (reuse_grad_buf_for_mxfp8_param_ag); turn that option off"
        )
    kept, kept_grads = list(storages.values()), list(grad_storages.values())
    return _Chunk(
        module=module,
        buckets=buckets,
        storages=kept,
        full_nbytes=[s.nbytes() for s in kept],
        grad_storages=kept_grads,
        grad_nbytes=[s.nbytes() for s in kept_grads],
    )


@dataclass(eq=False)
class ShardingPart(StepPart):
    """The step's view of the sharded model: a chunk's first compute after its gather waits for
    it, and its first backward allocates its gradients."""

    sharded: ShardedParameters | None = None

    def before_compute(self, step: RankStep, stage: int) -> None:
        if self.sharded is not None:
            self.sharded.wait(step.layout.chunk_of(stage))

    def before_backward(self, step: RankStep, key: Key) -> None:
        sharded = step.ctx.sharded
        if sharded is not None:
            sharded.allocate_grads(step.layout.chunk_of(key[0]))

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
        if func is not None and not step.ctx.call.forward_only:
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
