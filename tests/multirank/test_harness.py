"""The multi-rank foundation, proven with megatron-core's OWN schedules on CPU/gloo.

A tiny GPTModel (local layer spec) split over tp/pp/vp/dp ranks must give the losses and every
gradient of the single-process model with the same global-name initialisation; the harness must
report a failing rank's traceback quickly and kill a hung rank at its timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.megatron import cpu
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import RanksFailed, run_ranks

# run_ranks kills a stuck rank after RANK_TIMEOUT and reports every rank's stack; the per-test
# pytest-timeout is the backstop above the (at most two) run_ranks calls of a test.
RANK_TIMEOUT = 60.0
pytestmark = [pytest.mark.megatron, pytest.mark.timeout(2 * RANK_TIMEOUT + 30)]

Result = tuple[list[float], dict[str, M.GradShard]]


# --------------------------------------------------------------------------- rank functions


def reference(batches: list[M.Batch], tied: bool = False) -> tuple[list[float], dict[str, Any]]:
    return M.reference_losses_and_grads(
        M.tiny_gpt_config(), batches, share_embeddings_and_output_weights=tied
    )


def megatron_step(
    batches: list[M.Batch],
    sequence_parallel: bool = False,
    ddp: dict[str, Any] | None = None,
    tied: bool = False,
) -> Result:
    """One megatron-core forward-backward on this rank's data-parallel share; (losses, grads)."""
    config = M.tiny_gpt_config(sequence_parallel=sequence_parallel)
    chunks: list[Any] = M.build_model_chunks(config, share_embeddings_and_output_weights=tied)
    if ddp is not None:
        chunks = M.wrap_ddp(chunks, **ddp)
        for chunk in chunks:
            chunk.zero_grad_buffer()
    store = M.run_schedule(chunks, M.data_parallel_share(batches))
    return M.losses_from_store(store), M.grad_shards(chunks)


def train(steps: list[list[M.Batch]], overlap: bool) -> list[list[float]]:
    """A few Adam steps with DDP and the distributed optimizer; this rank's losses per step."""
    return M.train_steps(steps, overlap=overlap)


# --------------------------------------------------------------------------- helpers


def run_and_compare(
    *,
    world_size: int,
    num_microbatches: int,
    tp: int = 1,
    pp: int = 1,
    vp: int | None = None,
    reduces: bool = False,
    tied: bool = False,
    **step_kwargs: Any,
) -> None:
    """``reduces``: tensor- or data-parallel reductions sum in another order than the reference
    (compare within :func:`~megatron_bfpp.testing.models.reduction_tolerance`); otherwise every
    sum runs in the reference's order and results must be bitwise equal."""
    batches = M.make_batches(num_microbatches, seed=7)
    rel = M.reduction_tolerance(M.tokens_per_step(batches)) if reduces else 0.0
    ((ref_losses, ref_grads),) = run_ranks(
        reference, world_size=1, args=(batches, tied), timeout=RANK_TIMEOUT
    )
    results = run_ranks(
        megatron_step,
        world_size=world_size,
        tp=tp,
        pp=pp,
        vp=vp,
        args=(batches, step_kwargs.get("sequence_parallel", False), step_kwargs.get("ddp"), tied),
        timeout=RANK_TIMEOUT,
    )
    # Losses live on the last pipeline stage; concatenated in data-parallel order they are the
    # reference's micro-batches (rank order within the last stage is tp-major, dp-minor).
    dp = world_size // (tp * pp)
    last_stage = results[world_size - tp * dp :]
    losses = [loss for offset in range(0, tp * dp, tp) for loss in last_stage[offset][0]]
    assert all(not r[0] for r in results[: world_size - tp * dp]), "losses off the last stage"
    if rel == 0.0:
        assert losses == ref_losses
    else:
        assert losses == pytest.approx(ref_losses, rel=rel)
    M.assert_tensors_close(M.merge_shards(r[1] for r in results), ref_grads, rel=rel)


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_pipeline_equals_reference_exactly(pp: int) -> None:
    run_and_compare(world_size=pp, pp=pp, num_microbatches=2 * pp)


