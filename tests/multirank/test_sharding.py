"""Sharded parameters (``optim_grads_params``) on real megatron-core GPT chunks over gloo ranks:
the same losses, gradients and trained parameters as the distributed optimizer without sharding,
the collectives the schedule names and no others, and measured resident parameter bytes that
stay within the shard plus two chunks."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]


def _counting(counts: Counter[str]) -> None:
    """Count the data-parallel collectives this process issues (gathers and reduce-scatters)."""
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buffers

    gather, scatter = dist.all_gather_into_tensor, buffers.dist_reduce_scatter_func

    def counted_gather(*args: Any, **kwargs: Any) -> Any:
        counts["all_gather"] += 1
        return gather(*args, **kwargs)

    def counted_scatter(*args: Any, **kwargs: Any) -> Any:
        counts["reduce_scatter"] += 1
        return scatter(*args, **kwargs)

    dist.all_gather_into_tensor = counted_gather
    buffers.dist_all_gather_func = counted_gather
    buffers.dist_reduce_scatter_func = counted_scatter


def train(
    steps: list[list[M.Batch]],
    schedule: str,
    sharding: str,
    sequence_parallel: bool = False,
    num_layers: int = 8,
    tied: bool = False,
    overlap: bool = False,
    profile_step: int = -1,
    per_token: bool = False,
    group: int | None = None,
) -> dict[str, Any]:
    """Adam steps with DDP and the distributed optimizer, sharded or not; what to compare."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.runtime import sharded_optimizer_step
    from megatron_bfpp.runtime.sharding import sharded_parameters

    counts: Counter[str] = Counter()
    _counting(counts)
    chunks = M.wrap_ddp(
        M.build_model_chunks(
            M.tiny_gpt_config(
                sequence_parallel=sequence_parallel,
                num_layers=num_layers,
                calculate_per_token_loss=per_token,
            ),
            share_embeddings_and_output_weights=tied,
        ),
        use_distributed_optimizer=True,
        overlap_grad_reduce=overlap,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.01,
            clip_grad=1.0,
            use_distributed_optimizer=True,
        ),
        chunks,
    )
    options = {} if group is None else {"group_size": group}
    func = get_forward_backward_func(
        schedule, measure_memory=True, data_parallel_sharding_strategy=sharding, **options
    )
    losses, step_counts, peaks, grad_peaks, norms = [], [], [], [], []
    grads: list[torch.Tensor] = []
    profiled: list[int] = []
    for index, batches in enumerate(steps):
        window = _allocation_window(profiled) if index == profile_step else contextlib.nullcontext()
        with window:
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            counts.clear()
            store = M.run_schedule(
                chunks, M.data_parallel_share(batches), forward_backward_func=func
            )
            if sharding == "optim":
                ok, norm, _ = optimizer.step()
            else:
                ok, norm, _ = sharded_optimizer_step(optimizer, chunks)
        step_counts.append(dict(counts))
        peaks.append(func.last_memory.peak_parameter_bytes)
        if index == 0:
            grads = _reduced_grad_shards(chunks, sharding)
        if sharding != "optim":
            grad_peaks.append(sharded_parameters(chunks).peak_grad_bytes)
            peaks[-1] = sharded_parameters(chunks).peak_bytes  # the step's, optimizer included
        if not ok:
            raise RuntimeError("optimizer step skipped (inf/nan gradients)")
        losses.append(M.losses_from_store(store))
        norms.append(float(norm))
    result: dict[str, Any] = {
        "losses": losses,
        "grads": grads,
        "counts": step_counts,
        "norms": norms,
        "grad_peaks": grad_peaks,
        "allocated_peak": profiled[0] if profiled else None,
    }
    if sharding != "optim":
        sharded = sharded_parameters(chunks)
        result["chunk_bytes"] = [sum(state.full_nbytes) for state in sharded.chunks]
        result["grad_chunk_bytes"] = [sum(state.grad_nbytes) for state in sharded.chunks]
        result["peaks"] = peaks
        with sharded.whole():
            result["params"] = [p.detach().clone() for c in chunks for p in c.parameters()]
        result["trace"] = list(func.last_trace)
        result["buckets"] = {  # buckets per global stage of this rank
            int(a[:-2]): len(sharded.chunks[local_chunk(a)].buckets)
            for a in func.last_trace
            if a.endswith("PS")
        }
    else:
        from megatron_bfpp.compat import sharded_param_buckets

        result["params"] = [p.detach().clone() for c in chunks for p in c.parameters()]
        storages = {
            full.untyped_storage().data_ptr(): full.untyped_storage().nbytes()
            for c in chunks
            for full, *_ in sharded_param_buckets(c)
        }
        result["resident_bytes"] = sum(storages.values())  # unsharded: always all of them
        result["resident_grad_bytes"] = sum(
            {
                found.grad_data.untyped_storage().data_ptr(): (
                    found.grad_data.untyped_storage().nbytes()
                )
                for c in chunks
                for found in sharded_param_buckets(c)
            }.values()
        )
    return result


