#!/usr/bin/env python3
"""Schedule fidelity: measured step time of every schedule next to the simulator's.

Compute is emulated: each model chunk is a one-parameter module whose forward and backward sleep
their share of ``--t-forward`` / ``--t-backward`` (seconds per micro-batch through one full 1F1B
stage), so timing does not depend on this machine's cores. Everything else is real: our runtime,
megatron-core's forward_step / backward_step, gloo point-to-point messages between forked ranks.
``--t-grad-reduce`` emulates a per-chunk data-parallel gradient reduction on a per-rank
communication lane (a worker thread serving one reduction at a time), dispatched through
``config.grad_sync_func`` exactly where the runtime calls it; ``finalize_model_grads_func`` waits
for the lane, as megatron-core's finalize waits for DDP's reductions.

    python scripts/bench_fidelity.py                 # pp=4, every schedule, +DP case
    python scripts/bench_fidelity.py --pp 8 --microbatches 16
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from typing import Any

import torch

from megatron_bfpp.schedules import build_schedule
from megatron_bfpp.sim import CostModel, simulate
from megatron_bfpp.testing.multirank import run_ranks

HIDDEN, SEQ, MBS = 8, 4, 1


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, fwd: float, bwd: float) -> Any:
        ctx.save_for_backward(x, weight)
        ctx.bwd = bwd
        time.sleep(fwd)
        return x * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        time.sleep(ctx.bwd)
        return grad * weight, (grad * x).sum().reshape(1), None, None


class SleepChunk(torch.nn.Module):
    """A model chunk with megatron-core's interface (config, model_type, set_input_tensor).

    Its backward sleeps ``bwd - wgrad`` and then, when its megatron-core ``ColumnParallelLinear``
    weight accumulates its gradient, ``wgrad`` more: inside B for 1F1B-like schedules, inside W
    for the V-shapes, whose I defers that layer's weight GEMM (runtime.deferred_wgrad).
    """

    def __init__(self, config: Any, fwd: float, bwd: float, wgrad: float) -> None:
        from megatron.core.enums import ModelType
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.linear = ColumnParallelLinear(
            HIDDEN, HIDDEN, config=config, init_method=torch.nn.init.eye_, bias=False
        )
        self.linear.weight.register_post_accumulate_grad_hook(lambda _: time.sleep(wgrad))
        self.fwd, self.bwd = fwd, bwd - wgrad
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        self.input_tensor = tensors[0]

    def forward(self, x: torch.Tensor) -> Any:
        output, _ = self.linear(_Sleep.apply(x, self.weight, self.fwd, self.bwd))
        return output


class DataParallelLane:
    """One reduction at a time per rank, like one NCCL stream for the data-parallel group."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.jobs: queue.Queue[float | None] = queue.Queue()
        self.worker = threading.Thread(target=self._serve, daemon=True)
        self.worker.start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            time.sleep(job)
            self.jobs.task_done()

    def start(self, *unused: Any) -> None:
        self.jobs.put(self.seconds)

    def wait(self, *unused: Any, **also_unused: Any) -> None:
        self.jobs.join()


def _forward_step(data_iterator: Any, model: SleepChunk) -> Any:
    data = next(data_iterator)
    x = data if model.input_tensor is None else model.input_tensor
    output = model(x)
    return output, lambda out: ((out * 0).sum(), {"loss": (out * 0).sum().detach()})


def ping_pong(rounds: int = 200) -> float:
    """One-way latency of a pipeline message between ranks 0 and 1 (median, seconds)."""
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


