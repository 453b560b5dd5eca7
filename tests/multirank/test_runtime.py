"""Our runtime on real megatron-core GPT chunks over gloo ranks: gradients equal an unpipelined
reference, results equal megatron-core's own schedules, each rank runs exactly its schedule,
data-parallel reduction starts per chunk, and bad input fails on every rank before any message."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(180)]

Result = tuple[list[float], dict[str, M.GradShard]]


# --------------------------------------------------------------------------- rank functions


def reference(batches: list[M.Batch]) -> tuple[list[float], dict[str, Any]]:
    return M.reference_losses_and_grads(M.tiny_gpt_config(), batches)


def _chunks(sequence_parallel: bool, ddp: dict[str, Any] | None, **config: Any) -> list[Any]:
    chunks: list[Any] = M.build_model_chunks(
        M.tiny_gpt_config(sequence_parallel=sequence_parallel, **config)
    )
    if ddp is not None:
        chunks = M.wrap_ddp(chunks, **ddp)
        for chunk in chunks:
            chunk.zero_grad_buffer()
    return chunks


def ours_step(
    batches: list[M.Batch],
    schedule: str,
    options: dict[str, Any],
    sequence_parallel: bool = False,
    ddp: dict[str, Any] | None = None,
) -> Result:
    from megatron_bfpp import get_forward_backward_func

    chunks = _chunks(sequence_parallel, ddp)
    func = get_forward_backward_func(schedule, **options)
    store = M.run_schedule(chunks, M.data_parallel_share(batches), forward_backward_func=func)
    return M.losses_from_store(store), M.grad_shards(chunks)


def native_step(batches: list[M.Batch], group_size: int | None = None) -> Result:
    """megatron-core's own schedule for the current layout."""
    overrides = {} if group_size is None else {"microbatch_group_size_per_vp_stage": group_size}
    chunks = _chunks(False, None, **overrides)
    store = M.run_schedule(chunks, batches)
    return M.losses_from_store(store), M.grad_shards(chunks)


def forward_only(batches: list[M.Batch], schedule: str | None) -> tuple[list[float], bool]:
    """Losses of an evaluation pass and whether any gradient appeared."""
    from megatron_bfpp import get_forward_backward_func

    chunks = _chunks(False, None)
    func = None if schedule is None else get_forward_backward_func(schedule)
    store = M.run_schedule(chunks, batches, forward_backward_func=func, forward_only=True)
    any_grad = any(p.grad is not None for c in chunks for p in c.parameters())
    return M.losses_from_store(store), any_grad


def observed_order(batches: list[M.Batch], schedule: str) -> tuple[list[str], list[str]]:
    """(what the model saw, what the schedule says) for this rank's compute actions.

    Observed independently of the executor: forwards by wrapping the forward step, backwards by a
    hook on each chunk's output, which fires when that chunk's backward starts."""
    from megatron.core import parallel_state

    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.runtime import plan_schedule

    chunks = _chunks(False, None)
    seen: list[str] = []
    counters = [0] * len(chunks)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()

    def forward_step(data_iterator: Any, model: Any) -> Any:
        chunk = next(i for i, c in enumerate(chunks) if c is model)
        microbatch, stage = counters[chunk], chunk * pp + rank
        counters[chunk] += 1
        seen.append(f"{stage}F{microbatch}")
        output, loss = M.forward_step_func(data_iterator, model)
        output.register_hook(lambda grad: seen.append(f"{stage}B{microbatch}"))
        return output, loss

    func = get_forward_backward_func(schedule)
    iterators: Any = [iter(batches) for _ in chunks]
    func(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks,
        num_microbatches=len(batches),
        seq_length=M.SEQ_LENGTH,
        micro_batch_size=M.MICRO_BATCH_SIZE,
    )
    plan = plan_schedule(schedule, pp, len(chunks), len(batches), (), False)
    expected = [str(a) for a in plan.schedule.per_rank[rank] if a.kind.is_compute]
    return seen, expected