@pytest.mark.parametrize("pp, num_microbatches", [(2, 4), (4, 8)])
def test_interleaved_pipeline_equals_reference_exactly(pp: int, num_microbatches: int) -> None:
    run_and_compare(world_size=pp, pp=pp, vp=2, num_microbatches=num_microbatches)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no-sp"])
def test_tensor_parallel_pipeline_equals_reference(sequence_parallel: bool) -> None:
    # DDP (dp = 1) supplies finalize_model_grads, which sums the sequence-parallel norm grads.
    run_and_compare(
        world_size=4,
        tp=2,
        pp=2,
        num_microbatches=4,
        reduces=True,
        sequence_parallel=sequence_parallel,
        ddp={},
    )


@pytest.mark.parametrize(
    "vp, overlap, tied",
    [(None, False, False), (None, True, True), (2, True, False)],
    ids=["pp2", "pp2-overlap-tied", "pp2-vp2-overlap"],
)
def test_data_parallel_ddp_equals_reference(vp: int | None, overlap: bool, tied: bool) -> None:
    run_and_compare(
        world_size=4,
        pp=2,
        vp=vp,
        num_microbatches=8,
        reduces=True,
        tied=tied,
        ddp={"overlap_grad_reduce": overlap},
    )


@pytest.mark.parametrize("vp", [None, 2])
def test_distributed_optimizer_adam_losses_match_reference_step_for_step(vp: int | None) -> None:
    steps = [M.make_batches(4, seed=seed) for seed in range(3)]
    (reference_losses,) = run_ranks(train, world_size=1, args=(steps, False), timeout=RANK_TIMEOUT)
    results = run_ranks(train, world_size=4, pp=2, vp=vp, args=(steps, True), timeout=RANK_TIMEOUT)
    # Ranks 2 and 3 are the last stage, data-parallel ranks 0 and 1.
    for step, want in enumerate(reference_losses):
        assert results[2][step] + results[3][step] == pytest.approx(want, rel=1e-5), step


def test_merge_catches_a_missing_reduction() -> None:
    # Sequence parallel without finalize_model_grads leaves each TP rank its own partial
    # layer-norm gradient: the replicas disagree, and merge_shards says so.
    batches = M.make_batches(2, seed=7)
    results = run_ranks(
        megatron_step, world_size=2, tp=2, args=(batches, True), timeout=RANK_TIMEOUT
    )
    with pytest.raises(AssertionError, match=r"replicas of .*norm.* differ"):
        M.merge_shards(r[1] for r in results)


# --------------------------------------------------------------------------- harness behaviour


def _raise_on_rank_1() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # the other ranks would wait here forever


def test_failing_rank_raises_quickly_with_its_traceback() -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_raise_on_rank_1, world_size=3, timeout=60)
    error = info.value
    assert "timed out" not in str(error)  # the others were stopped, not waited for
    assert "ValueError: boom on rank 1" in error.reports[1]
    assert "_raise_on_rank_1" in error.reports[1]
    assert error.first_failed == 1
    assert str(error).startswith("rank 1 failed first")
    assert not multiprocessing.active_children()


def _hang_on_rank_0() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        while True:
            time.sleep(0.1)
    dist.barrier()


def test_hanging_rank_is_killed_at_the_timeout_with_every_stack() -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_hang_on_rank_0, world_size=2, timeout=5)
    error = info.value
    assert "timed out after 5 s" in str(error)
    assert "_hang_on_rank_0" in error.reports[0]  # where rank 0 was stuck
    assert "still running" in error.reports[1]
    assert not multiprocessing.active_children()


def test_rank_that_dies_is_reported() -> None:
    def die() -> None:
        os._exit(3)

    with pytest.raises(RanksFailed, match="exit code 3"):
        run_ranks(die, world_size=2, timeout=30)


