"""megatron-core's own 1F1B and interleaved schedules, run on gloo ranks with torch's
``batch_isend_irecv`` / ``isend`` / ``irecv`` and their Works recorded, post exactly the calls
``native_posting.megatron_posting`` derives from our catalogue's schedule: op for op (send or
receive, peer, shape), in order, batched or not, with the computes and the waits in between.
Under megatron-core DDP, each chunk's gradient reduction starts (its bucket group's
``start_grad_sync``, whether DDP's hooks, ``grad_sync_func`` or ``finalize_model_grads`` call
it) where the model puts the chunk's GS, with and without ``overlap_grad_reduce`` and
``grad_sync_func``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.ir import ActionKind, Schedule, parts
from megatron_bfpp.native_posting import GradSyncOptions, P2POptions, megatron_posting
from megatron_bfpp.nccl import Batch, Wait, check_posting
from megatron_bfpp.schedules.registry import build_schedule
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]

Event = tuple[Any, ...]
SHAPE = (M.SEQ_LENGTH, M.MICRO_BATCH_SIZE, 32)  # [sequence, micro-batch, hidden]

# (batch_p2p_comm, overlap_p2p_comm, deallocate_pipeline_outputs): megatron-core's default,
# non-batched, and the interleaved schedule's overlap without and with freed outputs.
BATCHED = (True, False, False)
PAIRWISE = (False, False, False)
OVERLAP = (False, True, False)
OVERLAP_FREED = (False, True, True)


# --------------------------------------------------------------------------- recording


def _recorder(events: list[Event]) -> Callable[[], None]:
    """Wrap torch's p2p calls (whatever is installed: gloo's, or the NCCL emulation's) to append
    ("batch", ops) / ("isend" | "irecv", peer, shape) and ("wait", op ids) to ``events``; return
    the undo."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    inner: dict[str, Any] = {
        "batch_isend_irecv": dist.batch_isend_irecv,
        "isend": dist.isend,
        "irecv": dist.irecv,
    }
    check_op = c10d._check_op
    next_id = [0]

    def ids(count: int) -> tuple[int, ...]:
        first = next_id[0]
        next_id[0] += count
        return tuple(range(first, first + count))

    class Recorded:
        def __init__(self, work: Any, op_ids: tuple[int, ...]) -> None:
            self.work, self.op_ids = work, op_ids

        def wait(self, *args: Any, **kwargs: Any) -> Any:
            events.append(("wait", frozenset(self.op_ids)))
            return self.work.wait(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.work, name)

    def isend(tensor: Any, dst: Any = None, group: Any = None, tag: int = 0, **kw: Any) -> Any:
        events.append(("isend", dst, tuple(tensor.shape)))
        return Recorded(inner["isend"](tensor, dst, group, tag, **kw), ids(1))

    def irecv(tensor: Any, src: Any = None, group: Any = None, tag: int = 0, **kw: Any) -> Any:
        events.append(("irecv", src, tuple(tensor.shape)))
        return Recorded(inner["irecv"](tensor, src, group, tag, **kw), ids(1))

    def batch(ops: list[Any]) -> list[Any]:
        recorded = []
        for op in ops:
            send = op.op in (isend, inner["isend"])
            op.op = inner["isend"] if send else inner["irecv"]
            recorded.append(("send" if send else "recv", op.peer, tuple(op.tensor.shape)))
        events.append(("batch", tuple(recorded)))
        op_ids = ids(len(ops))
        works = inner["batch_isend_irecv"](ops)
        if len(works) == 1:  # NCCL (and its emulation): one Work for the whole batch
            return [Recorded(works[0], op_ids)]
        return [Recorded(work, (op_id,)) for work, op_id in zip(works, op_ids, strict=True)]

    def check(op: Any) -> None:
        if op not in (isend, irecv):
            check_op(op)

    for name, wrapper in (("batch_isend_irecv", batch), ("isend", isend), ("irecv", irecv)):
        setattr(dist, name, wrapper)
    c10d._check_op = check  # P2POp accepts the wrappers

    def undo() -> None:
        for name, original in inner.items():
            setattr(dist, name, original)
        c10d._check_op = check_op

    return undo