@contextlib.contextmanager
def _allocation_window(out: list[int]) -> Iterator[None]:
    """The high-water mark of CPU bytes allocated (net of frees) inside the window, from
    torch.profiler's memory events: the allocator's own record, independent of the runtime's
    byte accounting. Buffers allocated before the window count only when freed and
    re-allocated inside it, which is what sharding does."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield
    events = sorted(
        (e for e in prof.events() if e.name == "[memory]"), key=lambda e: e.time_range.start
    )
    live = peak = 0
    for event in events:
        live += event.cpu_memory_usage
        peak = max(peak, live)
    out.append(peak)


def _reduced_grad_shards(chunks: list[Any], sharding: str) -> list[Any]:
    """This rank's reduced part of every gradient bucket: the kept shards when fully sharded
    (the full buffers are freed), the distributed optimizer's local range of the buffer when
    not."""
    from megatron_bfpp.compat import sharded_param_buckets
    from megatron_bfpp.runtime.sharding import sharded_parameters

    if sharding != "optim":
        sharded = sharded_parameters(chunks)
        return [b.grad_shard.clone() for state in sharded.chunks for b in state.buckets]
    shards = []
    for chunk in chunks:
        for found in sharded_param_buckets(chunk):
            numel = found.grad_data.numel() // found.size
            shards.append(found.grad_data.view(-1)[found.rank * numel :][:numel].clone())
    return shards


def local_chunk(action: str) -> int:
    """The local chunk of a global stage on a looped layout (stage // pipeline size)."""
    from megatron.core import parallel_state

    return int(action[:-2]) // parallel_state.get_pipeline_model_parallel_world_size()


def _steps() -> list[list[M.Batch]]:
    return [M.make_batches(8, seed=40 + i) for i in range(3)]


@pytest.mark.parametrize(
    "tp, pp, vp, dp, tied, overlap, per_token",
    [
        (1, 2, 2, 2, False, False, False),
        (1, 2, 4, 2, False, False, False),
        (1, 2, 4, 2, True, True, False),
        (1, 2, 8, 4, False, True, False),
        (2, 2, 4, 2, False, False, False),
        (1, 2, 4, 2, True, False, True),
    ],
    ids=[
        "pp2vp2dp2",
        "pp2vp4dp2",
        "pp2vp4dp2-tied-overlap",
        "pp2vp8dp4-overlap",
        "tp2pp2vp4dp2-sp",
        "pp2vp4dp2-tied-per-token",
    ],
)
def test_sharded_training_equals_distributed_optimizer(
    tp: int, pp: int, vp: int, dp: int, tied: bool, overlap: bool, per_token: bool
) -> None:
    """Adam with weight decay and global-norm clipping, 3 steps: losses, grad norms, the
    reduced gradient shards and the trained parameters of the fully sharded run equal the
    unsharded distributed optimizer's (sequence parallelism with tp=2: the layer norms'
    tensor-parallel all-reduce runs on shards; tied: the embedding all-reduce over the
    pipeline ends; overlap: reductions dispatched by DDP's hooks, landed at the next GS;
    per-token: the gradients scaled by the token count, on the shards)."""
    import torch

    world = tp * pp * dp
    sp = tp > 1
    common = dict(world_size=world, tp=tp, pp=pp, vp=vp)
    layers = 2 * vp
    schedule = "breadth-first"
    plain = run_ranks(
        train,
        **common,
        args=(_steps(), schedule, "optim", sp, layers, tied, overlap, -1, per_token),
    )
    sharded = run_ranks(
        train,
        **common,
        args=(_steps(), schedule, "optim_grads_params", sp, layers, tied, overlap, -1, per_token),
    )
    for rank, (want, got) in enumerate(zip(plain, sharded, strict=True)):
        flat_got = [loss for step in got["losses"] for loss in step]
        flat_want = [loss for step in want["losses"] for loss in step]
        assert flat_got == pytest.approx(flat_want, rel=1e-6), f"rank {rank}"
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-6), f"rank {rank}"
        for g, w in zip(got["grads"], want["grads"], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=0.0)
        for g, w in zip(got["params"], want["params"], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=0.0)
        # The collectives are exactly the schedule's: one all-gather per bucket per PS and no
        # gather from the optimizer step; one reduce-scatter per bucket, as without sharding.
        gathers = [int(action[:-2]) for action in got["trace"] if action.endswith("PS")]
        expected = sum(got["buckets"][stage] for stage in gathers)
        for counts, plain_counts in zip(got["counts"], want["counts"], strict=True):
            assert counts.get("reduce_scatter") == plain_counts.get("reduce_scatter")
            assert counts.get("all_gather", 0) == expected, f"rank {rank}"
        assert len(gathers) <= 2 * vp


