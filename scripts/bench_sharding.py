#!/usr/bin/env python3
"""Fully sharded breadth-first vs the distributed optimizer, measured beside the simulator.

Compute is emulated as in ``bench_fidelity.py`` (each chunk's forward and backward sleep their
share of ``--t-forward`` / ``--t-backward`` per full stage), so timing does not depend on this
machine's cores. Everything else is real: megatron-core DDP chunks built for the distributed
optimizer (one flat parameter of ``--chunk-mb`` MB per chunk, so each chunk is one bucket),
our runtime and its gathers, releases and gradient shards (runtime.sharding), DDP's per-chunk
reduce-scatter (``overlap_grad_reduce``), megatron-core's finalize_model_grads, and gloo
collectives between forked ranks (pp x dp of them).

Time (default mode), over the schedule's step plus, for the unsharded cases, the distributed
optimizer's closing all-gather of every chunk (which fully sharded runs do not have):

- ``breadth-first`` with ``optim_grads_params``: each chunk gathered at most twice, its
  gradients reduce-scattered into a shard after its last backward;
- ``breadth-first`` and ``interleaved`` with ``optim``: parameters and gradients whole;
- ``interleaved`` with ``optim_grads_params`` is refused by the runtime (one line, printed).

The simulator gets the same schedule and the gather and reduce-scatter times measured here,
with every rank's group busy at once, as the run has them. Its compute costs are the sleeps plus
the runtime's own cost per compute action on this machine, calibrated once from the unsharded
interleaved case run with no sleep, so the predictions rest on one measured number.

Memory (``--memory``): no sleeps, Adam steps through megatron-core's distributed optimizer,
each rank's process RSS polled every millisecond from /proc over whole iterations (zeroing,
forward-backward, finalize, optimizer step); model-state bytes are the peak less the RSS
before the model was built. Defaults: pp=2 vp=8 dp=4, 56 M fp32 parameters per rank. Run it
with ``MALLOC_MMAP_THRESHOLD_=1048576``: glibc otherwise raises its mmap threshold after the
first freed buffer and keeps later freed chunk buffers in its heap, so RSS never drops (measured
2026-11-25 on this 2-core machine: 0.958 without, 0.708 with; the runtime's own peaks were 107
of 214 MiB of parameters and of gradients per rank either way). Fully sharded processes now fix
the threshold themselves (``runtime.sharding.return_freed_buffers``); the variable still puts
the unsharded baseline under the same allocator rule.

    python scripts/bench_sharding.py                      # pp=2 vp=4 dp=2 m=8, 8 MB per chunk
    MALLOC_MMAP_THRESHOLD_=1048576 python scripts/bench_sharding.py --memory --steps 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch

from megatron_bfpp.schedules import build_schedule
from megatron_bfpp.sim import CostModel, simulate
from megatron_bfpp.testing.multirank import run_ranks

HIDDEN, SEQ, MBS = 8, 4, 1


def ping_pong(rounds: int = 200) -> float:
    """One-way time of a pipeline message between ranks 0 and 1 (median, seconds)."""
    rank = torch.distributed.get_rank()
    buffer = torch.zeros(SEQ, MBS, HIDDEN)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == 0:
            torch.distributed.send(buffer, 1)
            torch.distributed.recv(buffer, 1)
        elif rank == 1:
            torch.distributed.recv(buffer, 0)
            torch.distributed.send(buffer, 0)
        samples.append((time.perf_counter() - start) / 2)
    return statistics.median(samples)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, fwd: float, bwd: float) -> Any:
        ctx.bwd = bwd
        ctx.weight = weight
        time.sleep(fwd)
        return x * weight[:1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        time.sleep(ctx.bwd)
        # The weight's gradient: its values do not matter here, only that DDP reduces it.
        return grad, torch.zeros_like(ctx.weight), None, None


class SleepChunk(torch.nn.Module):
    """A model chunk with megatron-core's interface and one flat parameter of a chosen size."""

    def __init__(self, config: Any, numel: int, fwd: float, bwd: float) -> None:
        from megatron.core.enums import ModelType

        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.weight = torch.nn.Parameter(torch.ones(numel))
        self.fwd, self.bwd = fwd, bwd
        self.input_tensor: torch.Tensor | None = None
        # What megatron-core's finalize_model_grads looks for: no tied embedding here.
        self.pre_process = True
        self.share_embeddings_and_output_weights = False

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        self.input_tensor = tensors[0]

    def forward(self, x: torch.Tensor) -> Any:
        return _Sleep.apply(x, self.weight, self.fwd, self.bwd)


