#!/usr/bin/env python3
"""Sharded parameters: breadth-first vs depth-first interleaved, measured beside the simulator.

Compute is emulated as in ``bench_fidelity.py`` (each chunk's forward and backward sleep their
share of ``--t-forward`` / ``--t-backward`` per full stage), so timing does not depend on this
machine's cores. Everything else is real: megatron-core DDP chunks built for the distributed
optimizer (one flat parameter of ``--chunk-mb`` MB per chunk, so each chunk is one bucket),
our runtime and its gathers/releases (runtime.sharding), DDP's per-chunk reduce-scatter
(``overlap_grad_reduce``), and gloo collectives between forked ranks (pp x dp of them).

Three cases, timed over the schedule's step plus, for the unsharded one, the distributed
optimizer's closing all-gather of every chunk (which sharded runs do not have):

- ``breadth-first`` with ``optim_grads_params``: each chunk gathered at most twice;
- ``interleaved`` with ``optim_grads_params``: gathers again for every micro-batch group;
- ``interleaved`` with ``optim``: parameters whole, all gathered after the step.

The simulator gets the same schedule and the gather and reduce-scatter times measured here,
with every rank's group busy at once, as the run has them. Its compute costs are the sleeps plus
the runtime's own cost per compute action on this machine (megatron-core's forward_step /
backward_step, DDP hooks, our executor: several ms per action on a 2-core machine running 4
ranks), calibrated once from the unsharded case run with no sleep, so the three predictions
rest on one measured number and the sharded cases are predictions, not fits. Resident
parameter bytes are the runtime's measurement (kept shards plus gathered buffers, peak over the
step, per rank).

    python scripts/bench_sharding.py                      # pp=2 vp=4 dp=2 m=8, 8 MB per chunk
    python scripts/bench_sharding.py --vp 8 --chunk-mb 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from bench_fidelity import ping_pong  # scripts/ is on the path when run as a script

from megatron_bfpp.schedules import build_schedule
from megatron_bfpp.sim import CostModel, simulate
from megatron_bfpp.testing.multirank import run_ranks

HIDDEN, SEQ, MBS = 8, 4, 1


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
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
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

    def finalize(model: list[Any], *unused: Any, **also_unused: Any) -> None:
        for chunk in model:
            chunk.finish_grad_sync()

    config.finalize_model_grads_func = finalize
    return chunks


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
        iterators = [iter([torch.randn(SEQ, MBS, HIDDEN)] * m) for _ in chunks]
        torch.distributed.barrier()
        start = time.perf_counter()
        func(
            forward_step_func=_forward_step,
            data_iterator=iterators,
            model=chunks,
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
        if sharding == "optim":
            # The distributed optimizer's closing all-gather (no overlap_param_gather).
            for chunk in chunks:
                for full, bucket_group, size, rank in sharded_param_buckets(chunk):
                    part = full.numel() // size
                    local = full[rank * part : (rank + 1) * part].clone()
                    torch.distributed.all_gather_into_tensor(full, local, group=bucket_group)
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
    args = parser.parse_args()
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
        ("interleaved", "optim_grads_params"),
        ("interleaved", "optim"),
    ]
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
        f"interleaved+sharded / breadth-first+sharded = "
        f"{measured[('interleaved', 'optim_grads_params')] / bf:.3f}; interleaved+distributed "
        f"optimizer / breadth-first+sharded = {measured[('interleaved', 'optim')] / bf:.3f} "
        "(> 1: breadth-first with sharded parameters is faster)"
    )


if __name__ == "__main__":
    main()