def _bf_counts(pp: int, vp: int) -> tuple[int, int, int]:
    from megatron_bfpp.schedules.registry import build_schedule

    schedule = build_schedule(
        "breadth-first",
        num_ranks=pp,
        num_microbatches=8 // 2,
        num_chunks=vp,
        sharding="optim_grads_params",
    )
    program = [str(a) for a in schedule.per_rank[0]]
    return (
        sum(a.endswith("PS") for a in program),
        sum(a.endswith("GS") for a in program),
        sum(a.endswith("RL") for a in program),
    )


def test_breadth_first_gathers_each_chunk_at_most_twice_and_reduces_once() -> None:
    """The issue's count, from the runtime's trace on pipeline rank 0, data-parallel rank 0:
    at most 2 all-gathers and exactly 1 reduce-scatter per chunk per step (the chunk whose
    backwards follow its forwards, and the one before it with two chunks resident, need one)."""
    pp, vp = 2, 4
    results = run_ranks(
        train,
        world_size=4,
        pp=pp,
        vp=vp,
        args=(_steps()[:1], "breadth-first", "optim_grads_params"),
    )
    trace = results[0]["trace"]
    per_chunk = Counter((int(a[:-2]), a[-2:]) for a in trace if a[-2:] in ("PS", "GS", "RL"))
    stages = sorted({stage for stage, _ in per_chunk})
    assert len(stages) == vp
    for stage in stages:
        assert 1 <= per_chunk[(stage, "PS")] <= 2
        assert per_chunk[(stage, "GS")] == 1
        assert per_chunk[(stage, "RL")] == per_chunk[(stage, "PS")]
    assert sum(per_chunk[(s, "PS")] for s in stages) == 2 * vp - 2
    assert _bf_counts(pp, vp) == (2 * vp - 2, vp, 2 * vp - 2)