def _forward_step(data_iterator: Any, model: Any) -> Any:
    data = next(data_iterator)
    inner = model.module
    x = data if inner.input_tensor is None else inner.input_tensor
    output = model(x)
    return output, lambda out: ((out * 0).sum(), {"loss": (out * 0).sum().detach()})


def _chunks(costs: dict[str, float], numel: int) -> list[Any]:
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    config = TransformerConfig(
        num_layers=pp * vp,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        use_distributed_optimizer=True,
        bucket_size=None,
    )
    fwd, bwd = costs["t_forward"] / vp, costs["t_backward"] / vp
    chunks = [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=SleepChunk(config, numel, fwd, bwd),
            disable_bucketing=True,
        )
        for _ in range(vp)
    ]
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    return chunks


def _forward_backward(func: Any, chunks: list[Any], m: int) -> None:
    """One forward-backward call over ``m`` random micro-batches, one iterator per chunk."""
    iterators = [iter([torch.randn(SEQ, MBS, HIDDEN)] * m) for _ in chunks]
    func(
        forward_step_func=_forward_step,
        data_iterator=iterators,
        model=chunks,
        num_microbatches=m,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )


def collective_times(numel: int, rounds: int = 5) -> tuple[float, float]:
    """(all-gather, reduce-scatter) of one chunk's buffer over the data-parallel group, median,
    with every rank's group doing the same at once."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    size = torch.distributed.get_world_size(group)
    full = torch.zeros(numel)
    shard = torch.zeros(numel // size)
    gathers, scatters = [], []
    for _ in range(rounds):
        torch.distributed.barrier()
        start = time.perf_counter()
        torch.distributed.all_gather_into_tensor(full, shard, group=group)
        gathers.append(time.perf_counter() - start)
        torch.distributed.barrier()
        start = time.perf_counter()
        torch.distributed.reduce_scatter_tensor(shard, full, group=group)
        scatters.append(time.perf_counter() - start)
    return statistics.median(gathers), statistics.median(scatters)


def rank_main(
    name: str, sharding: str, costs: dict[str, float], numel: int, m: int, steps: int
) -> dict[str, Any]:
    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.compat import sharded_param_buckets
    from megatron_bfpp.runtime.sharding import sharded_parameters

    chunks = _chunks(costs, numel)
    func = get_forward_backward_func(
        name, measure_memory=True, data_parallel_sharding_strategy=sharding
    )
    times, peaks = [], []
    for _ in range(steps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        torch.distributed.barrier()
        start = time.perf_counter()
        _forward_backward(func, chunks, m)
        if sharding == "optim":
            # The distributed optimizer's closing all-gather (no overlap_param_gather).
            for chunk in chunks:
                for found in sharded_param_buckets(chunk):
                    full, part = found.param_data, found.param_data.numel() // found.size
                    local = full[found.rank * part : (found.rank + 1) * part].clone()
                    torch.distributed.all_gather_into_tensor(full, local, group=found.group)
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
        if sharding == "optim":
            peaks.append(sum(c.module.weight.untyped_storage().nbytes() for c in chunks))
        else:
            peaks.append(func.last_memory.peak_parameter_bytes)
    full = sum(c.module.weight.untyped_storage().nbytes() for c in chunks)
    if sharding != "optim":
        full = sharded_parameters(chunks).full_bytes()
    return {"times": times, "peak": max(peaks), "full": full}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vp", type=int, default=4)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8, help="per data-parallel rank")
    parser.add_argument("--t-forward", type=float, default=0.08, help="s per full stage")
    parser.add_argument("--t-backward", type=float, default=0.16, help="s per full stage")
    parser.add_argument("--chunk-mb", type=float, default=8.0, help="fp32 parameters per chunk")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument("--memory", action="store_true", help="model state by RSS (see above)")
    parser.add_argument(
        "--rank-mparams", type=float, default=56.0, help="--memory: M parameters per rank"
    )
    args = parser.parse_args()
    if args.memory:
        for flag, value in (("pp", 2), ("vp", 8), ("dp", 4)):
            if f"--{flag}" not in sys.argv:
                setattr(args, flag, value)
        memory(args)
        return
    world = args.pp * args.dp
    numel = int(args.chunk_mb * 2**20 / 4) // (args.dp * 64) * (args.dp * 64)
    gather, scatter = run_ranks(
        collective_times, world_size=world, pp=args.pp, timeout=300, args=(numel,)
    )[0]
    t_p2p = run_ranks(ping_pong, world_size=2, timeout=120)[0]
    costs = {"t_forward": args.t_forward, "t_backward": args.t_backward}
    chunk_f = args.t_forward / args.vp
    print(
        f"pp={args.pp} vp={args.vp} dp={args.dp} m={args.microbatches}; per chunk: forward "
        f"{1e3 * chunk_f:.0f} ms, backward {1e3 * args.t_backward / args.vp:.0f} ms, "
        f"{args.chunk_mb:g} MB of parameters; measured gloo all-gather {1e3 * gather:.1f} ms, "
        f"reduce-scatter {1e3 * scatter:.1f} ms (all groups at once), pipeline message "
        f"{1e3 * t_p2p:.2f} ms"
    )
    steps = range(1, args.steps + 1)
    cases = [
        ("breadth-first", "optim_grads_params"),
        ("breadth-first", "optim"),
        ("interleaved", "optim"),
    ]
    try:
        from megatron_bfpp.schedules.registry import check_sharding

        check_sharding("interleaved", "optim_grads_params")
    except ValueError as error:
        print(f"interleaved + optim_grads_params: refused: {error}")
    calibration = run_ranks(
        rank_main,
        world_size=world,
        pp=args.pp,
        vp=args.vp,
        timeout=900,
        args=("interleaved", "optim", {"t_forward": 0.0, "t_backward": 0.0}, numel,
              args.microbatches, args.steps + 1),
    )  # fmt: skip
    idle = statistics.median(max(r["times"][i] for r in calibration) for i in steps)
    # Per compute action (F or B, of one chunk): the unsharded step with no sleep, less its
    # closing gathers, over the computes on one rank's critical path (2 m vp of them).
    overhead = max(0.0, idle - args.vp * gather) / (2 * args.microbatches * args.vp)
    t_forward = args.t_forward + overhead * args.vp
    t_backward = args.t_backward + overhead * args.vp
    print(f"runtime cost per compute action (calibrated, no sleep): {1e3 * overhead:.2f} ms")
    print(
        f"{'schedule':<14} {'sharding':<19} {'gathers/rank':>12} {'simulated s':>11} "
        f"{'measured s':>10} {'error':>7} {'peak param MB/rank':>19} {'of whole':>8}"
    )
    measured: dict[tuple[str, str], float] = {}
    for name, sharding in cases:
        schedule = build_schedule(
            name,
            num_ranks=args.pp,
            num_microbatches=args.microbatches,
            num_chunks=args.vp,
            sharding=sharding,
        )
        sharded = sharding != "optim"
        predicted = simulate(
            schedule,
            CostModel(
                t_forward=t_forward,
                t_backward=t_backward,
                t_weight=0.0,
                t_p2p=t_p2p,
                t_grad_reduce=scatter,
                t_param_gather=gather if sharded else 0.0,
            ),
        ).step_time
        gathers = sum(a.kind.value == "PS" for a in schedule.per_rank[0]) if sharded else args.vp
        if not sharded:
            predicted += args.vp * gather  # the optimizer's closing gather, one chunk at a time
        results = run_ranks(
            rank_main,
            world_size=world,
            pp=args.pp,
            vp=args.vp,
            timeout=900,
            args=(name, sharding, costs, numel, args.microbatches, args.steps + 1),
        )
        time_s = statistics.median(max(r["times"][i] for r in results) for i in steps)
        measured[(name, sharding)] = time_s
        peak = max(r["peak"] for r in results)
        whole = max(r["full"] for r in results)
        print(
            f"{name:<14} {sharding:<19} {gathers:>12} {predicted:>11.3f} {time_s:>10.3f} "
            f"{100 * (time_s - predicted) / predicted:>6.1f}% {peak / 2**20:>19.1f} "
            f"{peak / whole:>8.2f}",
            flush=True,
        )
    bf = measured[("breadth-first", "optim_grads_params")]
    print(
        f"breadth-first+distributed optimizer / breadth-first+fully sharded = "
        f"{measured[('breadth-first', 'optim')] / bf:.3f}; interleaved+distributed optimizer / "
        f"breadth-first+fully sharded = {measured[('interleaved', 'optim')] / bf:.3f} "
        "(> 1: fully sharded breadth-first is faster)"
    )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_memory(sharding: str, numel: int, m: int, steps: int) -> dict[str, Any]:
    """Peak process RSS over whole training iterations, less the RSS before the model."""
    import gc

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.runtime import sharded_optimizer_step
    from megatron_bfpp.runtime.sharding import sharded_parameters

    gc.collect()
    before = _rss_bytes()
    peak = [before]
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        chunks = _chunks({"t_forward": 0.0, "t_backward": 0.0}, numel)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=1e-4, clip_grad=1.0, use_distributed_optimizer=True
            ),
            chunks,
        )
        func = get_forward_backward_func(
            "breadth-first", measure_memory=True, data_parallel_sharding_strategy=sharding
        )
        params = grads = 0
        for _ in range(steps):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            _forward_backward(func, chunks, m)
            if sharding == "optim":
                optimizer.step()
            else:
                sharded_optimizer_step(optimizer, chunks)
                sharded = sharded_parameters(chunks)
                params = max(params, sharded.peak_bytes)
                grads = max(grads, sharded.peak_grad_bytes)
        time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    if sharding == "optim":
        params = grads = sum(c.module.weight.numel() * 4 for c in chunks)
    return {"model_state": peak[0] - before, "rss": peak[0], "params": params, "grads": grads}


def memory(args: argparse.Namespace) -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        print("note: MALLOC_MMAP_THRESHOLD_ is not set; freed buffers may stay in RSS (see --help)")
    world = args.pp * args.dp
    per_rank = int(args.rank_mparams * 1e6)
    numel = per_rank // args.vp // (args.dp * 64) * (args.dp * 64)
    print(
        f"pp={args.pp} vp={args.vp} dp={args.dp} m={args.microbatches}: "
        f"{numel * args.vp / 1e6:.1f} M fp32 parameters per rank, Adam; peak RSS per rank "
        "over whole iterations, model state = peak less the RSS before the model"
    )
    results = {}
    for sharding in ("optim", "optim_grads_params"):
        results[sharding] = run_ranks(
            rank_memory,
            world_size=world,
            pp=args.pp,
            vp=args.vp,
            timeout=900,
            args=(sharding, numel, args.microbatches, args.steps),
        )
        states = [r["model_state"] / 2**20 for r in results[sharding]]
        rss = [r["rss"] / 2**20 for r in results[sharding]]
        print(
            f"{sharding:<19} model state MiB per rank {' '.join(f'{v:.0f}' for v in states)}; "
            f"peak RSS MiB {' '.join(f'{v:.0f}' for v in rss)}; runtime's peak parameter / "
            f"gradient MiB (rank 0) {results[sharding][0]['params'] / 2**20:.0f} / "
            f"{results[sharding][0]['grads'] / 2**20:.0f}",
            flush=True,
        )
    plain = max(r["model_state"] for r in results["optim"])
    sharded = max(r["model_state"] for r in results["optim_grads_params"])
    print(
        f"fully sharded / distributed optimizer model state (largest rank) = {sharded / plain:.3f}"
    )


if __name__ == "__main__":
    main()
