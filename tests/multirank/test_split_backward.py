"""Split backward (I then W) on real megatron-core GPT chunks over gloo ranks: orders of I and W
that validate give 1F1B's (or interleaved's) losses and gradients bitwise, with tensor and data
parallelism too, and a schedule given as data runs through get_forward_backward_func (or fails
with one line when it does not fit the call)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.ir import Action, ActionKind, Schedule, ScheduleError
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.schedules.registry import build_schedule
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(180)]

K = ActionKind
MEASURE = False


def split(pp: int, m: int, *, defer: bool, chunks: int | None = None) -> Schedule:
    """1F1B (or interleaved with ``chunks``) with every B split into I and W: W right after its
    I, or (``defer``) all of a rank's W at the end of its program, in micro-batch order."""
    name = "1f1b" if chunks is None else "interleaved"
    base = build_schedule(name, num_ranks=pp, num_microbatches=m, num_chunks=chunks, lower=False)
    programs = []
    for actions in base.per_rank:
        program: list[Action] = []
        weights: list[Action] = []
        for action in actions:
            if action.kind is not K.BACKWARD:
                program.append(action)
                continue
            program.append(Action(action.stage, K.BACKWARD_INPUT, action.microbatch))
            weight = Action(action.stage, K.BACKWARD_WEIGHT, action.microbatch)
            (weights if defer else program).append(weight)
        programs.append(program + weights)
    return add_grad_sync(add_communication(base.with_programs(programs)))


def step(schedule: Schedule | str, batches: list[M.Batch], tp_sp: bool, ddp: bool) -> Any:
    from megatron_bfpp import get_forward_backward_func

    chunks: list[Any] = M.build_model_chunks(M.tiny_gpt_config(sequence_parallel=tp_sp))
    if ddp:
        chunks = M.wrap_ddp(chunks)
        for chunk in chunks:
            chunk.zero_grad_buffer()
    func = get_forward_backward_func(schedule, measure_memory=MEASURE)
    store = M.run_schedule(chunks, M.data_parallel_share(batches), forward_backward_func=func)
    return M.losses_from_store(store), M.grad_shards(chunks), list(func.last_trace)


@pytest.mark.parametrize(
    "pp, vp, m, defer, tp, dp",
    [
        (2, None, 4, False, 1, 1),
        (2, None, 4, True, 1, 1),
        (4, None, 6, True, 1, 1),
        (2, 2, 4, True, 1, 1),
        (2, None, 4, True, 2, 1),
        (2, None, 8, True, 1, 2),
    ],
    ids=[
        "pp2-immediate",
        "pp2-deferred",
        "pp4-deferred",
        "interleaved-deferred",
        "tp2-sp",
        "dp2-ddp",
    ],
)
def test_split_backward_gives_1f1b_gradients(
    pp: int, vp: int | None, m: int, defer: bool, tp: int, dp: int
) -> None:
    """Bitwise: I runs B's kernels in B's order. With data parallelism the DDP reduction runs
    from the chunks' no_sync hooks and gives the same gradients on every replica."""
    batches = M.make_batches(m, seed=21)
    schedule = split(pp, m // dp, defer=defer, chunks=vp)
    reference = "1f1b" if vp is None else "interleaved"
    common: dict[str, Any] = dict(world_size=pp * tp * dp, tp=tp, pp=pp, vp=vp)
    ddp = tp > 1 or dp > 1
    ours = run_ranks(step, **common, args=(schedule, batches, tp > 1, ddp))
    base = run_ranks(step, **common, args=(reference, batches, tp > 1, ddp))
    assert [r[0] for r in ours] == [r[0] for r in base]
    M.assert_tensors_close(
        M.merge_shards(r[1] for r in ours), M.merge_shards(r[1] for r in base), rel=0.0
    )
    for index, result in enumerate(ours):
        rank = index // (tp * dp)  # Megatron's order: tensor, data, then pipeline parallel
        assert result[2] == [
            str(a)
            for a in schedule.per_rank[rank]
            if a.kind.is_compute or a.kind in (K.GRAD_SYNC, K.PARAM_SYNC)
        ], f"rank {rank}"


def test_a_schedule_object_that_does_not_fit_the_call_is_one_line() -> None:
    def call(batches: list[M.Batch]) -> str:
        from megatron_bfpp import get_forward_backward_func

        chunks: list[Any] = M.build_model_chunks(M.tiny_gpt_config())
        try:
            func = get_forward_backward_func(split(2, 4, defer=False))
            M.run_schedule(chunks, batches, forward_backward_func=func)
        except ScheduleError as error:
            return str(error)
        return "no error"

    results = run_ranks(call, world_size=2, pp=2, args=(M.make_batches(6),))
    assert results[0] == results[1]
    assert "micro-batches" in results[0] and "\n" not in results[0]