@pytest.mark.parametrize("dp", [2, 4])
def test_resident_parameter_and_gradient_bytes_stay_within_shard_plus_two_chunks(dp: int) -> None:
    """Over a whole iteration (zeroing, forward-backward, finalize, optimizer step) on every
    rank, with 16 layers over pp=2, vp=8 so the layers outweigh the embedding.

    Two accountings: the runtime's (allocated storage of the parameter and gradient buffers
    plus the kept shards), and torch.profiler's memory events (the allocator's record of what
    the iteration allocated net of frees: the unsharded run re-allocates no buffer, so the
    sharded run's excess over it is the full chunks it gathers and accumulates at once)."""
    pp, vp = 2, 8
    args = (_steps()[:2], "breadth-first")
    extra = (False, 16, False, False, 1)
    sharded = run_ranks(
        train, world_size=pp * dp, pp=pp, vp=vp, args=(*args, "optim_grads_params", *extra)
    )
    plain = run_ranks(train, world_size=pp * dp, pp=pp, vp=vp, args=(*args, "optim", *extra))
    for rank, (result, unsharded) in enumerate(zip(sharded, plain, strict=True)):
        chunks, grad_chunks = result["chunk_bytes"], result["grad_chunk_bytes"]
        full, full_grads = sum(chunks), sum(grad_chunks)
        assert full == unsharded["resident_bytes"]
        assert full_grads == unsharded["resident_grad_bytes"]
        two, two_grads = sum(sorted(chunks)[-2:]), sum(sorted(grad_chunks)[-2:])
        for peak in result["peaks"]:
            assert peak <= full / dp + two, f"rank {rank}: {peak} of {full}"
            assert peak <= 0.8 * full, f"rank {rank}: peak {peak} not well below unsharded {full}"
        for peak in result["grad_peaks"]:
            assert peak <= full_grads / dp + two_grads, f"rank {rank}: {peak} of {full_grads}"
            assert peak <= 0.8 * full_grads, f"rank {rank}: grads {peak} of {full_grads}"
        # The allocator's view: what the iteration allocated beyond the unsharded run's is at
        # most two chunks' full parameters and gradients (1% slack for the allocator's own
        # rounding of small temporaries).
        excess = result["allocated_peak"] - unsharded["allocated_peak"]
        assert excess <= 1.01 * (two + two_grads), (rank, excess, two + two_grads)
        # ... and at least one gathered chunk: the measurement sees the gathers.
        assert excess >= min(chunks), (rank, excess)


def train_groups(
    steps: list[list[M.Batch]], groups: list[int], sharding: str, num_layers: int, overlap: bool
) -> list[dict[str, Any]]:
    """``train`` once per group size, each from the same initial model."""
    return [
        train(steps, "breadth-first", sharding, False, num_layers, False, overlap, group=group)
        for group in groups
    ]