def megatron_events(
    modes: list[tuple[bool, bool, bool]], microbatch_counts: list[int], group: int | None
) -> list[list[Event]]:
    """Per (mode, micro-batch count): what this rank posted, ran and waited for in one call of
    megatron-core's own forward-backward function."""
    runs = []
    grouping: dict[str, Any] = {}
    if group is not None:
        grouping["microbatch_group_size_per_vp_stage"] = group
    for batch_p2p, overlap, deallocate in modes:
        config = M.tiny_gpt_config(
            batch_p2p_comm=batch_p2p,
            overlap_p2p_comm=overlap,
            deallocate_pipeline_outputs=deallocate,
            **grouping,
        )
        chunks = M.build_model_chunks(config)
        for count in microbatch_counts:
            runs.append(_merged_waits(_one_step(chunks, count)))
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
    return runs


def megatron_grad_sync_events(
    mode: tuple[bool, bool, bool], count: int, group: int | None, syncs: list[GradSyncOptions]
) -> list[list[Event]]:
    """Per DDP setting: what this rank posted, ran and waited for, and when each chunk's
    gradient reduction started, in the second of two steps under megatron-core DDP (the first
    step starts every reduction in ``finish_grad_sync``: ``is_first_batch``)."""
    from megatron_bfpp.train.presets import wrap_ddp

    batch_p2p, overlap, deallocate = mode
    grouping: dict[str, Any] = {}
    if group is not None:
        grouping["microbatch_group_size_per_vp_stage"] = group
    runs = []
    for sync in syncs:
        config = M.tiny_gpt_config(
            batch_p2p_comm=batch_p2p,
            overlap_p2p_comm=overlap,
            deallocate_pipeline_outputs=deallocate,
            **grouping,
        )
        chunks = wrap_ddp(
            M.build_model_chunks(config), overlap_grad_reduce=sync.overlap_grad_reduce
        )
        if not sync.grad_sync_func:
            config.grad_sync_func = None  # Megatron-LM's --no-align-grad-reduce
        _one_step(chunks, count)  # the first step
        runs.append(_merged_waits(_step_with_grad_syncs(chunks, count)))
    return runs


