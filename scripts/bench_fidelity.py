#!/usr/bin/env python3
"""Schedule fidelity: measured step time of every schedule next to its timing model's.

The ranks run under the tests' NCCL emulation (``megatron_bfpp.testing.nccl_emulation``: one
stream per group, a send posted only once its receiver's batch started) with an emulated
transfer time ``--t-p2p``: each message completes that long after both halves started, the
model of ``nccl.posting_timer``. Compute is emulated: each model chunk is a one-parameter module
whose forward and backward sleep their share of ``--t-forward`` / ``--t-backward`` (seconds per
micro-batch through one full 1F1B stage), so timing does not depend on this machine's cores.
Everything else is real: our runtime and megatron-core's forward_step / backward_step, gloo
point-to-point messages between forked ranks.

Our schedules run through our runtime and are compared with ``simulate(..., p2p="lockstep")``;
Megatron's own 1f1b and interleaved (``megatron-1f1b``, ``megatron-interleaved``) run through
megatron-core's own forward-backward function with Megatron-LM's p2p settings
(``native_posting.megatron_lm_options``: interleaved non-batched with p2p overlap and freed
outputs, 1f1b batched) and are compared with ``simulate(..., p2p="megatron")``.
``--t-grad-reduce`` emulates a per-chunk data-parallel gradient reduction on a per-rank
communication lane (a worker thread serving one reduction at a time), started as megatron-core's
DDP starts it (``ChunkSync``: by gradient hooks outside ``config.no_sync_func``, or by
``config.grad_sync_func``, where each executor calls them); ``finalize_model_grads_func`` waits
for the lane, as megatron-core's finalize waits for DDP's reductions. Each case runs with and
without it.

The models time compute as the emulation sleeps it; the CPU ranks also spend host time per
action (Python, megatron-core's forward_step / backward_step, autograd, building and posting
each tick's batch, the sleeps' overshoot, waking from waits) that a multi-chunk schedule pays v
times as often for the same work. Each step measures it (``rank_main``: the step less the
sleeps asked for, the time blocked in the emulation's waits and the reduction's wait) and
divides it by the rank's compute actions. The emulated transport also takes longer than
``--t-p2p`` per message (the worker's sleep to the due time, gloo, thread wake-ups: a fraction
of a millisecond, more under load); before each step the ranks time it in pairs with a chain of
round trips that no host work interrupts (``_message_time``).

Each row holds three models of its measured (median) step, none fitted to it:

* nominal: the costs as set, no host time (``CostModel.t_host`` 0, ``t_p2p`` as emulated);
* calibrated (the default mode): ``t_host`` and ``t_p2p`` from a calibration run apart from
  every predicted case (``calibrate``: before each pp's cases, its own launch of a fixed
  schedule, 1F1B at the same pp without a reduction, measured as above, medians over its
  steps), so each prediction is fixed before its case runs and reads nothing of it; the planner
  does the same with a ``bfpp-plan profile``'s ``t_host``;
* in-step (for reference): each step's own measured ``t_host`` and message time, the fidelity
  of the p2p and timing rules with the CPU ranks' costs accounted for (the model still decides
  how much of them lies on the critical path), but read from the step it predicts.

The calibrated model's error is what a prediction from independent inputs achieves; the gap to
the in-step one is how much a step's host time and message time vary from run to run (load).

    python scripts/bench_fidelity.py                          # pp 4 and 8, every schedule
    python scripts/bench_fidelity.py --pp 4 --only v-zb megatron-interleaved --dp-only
    python scripts/bench_fidelity.py --no-calibration        # nominal and in-step models only
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import queue
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from megatron_bfpp.ir import Schedule
from megatron_bfpp.schedules import build_schedule
from megatron_bfpp.sim import CostModel, simulate
from megatron_bfpp.testing import nccl_emulation
from megatron_bfpp.testing.multirank import RanksFailed, preload_megatron, run_ranks

HIDDEN, SEQ, MBS = 8, 4, 1


_EMULATED = [0.0]  # this rank's emulated compute so far: the seconds its sleeps asked for


def _compute(seconds: float) -> None:
    _EMULATED[0] += seconds
    time.sleep(seconds)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, fwd: float, bwd: float) -> Any:
        ctx.save_for_backward(x, weight)
        ctx.bwd = bwd
        _compute(fwd)
        return x * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        _compute(ctx.bwd)
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
        self.linear.weight.register_post_accumulate_grad_hook(lambda _: _compute(wgrad))
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
        self.waited = 0.0  # the CPU's time blocked in wait()
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
        began = time.perf_counter()
        self.jobs.join()
        self.waited += time.perf_counter() - began


class ChunkSync:
    """One chunk's gradient reduction as megatron-core's DDP starts it: by its parameters'
    gradient hooks once every parameter's gradient is ready outside ``no_sync`` (megatron-core's
    1F1B leaves ``no_sync`` before the first stage's last backward and never calls
    ``grad_sync_func`` there), or by ``grad_sync_func``, whichever comes first, once per step."""

    def __init__(self, lane: DataParallelLane, params: list[torch.nn.Parameter]) -> None:
        self.lane, self.params = lane, params
        self.synced, self.started = True, False
        self.ready: set[int] = set()
        for index, param in enumerate(params):
            param.register_post_accumulate_grad_hook(lambda _, index=index: self._ready(index))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.synced = False
        try:
            yield
        finally:
            self.synced = True

    def _ready(self, index: int) -> None:
        if self.synced:
            self.ready.add(index)
            if len(self.ready) == len(self.params):
                self.start()

    def start(self, *unused: Any) -> None:
        if not self.started:
            self.started = True
            self.lane.start()

    def finish_step(self) -> None:
        self.started = False
        self.ready.clear()


def _forward_step(data_iterator: Any, model: SleepChunk) -> Any:
    data = next(data_iterator)
    x = data if model.input_tensor is None else model.input_tensor
    output = model(x)
    return output, lambda out: ((out * 0).sum(), {"loss": (out * 0).sum().detach()})


MEGATRON = "megatron-"  # the prefix of Megatron's own schedules in the case names


def _megatron_options(name: str, pp: int, vp: int, num_microbatches: int) -> dict[str, Any]:
    """The ``ModelParallelConfig`` p2p fields Megatron-LM sets for its own ``name``."""
    from megatron_bfpp.compat import megatron_core_version
    from megatron_bfpp.native_posting import megatron_lm_options

    schedule = build_schedule(
        name, num_ranks=pp, num_microbatches=num_microbatches, num_chunks=vp if vp > 1 else None
    )
    options = megatron_lm_options(schedule, core_version=megatron_core_version()[:2])
    return {
        "batch_p2p_comm": options.batch_p2p,
        "overlap_p2p_comm": options.overlap_p2p,
        "deallocate_pipeline_outputs": True,  # Megatron-LM's training loop sets it
        # megatron-core counts its warm-up by the config's chunks; Megatron-LM's default
        # group, which our interleaved builds as well
        **(
            {"virtual_pipeline_model_parallel_size": vp, "microbatch_group_size_per_vp_stage": pp}
            if vp > 1
            else {}
        ),
    }


def rank_main(
    name: str,
    costs: dict[str, float],
    num_microbatches: int,
    steps: int,
    ends: tuple[float, float] = (1.0, 1.0),
) -> list[tuple[float, float, float]]:
    """Per step: (its time between two barriers, the host's time in it, the emulated
    transport's time per message just before it, ``_message_time``). The host's time is the
    time until the forward-backward function returned less the emulated compute's sleeps as
    asked for, the time blocked waiting for messages (``nccl_emulation.blocked_seconds``) and
    for the emulated reduction: the CPU's own work (Python, autograd, posting) and the sleeps'
    overshoot, what ``CostModel.t_host`` stands for."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.testing import nccl_emulation

    if not nccl_emulation.installed():
        raise RuntimeError("the NCCL emulation is not installed in the rank; see main()")
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    native = name.startswith(MEGATRON)
    p2p = _megatron_options(name[len(MEGATRON) :], pp, vp, num_microbatches) if native else {}
    config = TransformerConfig(
        num_layers=pp * vp,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        **p2p,
    )
    # each chunk's compute: its stage's share, weighed by ``--end-weights`` (uneven stages)
    layout = _schedule(name, pp, vp, num_microbatches).layout
    rank = parallel_state.get_pipeline_model_parallel_rank()
    weights = stage_weights(layout.num_stages, ends)
    chunks = [
        SleepChunk(
            config,
            costs["t_forward"] * weights[stage] / vp,
            costs["t_backward"] * weights[stage] / vp,
            costs["t_weight"] * weights[stage] / vp,
        )
        for stage in layout.stages_of(rank)
    ]
    lane = DataParallelLane(costs["t_grad_reduce"])
    syncs = [ChunkSync(lane, [chunk.linear.weight, chunk.weight]) for chunk in chunks]

    def finalize(*unused: Any, **also_unused: Any) -> None:
        lane.wait()
        for sync in syncs:
            sync.finish_step()

    if costs["t_grad_reduce"] > 0:
        config.no_sync_func = [sync.no_sync for sync in syncs] if vp > 1 else syncs[0].no_sync
        config.grad_sync_func = [sync.start for sync in syncs] if vp > 1 else syncs[0].start
    config.finalize_model_grads_func = finalize
    func = megatron_func() if native else get_forward_backward_func(name)
    times = []
    for _ in range(steps):
        iterators = [iter([torch.randn(SEQ, MBS, HIDDEN)] * num_microbatches) for _ in chunks]
        message = _message_time(parallel_state.get_pipeline_model_parallel_group())
        torch.distributed.barrier()
        emulated, blocked, waited = _EMULATED[0], nccl_emulation.blocked_seconds(), lane.waited
        start = time.perf_counter()
        func(
            forward_step_func=_forward_step,
            data_iterator=iterators if vp > 1 else iterators[0],
            model=chunks,
            num_microbatches=num_microbatches,
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
        returned = time.perf_counter()
        host = (
            returned
            - start
            - (_EMULATED[0] - emulated)
            - (nccl_emulation.blocked_seconds() - blocked)
            - (lane.waited - waited)
        )
        torch.distributed.barrier()
        times.append((time.perf_counter() - start, host, message))
    return times


ROUND_TRIPS = 5  # per step, to time the emulated transport (``_message_time``)


def _message_time(group: Any) -> float:
    """What one message of the emulated transport takes now, under this machine's load:
    ``ROUND_TRIPS`` round trips with the partner rank (pipeline rank r ^ 1) on the group's
    stream, every batch posted up front so that the emulation's workers chain them with no host
    work in between; the time of the chain over its messages. It is ``--t-p2p`` plus the
    emulation's own latency (sleeping to the due time, gloo, thread wake-ups)."""
    import torch.distributed as dist

    me = group.rank()
    peer = dist.get_global_rank(group, me ^ 1)
    out, into = torch.zeros(1), torch.zeros(1)
    send = [dist.P2POp(dist.isend, out, peer, group)]
    receive = [dist.P2POp(dist.irecv, into, peer, group)]
    batches = [send, receive] if me % 2 == 0 else [receive, send]
    dist.barrier(group)
    start = time.perf_counter()
    works = [dist.batch_isend_irecv(batch)[0] for _ in range(ROUND_TRIPS) for batch in batches]
    for work in works:
        work.wait()
    return (time.perf_counter() - start) / (2 * ROUND_TRIPS)


def _schedule(name: str, pp: int, vp: int, num_microbatches: int) -> Schedule:
    """The schedule that runs as ``name`` (Megatron's own: the one its executor follows)."""
    return build_schedule(
        name[len(MEGATRON) :] if name.startswith(MEGATRON) else name,
        num_ranks=pp,
        num_microbatches=num_microbatches,
        num_chunks=vp if vp > 1 else None,
    )


def stage_weights(num_stages: int, ends: tuple[float, float]) -> tuple[float, ...]:
    """``CostModel.stage_weights`` of ``--end-weights``: the first and the last stage weighed,
    the rest 1 (the emulated chunks sleep as much)."""
    return tuple(ends[0] if s == 0 else ends[1] if s == num_stages - 1 else 1.0
                 for s in range(num_stages))  # fmt: skip


def predict(
    name: str,
    pp: int,
    vp: int,
    num_microbatches: int,
    costs: CostModel,
    ends: tuple[float, float] = (1.0, 1.0),
) -> float:
    """The step time of the timing model that stands for what runs ``name``; uneven ``ends``
    as ``CostModel.stage_weights`` (none when even: the same figures either way)."""
    model = "megatron" if name.startswith(MEGATRON) else "lockstep"
    schedule = _schedule(name, pp, vp, num_microbatches)
    if ends != (1.0, 1.0):
        costs = dataclasses.replace(costs, stage_weights=stage_weights(schedule.num_stages, ends))
    return simulate(schedule, costs, p2p=model).step_time


def host_per_action(name: str, pp: int, vp: int, m: int, hosts: list[float]) -> float:
    """``t_host`` as measured in one step: the ranks' mean host time (``rank_main``;
    ``hosts[rank]``) per compute action of the rank."""
    programs = _schedule(name, pp, vp, m).per_rank
    computes = [sum(action.kind.is_compute for action in program) for program in programs]
    return statistics.mean(hosts[rank] / computes[rank] for rank in range(pp))


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--vp", type=int, default=2, help="chunks per rank, interleaved / bf")
    parser.add_argument(
        "--microbatches", type=int, default=8, help="per step (at least pp: Megatron's own)"
    )
    parser.add_argument("--t-forward", type=float, default=0.08)
    parser.add_argument("--t-backward", type=float, default=0.16)
    parser.add_argument(
        "--t-weight",
        type=float,
        default=None,
        help="the weight-gradient share of --t-backward (default half of it, as bfpp-sim's)",
    )
    parser.add_argument(
        "--t-p2p", type=float, default=0.01, help="the emulated transfer time of one message"
    )
    parser.add_argument(
        "--t-grad-reduce",
        type=float,
        default=None,
        help="per-chunk reduction of the DP cases (default: --t-backward)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument(
        "--end-weights",
        type=float,
        nargs=2,
        default=(1.0, 1.0),
        metavar=("FIRST", "LAST"),
        help="uneven stages: the first and last global stage's compute against the others' "
        "(e.g. 0.7 1.6: a light embedding stage, a heavy output layer), in the emulated chunks "
        "and as the model's stage weights; the calibration stays even",
    )
    parser.add_argument("--only", nargs="*", default=None, help="run only these schedules")
    parser.add_argument("--dp-only", action="store_true", help="only the cases with a reduction")
    parser.add_argument("--no-dp", action="store_true", help="only the cases without one")
    calibration = parser.add_argument_group(
        "calibration", "t_host and t_msg measured apart, before each pp's cases (the default)"
    )
    calibration.add_argument(
        "--no-calibration", action="store_true", help="only the nominal and in-step models"
    )
    calibration.add_argument(
        "--calibration-schedule",
        choices=("1f1b", "gpipe"),
        default="1f1b",
        help="the fixed schedule run to calibrate (default 1f1b, no reduction)",
    )
    calibration.add_argument(
        "--calibration-microbatches", type=int, default=None, help="default: --microbatches"
    )
    calibration.add_argument(
        "--calibration-steps", type=int, default=None, help="timed steps (default: --steps)"
    )
    args = parser.parse_args()
    if args.t_weight is None:
        args.t_weight = args.t_backward / 2
    if args.t_grad_reduce is None:
        args.t_grad_reduce = args.t_backward
    args.calibration_microbatches = args.calibration_microbatches or args.microbatches
    args.calibration_steps = args.calibration_steps or args.steps
    return args


def _cases(args: argparse.Namespace) -> list[tuple[str, int]]:
    names = [
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved", args.vp),
        ("breadth-first", args.vp),
        ("bpipe", 1),
        # V-shapes: two half-stage chunks per rank; I defers the linear layer's weight GEMM and
        # W computes it (runtime.deferred_wgrad), so W takes t_weight as the simulator says.
        ("v-min", 2),
        ("v-half", 2),
        ("v-zb", 2),
        (MEGATRON + "1f1b", 1),
        (MEGATRON + "interleaved", args.vp),
    ]
    return [case for case in names if not args.only or case[0] in args.only]


def _rank_costs(args: argparse.Namespace, reduce: float) -> dict[str, float]:
    return {
        "t_forward": args.t_forward,
        "t_backward": args.t_backward,
        "t_weight": args.t_weight,
        "t_grad_reduce": reduce,
    }


def _load() -> str:
    return "load " + " / ".join(f"{x:.1f}" for x in os.getloadavg())


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the calibration run measured: the host's time per compute action and one message's
    time, each the median over its timed steps; the model of every case at this pp reads only
    these (``CostModel.t_host``, ``t_p2p``), never its own run's."""

    t_host: float
    t_msg: float


def calibrate(args: argparse.Namespace, pp: int) -> Calibration:
    """Run the calibration schedule (1F1B by default, ``--calibration-microbatches``, no
    data-parallel reduction) in its own launch of ``pp`` ranks, apart from every predicted case,
    and measure as ``rank_main`` measures each step: per timed step the ranks' mean host time
    per compute action and the message time of ``_message_time``; the medians."""
    name, m = args.calibration_schedule, args.calibration_microbatches
    results = run_ranks(
        rank_main,
        world_size=pp,
        pp=pp,
        timeout=600,
        args=(name, _rank_costs(args, 0.0), m, args.calibration_steps + 1),
    )
    steps = range(1, args.calibration_steps + 1)
    hosts = [host_per_action(name, pp, 1, m, [r[i][1] for r in results]) for i in steps]
    messages = [statistics.mean(r[i][2] for r in results) for i in steps]
    return Calibration(statistics.median(hosts), statistics.median(messages))


def _error(measured: float, model: float) -> float:
    return (measured - model) / model


@dataclasses.dataclass(frozen=True)
class Row:
    """One case: the measured median step and fastest step, and the models' steps (nominal,
    calibrated, in-step: the median step's own measured t_host and t_msg)."""

    measured: float
    fastest: float
    nominal: float
    calibrated: float | None
    in_step: float
    t_host: float
    t_msg: float


def run_case(
    args: argparse.Namespace,
    name: str,
    pp: int,
    vp: int,
    reduce: float,
    calibration: Calibration | None,
) -> Row:
    m, ends = args.microbatches, tuple(args.end_weights)
    costs = CostModel(
        t_forward=args.t_forward,
        t_backward=args.t_backward,
        t_weight=args.t_weight,
        t_p2p=args.t_p2p,
        t_grad_reduce=reduce,
        t_evict=args.t_p2p,  # an eviction is one message too, at vp 1 unscaled
    )
    # The calibrated model, fixed before this case runs: the calibration's costs only.
    calibrated = None
    if calibration is not None:
        measured_apart = dataclasses.replace(
            costs, t_host=calibration.t_host, t_p2p=calibration.t_msg, t_evict=calibration.t_msg
        )
        calibrated = predict(name, pp, vp, m, measured_apart, ends)
    results = run_ranks(
        rank_main,
        world_size=pp,
        pp=pp,
        vp=vp if vp > 1 else None,
        timeout=600,
        args=(name, _rank_costs(args, reduce), m, args.steps + 1, ends),
    )
    # Each timed step (the slowest rank's) against the model with its own t_host and message
    # time; the step of median time is reported, and the fastest.
    rows = []
    for i in range(1, args.steps + 1):
        host = host_per_action(name, pp, vp, m, [r[i][1] for r in results])
        message = statistics.mean(r[i][2] for r in results)
        own = dataclasses.replace(costs, t_host=host, t_p2p=message, t_evict=message)
        rows.append(
            (max(r[i][0] for r in results), host, message, predict(name, pp, vp, m, own, ends))
        )
    rows.sort()
    measured, host, message, in_step = rows[(len(rows) - 1) // 2]
    nominal = predict(name, pp, vp, m, costs, ends)
    return Row(measured, rows[0][0], nominal, calibrated, in_step, host, message)


HEADER = (
    f"{'schedule':<22} {'pp':>2} {'vp':>2} {'m':>3} {'t_red':>5} {'model':>8} {'measured':>8} "
    f"{'nominal':>7} {'error':>6} {'calib.':>6} {'error':>6} {'in-step':>7} {'error':>6} "
    f"{'t_host':>7} {'t_msg':>8} {'fastest':>7} {'calib.':>6}"
)


def format_row(name: str, pp: int, vp: int, m: int, reduce: float, row: Row) -> str:
    model = "megatron" if name.startswith(MEGATRON) else "lockstep"
    calibrated = "     -      -"
    fastest = "     -"
    if row.calibrated is not None:
        calibrated = f"{row.calibrated:>6.3f} {100 * _error(row.measured, row.calibrated):>5.1f}%"
        fastest = f"{100 * _error(row.fastest, row.calibrated):>5.1f}%"
    return (
        f"{name:<22} {pp:>2} {vp:>2} {m:>3} {reduce:>5.2f} {model:>8} {row.measured:>8.3f} "
        f"{row.nominal:>7.3f} {100 * _error(row.measured, row.nominal):>5.1f}% {calibrated} "
        f"{row.in_step:>7.3f} {100 * _error(row.measured, row.in_step):>5.1f}% "
        f"{1000 * row.t_host:>5.2f}ms {1000 * row.t_msg:>6.2f}ms {row.fastest:>7.3f} {fastest}"
    )


def _summary(rows: list[Row]) -> None:
    for label, model in (
        ("nominal (t_host 0, t_p2p as set)", lambda r: r.nominal),
        ("calibrated (t_host, t_msg of the calibration run)", lambda r: r.calibrated),
        ("in-step (each step's own t_host, t_msg)", lambda r: r.in_step),
    ):
        errors = [abs(_error(r.measured, model(r))) for r in rows if model(r) is not None]
        if errors:
            print(
                f"{label}: largest |error| {100 * max(errors):.1f}%, mean "
                f"{100 * statistics.mean(errors):.1f}%, within 5%: "
                f"{sum(e <= 0.05 for e in errors)} of {len(errors)}"
            )


def main() -> None:
    args = _parse_args()
    # The forked ranks install the emulation (testing.multirank) with this transfer time.
    os.environ[nccl_emulation.ENV] = "1"
    os.environ[nccl_emulation.TRANSFER_ENV] = repr(args.t_p2p)
    preload_megatron()
    reductions = [0.0, args.t_grad_reduce]
    if args.dp_only:
        reductions = [args.t_grad_reduce]
    if args.no_dp:
        reductions = [0.0]
    print(
        f"t_forward={args.t_forward}s t_backward={args.t_backward}s t_weight={args.t_weight}s "
        f"(per full stage; first and last stage x {args.end_weights[0]:g}, x "
        f"{args.end_weights[1]:g}), emulated transfer t_p2p={args.t_p2p}s, per-chunk reduction "
        f"{args.t_grad_reduce}s in the DP cases; {args.steps} timed steps after a warm-up, each "
        "the slowest rank's; measured: the median step. Models: nominal (no host time, t_p2p as "
        "set); calib.: t_host and t_msg of the calibration run before each pp's cases; in-step: "
        "the median step's own t_host and t_msg (printed); fastest: the fastest step, its error "
        "against calib. (load only slows a step)",
        flush=True,
    )
    rows: list[Row] = []
    failed: list[str] = []
    for pp in args.pp:
        calibration = None
        if not args.no_calibration:
            calibration = calibrate(args, pp)
            schedule, m = args.calibration_schedule, args.calibration_microbatches
            print(
                f"calibration pp={pp}: {schedule} m={m}, {args.calibration_steps} timed steps: "
                f"t_host {1000 * calibration.t_host:.2f} ms per compute action, t_msg "
                f"{1000 * calibration.t_msg:.2f} ms ({_load()})",
                flush=True,
            )
        print(HEADER, flush=True)
        for reduce in reductions:
            for name, vp in _cases(args):
                try:
                    row = run_case(args, name, pp, vp, reduce, calibration)
                except RanksFailed as failure:  # report it, go on with the other cases
                    print(f"{name:<22} {pp:>2} {vp:>2} failed: {failure.summary}")
                    failed.append(name)
                    continue
                rows.append(row)
                print(format_row(name, pp, vp, args.microbatches, reduce, row), flush=True)
        print(f"pp={pp} done ({_load()})", flush=True)
    _summary(rows)
    if failed:
        print(f"failed: {', '.join(failed)}")
    print("load averages (1, 5, 15 min): " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