@pytest.mark.parametrize(
    ("vp", "dp", "overlap"), [(4, 2, False), (8, 4, True)], ids=["vp4dp2", "vp8dp4-overlap"]
)
def test_grouped_sharded_training_reduces_per_group_and_holds_no_more_than_unsharded(
    vp: int, dp: int, overlap: bool
) -> None:
    """Breadth-first with groups of 1, 2 and m micro-batches, fully sharded, 3 Adam steps
    against the unsharded distributed optimizer (whose results do not depend on the group
    size: each chunk accumulates its micro-batches in the same order). One group: bit for bit.
    Several: each group's gradients are reduce-scattered and added into the kept shard, so the
    sum runs in another order (group by group over the ranks instead of rank by rank over the
    micro-batches): equal within fp32 rounding (measured: losses and norms within 1.2e-7
    relative, asserted to 1e-5; reduced gradients to rel 1e-5 + 1e-7; trained parameters within
    1.7e-4 absolute, asserted to 1e-3, see below). Measured peak gradient and parameter bytes
    are at most the shard plus the two largest chunks for every group size, which is no more
    than the unsharded run's wherever that bound is."""
    import torch

    pp, batches = 2, [M.make_batches(16, seed=50 + i) for i in range(3)]
    m = 16 // dp
    groups = [1, 2, m]
    common = dict(world_size=pp * dp, pp=pp, vp=vp)
    layers = 2 * vp
    plain = [
        ranks[0]
        for ranks in run_ranks(
            train_groups, **common, args=(batches, [m], "optim", layers, overlap)
        )
    ]
    per_rank = run_ranks(
        train_groups, **common, args=(batches, groups, "optim_grads_params", layers, overlap)
    )
    runs = [[ranks[index] for ranks in per_rank] for index in range(len(groups))]
    for group, sharded in zip(groups, runs, strict=True):
        exact = group == m
        for rank, (want, got) in enumerate(zip(plain, sharded, strict=True)):
            where = f"group {group}, rank {rank}"
            flat_got = [loss for step in got["losses"] for loss in step]
            flat_want = [loss for step in want["losses"] for loss in step]
            if exact:
                assert flat_got == flat_want, where
                assert got["norms"] == want["norms"], where
            else:
                assert flat_got == pytest.approx(flat_want, rel=1e-5), where
                assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), where
            tolerance = dict(rtol=0.0, atol=0.0) if exact else dict(rtol=1e-5, atol=1e-7)
            for g, w in zip(got["grads"], want["grads"], strict=True):
                torch.testing.assert_close(g, w, **tolerance)
            # Adam divides each element's step by its own gradient's magnitude: an element
            # whose gradient is rounding noise moves by up to lr (1e-2) whichever way the
            # noise points, so parameters are compared to a tenth of one step.
            tolerance = dict(rtol=0.0, atol=0.0) if exact else dict(rtol=0.0, atol=1e-3)
            for g, w in zip(got["params"], want["params"], strict=True):
                torch.testing.assert_close(g, w, **tolerance)
            # One reduce-scatter per bucket per group and chunk; gathers as the trace says.
            buckets = got["buckets"]
            reductions = sum(a.endswith("GS") for a in got["trace"])
            assert reductions == vp * -(-m // group), where
            gathers = [int(action[:-2]) for action in got["trace"] if action.endswith("PS")]
            for counts in got["counts"]:
                assert counts.get("all_gather", 0) == sum(buckets[s] for s in gathers), where
                assert counts.get("reduce_scatter", 0) == sum(
                    buckets[int(a[:-2])] for a in got["trace"] if a.endswith("GS")
                ), where
            full, full_grads = sum(got["chunk_bytes"]), sum(got["grad_chunk_bytes"])
            assert full == want["resident_bytes"] and full_grads == want["resident_grad_bytes"]
            # The shard plus the two largest chunks, for every group size; no more than the
            # unsharded run wherever that bound is (1/dp + 2/vp < 1 with even chunks: not at vp 4,
            # dp 2, where it is the unsharded run's bytes plus the embedding chunk's excess).
            two = sum(sorted(got["chunk_bytes"])[-2:])
            two_grads = sum(sorted(got["grad_chunk_bytes"])[-2:])
            for peak in got["peaks"]:
                assert peak <= full / dp + two, where
                assert peak <= full or full / dp + two > full, where
            for peak in got["grad_peaks"]:
                assert peak <= full_grads / dp + two_grads, where
                assert peak <= full_grads or full_grads / dp + two_grads > full_grads, where


def _vm_hwm() -> int:
    """The kernel's high-water mark of this process's resident memory (VmHWM), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def iterations_measured(sharding: str, hidden: int, steps: int) -> dict[str, Any]:
    """``steps`` whole iterations (zeroing, forward-backward, finalize, Adam step) of a GPT of
    16 layers; each iteration's peak resident memory by the kernel (VmHWM, reset before it
    through /proc/self/clear_refs), and the parameter and gradient bytes the runtime's
    accounting says the rank holds at its peaks (unsharded: its whole buffers)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.compat import sharded_param_buckets
    from megatron_bfpp.runtime import sharded_optimizer_step
    from megatron_bfpp.runtime.sharding import sharded_parameters

    vocab, seq = 1024, 64
    config = M.tiny_gpt_config(
        num_layers=16, hidden_size=hidden, num_attention_heads=8, ffn_hidden_size=4 * hidden
    )
    chunks = M.wrap_ddp(
        M.build_model_chunks(config, vocab_size=vocab, max_sequence_length=seq),
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=True), chunks
    )
    func = get_forward_backward_func("breadth-first", data_parallel_sharding_strategy=sharding)
    peaks, accounted = [], 0
    for step in range(steps):
        batches = M.make_batches(16, seq_len=seq, vocab=vocab, seed=step)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        M.run_schedule(
            chunks, M.data_parallel_share(batches), forward_backward_func=func, seq_length=seq
        )
        if sharding == "optim":
            optimizer.step()
        else:
            sharded_optimizer_step(optimizer, chunks)
        peaks.append(_vm_hwm())
        if sharding != "optim":
            sharded = sharded_parameters(chunks)
            accounted = max(accounted, sharded.peak_bytes + sharded.peak_grad_bytes)
    if sharding == "optim":
        storages = {
            tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
            for chunk in chunks
            for found in sharded_param_buckets(chunk)
            for tensor in (found.param_data, found.grad_data)
        }
        accounted = sum(storages.values())
    return {"peaks": peaks, "accounted": accounted}


