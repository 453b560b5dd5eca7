"""BPipe on real megatron-core GPT stages over gloo ranks: the same numbers as 1F1B, and measured
(not computed) activation memory capped at ceil((p+2)/2) micro-batches on every rank."""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.passes.eviction import bpipe_max_stored
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import RanksFailed, run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(240)]

Memory = tuple[int, int]  # (peak bytes, peak stored micro-batches) of one rank


def _config(**overrides: Any) -> Any:
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return M.tiny_gpt_config(num_layers=2 * pp, **overrides)


def train(
    batches: list[M.Batch],
    schedule: str,
    options: dict[str, Any],
    config: dict[str, Any],
    steps: int = 2,
    forward_step: Any = None,
) -> tuple[list[list[float]], dict[str, M.GradShard], list[Memory]]:
    """``steps`` forward-backward calls (fresh gradients each); losses of every step, last
    gradients and each step's measured memory on this rank."""
    from megatron_bfpp import get_forward_backward_func

    chunks = M.build_model_chunks(_config(**config))
    func = get_forward_backward_func(schedule, measure_memory=True, **options)
    losses, memory = [], []
    for _ in range(steps):
        for chunk in chunks:
            chunk.zero_grad()
        iterators = iter(batches)
        store = func(
            forward_step_func=forward_step or M.forward_step_func,
            data_iterator=iterators,
            model=chunks,
            num_microbatches=len(batches),
            seq_length=M.SEQ_LENGTH,
            micro_batch_size=M.MICRO_BATCH_SIZE,
        )
        losses.append(M.losses_from_store(store))
        report = func.last_memory
        memory.append((report.peak_activation_bytes, report.peak_stored_microbatches))
    return losses, M.grad_shards(chunks), memory


def _run(
    pp: int, m: int, schedule: str, options: dict[str, Any], tp: int = 1, **config: Any
) -> list[Any]:
    batches = M.make_batches(m, seed=pp)
    return run_ranks(
        train, world_size=tp * pp, tp=tp, pp=pp, args=(batches, schedule, options, config)
    )


def _assert_same(got: list[Any], want: list[Any]) -> None:
    """Bitwise equal losses (every step) and gradients, rank by rank (with sequence
    parallelism a replicated weight's gradient is partial per tensor-parallel rank until
    finalize_model_grads, which this comparison does not need)."""
    assert [r[0] for r in got] == [r[0] for r in want]
    for mine, theirs in zip(got, want, strict=True):
        M.assert_tensors_close(
            {name: shard.tensor for name, shard in mine[1].items()},
            {name: shard.tensor for name, shard in theirs[1].items()},
        )


# --------------------------------------------------------------------------- equality


@pytest.mark.parametrize(
    "pp, m, options",
    [
        (2, 4, {}),  # BPipe's cap is 1F1B's own at p=2: nothing to evict, same code path
        (3, 6, {"max_stored": 2}),  # odd p; rank 0 parks on rank 2
        (4, 8, {}),  # rank 0 parks on rank 3
        (4, 8, {"max_stored": 2}),  # the middle pair are neighbours: FIFO with act/grad
        (5, 10, {}),  # odd p at BPipe's own cap
    ],
    ids=["pp2", "pp3-cap2", "pp4", "pp4-cap2", "pp5"],
)
def test_bpipe_equals_1f1b_exactly(pp: int, m: int, options: dict[str, Any]) -> None:
    one_f_one_b = _run(pp, m, "1f1b", {})
    bpipe = _run(pp, m, "bpipe", options)
    _assert_same(bpipe, one_f_one_b)


