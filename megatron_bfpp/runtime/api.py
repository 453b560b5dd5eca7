"""``get_forward_backward_func``: any schedule behind megatron-core's forward-backward signature.

megatron-core-only training loops (NeMo, Megatron-Bridge, custom loops) call the returned
function exactly where they call megatron-core's own; it builds (once, cached) the validated
schedule for the current layout and runs this rank's actions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_bfpp.compat import (
    check_megatron_core,
    default_process_groups,
    process_groups_without_embedding_group,
)
from megatron_bfpp.ir import ActionKind, Schedule, ScheduleError
from megatron_bfpp.runtime.executor import nccl_posting, run_rank_program
from megatron_bfpp.runtime.p2p import PipeComm
from megatron_bfpp.runtime.placement import (
    check_chunk_placement,
    deliver_to_last_rank,
    sum_tied_embedding_grads,
)
from megatron_bfpp.runtime.sharding import sharded_parameters
from megatron_bfpp.runtime.step import MemoryReport, StepContext
from megatron_bfpp.schedules.registry import (
    build_schedule,
    check_runnable,
    check_sharding,
    forward_only_schedule,
    get_spec,
    runnable_names,
)
from megatron_bfpp.validate import validate_schedule

__all__ = [
    "ForwardBackwardFunc",
    "get_forward_backward_func",
    "plan_schedule",
    "runnable_names",
    "sharded_optimizer_step",
]


def get_forward_backward_func(
    schedule: str | Schedule,
    *,
    measure_memory: bool = False,
    data_parallel_sharding_strategy: str = "optim",
    **options: Any,
) -> ForwardBackwardFunc:
    """A forward-backward function running ``schedule`` (a registry name).

    ``options`` are the schedule's own (``microbatch_group_size`` for interleaved,
    ``group_size`` for breadth-first, ``max_stored`` for bpipe). Unknown names, options and
    not-yet-runnable schedules fail here, before any communication.

    ``data_parallel_sharding_strategy`` is Megatron's: ``optim`` (the distributed optimizer as
    built; the default) or ``optim_grads_params``, parameters sharded over the data-parallel
    group and gathered per chunk where the schedule says (runtime.sharding; needs DDP chunks
    built for the distributed optimizer, a schedule with several chunks per rank, and
    data-parallel size > 1). Step the optimizer through :func:`sharded_optimizer_step` then.

    After each call the function's ``last_memory`` attribute holds this rank's
    :class:`~megatron_bfpp.runtime.step.MemoryReport` (measured when ``measure_memory`` is
    true, or on a rank that evicts; otherwise zeros) and ``last_trace`` the actions it ran.
    """
    check_megatron_core()
    if isinstance(schedule, Schedule):
        return _prebuilt(schedule, measure_memory, data_parallel_sharding_strategy, options)
    spec = check_runnable(schedule)
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
    """A lowered schedule given as data (e.g. loaded from a CSV, or a hand-made order), checked
    here: complete, deadlock-free, data read in order, and sharded only with sharding on."""
    if options:
        raise ScheduleError(
            f"a Schedule object takes no schedule options (got {sorted(options)}): they shaped "
            "it when it was built"
        )
    validate_schedule(schedule, require_communication=True)
    _check_data_order(schedule)
    releases = any(a.kind is ActionKind.RELEASE for actions in schedule.per_rank for a in actions)
    if releases != (sharding == "optim_grads_params"):
        raise ScheduleError(
            f"schedule {schedule.name!r} {'has' if releases else 'has no'} parameter releases "
            f"(RL) but data_parallel_sharding_strategy is {sharding!r}; lower it with "
            "add_grad_sync(..., sharding=...) to match"
        )
    return ForwardBackwardFunc(
        schedule=schedule.name, measure_memory=measure_memory, sharding=sharding, prebuilt=schedule
    )


@dataclass(eq=False)
class ForwardBackwardFunc:
    """What :func:`get_forward_backward_func` returns: callable with megatron-core's
    forward-backward signature, and the one place that keeps what outlives a step.

    A class rather than a closure so that this state is typed and visible: the last step's
    trace and memory report (read by benchmarks and bfpp-train), and the BPipe payload sizes
    both ends of each evictor/acceptor pair agreed, which later steps of the run reuse.
    """

    schedule: str
    options: tuple[tuple[str, Any], ...] = ()
    measure_memory: bool = False
    sharding: str = "optim"
    prebuilt: Schedule | None = field(default=None, repr=False)
    last_trace: list[str] = field(default_factory=list, repr=False)
    last_memory: MemoryReport = field(default_factory=MemoryReport, repr=False)

    def __call__(
        self,
        *,
        forward_step_func: Callable[..., Any],
        data_iterator: Iterator[Any] | list[Iterator[Any]] | None,
        model: torch.nn.Module | list[torch.nn.Module],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable[..., Any] | None = None,
        p2p_communicator: Any = None,
        pg_collection: Any = None,
        force_all_reduce: bool | None = False,
    ) -> list[Any]:
        """megatron-core's forward-backward signature; returns the loss dicts (last stage)."""
        return _run_step(
            self,
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length,
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data,
            first_val_step=first_val_step,
            adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
            p2p_communicator=p2p_communicator,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )


@functools.lru_cache(maxsize=32)
def plan_schedule(
    name: str,
    num_ranks: int,
    num_chunks: int,
    num_microbatches: int,
    options: tuple[tuple[str, Any], ...],
    forward_only: bool,
    sharding: str = "optim",
) -> Schedule:
    """The validated schedule for a layout, built once per process (every rank builds the same
    one deterministically, so errors surface identically everywhere, before communication)."""
    spec = get_spec(name)
    chunks = num_chunks if spec.placement == "looped" or num_chunks > 1 else None
    schedule = build_schedule(
        name,
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        num_chunks=chunks,
        sharding=sharding,
        **dict(options),
    )
    _check_data_order(schedule)
    planned = forward_only_schedule(schedule) if forward_only else schedule
    nccl_posting(planned)  # proven NCCL-safe here, before any message
    return planned


def _check_data_order(schedule: Schedule) -> None:
    """Each chunk reads its data iterator in forward order, so micro-batch ids must increase."""
    for actions in schedule.per_rank:
        last: dict[int, int] = {}
        for action in actions:
            if action.kind.value == "F":
                mb = action.microbatch if action.microbatch is not None else -1
                if mb < last.get(action.stage, -1):
                    raise ScheduleError(
                        f"{schedule.name} runs stage {action.stage}'s micro-batches out of order; "
                        "megatron data iterators are read sequentially"
                    )
                last[action.stage] = mb


def _run_step(
    func: ForwardBackwardFunc,
    *,
    forward_step_func: Callable[..., Any],
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None,
    forward_only: bool,
    collect_non_loss_data: bool,
    first_val_step: bool | None,
    adjust_tensor_shapes_fn: Callable[..., Any] | None,
    p2p_communicator: Any,
    pg_collection: Any,
    force_all_reduce: bool | None,
) -> list[Any]:
    from megatron.core.pipeline_parallel.schedules import (
        clear_embedding_activation_buffer,
        finish_embedding_wgrad_compute,
    )
    from megatron.core.pipeline_parallel.utils import is_pp_last_stage
    from megatron.core.utils import get_model_config, get_model_type

    chunks = model if isinstance(model, list) else [model]
    if not chunks:
        raise ValueError("model must be a module or a non-empty list of model chunks")
    iterators = _iterators_per_chunk(data_iterator, len(chunks))
    config = get_model_config(chunks[0])
    _reject_unsupported(config)
    groups = _resolve_groups(p2p_communicator, pg_collection)
    pp_group = groups.pp
    if func.prebuilt is not None:
        schedule = _fitted(func.prebuilt, pp_group.size(), len(chunks), num_microbatches)
        if forward_only:
            schedule = forward_only_schedule(schedule)
    else:
        schedule = plan_schedule(
            func.schedule,
            pp_group.size(),
            len(chunks),
            num_microbatches,
            func.options,
            bool(forward_only),
            func.sharding,
        )
    _check_chunk_count(schedule, len(chunks))
    check_chunk_placement(chunks, schedule.layout, pp_group.rank(), schedule.name)
    if _embedding_and_loss_on_one_rank(schedule) and getattr(
        config, "defer_embedding_wgrad_compute", False
    ):
        raise NotImplementedError(
            "defer_embedding_wgrad_compute is not supported with V-shape schedules yet (the "
            "output layer is on the first pipeline rank there); turn it off"
        )
    sharded = None
    if func.sharding != "optim":
        if groups.dp_cp.size() == 1:
            raise ScheduleError(
                "--data-parallel-sharding-strategy optim_grads_params needs data parallelism "
                "(data-parallel size is 1: there is nothing to shard over)"
            )
        sharded = sharded_parameters(chunks)
        if not forward_only:
            _check_sharded_finalize(config)
            sharded.prepare_step(config, groups)
    shape = _message_shape(
        seq_length, micro_batch_size, decoder_seq_length, config, groups, adjust_tensor_shapes_fn
    )
    device = next(chunks[0].parameters()).device
    comm = PipeComm(
        group=pp_group,
        shape=shape,
        dtype=config.pipeline_dtype,
        device=device,
    )
    ctx = StepContext(
        forward_step_func=forward_step_func,
        data_iterators=iterators,
        model=chunks,
        num_microbatches=num_microbatches,
        config=config,
        model_type=get_model_type(chunks[0]),
        cp_group_size=groups.cp.size(),
        forward_only=bool(forward_only),
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        comm=comm,
        measure_memory=func.measure_memory,
        sharded=sharded,
    )
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    embedding_module = None
    if config.finalize_model_grads_func is not None and not forward_only:
        embedding_module = clear_embedding_activation_buffer(
            config, chunks, is_pp_last_stage(pp_group)
        )
    store, total_num_tokens, trace, memory = run_rank_program(schedule, pp_group.rank(), ctx)
    func.last_trace = trace
    func.last_memory = memory
    if config.finalize_model_grads_func is not None and not forward_only:
        finish_embedding_wgrad_compute(
            config, embedding_module, is_pp_last_stage(pp_group), groups.tp
        )
        # Embedding and output layer on one rank (V-shape): no all-reduce over the pipeline;
        # the rank adds its two copies' gradients after the data-parallel reduction.
        on_one_rank = _embedding_and_loss_on_one_rank(schedule)
        if on_one_rank and config.calculate_per_token_loss:
            # finalize_model_grads broadcasts the token count from the last pipeline rank, but
            # under the V the loss (and so the count) is on the first: give it to every rank.
            torch.distributed.all_reduce(total_num_tokens, group=pp_group)
        num_tokens = total_num_tokens if config.calculate_per_token_loss else None
        if sharded is not None:
            # megatron-core's finalize reads full gradients; the sharded model finishes the
            # same reductions on its kept shards.
            sharded.finalize_grads(config, groups, num_tokens, bool(force_all_reduce))
        else:
            config.finalize_model_grads_func(
                chunks,
                num_tokens,
                pg_collection=(
                    process_groups_without_embedding_group(groups) if on_one_rank else groups
                ),
                force_all_reduce=force_all_reduce,
            )
        if on_one_rank:
            sum_tied_embedding_grads(chunks)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return deliver_to_last_rank(store, schedule.layout, pp_group, device)