@pytest.mark.timeout(1800)
@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs"
)
def test_each_ranks_process_peak_is_below_the_unsharded_runs_by_what_it_accounts() -> None:
    """The issue's measurement from outside the runtime: pp=2 vp=8 dp=4 (8 CPU ranks), 16
    layers of hidden 512, 10 iterations, each iteration's peak resident memory of every rank by
    the kernel (VmHWM). Fully sharded, every rank's peak is below the unsharded run's (same
    rank) by at least 3/4 of the parameter and gradient bytes the runtime's accounting says it
    saves (196 MiB whole against 101 MiB at the peaks; measured 204-245 MiB below, see
    docs/design-notes.md, "The process's own peak", and ``runtime.sharding.
    return_freed_buffers`` for why), and its peak grows from the third iteration to the tenth
    by at most half of that saving: a chunk buffer kept per iteration (12 MiB) would pass it by
    the tenth, the measured creep of both runs alike (up to 26 MiB sharded, 45 unsharded, the
    allocator's heap of small blocks) does not. The tolerance stands for what an outside
    measurement of a whole process adds: activations, Python objects and the allocator's heap
    move by a few MiB from run to run."""
    pp, vp, dp, steps, hidden = 2, 8, 4, 10, 512
    common = dict(world_size=pp * dp, pp=pp, vp=vp, timeout=1500)
    sharded = run_ranks(iterations_measured, **common, args=("optim_grads_params", hidden, steps))
    plain = run_ranks(iterations_measured, **common, args=("optim", hidden, steps))
    for rank, (got, want) in enumerate(zip(sharded, plain, strict=True)):
        saving = want["accounted"] - got["accounted"]
        assert saving > 0, rank
        below = want["peaks"][-1] - got["peaks"][-1]
        assert below >= 0.75 * saving, (rank, below >> 20, saving >> 20)
        growth = max(got["peaks"][3:]) - got["peaks"][2]
        assert growth <= saving / 2, (rank, growth >> 20, saving >> 20)