def recording_groups(
    batches: list[M.Batch],
) -> tuple[list[tuple[bool, list[str]]], list[int], list[int]]:
    """BPipe's training step with every batch's messages and group recorded: (side, kinds) per
    batch posted, the global ranks of the group the side batches went on, and the pipeline's."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_bfpp.runtime import p2p

    original = p2p.PipeComm.post
    posted: list[tuple[bool, list[str]]] = []
    side_ranks: list[int] = []

    def post(self: Any, sends: Any, receives: Any, *, side: bool = False) -> None:
        whats = [str(send.message.what) for send in sends]
        # an eviction's size header is received under the eviction's own message
        whats += ["evict_size" if r.header is not None else str(r.message.what) for r in receives]
        posted.append((side, whats))
        if side and not side_ranks:
            side_ranks.extend(dist.get_process_group_ranks(self.side_group))
        original(self, sends, receives, side=side)

    p2p.PipeComm.post = post  # type: ignore[method-assign]
    train(batches, "bpipe", {"max_stored": 2}, {}, 1)
    pipeline = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    return posted, side_ranks, pipeline


@pytest.mark.parametrize("dp", [1, 2])
def test_payloads_travel_on_the_partners_own_group(dp: int) -> None:
    """Evicted and restored activations go on a process group of the two partners alone (on
    NCCL a stream of their own, so a payload's transfer does not hold the pipeline's tick
    batches); the tick batches carry the size header and the pipeline's messages. With two
    pipelines every rank of the job makes every pair's group, in one order."""
    pp = 4
    results = run_ranks(
        recording_groups, world_size=pp * dp, pp=pp, args=(M.make_batches(8, seed=5),)
    )
    for rank, (posted, side_ranks, pipeline) in enumerate(results):
        payloads = {"evict", "restore"}
        sides = [whats for side, whats in posted if side]
        assert sides, f"rank {rank} posted no payload batch"
        assert all(set(whats) <= payloads for whats in sides), sides
        assert not any(set(whats) & payloads for side, whats in posted if not side)
        x = pipeline.index(rank)
        assert sorted(side_ranks) == sorted({pipeline[x], pipeline[pp - 1 - x]})


# --------------------------------------------------------------------------- measured memory


@pytest.mark.parametrize("pp", [4, 6])
def test_measured_peak_memory_is_capped(pp: int) -> None:
    m = 2 * pp
    cap = bpipe_max_stored(pp)
    # One micro-batch's bytes on each rank, measured alone (m=1: nothing else is stored).
    unit = [r[2][-1][0] for r in _run(pp, 1, "1f1b", {})]
    one_f_one_b = [r[2][-1] for r in _run(pp, m, "1f1b", {})]
    bpipe = [r[2][-1] for r in _run(pp, m, "bpipe", {})]
    metadata = 64 * pp  # alignment padding of the payload buffers, per micro-batch
    # 1F1B: rank r stores min(p - r, m) micro-batches; rank 0 stores p.
    for rank, (nbytes, stored) in enumerate(one_f_one_b):
        assert stored == pp - rank
        assert nbytes == pytest.approx((pp - rank) * unit[rank], abs=metadata)
    # BPipe: every rank at most ceil((p+2)/2) micro-batches, counted and in bytes (an acceptor
    # holds its partner's micro-batches, which may be larger than its own).
    for rank, (nbytes, stored) in enumerate(bpipe):
        partner = pp - 1 - rank
        assert stored <= cap, (rank, stored, cap)
        assert nbytes <= cap * max(unit[rank], unit[partner]) + metadata * cap, (rank, nbytes)
    assert max(b for b, _ in bpipe) < max(b for b, _ in one_f_one_b)
    assert bpipe[0][0] <= (cap / pp) * one_f_one_b[0][0] + metadata * cap

    def spread(peaks: list[Memory]) -> float:
        return max(b for b, _ in peaks) / min(b for b, _ in peaks)

    assert spread(bpipe) < spread(one_f_one_b)


def test_first_step_agrees_payload_size_and_later_steps_reuse_it() -> None:
    """Every eviction sends its size, then its payload in the same tick, so every step holds
    the same: the cap holds in every step, and results stay exact."""
    pp, m = 4, 8
    bpipe = run_ranks(
        train,
        world_size=pp,
        pp=pp,
        args=(M.make_batches(m, seed=9), "bpipe", {}, {}, 3),
    )
    cap = bpipe_max_stored(pp)
    for _, _, memory in bpipe:
        assert all(stored <= cap for _, stored in memory)
        assert len({nbytes for nbytes, _ in memory}) == 1  # every step measures the same
    losses = bpipe[-1][0]
    assert losses[0] == losses[1] == losses[2]  # no optimizer step: same loss every step