def reduction_timing(batches: list[M.Batch], schedule: str) -> list[str]:
    """Trace of backwards and per-chunk gradient-reduction dispatches (DDP, overlap on)."""
    from megatron_bfpp import get_forward_backward_func

    chunks = _chunks(False, {"overlap_grad_reduce": True})
    config = M.unwrap(chunks[0]).config
    events: list[str] = []
    syncs = config.grad_sync_func

    def recorder(chunk: int) -> Any:
        def start(*args: Any) -> None:
            events.append(f"GS{chunk}")
            syncs[chunk](*args)

        return start

    config.grad_sync_func = [recorder(i) for i in range(len(chunks))]
    for index, chunk in enumerate(chunks):
        chunk.register_full_backward_pre_hook(
            lambda module, grad, index=index: events.append(f"B{index}")
        )
    M.run_schedule(
        chunks,
        M.data_parallel_share(batches),
        forward_backward_func=get_forward_backward_func(schedule),
    )
    return events


def train(steps: list[list[M.Batch]], schedule: str | None, overlap: bool) -> list[list[float]]:
    """Adam steps with DDP and the distributed optimizer; this rank's losses per step."""
    from megatron_bfpp import get_forward_backward_func

    func = None if schedule is None else get_forward_backward_func(schedule)
    return M.train_steps(steps, forward_backward_func=func, overlap=overlap)