def rank_main(name: str, costs: dict[str, float], num_microbatches: int, steps: int) -> list[float]:
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_bfpp import get_forward_backward_func

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    config = TransformerConfig(
        num_layers=pp * vp,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    fraction = 1.0 / vp
    chunks = [
        SleepChunk(
            config,
            costs["t_forward"] * fraction,
            costs["t_backward"] * fraction,
            costs["t_weight"] * fraction,
        )
        for _ in range(vp)
    ]
    lane = DataParallelLane(costs["t_grad_reduce"])
    if costs["t_grad_reduce"] > 0:
        config.grad_sync_func = [lane.start] * vp if vp > 1 else lane.start
    config.finalize_model_grads_func = lane.wait
    func = get_forward_backward_func(name)
    times = []
    for _ in range(steps):
        iterators = [iter([torch.randn(SEQ, MBS, HIDDEN)] * num_microbatches) for _ in chunks]
        torch.distributed.barrier()
        start = time.perf_counter()
        func(
            forward_step_func=_forward_step,
            data_iterator=iterators if vp > 1 else iterators[0],
            model=chunks,
            num_microbatches=num_microbatches,
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--vp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--t-forward", type=float, default=0.04)
    parser.add_argument("--t-backward", type=float, default=0.08)
    parser.add_argument(
        "--t-weight",
        type=float,
        default=None,
        help="the weight-gradient share of --t-backward (default half of it, as bfpp-sim's)",
    )
    parser.add_argument(
        "--t-grad-reduce",
        type=float,
        default=0.0,
        help="per-chunk reduction for the DP cases (default: twice one group's "
        "backward, pp * t_backward / vp * 2, where depth-first cannot hide it)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these schedules")
    args = parser.parse_args()
    if args.t_weight is None:
        args.t_weight = args.t_backward / 2
    (latencies,) = [run_ranks(ping_pong, world_size=2, timeout=120)[0]]
    t_p2p = latencies
    reduce_time = args.t_grad_reduce or 2 * args.pp * args.t_backward / args.vp
    cases = [
        ("gpipe", None, 0.0),
        ("1f1b", None, 0.0),
        ("interleaved", args.vp, 0.0),
        ("breadth-first", args.vp, 0.0),
        ("interleaved", args.vp, reduce_time),
        ("breadth-first", args.vp, reduce_time),
        # V-shapes: two half-stage chunks per rank; I defers the linear layer's weight GEMM and
        # W computes it (runtime.deferred_wgrad), so W takes t_weight as the simulator says.
        ("v-min", 2, 0.0),
        ("v-half", 2, 0.0),
        ("v-zb", 2, 0.0),
    ]
    if args.only:
        cases = [case for case in cases if case[0] in args.only]
    print(
        f"pp={args.pp} m={args.microbatches} t_forward={args.t_forward}s "
        f"t_backward={args.t_backward}s t_weight={args.t_weight}s (per full stage); "
        "measured gloo message latency "
        f"t_p2p={1e3 * t_p2p:.3f} ms (used by the simulator)"
    )
    print(
        f"{'schedule':<14} {'vp':>2} {'t_reduce':>8} {'simulated s':>11} {'measured s':>10} "
        f"{'error':>7}"
    )
    measured_dp: dict[str, float] = {}
    for name, vp, reduce in cases:
        costs = {
            "t_forward": args.t_forward,
            "t_backward": args.t_backward,
            "t_weight": args.t_weight,
            "t_grad_reduce": reduce,
        }
        schedule = build_schedule(
            name, num_ranks=args.pp, num_microbatches=args.microbatches, num_chunks=vp
        )
        predicted = simulate(
            schedule,
            CostModel(
                t_forward=args.t_forward,
                t_backward=args.t_backward,
                t_weight=args.t_weight,
                t_p2p=t_p2p,
                t_grad_reduce=reduce,
            ),
        ).step_time
        results = run_ranks(
            rank_main,
            world_size=args.pp,
            pp=args.pp,
            vp=vp,
            timeout=600,
            args=(name, costs, args.microbatches, args.steps + 1),
        )
        measured = statistics.median(max(r[i] for r in results) for i in range(1, args.steps + 1))
        if reduce:
            measured_dp[name] = measured
        print(
            f"{name:<14} {vp or 1:>2} {reduce:>8.3f} {predicted:>11.3f} {measured:>10.3f} "
            f"{100 * (measured - predicted) / predicted:>6.1f}%",
            flush=True,
        )
    if len(measured_dp) == 2:
        ratio = measured_dp["interleaved"] / measured_dp["breadth-first"]
        print(
            f"with a per-chunk gradient reduction, interleaved / breadth-first step time = "
            f"{ratio:.3f} (> 1: breadth-first is faster)"
        )


if __name__ == "__main__":
    main()