# --------------------------------------------------------------------------- composition


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_composes_with_activation_recomputation(granularity: str) -> None:
    config: dict[str, Any] = {"recompute_granularity": granularity}
    if granularity == "full":
        config.update(recompute_method="uniform", recompute_num_layers=1)
    pp, m = 4, 8
    one_f_one_b = _run(pp, m, "1f1b", {}, **config)
    bpipe = _run(pp, m, "bpipe", {}, **config)
    _assert_same(bpipe, one_f_one_b)
    cap = bpipe_max_stored(pp)
    assert all(r[2][-1][1] <= cap for r in bpipe)
    if granularity == "full":
        plain = _run(pp, m, "bpipe", {})
        # Full recomputation keeps only each layer's input: far fewer bytes are stored.
        assert bpipe[0][2][-1][0] < plain[0][2][-1][0] / 2


def test_composes_with_tensor_and_sequence_parallel() -> None:
    pp, tp, m = 4, 2, 8
    one_f_one_b = _run(pp, m, "1f1b", {}, tp=tp, sequence_parallel=True)
    bpipe = _run(pp, m, "bpipe", {}, tp=tp, sequence_parallel=True)
    _assert_same(bpipe, one_f_one_b)
    assert all(r[2][-1][1] <= bpipe_max_stored(pp) for r in bpipe)


def offloading_forward_step(data_iterator: Any, model: Any) -> Any:
    """A forward under an inner saved-tensor hook that takes every tensor itself, as
    Transformer Engine's CPU offload does: the inner hook must win for what it saves."""
    import torch

    kept: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> int:
        kept.append(tensor.clone())
        return len(kept) - 1

    def unpack(index: int) -> torch.Tensor:
        return kept[index]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return M.forward_step_func(data_iterator, model)


def test_inner_saved_tensor_hooks_take_precedence() -> None:
    pp, m = 4, 8
    one_f_one_b = _run(pp, m, "1f1b", {})
    batches = M.make_batches(m, seed=pp)
    offloaded = run_ranks(
        train,
        world_size=pp,
        pp=pp,
        args=(batches, "bpipe", {}, {}, 2, offloading_forward_step),
    )
    _assert_same(offloaded, one_f_one_b)
    # Our store saw only what the inner hook did not take: the stage inputs and outputs.
    assert offloaded[1][2][-1][0] < one_f_one_b[1][2][-1][0] / 4


# --------------------------------------------------------------------------- failure


def dying_evictor(batches: list[M.Batch]) -> Any:
    """Rank 0 sends its first eviction's size header, then dies before the payload."""
    import torch.distributed as dist

    from megatron_bfpp.runtime import p2p

    original = p2p.PipeComm.post

    def post(self: Any, sends: Any, receives: Any, *, side: bool = False) -> None:
        # The payload goes in a batch of its own on the pair's group, right after the size's.
        if any(send.message.what == "evict" for send in sends):
            for work in [pending.work for pending in self.sends]:
                work.wait()
            os._exit(17)
        original(self, sends, receives, side=side)

    if dist.get_rank() == 0:
        p2p.PipeComm.post = post  # type: ignore[method-assign]
    return train(batches, "bpipe", {}, {}, 1)


def test_partner_dying_mid_transfer_fails_clearly_without_hanging() -> None:
    pp, m = 4, 8
    with pytest.raises(RanksFailed) as failure:
        run_ranks(
            dying_evictor,
            world_size=pp,
            pp=pp,
            args=(M.make_batches(m, seed=3),),
            timeout=90,
            error_grace=60,
        )
    reports = failure.value.reports
    assert "exit code 17" in reports[0]
    # Rank 1 waits on rank 0 directly; the others on a neighbour that failed in turn (the
    # acceptor, whose payload never came, also loses its neighbour, which it notices first).
    # (Under NCCL's rules a failed batch fails the ones queued behind it on the stream, so the
    # error may come from a later receive; the first failure, from rank 0, is quoted in it.)
    assert "rank 0" in reports[1].lower(), reports[1]
    for rank in range(1, pp):  # every survivor fails by itself, none is killed as hung
        assert "still running when killed" not in reports[rank], reports[rank]
        assert "has probably failed or been killed" in reports[rank], reports[rank]