def bad(schedule: str, sharding: str, ddp: dict[str, Any]) -> str:
    from megatron_bfpp import get_forward_backward_func

    custom_finalize = ddp.pop("custom_finalize", False)
    try:
        chunks = M.wrap_ddp(M.build_model_chunks(M.tiny_gpt_config()), **ddp)
        if custom_finalize:
            chunks[0].config.finalize_model_grads_func = lambda *args, **kwargs: None
        func = get_forward_backward_func(schedule, data_parallel_sharding_strategy=sharding)
        M.run_schedule(chunks, M.data_parallel_share(M.make_batches(4)), forward_backward_func=func)
    except (ScheduleError, ValueError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return "no error"


@pytest.mark.parametrize(
    "world, vp, schedule, ddp, expected",
    [
        (4, 2, "breadth-first", {"use_distributed_optimizer": False}, "distributed optimizer"),
        (2, 2, "breadth-first", {"use_distributed_optimizer": True}, "nothing to shard"),
        (4, None, "1f1b", {"use_distributed_optimizer": True}, "needs breadth-first"),
        (4, 2, "interleaved", {"use_distributed_optimizer": True}, "needs breadth-first"),
        (
            4,
            2,
            "breadth-first",
            {"use_distributed_optimizer": True, "custom_finalize": True},
            "custom finalize_model_grads_func",
        ),
        (
            4,
            2,
            "breadth-first",
            {
                "use_distributed_optimizer": True,
                "overlap_param_gather": True,
                "overlap_grad_reduce": True,
            },
            "overlap-param-gather",
        ),
    ],
    ids=[
        "no-distopt",
        "dp1",
        "single-chunk",
        "interleaved",
        "custom-finalize",
        "overlap-param-gather",
    ],
)
def test_sharding_that_cannot_apply_fails_on_every_rank_with_one_line(
    world: int, vp: int | None, schedule: str, ddp: dict[str, Any], expected: str
) -> None:
    results = run_ranks(
        bad, world_size=world, pp=2, vp=vp, args=(schedule, "optim_grads_params", ddp)
    )
    assert len(set(results)) == 1, results
    assert expected in results[0], results[0]


def _model_and_optimizer(seed: int) -> tuple[list[Any], Any]:
    """Tiny GPT chunks (8 layers) in DDP with megatron-core's distributed optimizer (Adam)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks = M.wrap_ddp(
        M.build_model_chunks(M.tiny_gpt_config(num_layers=8), seed=seed),
        use_distributed_optimizer=True,
    )
    config = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True)
    return chunks, get_megatron_optimizer(config, chunks)


def _one_sharded_step(chunks: list[Any], optimizer: Any) -> Any:
    """One breadth-first fully sharded step; the chunks' ShardedParameters after it."""
    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.runtime import sharded_optimizer_step
    from megatron_bfpp.runtime.sharding import sharded_parameters

    func = get_forward_backward_func(
        "breadth-first", data_parallel_sharding_strategy="optim_grads_params"
    )
    M.run_schedule(chunks, M.data_parallel_share(M.make_batches(8)), forward_backward_func=func)
    sharded_optimizer_step(optimizer, chunks)
    return sharded_parameters(chunks)


def save_one_chunk_at_a_time(tmp: str) -> dict[str, Any]:
    """One fully sharded step, then bfpp-train's torch-format rank file written with the chunks
    gathered one at a time: the most chunks whole at once while saving, and whether the file
    holds exactly the parameters (gathered afterwards for comparison)."""
    import torch

    from megatron_bfpp.train import checkpoint

    chunks, optimizer = _model_and_optimizer(seed=0)
    sharded = _one_sharded_step(chunks, optimizer)
    most = 0
    gather = sharded.gather

    def counted(chunk: int, **kwargs: Any) -> None:
        nonlocal most
        gather(chunk, **kwargs)
        most = max(most, sum(state.resident for state in sharded.chunks))

    sharded.gather = counted  # type: ignore[method-assign]

    class Scheduler:  # the rank file's scheduler entry; its value does not matter here
        def state_dict(self) -> dict[str, Any]:
            return {}

    folder = Path(tmp) / str(torch.distributed.get_rank())
    folder.mkdir(parents=True)
    state = checkpoint._rank_state(Scheduler(), 1, 8)
    record = checkpoint._save_torch(folder, chunks, optimizer, state, lambda i: sharded.whole([i]))
    sharded.gather = gather  # type: ignore[method-assign]
    saved = checkpoint.read_rank_file(folder / record.name)["model"]
    released_after = not any(state.resident for state in sharded.chunks)
    with sharded.whole():
        equal = all(
            torch.equal(saved[index][key].to(value.device), value)
            for index, chunk in enumerate(chunks)
            for key, value in chunk.module.state_dict().items()
            if isinstance(value, torch.Tensor)
        )
    return {"most": most, "equal": equal, "released_after": released_after}


def test_a_torch_checkpoint_gathers_one_chunk_at_a_time(tmp_path: Any) -> None:
    results = run_ranks(save_one_chunk_at_a_time, world_size=4, pp=2, vp=4, args=(str(tmp_path),))
    for rank, result in enumerate(results):
        assert result == {"most": 1, "equal": True, "released_after": True}, rank


def save_torch_dist_without_gathering(tmp: str) -> dict[str, Any]:
    """One fully sharded step, then bfpp-train's torch_dist save: how many chunks it gathers,
    and whether an unsharded model and optimizer (built from another seed, so the load has
    something to change) loaded from it hold the sharded run's parameters and Adam state."""
    import torch

    from megatron_bfpp.train import checkpoint

    class Scheduler:  # the state's scheduler entry: saved and given back, its value unused
        def state_dict(self) -> dict[str, Any]:
            return {"num_steps": 1}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.loaded = state

    chunks, optimizer = _model_and_optimizer(seed=0)
    sharded = _one_sharded_step(chunks, optimizer)
    gathers = 0
    gather = sharded.gather

    def counted(chunk: int, **kwargs: Any) -> None:
        nonlocal gathers
        gathers += 1
        gather(chunk, **kwargs)

    sharded.gather = counted  # type: ignore[method-assign]
    folder = Path(tmp) / "iter_1"
    if torch.distributed.get_rank() == 0:
        folder.mkdir(parents=True)
    torch.distributed.barrier()
    state = checkpoint._rank_state(Scheduler(), 1, 8)
    checkpoint._save_torch_dist(folder, chunks, optimizer, state, parameters=False)
    sharded.gather = gather  # type: ignore[method-assign]

    loaded, loaded_optimizer = _model_and_optimizer(seed=1)
    scheduler = Scheduler()
    # None: the checkpoint's scheduler values stand (no --override-opt_param-scheduler)
    checkpoint._load_torch_dist(tmp, folder, loaded, loaded_optimizer, scheduler, None)

    def adam_state(opt: Any) -> list[torch.Tensor]:
        return [
            state[name]
            for inner in checkpoint._inner_optimizers(opt)
            for group in inner.param_groups
            for param in group["params"]
            for state in [inner.state[param]]
            for name in ("exp_avg", "exp_avg_sq")
        ]

    with sharded.whole():
        parameters = all(
            torch.equal(mine, theirs)
            for chunk, other in zip(chunks, loaded, strict=True)
            for mine, theirs in zip(
                chunk.module.parameters(), other.module.parameters(), strict=True
            )
        )
    adam = all(
        torch.equal(a, b)
        for a, b in zip(adam_state(optimizer), adam_state(loaded_optimizer), strict=True)
    )
    return {"gathers": gathers, "parameters": parameters, "adam": adam}


def test_a_torch_dist_checkpoint_gathers_no_chunk_and_loads_unsharded(tmp_path: Any) -> None:
    pytest.importorskip("psutil")  # megatron-core's torch_dist writer
    results = run_ranks(
        save_torch_dist_without_gathering,
        world_size=4,
        pp=2,
        vp=4,
        args=(str(tmp_path),),
        daemon=False,
    )
    for rank, result in enumerate(results):
        assert result == {"gathers": 0, "parameters": True, "adam": True}, rank