def bad_call(batches: list[M.Batch], schedule: str, options: dict[str, Any]) -> str:
    """Every rank must fail the same way, before sending anything."""
    from megatron_bfpp import get_forward_backward_func

    chunks = _chunks(False, None)
    try:
        func = get_forward_backward_func(schedule, **options)
        M.run_schedule(chunks, batches, forward_backward_func=func)
    except (ScheduleError, ValueError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return "no error"


# --------------------------------------------------------------------------- helpers


def _losses_on_last_stage(results: list[Any], world_size: int, tp: int, dp: int) -> list[float]:
    """Concatenate the last stage's losses in data-parallel order (ranks are tp-major)."""
    last = results[world_size - tp * dp :]
    return [loss for offset in range(0, tp * dp, tp) for loss in last[offset][0]]


def _compare(
    results: list[Result],
    ref: tuple[list[float], Any],
    *,
    world_size: int,
    tp: int,
    dp: int,
    rel: float,
) -> None:
    losses = _losses_on_last_stage(results, world_size, tp, dp)
    if rel == 0.0:
        assert losses == ref[0]
    else:
        assert losses == pytest.approx(ref[0], rel=rel)
    M.assert_tensors_close(M.merge_shards(r[1] for r in results), ref[1], rel=rel)


# (schedule, options, tp, pp, vp, dp, sequence parallel, micro-batches)
GRID = [
    ("gpipe", {}, 1, 2, None, 1, False, 4),
    ("1f1b", {}, 1, 2, None, 1, False, 4),
    ("1f1b", {}, 1, 4, None, 1, False, 6),
    ("gpipe", {}, 1, 4, None, 1, False, 4),
    ("interleaved", {}, 1, 2, 2, 1, False, 4),
    ("breadth-first", {}, 1, 2, 2, 1, False, 4),
    ("breadth-first", {"group_size": 2}, 1, 2, 2, 1, False, 6),
    ("interleaved", {}, 1, 4, 2, 1, False, 8),
    ("breadth-first", {}, 1, 4, 2, 1, False, 8),
    ("1f1b", {}, 2, 2, None, 1, True, 4),
    ("breadth-first", {}, 2, 2, 2, 1, True, 4),
    ("interleaved", {}, 2, 2, 2, 1, False, 4),
    ("1f1b", {}, 1, 2, None, 2, False, 8),
    ("breadth-first", {}, 1, 2, 2, 2, False, 8),
    ("interleaved", {}, 1, 2, 2, 2, False, 8),
]


@pytest.mark.parametrize(
    "schedule, options, tp, pp, vp, dp, sp, m",
    GRID,
    ids=[f"{g[0]}{'-g' if g[1] else ''}-tp{g[2]}pp{g[3]}vp{g[4] or 1}dp{g[5]}" for g in GRID],
)
def test_gradients_equal_unpipelined_reference(
    schedule: str,
    options: dict[str, Any],
    tp: int,
    pp: int,
    vp: int | None,
    dp: int,
    sp: bool,
    m: int,
) -> None:
    batches = M.make_batches(m, seed=11)
    (ref,) = run_ranks(reference, world_size=1, args=(batches,))
    world_size = tp * pp * dp
    # Tensor parallel and data parallel need finalize_model_grads (sequence-parallel norms, DP
    # reduction): wrap in megatron-core DDP as Megatron-LM does.
    ddp = {} if (tp > 1 or dp > 1) else None
    results = run_ranks(
        ours_step,
        world_size=world_size,
        tp=tp,
        pp=pp,
        vp=vp,
        args=(batches, schedule, options, sp, ddp),
    )
    # Pure pipeline parallelism runs every sum in the reference's order: bitwise exact. Tensor-
    # and data-parallel reductions sum the step's tokens in another order: the summation bound.
    reduces = tp > 1 or dp > 1
    rel = M.reduction_tolerance(M.tokens_per_step(batches)) if reduces else 0.0
    _compare(results, ref, world_size=world_size, tp=tp, dp=dp, rel=rel)


@pytest.mark.parametrize(
    "schedule, pp, vp, m, native_group",
    [
        ("1f1b", 4, None, 8, None),
        # BPipe (rank 0 parks micro-batches on rank 3 and loads them back) is 1F1B's arithmetic.
        ("bpipe", 4, None, 8, None),
        ("interleaved", 2, 2, 4, None),
        ("interleaved", 4, 2, 8, None),
        # Breadth-first is megatron's interleaved with one group of all micro-batches.
        ("breadth-first", 2, 2, 4, 4),
        ("breadth-first", 4, 2, 8, 8),
    ],
)
def test_same_results_as_megatron_core(
    schedule: str, pp: int, vp: int | None, m: int, native_group: int | None
) -> None:
    batches = M.make_batches(m, seed=5)
    ours = run_ranks(ours_step, world_size=pp, pp=pp, vp=vp, args=(batches, schedule, {}))
    native = run_ranks(native_step, world_size=pp, pp=pp, vp=vp, args=(batches, native_group))
    assert ours[-1][0] == native[-1][0]
    M.assert_tensors_close(M.merge_shards(r[1] for r in ours), M.merge_shards(r[1] for r in native))


@pytest.mark.parametrize(
    "schedule, pp, vp, m",
    [
        ("breadth-first", 2, 2, 4),
        ("interleaved", 4, 2, 8),
        ("1f1b", 4, None, 6),
        ("gpipe", 2, None, 3),
    ],
)
def test_each_rank_runs_exactly_its_schedule(
    schedule: str, pp: int, vp: int | None, m: int
) -> None:
    batches = M.make_batches(m, seed=3)
    for rank, (seen, expected) in enumerate(
        run_ranks(observed_order, world_size=pp, pp=pp, vp=vp, args=(batches, schedule))
    ):
        assert seen == expected, f"rank {rank}"


@pytest.mark.parametrize(
    "schedule, pp, vp, m",
    [
        ("breadth-first", 2, 2, 4),
        ("interleaved", 4, 2, 8),
        ("1f1b", 4, None, 5),
    ],
)
def test_forward_only_returns_megatron_losses(
    schedule: str, pp: int, vp: int | None, m: int
) -> None:
    batches = M.make_batches(m, seed=9)
    ours = run_ranks(forward_only, world_size=pp, pp=pp, vp=vp, args=(batches, schedule))
    native = run_ranks(forward_only, world_size=pp, pp=pp, vp=vp, args=(batches, None))
    assert ours[-1][0] == native[-1][0] and len(ours[-1][0]) == m
    assert not any(any_grad for _, any_grad in ours)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("schedule, vp", [("breadth-first", 2), ("interleaved", 2), ("1f1b", None)])
def test_adam_training_with_distributed_optimizer_matches_reference(
    schedule: str, vp: int | None, overlap: bool
) -> None:
    steps = [M.make_batches(4, seed=100 + i) for i in range(3)]
    (reference_losses,) = run_ranks(train, world_size=1, args=(steps, None, False))
    results = run_ranks(train, world_size=4, pp=2, vp=vp, args=(steps, schedule, overlap))
    # Ranks 2 and 3 are the last pipeline stage, data-parallel ranks 0 and 1.
    for step, want in enumerate(reference_losses):
        got = results[2][step] + results[3][step]
        assert got == pytest.approx(want, rel=2e-5), f"step {step}"
    assert reference_losses[-1] != reference_losses[0]  # the model really trained


def test_breadth_first_starts_each_chunk_reduction_before_the_next_chunk_backward() -> None:
    """The point of breadth-first with data parallelism: chunk 1's reduction is dispatched
    right after its last backward, before any backward of chunk 0; depth-first cannot."""
    batches = M.make_batches(8, seed=1)
    breadth = run_ranks(reduction_timing, world_size=4, pp=2, vp=2, args=(batches, "breadth-first"))
    for events in breadth:
        assert events.index("GS1") < events.index("B0"), events
        assert events.index("GS1") > max(i for i, e in enumerate(events) if e == "B1")
        assert events[-1] == "GS0"
    depth = run_ranks(reduction_timing, world_size=4, pp=2, vp=2, args=(batches, "interleaved"))
    assert all(events.index("GS1") > events.index("B0") for events in depth)


@pytest.mark.parametrize(
    "schedule, options, vp, m, message",
    [
        ("interleaved", {}, None, 4, "needs virtual pipeline stages"),
        ("breadth-first", {}, None, 4, "needs virtual pipeline stages"),
        ("interleaved", {}, 2, 1, "group size in [pp=2, num_microbatches=1]"),
        ("interleaved", {}, 2, 3, "got 3 % 2 = 1 (use a multiple of 2)"),
        (
            "interleaved",
            {"microbatch_group_size": 3},
            2,
            4,
            "num_microbatches % group size to be 0 or >= pp=2; got 4 % 3 = 1",
        ),
        ("1f1b", {}, 2, 4, "runs one stage per rank"),
        ("v-half", {}, None, 4, "places 2 stages per pipeline rank but the model has 1 chunk"),
        ("breadth-first", {"warp": 1}, 2, 4, "does not take option(s) warp"),
    ],
)
def test_bad_input_fails_on_every_rank_before_communication(
    schedule: str, options: dict[str, Any], vp: int | None, m: int, message: str
) -> None:
    batches = M.make_batches(m, seed=2)
    outcomes = run_ranks(
        bad_call, world_size=2, pp=2, vp=vp, args=(batches, schedule, options), timeout=60
    )
    assert len(set(outcomes)) == 1, outcomes
    assert message in outcomes[0], outcomes[0]


def test_step_post_conditions_fail_loudly_on_leftovers() -> None:
    """A step that ends with a stored activation or an unconsumed receive is a bug; the
    executor must say so instead of leaking it into the next step."""
    from types import SimpleNamespace

    import torch

    from megatron_bfpp.runtime.executor import _check_drained, _rank_step, planned
    from megatron_bfpp.schedules import build_schedule

    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    comm = SimpleNamespace(receives={}, sends=[], headers=[], device=torch.device("cpu"))
    ctx: Any = SimpleNamespace(
        comm=comm,
        config=SimpleNamespace(grad_sync_func=None),
        model=[torch.nn.Linear(1, 1)],
        call=SimpleNamespace(forward_only=False),
        measure_memory=False,
    )
    step = _rank_step(planned(schedule), 0, ctx)
    _check_drained(step)  # nothing left: passes
    step.state.outputs[(0, 1)] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"stored outputs: \['\(0, 1\)'\]"):
        _check_drained(step)
    step.state.outputs.clear()
    comm.receives["x"] = None
    with pytest.raises(RuntimeError, match="receives never consumed"):
        _check_drained(step)
