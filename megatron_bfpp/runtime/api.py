"""``get_forward_backward_func``: any schedule behind megatron-core's forward-backward signature.

megatron-core-only training loops (NeMo, Megatron-Bridge, custom loops) call the returned
function exactly where they call megatron-core's own; it builds (once, cached) the validated
schedule for the current layout and runs this rank's actions."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_bfpp.compat import (
    check_megatron_core,
    default_process_groups,
    process_groups_without_embedding_group,
)
from megatron_bfpp.ir import ActionKind, Placement, Schedule, ScheduleError
from megatron_bfpp.runtime import combined
from megatron_bfpp.runtime.executor import PlannedSchedule, planned, run_rank_program
from megatron_bfpp.runtime.p2p import PipeComm
from megatron_bfpp.runtime.placement import (
    check_chunk_placement,
    deliver_to_last_rank,
    sum_tied_embedding_grads,
)
from megatron_bfpp.runtime.sharding import ShardedParameters, sharded_parameters
from megatron_bfpp.runtime.step import Call, MemoryReport, StepContext
from megatron_bfpp.schedules.fit import check_overlapped_pairs
from megatron_bfpp.schedules.registry import (
    build_schedule,
    check_sharding,
    check_sharding_data_parallel,
    forward_only_schedule,
    get_spec,
)
from megatron_bfpp.validate import validate_schedule

__all__ = [
    "ForwardBackwardFunc",
    "get_forward_backward_func",
    "plan_schedule",
    "sharded_optimizer_step",
]


def get_forward_backward_func(
    schedule: str | Schedule,
    *,
    measure_memory: bool = False,
    data_parallel_sharding_strategy: str = "optim",
    **options: Any,
) -> ForwardBackwardFunc:
    """A forward-backward function running ``schedule``, to call where megatron-core's
    ``get_forward_backward_func()`` result is called (arguments and result:
    :class:`ForwardBackwardFunc`, ``help(fn)``).

    ``schedule`` is a registry name (``megatron_bfpp.schedule_names()``) or a lowered
    :class:`~megatron_bfpp.ir.Schedule` (checked as :func:`_prebuilt` says); ``options`` are the
    schedule's own (``microbatch_group_size``, ``group_size``, ``max_stored``). Unknown names and
    options fail here in one line. ``data_parallel_sharding_strategy`` is Megatron's ``optim`` or
    ``optim_grads_params`` (runtime.sharding: DDP chunks built for the distributed optimizer,
    several chunks per rank, dp > 1; step through :func:`sharded_optimizer_step`). ``last_memory``
    is measured when ``measure_memory`` is true or the rank evicts (else zeros)."""
    check_megatron_core()
    if isinstance(schedule, Schedule):
        return _prebuilt(schedule, measure_memory, data_parallel_sharding_strategy, options)
    spec = get_spec(schedule)
    spec.check_option_names(options)
    check_sharding(spec.name, data_parallel_sharding_strategy)
    return ForwardBackwardFunc(
        schedule=spec.name,
        options=tuple(sorted(options.items())),
        measure_memory=measure_memory,
        sharding=data_parallel_sharding_strategy,
    )


def _prebuilt(
    schedule: Schedule, measure_memory: bool, sharding: str, options: dict[str, Any]
) -> ForwardBackwardFunc:
    """A lowered schedule given as data (a CSV, a hand-made order), validated as a built one is,
    sharded only with sharding on, and planned with its NCCL-safe posting once, here."""
    if options:
        raise ScheduleError(
            f"a Schedule object takes no schedule options (got {sorted(options)}): they shaped "
            "it when it was built"
        )
    # Grad sync is required: a chunk this rank never reduces during the step would leave its
    # replicas' gradients to the end-of-step fallback, and a misplaced GS leaves them unreduced.
    validate_schedule(schedule, require_communication=True, require_grad_sync=True, nccl=False)
    releases = any(a.kind is ActionKind.RELEASE for actions in schedule.per_rank for a in actions)
    if releases != (sharding == "optim_grads_params"):
        raise ScheduleError(
            f"schedule {schedule.name!r} {'has' if releases else 'has no'} parameter releases "
            f"(RL) but data_parallel_sharding_strategy is {sharding!r}; lower it with "
            "add_grad_sync(..., sharding=...) to match"
        )
    func = ForwardBackwardFunc(
        schedule=schedule.name, measure_memory=measure_memory, sharding=sharding, prebuilt=schedule
    )
    func.prebuilt_plan(forward_only=False)  # the NCCL proof (validate check 6), once
    return func


@dataclass(eq=False)
class ForwardBackwardFunc:
    """Run one training (or evaluation) step of the schedule, as megatron-core's
    forward-backward functions do, with the same keyword arguments and return value.

    Arguments (keyword-only, megatron-core's names and meanings):

    * ``forward_step_func(data_iterator, model)`` returns ``(output_tensor, loss_func)``;
      ``loss_func(output_tensor)`` returns ``(loss, reported)`` or ``(loss, num_tokens,
      reported)``, ``reported`` a dict of str -> tensor (``"lm loss"``).
    * ``data_iterator``: one iterator per model chunk (a list) or a single one for a single chunk,
      each read once per micro-batch, in order.
    * ``model``: this rank's megatron-core chunks (a module or a list) in the schedule's placement
      (``megatron_bfpp.megatron.chunks``: looped for interleaved and breadth-first, the V for
      ``v-*``); checked before any message.
    * ``num_microbatches``, ``seq_length``, ``micro_batch_size``, ``decoder_seq_length``: as
      megatron-core; the message between stages is ``(seq / cp [/ tp with sequence parallel],
      micro_batch_size, hidden)`` in ``config.pipeline_dtype``.
    * ``forward_only``: forwards only (evaluation), every schedule's forward order.
    * ``collect_non_loss_data``, ``first_val_step``, ``force_all_reduce``: passed on to
      ``forward_step`` / ``finalize_model_grads`` as megatron-core does.
    * ``adjust_tensor_shapes_fn``: may rename the shape, not split it into several tensors.
    * ``p2p_communicator`` and ``pg_collection``: both or neither (then the global groups).

    Returns, on the last pipeline rank, what ``loss_func`` reported per micro-batch (delivered
    there when another rank computed the last stage, as in the V-shapes); ``[]`` elsewhere.
    Gradients are reduced and finalized (``config.finalize_model_grads_func``) unless
    ``forward_only``.

    Refused in one line, before any message: chunks not in the schedule's placement, chunk or
    micro-batch counts the schedule cannot run, and megatron-core features the runtime lacks
    (partial activation checkpointing, fine-grained activation offloading, local CUDA graphs,
    V-shapes with deferred embedding wgrad).

    It behaves as a function (``__name__``, ``__doc__``, ``__signature__`` from
    :class:`~megatron_bfpp.runtime.step.Call`; an unknown keyword is a ``TypeError`` naming it)
    and keeps what outlives a step: ``last_trace`` (the actions this rank ran last call),
    ``last_memory`` (a :class:`~megatron_bfpp.runtime.step.MemoryReport`) and a prebuilt
    schedule's ``prebuilt_plan`` (with its NCCL-safe posting, made once)."""

    schedule: str
    options: tuple[tuple[str, Any], ...] = ()
    measure_memory: bool = False
    sharding: str = "optim"
    prebuilt: Schedule | None = field(default=None, repr=False)
    last_trace: list[str] = field(default_factory=list, repr=False)
    last_memory: MemoryReport = field(default_factory=MemoryReport, repr=False)
    _plans: dict[bool, PlannedSchedule] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        name = _function_name(self.schedule)
        vars(self).update(__name__=name, __qualname__=name, __signature__=_SIGNATURE)

    def prebuilt_plan(self, *, forward_only: bool) -> PlannedSchedule:
        """The prebuilt schedule (its forward-only version) with its posting, planned once."""
        plan = self._plans.get(forward_only)
        if plan is None:
            if self.prebuilt is None:
                raise ValueError(f"{self.schedule!r} is a registry schedule, not a prebuilt one")
            schedule = forward_only_schedule(self.prebuilt) if forward_only else self.prebuilt
            plan = self._plans[forward_only] = planned(schedule)
        return plan

    def __call__(self, **kwargs: Any) -> list[Any]:
        """See the class docstring (signature: ``runtime.step.Call``, ``__signature__``)."""
        try:
            call = Call(**kwargs)
        except TypeError as error:  # as a function says it: "f() got an unexpected keyword..."
            name = _function_name(self.schedule)
            raise TypeError(str(error).replace(Call.__init__.__qualname__, name)) from None
        return _run_step(self, call)


def _function_name(schedule: str) -> str:
    """megatron-core's are named forward_backward_no_pipelining etc.; ours name the schedule."""
    return "forward_backward_" + "".join(c if c.isalnum() else "_" for c in schedule)


# ForwardBackwardFunc's signature as a function's: megatron-core's keyword-only arguments.
_SIGNATURE = inspect.signature(Call).replace(return_annotation="list[Any]")


@functools.lru_cache(maxsize=32)
def plan_schedule(
    name: str,
    num_ranks: int,
    num_chunks: int,
    num_microbatches: int,
    options: tuple[tuple[str, Any], ...],
    forward_only: bool,
    sharding: str = "optim",
) -> PlannedSchedule:
    """The validated schedule for a layout with its NCCL-safe posting, planned once per process
    (deterministic on every rank, so errors surface identically before any communication)."""
    spec = get_spec(name)
    chunks = num_chunks if spec.placement is Placement.LOOPED or num_chunks > 1 else None
    schedule = build_schedule(
        name,
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        num_chunks=chunks,
        sharding=sharding,
        **dict(options),
    )
    return planned(forward_only_schedule(schedule) if forward_only else schedule)


def _device_of(chunks: list[Any], group: Any) -> torch.device:
    """The model's device. A rank of an empty layout stage (no layer, embedding or output) holds
    no tensor: it sends on its pipeline group's device, NCCL's the current CUDA device."""
    for tensor in (tensor for chunk in chunks for tensor in chunk.parameters()):
        return torch.device(tensor.device)
    nccl = torch.distributed.get_backend(group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _run_step(func: ForwardBackwardFunc, call: Call) -> list[Any]:
    """One step, in its five jobs: read the call, fix the schedule, prepare sharded parameters,
    run this rank's program (with what every action handler reads), finish the gradients."""
    from megatron.core.pipeline_parallel.schedules import (
        clear_embedding_activation_buffer,
        finish_embedding_wgrad_compute,
    )
    from megatron.core.pipeline_parallel.utils import is_pp_last_stage
    from megatron.core.utils import get_model_config, get_model_type

    check_megatron_core()
    chunks = call.model if isinstance(call.model, list) else [call.model]
    if not chunks:
        raise ValueError("model must be a module or a non-empty list of model chunks")
    iterators = _iterators_per_chunk(call.data_iterator, len(chunks))
    config = get_model_config(chunks[0])
    _reject_unsupported(config)
    groups = _resolve_groups(call.p2p_communicator, call.pg_collection)
    plan = _step_schedule(func, call, chunks, config, groups.pp)
    schedule = plan.schedule
    sharded: ShardedParameters | None = None
    if func.sharding != "optim":
        check_sharding_data_parallel(func.sharding, groups.dp_cp.size())
        sharded = sharded_parameters(chunks)
        if not call.forward_only:
            _check_sharded_finalize(config)
            sharded.prepare_step(config, groups)
    shape = _message_shape(call, config, groups)
    device = _device_of(chunks, groups.pp)
    ctx = StepContext(
        call=call,
        data_iterators=iterators,
        model=chunks,
        config=config,
        model_type=get_model_type(chunks[0]),
        cp_group_size=groups.cp.size(),
        comm=PipeComm(group=groups.pp, shape=shape, dtype=config.pipeline_dtype, device=device),
        measure_memory=func.measure_memory,
        sharded=sharded,
    )
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    finalize = config.finalize_model_grads_func is not None and not call.forward_only
    last_stage = is_pp_last_stage(groups.pp)
    embedding = clear_embedding_activation_buffer(config, chunks, last_stage) if finalize else None
    store, total_num_tokens, func.last_trace, func.last_memory = run_rank_program(
        plan, groups.pp.rank(), ctx
    )
    if finalize:
        finish_embedding_wgrad_compute(config, embedding, last_stage, groups.tp)
        _finish_grads(ctx, schedule, groups, total_num_tokens)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return deliver_to_last_rank(store, schedule.layout, groups.pp, ctx.comm.device)


def _step_schedule(
    func: ForwardBackwardFunc, call: Call, chunks: list[Any], config: Any, pp_group: Any
) -> PlannedSchedule:
    """The planned schedule for this call's layout, checked against the chunks handed in."""
    if func.prebuilt is not None:
        prebuilt = func.prebuilt
        per_rank = len(prebuilt.layout.stages_of(0))
        layout = (pp_group.size(), len(chunks), call.num_microbatches)
        if (prebuilt.num_ranks, per_rank, prebuilt.num_microbatches) != layout:
            raise ScheduleError(
                f"schedule {prebuilt.name!r} is for pp={prebuilt.num_ranks}, {per_rank} chunk(s) "
                f"per rank, {prebuilt.num_microbatches} micro-batches; this call has "
                f"pp={pp_group.size()}, {len(chunks)} model chunk(s), {call.num_microbatches} "
                "micro-batches"
            )
        plan = func.prebuilt_plan(forward_only=call.forward_only)
    else:
        plan = plan_schedule(
            func.schedule,
            pp_group.size(),
            len(chunks),
            call.num_microbatches,
            func.options,
            call.forward_only,
            func.sharding,
        )
    schedule = plan.schedule
    wanted = schedule.layout.num_chunks  # a V-shape's two, whatever the call's chunk count
    if wanted != len(chunks):
        raise ScheduleError(
            f"schedule {schedule.name!r} places {wanted} stages per pipeline rank but the model "
            f"has {len(chunks)} chunk(s) here; build {wanted} chunks per rank (virtual pipeline "
            f"size {wanted})"
        )
    check_chunk_placement(chunks, schedule.layout, pp_group.rank(), schedule.name)
    if getattr(config, "overlap_moe_expert_parallel_comm", False) and not call.forward_only:
        check_overlapped_pairs(schedule)
        combined.check_forward_step_func(call.forward_step_func)
    if _embedding_and_loss_on_one_rank(schedule) and getattr(
        config, "defer_embedding_wgrad_compute", False
    ):
        raise NotImplementedError(
            "defer_embedding_wgrad_compute is not supported with V-shape schedules yet (the "
            "output layer is on the first pipeline rank there); turn it off"
        )
    return plan


def _finish_grads(
    ctx: StepContext, schedule: Schedule, groups: Any, total_num_tokens: torch.Tensor
) -> None:
    """megatron-core's gradient finalization, or its sharded equivalent; under the V (embedding and
    output layer on one rank) the rank adds its two copies instead of the pipeline all-reduce."""
    config, chunks = ctx.config, ctx.model
    on_one_rank = _embedding_and_loss_on_one_rank(schedule)
    if on_one_rank and config.calculate_per_token_loss:
        # finalize_model_grads broadcasts the token count from the last pipeline rank, but
        # under the V the loss (and so the count) is on the first: give it to every rank.
        torch.distributed.all_reduce(total_num_tokens, group=groups.pp)
    num_tokens = total_num_tokens if config.calculate_per_token_loss else None
    if ctx.sharded is not None:
        # megatron-core's finalize reads full gradients; sharded, its reductions run on kept shards.
        ctx.sharded.finalize_grads(config, groups, num_tokens, bool(ctx.call.force_all_reduce))
    else:
        config.finalize_model_grads_func(
            chunks,
            num_tokens,
            pg_collection=(
                process_groups_without_embedding_group(groups) if on_one_rank else groups
            ),
            force_all_reduce=ctx.call.force_all_reduce,
        )
    if on_one_rank:
        sum_tied_embedding_grads(chunks)


def _embedding_and_loss_on_one_rank(schedule: Schedule) -> bool:
    layout = schedule.layout
    return layout.num_ranks > 1 and layout.rank_of(0) == layout.rank_of(layout.num_stages - 1)


def sharded_optimizer_step(optimizer: Any, model: torch.nn.Module | list[torch.nn.Module]) -> Any:
    """``optimizer.step()`` for ``optim_grads_params``: the distributed optimizer steps on the kept
    shards, without its closing all-gather (the schedule gathers chunks when needed)."""
    chunks = model if isinstance(model, list) else [model]
    return sharded_parameters(chunks).optimizer_step(optimizer.step, optimizer)


def gradients_finite(model: torch.nn.Module | list[torch.nn.Module], *, sharded: bool) -> bool:
    """Whether every gradient the optimizer step will read (``main_grad``; sharded: kept shards) has
    a finite norm, as Megatron-LM's ``--check-for-nan-in-loss-and-grad`` tests: fp32 has no grad
    scaler to skip a NaN, inf or overflowing step. Local: the caller agrees over ranks."""
    chunks = model if isinstance(model, list) else [model]
    if sharded:
        grads = sharded_parameters(chunks).grad_shards()
    else:
        grads = [
            grad
            for chunk in chunks
            for param in chunk.parameters()
            if (grad := getattr(param, "main_grad", param.grad)) is not None
        ]
    if not grads:
        return True
    norms = torch.stack([torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in grads])
    return bool(torch.isfinite(norms).all())


def _check_sharded_finalize(config: Any) -> None:
    """Fully sharded steps finish gradients themselves (``finalize_model_grads`` reads full
    buffers), so a finalize function other than megatron-core's would be skipped: refused."""
    func = config.finalize_model_grads_func
    if func is None:
        raise ScheduleError(
            "--data-parallel-sharding-strategy optim_grads_params reduces gradients at the end "
            "of the step; set config.finalize_model_grads_func (megatron-core's "
            "finalize_model_grads) as Megatron-LM does"
        )
    from megatron.core.distributed import finalize_model_grads

    target = getattr(func, "func", func)  # a functools.partial of it is fine too
    if target is not finalize_model_grads:
        raise ScheduleError(
            "--data-parallel-sharding-strategy optim_grads_params finishes the gradient "
            "reduction on shards in place of megatron-core's finalize_model_grads; a custom "
            f"finalize_model_grads_func ({getattr(target, '__qualname__', target)!r}) cannot "
            "run on them"
        )


def _iterators_per_chunk(data_iterator: Any, num_chunks: int) -> list[Any]:
    if isinstance(data_iterator, list):
        if len(data_iterator) != num_chunks:
            raise ValueError(
                f"got {len(data_iterator)} data iterators for {num_chunks} model chunks; pass one "
                "per chunk (as for megatron-core's interleaved schedule)"
            )
        return data_iterator
    if num_chunks > 1:
        raise ValueError(
            f"{num_chunks} model chunks need a list of {num_chunks} data iterators, one per chunk"
        )
    return [data_iterator]


def _reject_unsupported(config: Any) -> None:
    """Features megatron-core offers that this runtime does not implement yet: fail loudly."""
    if getattr(config, "num_microbatches_with_partial_activation_checkpoints", None) is not None:
        raise NotImplementedError(
            "num_microbatches_with_partial_activation_checkpoints is not supported by "
            "megatron_bfpp schedules yet; use full or selective recompute instead"
        )
    if getattr(config, "fine_grained_activation_offloading", False):
        raise NotImplementedError(
            "fine_grained_activation_offloading is not supported by megatron_bfpp schedules yet"
        )
    if getattr(config, "cuda_graph_impl", None) == "local":
        # megatron-core's schedules capture at the end of a step (create_cudagraphs); BPipe's
        # restores and sharded parameters' re-gathers move storages a graph would bake in.
        raise NotImplementedError(
            "cuda_graph_impl='local' (--cuda-graph-impl local) is not supported by megatron_bfpp "
            "schedules yet; use --cuda-graph-impl none"
        )


def _resolve_groups(p2p_communicator: Any, pg_collection: Any) -> Any:
    if p2p_communicator is None and pg_collection is None:
        return default_process_groups()
    if p2p_communicator is not None and pg_collection is not None:
        for name in ("tp", "cp", "pp", "embd", "pos_embd", "dp_cp"):
            if not hasattr(pg_collection, name):
                raise ValueError(f"pg_collection must have a {name!r} process group")
        return pg_collection
    raise ValueError(
        "Invalid combination of p2p_communicator, pg_collection: provide none or provide both"
    )


def _message_shape(call: Call, config: Any, groups: Any) -> tuple[int, ...]:
    """megatron-core's get_tensor_shapes: (seq / cp [/ tp with sequence parallel], mbs, hidden)."""
    length = call.seq_length if call.decoder_seq_length is None else call.decoder_seq_length
    length //= groups.cp.size()
    if config.sequence_parallel:
        length //= groups.tp.size()
    shape = (length, call.micro_batch_size, config.hidden_size)
    if call.adjust_tensor_shapes_fn is not None:
        recv, send = call.adjust_tensor_shapes_fn([shape], [shape])
        if len(recv) != 1 or len(send) != 1 or tuple(recv[0]) != tuple(send[0]):
            raise NotImplementedError(
                "megatron_bfpp schedules send one tensor of one shape between stages; "
                f"adjust_tensor_shapes_fn returned receive {recv} and send {send}"
            )
        shape = tuple(recv[0])
    return shape