def _step_with_grad_syncs(chunks: list[Any], count: int) -> list[Event]:
    """One step's record with ("GS", stage) where a chunk's first bucket group starts its
    reduction (``_ParamAndGradBucketGroup.start_grad_sync``, whoever calls it)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    stage_of = _stage_of_bucket_groups(chunks)
    events: list[Event] = []
    original = _ParamAndGradBucketGroup.start_grad_sync

    def start_grad_sync(group: Any, *args: Any, **kwargs: Any) -> Any:
        stage = stage_of[id(group)]
        if ("GS", stage) not in events:
            events.append(("GS", stage))
        return original(group, *args, **kwargs)

    for chunk in chunks:
        chunk.zero_grad_buffer()
    _ParamAndGradBucketGroup.start_grad_sync = start_grad_sync
    try:
        return _one_step(chunks, count, events)
    finally:
        _ParamAndGradBucketGroup.start_grad_sync = original


def _stage_of_bucket_groups(chunks: list[Any]) -> dict[int, int]:
    from megatron.core import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return {
        id(group): index * pp + pp_rank
        for index, chunk in enumerate(chunks)
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups
    }


def _one_step(chunks: list[Any], count: int, events: list[Event] | None = None) -> list[Event]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    events = [] if events is None else events
    forwards = [0] * len(chunks)
    original_backward = schedules.backward_step

    def forward_step(data_iterator: Any, model: Any) -> Any:
        chunk = next(c for c, candidate in enumerate(chunks) if candidate is model)
        events.append(("F", chunk * pp + pp_rank, forwards[chunk]))
        forwards[chunk] += 1
        return M.forward_step_func(data_iterator, model)

    def backward_step(*args: Any, **kwargs: Any) -> Any:
        events.append(("B",))
        return original_backward(*args, **kwargs)

    batches = M.make_batches(count)
    iterators = [iter(batches) for _ in chunks]
    undo = _recorder(events)
    schedules.backward_step = backward_step
    try:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks,
            num_microbatches=count,
            seq_length=M.SEQ_LENGTH,
            micro_batch_size=M.MICRO_BATCH_SIZE,
        )
    finally:
        undo()
        schedules.backward_step = original_backward
    return events


# --------------------------------------------------------------------------- the model's side


def model_events(
    schedule: Schedule, options: P2POptions, rank: int, grad_sync: GradSyncOptions | None = None
) -> list[Event]:
    """The same record, read from ``megatron_posting``: a pairwise batch as its isend / irecv
    calls, a blocking batch followed by the wait of its ops, PS / RL left out, and GS as
    ("GS", stage) under ``grad_sync`` (left out without)."""
    posting = megatron_posting(schedule, options, grad_sync or GradSyncOptions())
    check_posting(schedule, posting)  # and the posting is proven under NCCL's rules
    actions = schedule.per_rank[rank]
    op_id: dict[int, int] = {}
    events: list[Event] = []
    for step in posting.per_rank[rank]:
        if isinstance(step, int):
            action = actions[step]
            if action.kind is ActionKind.FORWARD:
                events.append(("F", action.stage, action.microbatch))
            elif action.kind is ActionKind.BACKWARD:
                events.append(("B",))
            elif action.kind is ActionKind.OVERLAP_F_B:  # a combined step: its F, then its B
                forward = parts(action)[0]
                events.extend([("F", forward.stage, forward.microbatch), ("B",)])
            elif action.kind is ActionKind.GRAD_SYNC and grad_sync is not None:
                events.append(("GS", action.stage))
        elif isinstance(step, Wait):
            events.append(("wait", frozenset(op_id[q] for q in step.positions)))
        else:
            assert isinstance(step, Batch)
            ops = []
            for item in step.items:
                op_id[item.position] = len(op_id)
                action = actions[item.position]
                ops.append(("send" if action.kind.is_send else "recv", action.peer, SHAPE))
            if step.pairwise:
                events.extend(
                    ("isend" if s == "send" else "irecv", peer, shape) for s, peer, shape in ops
                )
            else:
                events.append(("batch", tuple(ops)))
            if step.blocking:
                events.append(("wait", frozenset(op_id[item.position] for item in step.items)))
    return _merged_waits(events)


def _merged_waits(events: list[Event]) -> list[Event]:
    """Consecutive waits as one (waiting for a then b is waiting for both)."""
    merged: list[Event] = []
    for event in events:
        if event[0] == "wait" and merged and merged[-1][0] == "wait":
            merged[-1] = ("wait", merged[-1][1] | event[1])
        else:
            merged.append(event)
    return merged


def _options(mode: tuple[bool, bool, bool], core: tuple[int, int]) -> P2POptions:
    batch_p2p, overlap, deallocate = mode
    return P2POptions(
        overlap_p2p=overlap, batch_p2p=batch_p2p, wait_forward_sends=deallocate and core >= (0, 18)
    )


def _first_difference(got: list[Event], want: list[Event]) -> str:
    for index, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            before = got[max(0, index - 4) : index]
            return f"event {index}: megatron-core {a}, model {b}; before it {before}"
    return f"lengths {len(got)} (megatron-core) and {len(want)} (model)"


# --------------------------------------------------------------------------- tests


ALL_INTERLEAVED = [BATCHED, PAIRWISE, OVERLAP, OVERLAP_FREED]
CASES = [
    pytest.param(2, None, None, [BATCHED, PAIRWISE], [1, 3, 5], id="1f1b-pp2"),
    pytest.param(4, None, None, [BATCHED, PAIRWISE], [2, 4, 7], id="1f1b-pp4"),
    pytest.param(4, 2, None, ALL_INTERLEAVED, [4, 8], id="interleaved-pp4-vp2"),
    # microbatch_group_size_per_vp_stage 5: the schedule table and the warm-up change
    pytest.param(4, 2, 5, [BATCHED, OVERLAP], [10], id="interleaved-pp4-vp2-group5"),
]


@pytest.mark.parametrize(("pp", "vp", "group", "modes", "counts"), CASES)
def test_megatron_core_posts_what_the_model_derives(
    pp: int,
    vp: int | None,
    group: int | None,
    modes: list[tuple[bool, bool, bool]],
    counts: list[int],
) -> None:
    from megatron_bfpp.compat import megatron_core_version

    core = megatron_core_version()[:2]
    if core < (0, 18):  # 0.16-0.17 free a forward's output before its isend completed (gloo)
        modes = [mode for mode in modes if mode != OVERLAP_FREED]
    results = run_ranks(
        megatron_events, world_size=pp, pp=pp, vp=vp, timeout=540, args=(modes, counts, group)
    )
    name = "1f1b" if vp is None else "interleaved"
    grouping: dict[str, Any] = {} if group is None else {"microbatch_group_size": group}
    for index, (mode, count) in enumerate((mode, count) for mode in modes for count in counts):
        schedule = build_schedule(
            name, num_ranks=pp, num_microbatches=count, num_chunks=vp, **grouping
        )
        options = _options(mode, core)
        for rank in range(pp):
            got, want = results[rank][index], model_events(schedule, options, rank)
            assert got == want, (
                f"{name} pp={pp} m={count} {options}, rank {rank}: {_first_difference(got, want)}"
            )
            assert any(event[0] in ("batch", "isend", "irecv") for event in got)


# (overlap_grad_reduce, grad_sync_func): megatron-core's default (all in finalize_model_grads),
# DDP's hooks alone (--no-align-grad-reduce), Megatron-LM's --overlap-grad-reduce.
GRAD_SYNCS = [
    GradSyncOptions(False, False),
    GradSyncOptions(True, False),
    GradSyncOptions(True, True),
]
GRAD_SYNC_CASES = [
    pytest.param(4, None, BATCHED, 6, None, id="1f1b-pp4"),
    pytest.param(4, None, PAIRWISE, 2, None, id="1f1b-pp4-all-in-warm-up"),
    pytest.param(4, 2, OVERLAP, 8, None, id="interleaved-pp4-vp2-overlap"),
    pytest.param(4, 2, BATCHED, 12, None, id="interleaved-pp4-vp2-batched"),
    pytest.param(4, 2, OVERLAP, 10, 5, id="interleaved-pp4-vp2-group5"),
]


@pytest.mark.parametrize(("pp", "vp", "mode", "count", "group"), GRAD_SYNC_CASES)
def test_megatron_core_ddp_starts_each_reduction_where_the_model_puts_its_gs(
    pp: int, vp: int | None, mode: tuple[bool, bool, bool], count: int, group: int | None
) -> None:
    from megatron_bfpp.compat import megatron_core_version

    core = megatron_core_version()[:2]
    results = run_ranks(
        megatron_grad_sync_events,
        world_size=pp,
        pp=pp,
        vp=vp,
        timeout=540,
        args=(mode, count, group, GRAD_SYNCS),
    )
    name = "1f1b" if vp is None else "interleaved"
    grouping: dict[str, Any] = {} if group is None else {"microbatch_group_size": group}
    schedule = build_schedule(name, num_ranks=pp, num_microbatches=count, num_chunks=vp, **grouping)
    options = _options(mode, core)
    for index, sync in enumerate(GRAD_SYNCS):
        for rank in range(pp):
            got = results[rank][index]
            want = model_events(schedule, options, rank, sync)
            assert got == want, (
                f"{name} pp={pp} m={count} {options} {sync}, rank {rank}: "
                f"{_first_difference(got, want)}"
            )
            assert sum(event[0] == "GS" for event in got) == (vp or 1)