def _check_chunk_count(schedule: Schedule, num_chunks: int) -> None:
    """A V-shape schedule places two stages per rank whatever the call's chunk count (the
    looped ones are built for it); one line if the model is not two chunks."""
    wanted = schedule.layout.num_chunks
    if wanted != num_chunks:
        raise ScheduleError(
            f"schedule {schedule.name!r} places {wanted} stages per pipeline rank but the model "
            f"has {num_chunks} chunk(s) here; build {wanted} chunks per rank (virtual pipeline "
            f"size {wanted})"
        )


def _embedding_and_loss_on_one_rank(schedule: Schedule) -> bool:
    layout = schedule.layout
    return layout.num_ranks > 1 and layout.rank_of(0) == layout.rank_of(layout.num_stages - 1)


def sharded_optimizer_step(optimizer: Any, model: torch.nn.Module | list[torch.nn.Module]) -> Any:
    """``optimizer.step()`` for a model trained with ``optim_grads_params``: megatron-core's
    distributed optimizer steps on the kept parameter and gradient shards (no full buffer is
    allocated), without its closing all-gather (the schedule gathers each chunk when it needs
    it). Returns what ``optimizer.step()`` returns."""
    chunks = model if isinstance(model, list) else [model]
    return sharded_parameters(chunks).optimizer_step(optimizer.step, optimizer)


def _check_sharded_finalize(config: Any) -> None:
    """Fully sharded steps finish the gradients themselves (``finalize_model_grads`` reads
    full buffers); a finalize function other than megatron-core's would be skipped, so one
    line instead."""
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


def _fitted(schedule: Schedule, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """A prebuilt schedule, if it fits the call's layout (one line saying what differs)."""
    chunks = len(schedule.layout.stages_of(0))
    if (schedule.num_ranks, chunks, schedule.num_microbatches) != (
        num_ranks,
        num_chunks,
        num_microbatches,
    ):
        raise ScheduleError(
            f"schedule {schedule.name!r} is for pp={schedule.num_ranks}, {chunks} chunk(s) per "
            f"rank, {schedule.num_microbatches} micro-batches; this call has pp={num_ranks}, "
            f"{num_chunks} model chunk(s), {num_microbatches} micro-batches"
        )
    return schedule


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


def _message_shape(
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None,
    config: Any,
    groups: Any,
    adjust_tensor_shapes_fn: Callable[..., Any] | None,
) -> tuple[int, ...]:
    """megatron-core's get_tensor_shapes: (seq / cp [/ tp with sequence parallel], mbs, hidden)."""
    length = decoder_seq_length if decoder_seq_length is not None else seq_length
    length //= groups.cp.size()
    if config.sequence_parallel:
        length //= groups.tp.size()
    shape = (length, micro_batch_size, config.hidden_size)
    if adjust_tensor_shapes_fn is not None:
        recv, send = adjust_tensor_shapes_fn([shape], [shape])
        if len(recv) != 1 or len(send) != 1 or tuple(recv[0]) != tuple(send[0]):
            raise NotImplementedError(
                "megatron_bfpp schedules send one tensor of one shape between stages; "
                f"adjust_tensor_shapes_fn returned receive {recv} and send {send}"
            )
        shape = tuple(recv[0])
    return shape
