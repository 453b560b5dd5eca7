"""NeMo 2's call form reaches our schedules through the plugin's megatron-core patch.

NeMo 2 (``nemo/lightning/megatron_parallel.py``: ``MegatronParallel.forward_backward_func`` and
``MegatronStep.forward_backward_func``) imports megatron-core's ``get_forward_backward_func``
inside a property, at call time, calls it with no arguments, and calls the result with
``forward_step_func``, a list of data iterators (one per chunk, a one-element list for one
chunk), ``model`` (the module itself for one chunk, else the list), ``forward_only``,
``micro_batch_size``, ``seq_length`` and ``num_microbatches``. NeMo itself does not install on a
CPU-only machine (its Lightning stack pulls in CUDA-only packages), so this test makes exactly
that call after ``megatron_bfpp.install(); megatron_bfpp.set_schedule(name)`` and compares the
result with megatron-core's own schedule.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(180)]


def _nemo_step(chunks: list[Any], batches: list[M.Batch]) -> tuple[str, list[float]]:
    """MegatronParallel.forward's call, as NeMo 2 writes it; with the function's name."""
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    forward_backward_func = get_forward_backward_func()  # NeMo: fetched at call time, no args
    pipeline = chunks[0] if len(chunks) == 1 else chunks
    store = forward_backward_func(
        forward_step_func=M.forward_step_func,
        data_iterator=[iter(batches) for _ in chunks],
        model=pipeline,
        forward_only=False,
        micro_batch_size=batches[0]["tokens"].shape[0],
        seq_length=M.SEQ_LENGTH,
        num_microbatches=len(batches),
    )
    return forward_backward_func.__name__, M.losses_from_store(store)


def nemo_rank(batches: list[M.Batch], schedule: str) -> tuple[str, list[float], Any]:
    import megatron_bfpp

    megatron_bfpp.install()
    try:
        megatron_bfpp.set_schedule(schedule)
        chunks = M.build_model_chunks(M.tiny_gpt_config())
        name, losses = _nemo_step(chunks, batches)
        return name, losses, M.grad_shards(chunks)
    finally:
        megatron_bfpp.set_schedule("default")
        megatron_bfpp.uninstall()


def native_rank(batches: list[M.Batch], group_size: int | None) -> tuple[list[float], Any]:
    overrides = {} if group_size is None else {"microbatch_group_size_per_vp_stage": group_size}
    chunks = M.build_model_chunks(M.tiny_gpt_config(**overrides))
    return M.losses_from_store(M.run_schedule(chunks, batches)), M.grad_shards(chunks)


@pytest.mark.parametrize(
    "schedule, vp, native_group",
    [("1f1b", None, None), ("bpipe", None, None), ("breadth-first", 2, 4)],
)
def test_nemo_call_form_runs_our_schedule(
    schedule: str, vp: int | None, native_group: int | None
) -> None:
    batches = M.make_batches(4, seed=11)
    ours = run_ranks(nemo_rank, world_size=2, pp=2, vp=vp, args=(batches, schedule))
    native = run_ranks(native_rank, world_size=2, pp=2, vp=vp, args=(batches, native_group))
    assert {name for name, _, _ in ours} == {"forward_backward_" + schedule.replace("-", "_")}
    assert ours[-1][1] == native[-1][0]  # the last stage's losses, bit for bit
    M.assert_tensors_close(M.merge_shards(r[2] for r in ours), M.merge_shards(r[1] for r in native))