def test_results_come_back_by_global_rank_with_the_parallel_state() -> None:
    def where() -> tuple[int, int, int, int | None]:
        from megatron.core import parallel_state as ps

        return (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_data_parallel_rank(),
            ps.get_virtual_pipeline_model_parallel_world_size(),
        )

    assert run_ranks(where, world_size=4, tp=2, pp=2, vp=2) == [
        (0, 0, 0, 2),
        (1, 0, 0, 2),
        (0, 1, 0, 2),
        (1, 1, 0, 2),
    ]


# --------------------------------------------------------------------------- the CPU adapter


def _rng_streams() -> tuple[Any, bool, Any]:
    import torch
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(3)
    restored = torch.equal(before, torch.get_rng_state())
    return inside, restored, torch.rand(3)


def test_rng_tracker_forks_the_cpu_generator() -> None:
    import torch

    seed = 1234
    results = run_ranks(_rng_streams, world_size=2, tp=2, seed=seed, timeout=RANK_TIMEOUT)
    for tp_rank, (inside, restored, _) in enumerate(results):
        # The model-parallel stream is seeded seed + 2718 + tp_rank, as on GPU.
        want = torch.rand(3, generator=torch.Generator().manual_seed(seed + 2718 + tp_rank))
        assert torch.equal(inside, want)
        assert restored
    # The default (data-parallel) stream is the same on every TP rank.
    assert torch.equal(results[0][2], results[1][2])
    assert torch.equal(results[0][2], torch.rand(3, generator=torch.Generator().manual_seed(seed)))


def test_cpu_adapter_is_idempotent_and_restores_everything() -> None:
    import megatron.core.tensor_parallel.random as mrandom
    import torch
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def snapshot() -> dict[str, Any]:
        return {
            "current_device": torch.cuda.current_device,
            "synchronize": torch.cuda.synchronize,
            "zeros": torch.zeros,
            "tensor": torch.tensor,
            "Tensor.cuda": vars(torch.Tensor).get("cuda"),
            "Tensor.type": vars(torch.Tensor).get("type"),
            "Module.cuda": vars(torch.nn.Module).get("cuda"),
            "get_state": mrandom._get_cuda_rng_state,
            "set_state": mrandom._set_cuda_rng_state,
            "add": vars(mrandom.CudaRNGStatesTracker)["add"],
            "seed": mrandom.model_parallel_cuda_manual_seed,
            "norm": vars(WrappedTorchNorm)["__new__"],
            "all_to_all_single": torch.distributed.all_to_all_single,
            "record_stream": vars(torch.Tensor).get("record_stream"),
            "range_push": torch.cuda.nvtx.range_push,
            "range_pop": torch.cuda.nvtx.range_pop,
        }

    assert not cpu.is_cpu_megatron_enabled()
    before = snapshot()
    try:
        cpu.enable_cpu_megatron()
        patched = snapshot()
        cpu.enable_cpu_megatron()  # idempotent: nothing wrapped twice
        assert snapshot() == patched
        assert all(patched[k] is not before[k] for k in before)
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1).cuda().type() == "torch.cuda.FloatTensor"
        # megatron-core's combined 1F1B: its comm stream's tensors and its NVTX ranges
        torch.ones(1).record_stream(torch.cuda.Stream())
        torch.cuda.nvtx.range_push("forward")
        torch.cuda.nvtx.range_pop()
    finally:
        cpu.disable_cpu_megatron()
    assert not cpu.is_cpu_megatron_enabled()
    assert snapshot() == before
    assert torch.ones(1).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


def _uneven_all_to_all() -> list[float]:
    """megatron-core's MoE dispatcher's call: split sizes as tensors (host arrays on a GPU)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    sent = torch.arange(3, dtype=torch.float32) + 10 * rank  # 1 value to rank 0, 2 to rank 1
    received = torch.empty(2 * (1 + rank))
    sizes = torch.tensor([1 + rank, 1 + rank])
    dist.all_to_all_single(received, sent, sizes, input_split_sizes=torch.tensor([1, 2]))
    return received.tolist()


def test_all_to_all_takes_megatrons_tensor_split_sizes_on_gloo() -> None:
    assert run_ranks(_uneven_all_to_all, world_size=2) == [[0.0, 10.0], [1.0, 2.0, 11.0, 12.0]]
