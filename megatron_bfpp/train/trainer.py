"""``bfpp-train``'s training loop on megatron-core alone (one process = one rank): DDP with the
distributed optimizer (Adam), megatron-core's scheduler and one ``get_forward_backward_func``
call per iteration; the loss is reported as Megatron-LM does, rank 0 writes the records."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import re
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TextIO

import torch
import torch.distributed as dist

from megatron_bfpp.config.model_memory import memory_problem
from megatron_bfpp.config.run_config import RunConfig, run_config
from megatron_bfpp.ir import first_line
from megatron_bfpp.schedules.registry import get_spec, options_from_args
from megatron_bfpp.train.checkpoint import OtherRankFailed, _agree, load_checkpoint, save_checkpoint
from megatron_bfpp.train.checkpoint_files import CheckpointError, fresh_start_reason, read_tracker
from megatron_bfpp.train.checkpoint_metadata import SchedulerPolicy, scheduler_policy
from megatron_bfpp.train.data import IndexedTrainingData, TrainingData, training_data
from megatron_bfpp.train.liveness import RanksLost, Verdict, start_liveness
from megatron_bfpp.train.metric_writers import (
    GuardedWriter,
    JsonlWriter,
    MetricWriter,
    TensorBoardWriter,
    WandbWriter,
)
from megatron_bfpp.train.presets import build_model_chunks, transformer_config, wrap_ddp
from megatron_bfpp.train.step_functions import forward_step

__all__ = ["TrainResult", "train"]


@dataclasses.dataclass
class TrainResult:
    """What rank 0 saw: (iteration, lm_loss) per iteration run by this process."""

    losses: list[tuple[int, float]]


def init_distributed(store: Any = None, timeout_s: float = 600.0) -> torch.device:
    """Process group from the environment (torchrun / our launcher). GPU: NCCL on
    ``cuda:LOCAL_RANK``. CPU only: gloo, and megatron-core's CUDA calls redirected to the CPU."""
    kwargs: dict[str, Any] = dict(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
        **({} if store is None else {"store": store}),
    )
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        _rendezvous("nccl", kwargs, timeout_s)
        return torch.device("cuda", local_rank)
    from megatron_bfpp.megatron.cpu import enable_cpu_megatron  # the one CPU/gloo adapter

    # megatron-core 0.16 calls these by their old names; torch warns once per rank
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )

    torch.set_num_threads(1)
    enable_cpu_megatron()
    _rendezvous("gloo", kwargs, timeout_s)
    return torch.device("cpu")


class RendezvousTimeout(RuntimeError):
    """Not every rank joined the job's rendezvous in time; the message is one line."""


def _rendezvous(backend: str, kwargs: dict[str, Any], timeout_s: float) -> None:
    """``init_process_group``, its store errors (a rank that never started, stopped during start-up
    or cannot reach the address: torch's DistStoreError traceback at the timeout) one line."""
    try:
        dist.init_process_group(backend, **kwargs)
    except (dist.DistStoreError, dist.DistNetworkError) as error:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        joined = re.search(r"(\d+)/(\d+) clients joined", str(error))
        count = f" ({joined[1]} of {joined[2]} ranks joined)" if joined else ""
        if "store" not in kwargs and not _claim_start_up_report():
            raise OtherRankFailed("another rank reports the rendezvous") from None
        raise RendezvousTimeout(
            f"rank {kwargs['rank']}: the job's rendezvous at {where} did not complete within "
            f"{timeout_s:g} s (--distributed-timeout-minutes){count}: a rank did not start, "
            "stopped during start-up or cannot reach that address; look at the ranks that "
            f"printed nothing ({type(error).__name__}: {first_line(error)[:200]})"
        ) from None


def _claim_start_up_report() -> bool:
    """True for the first rank to ask the job's store (torchrun's agent hosts it), which prints the
    line; where no store answers (under srun its host may be the rank that stopped), every rank."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        return True
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, int(port), is_master=False, timeout=timedelta(seconds=5),
            wait_for_workers=False,
        )  # fmt: skip
        return int(store.add(f"bfpp-start-up-reported/{attempt}", 1)) == 1
    except Exception:  # no store to agree on
        return True


def _optimizer_and_scheduler(
    args: Any, model: list[Any], config: RunConfig, policy: SchedulerPolicy
) -> tuple[Any, Any]:
    """Adam (distributed optimizer) and megatron-core's scheduler, whose values on resume follow
    ``policy`` as Megatron-LM's two flags do (compared, this run's, or the checkpoint's)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=0.9,
            adam_beta2=0.95,
            clip_grad=args.clip_grad,
            use_distributed_optimizer=True,
            bf16=args.bf16,  # fp32 main weights in the optimizer, as Megatron-LM's --bf16
            params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        ),
        model,
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        **dataclasses.asdict(config.training.lr_schedule()),
        use_checkpoint_opt_param_scheduler=policy == "checkpoint",
        override_opt_param_scheduler=policy == "override",
    )
    return optimizer, scheduler


def _memory_per_pipeline_rank(run: _Run) -> dict[str, Any]:
    """The step's measured memory per pipeline rank of this replica (collective over the pipeline
    group; peaks include the optimizer step) and, sharded, the data-parallel collectives issued."""
    from megatron.core import parallel_state

    from megatron_bfpp.runtime.activations import unique_storage_bytes

    report = run.forward_backward.last_memory
    cuda = report.cuda_max_memory_allocated
    if run.args.data_parallel_sharding_strategy != "optim":
        # the runtime's high-water marks since forward-backward began, optimizer step included
        from megatron_bfpp.runtime.sharding import sharded_parameters

        sharded = sharded_parameters(run.model)
        parameters, gradients = sharded.peak_bytes, sharded.peak_grad_bytes
    else:  # unsharded: every parameter and gradient buffer is allocated all the time
        params = [p for chunk in run.model for p in chunk.parameters()]
        parameters = unique_storage_bytes(params)
        gradients = unique_storage_bytes(getattr(p, "main_grad", None) for p in params)
    mine = {  # in the record's key order
        "peak_activation_bytes": report.peak_activation_bytes,
        "peak_activations": report.peak_stored_microbatches,
        "peak_parameter_bytes": parameters,
        "peak_gradient_bytes": gradients,
        "cuda_max_memory_allocated": -1 if cuda is None else cuda,
    }
    local = torch.tensor(list(mine.values()), dtype=torch.int64, device=run.device)
    group = parallel_state.get_pipeline_model_parallel_group()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    memory: dict[str, Any] = dict(zip(mine, torch.stack(gathered).T.tolist(), strict=True))
    # bfpp-sim's unit (sim.simulator.UNITS): a rank's chunk is 1/len(model) of a full stage
    memory["peak_activations"] = [round(v / len(run.model), 6) for v in memory["peak_activations"]]
    if cuda is None:
        del memory["cuda_max_memory_allocated"]
    if run.args.data_parallel_sharding_strategy != "optim":
        trace = run.forward_backward.last_trace
        memory["param_all_gathers_per_step"] = sum(a.endswith("PS") for a in trace)
        memory["grad_reduce_scatters_per_step"] = sum(a.endswith("GS") for a in trace)
    return memory


def _logs_lines(no_progress: bool, stream: TextIO) -> bool:
    """A redrawn bar only on a terminal: in a SLURM or redirected log carriage returns would put
    every iteration on one line, so there it logs lines as with ``--no-progress``."""
    if no_progress:
        return True
    isatty = getattr(stream, "isatty", None)
    return not (callable(isatty) and isatty())


class _Progress:
    """Rank 0's progress line, redrawn on a terminal, else one per ``--log-interval`` iterations."""

    def __init__(
        self, enabled: bool, no_progress: bool, total: int, log_interval: int, stream: TextIO
    ) -> None:
        self.enabled = enabled
        self.lines = _logs_lines(no_progress, stream)
        self.total = total
        self.log_interval = log_interval
        self.stream = stream
        self.drawn = False

    def update(self, iteration: int, loss: float, step_time: float, lr: float) -> None:
        if not self.enabled:
            return
        text = (
            f"iteration {iteration:>{len(str(self.total))}}/{self.total} | lm loss {loss:.6f} | "
            f"step {step_time * 1000:7.1f} ms | lr {lr:.3e}"
        )
        if self.lines:
            if iteration % self.log_interval == 0 or iteration == self.total:
                print(text, file=self.stream, flush=True)
        else:
            self.stream.write("\r" + text)
            self.stream.flush()
            self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


@dataclasses.dataclass
class _Run:
    """What one rank trains with, set up once (mutable: the iteration advances)."""

    args: Any
    device: torch.device
    model: list[Any]
    optimizer: Any
    scheduler: Any
    config: RunConfig
    forward_backward: Any
    data: TrainingData | IndexedTrainingData
    dp_rank: int
    dp_size: int
    num_microbatches: int
    iteration: int
    consumed_samples: int  # the data position: the next sample's global index


@dataclasses.dataclass(frozen=True)
class _Step:
    loss: float
    grad_norm: float | None
    lr: float
    step_time: float
    schedule_plans: int  # forwards run as megatron-core schedule plans (its combined step)


def train(args: Any, *, store: Any = None) -> TrainResult:
    """Run ``args`` (a parsed ``bfpp-train`` namespace) on this rank; collective."""
    from megatron.core import parallel_state

    device = init_distributed(store, timeout_s=60.0 * args.distributed_timeout_minutes)
    # launched by torchrun or srun: no launcher of ours speaks for the job (see .liveness)
    liveness = start_liveness(dist.get_rank(), dist.get_world_size()) if store is None else None
    lock = None
    try:
        if store is None:  # our launcher holds --save's lock; under torchrun rank 0 takes it
            lock = _take_save_lock(args)
        _check_gpu_memory(args, device)
        return _loop(_set_up(args, device))
    except Exception as error:
        if liveness is not None and not isinstance(error, OtherRankFailed):
            verdict = liveness.judge(error)
            if verdict is Verdict.QUIET:
                raise OtherRankFailed("another rank reports") from None
            if isinstance(verdict, RanksLost):
                raise verdict from None
        raise
    finally:
        if lock is not None:
            lock.release()
        if liveness is not None:
            liveness.stop.set()
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _take_save_lock(args: Any) -> Any:
    """Rank 0 takes ``--save``'s lock (:mod:`.save_lock`); every rank learns if it could not."""
    from megatron_bfpp.train.save_lock import SaveLock

    if args.save is None:
        return None
    lock, error = None, None
    if dist.get_rank() == 0:
        try:
            lock = SaveLock.acquire(args.save)
        except CheckpointError as failure:
            error = failure
    _agree(error)
    return lock


def _check_gpu_memory(args: Any, device: torch.device) -> None:
    """The model's weights, gradients and Adam state on this rank against its GPU, before the
    model is built (:mod:`.model_memory`; the command line checks RAM on CPU-only machines)."""
    if device.type != "cuda" or getattr(args, "no_memory_check", False):
        return
    run = run_config(args, dist.get_world_size())
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    bf16 = run.training.bf16
    if problem := memory_problem(
        run.model, run.layout, local_ranks=1, gpu_bytes=gpu_bytes, bf16=bf16
    ):
        raise ValueError(problem)


def _set_up(args: Any, device: torch.device) -> _Run:
    """Parallel state, seeds, model, optimizer, checkpoint and the schedule's function."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_bfpp.runtime import get_forward_backward_func

    tp, pp, vp = _layout(args)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        expert_model_parallel_size=args.expert_model_parallel_size,
        # megatron-core's groups default to 30 minutes; this bounds every wait (runtime.p2p)
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)

    run_cfg = run_config(args, dist.get_world_size())
    shape = run_cfg.model
    if shape.num_experts:
        from megatron_bfpp.megatron.patches import moe_without_transformer_engine

        moe_without_transformer_engine()
    config = transformer_config(
        shape,
        tp=tp,
        pp=pp,
        vp=vp,
        on_cpu=device.type == "cpu",
        ep=args.expert_model_parallel_size,
        dispatcher=args.moe_token_dispatcher_type,
        bf16=args.bf16,
        overlap=args.overlap_moe_expert_parallel_comm,
        **run_cfg.layout.uneven_config(),
    )
    placement = get_spec(args.pipeline_schedule).placement
    chunks = build_model_chunks(config, shape, seed=args.seed, placement=placement)
    if args.bf16:  # as Megatron-LM's get_model: fp32 in and out at the pipeline's ends
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, chunk) for chunk in chunks]
    model = wrap_ddp(chunks, use_distributed_optimizer=True)
    policy = scheduler_policy(args)
    optimizer, scheduler = _optimizer_and_scheduler(args, model, run_cfg, policy)
    iteration, consumed_samples = 0, 0
    if args.load and fresh_start_reason(args.load) is None:  # else: start fresh (the CLI said)
        iteration, consumed_samples = load_checkpoint(
            args.load,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            run=run_cfg,
            scheduler_policy=policy,
        )
    forward_backward = get_forward_backward_func(
        args.pipeline_schedule,
        measure_memory=_logs_metrics(args),
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        **options_from_args(args.pipeline_schedule, args),
    )
    dp_size = parallel_state.get_data_parallel_world_size()
    return _Run(
        args=args,
        device=device,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        config=run_cfg,
        forward_backward=forward_backward,
        data=training_data(args),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=dp_size,
        num_microbatches=args.global_batch_size // (args.micro_batch_size * dp_size),
        iteration=iteration,
        consumed_samples=consumed_samples,
    )


def _layout(args: Any) -> tuple[int, int, int | None]:
    vp = args.num_virtual_stages_per_pipeline_rank
    return (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        vp if vp and vp > 1 else None,
    )


def _loop(run: _Run) -> TrainResult:
    """Iterations until ``--train-iters`` (or ``--exit-interval``), with progress, metrics and
    checkpoints; a checkpoint at the end unless the last iteration was just saved."""
    args, rank0 = run.args, dist.get_rank() == 0
    writers = _metric_writers(run) if rank0 else []
    shown = rank0 and args.train_iters > run.iteration
    progress = _Progress(shown, args.no_progress, args.train_iters, args.log_interval, sys.stdout)
    if rank0 and progress.lines:
        tp, pp, vp = _layout(args)
        shape = run.config.model
        experts = (
            f" ({shape.num_experts} experts, top {shape.router_topk})" if shape.num_experts else ""
        )
        ep = f" ep={args.expert_model_parallel_size}" if args.num_experts else ""
        overlap = " with the all-to-all overlap" * args.overlap_moe_expert_parallel_comm
        print(
            f"bfpp-train: {args.model} {args.num_layers} layers{experts}, hidden "
            f"{args.hidden_size}, {'bf16' if args.bf16 else 'fp32'}, tp={tp} pp={pp} "
            f"vp={vp or 1} dp={run.dp_size}{ep}, {run.num_microbatches} micro-batches "
            f"per step, schedule {args.pipeline_schedule}{overlap}, device {run.device.type}, from "
            f"iteration {run.iteration} ({run.consumed_samples} samples consumed)",
            flush=True,
        )
    losses: list[tuple[int, float]] = []
    last_saved, finished = run.iteration if args.load and run.iteration else -1, False
    try:
        while run.iteration < args.train_iters:
            step = _train_step(run)
            losses.append((run.iteration, step.loss))
            progress.update(run.iteration, step.loss, step.step_time, step.lr)
            memory = _memory_per_pipeline_rank(run) if _logs_metrics(args) else {}
            if writers:
                record = _metrics_record(run, step, memory)
                for writer in writers:
                    writer.write(record)
            if args.save and args.save_interval and run.iteration % args.save_interval == 0:
                _save(run)
                last_saved = run.iteration
            if args.exit_interval and run.iteration % args.exit_interval == 0:
                break  # Megatron-LM's --exit-interval: stop here (checkpoint below)
        if args.save and last_saved != run.iteration:
            _save(run)
        finished = True
    finally:
        progress.close()
        _close_all(writers, quietly=not finished)  # else the error on its way up is the report
    return TrainResult(losses=losses)


def _close_all(writers: list[MetricWriter], *, quietly: bool) -> None:
    """Close every writer even when one fails; the first failure is raised unless ``quietly``."""
    first: Exception | None = None
    for writer in writers:
        try:
            writer.close()
        except Exception as error:
            first = first or error
    if first is not None and not quietly:
        raise first


def _logs_metrics(args: Any) -> bool:
    """Whether any per-iteration record is written (then the step measures memory for it)."""
    return bool(args.metrics_file or args.tensorboard_dir or args.wandb_project)


def _metric_writers(run: _Run) -> list[MetricWriter]:
    """Rank 0's writers of the per-iteration record, one per destination asked for."""
    args = run.args
    first = "pipeline_schedule model num_layers hidden_size tensor_model_parallel_size"
    config = {key: getattr(args, key) for key in [*first.split(), "pipeline_model_parallel_size"]}
    config.update(data_parallel_size=run.dp_size, num_microbatches=run.num_microbatches)
    for key in ("global_batch_size", "micro_batch_size", "seq_length", "lr"):
        config[key] = getattr(args, key)
    builders: dict[str, Callable[[], MetricWriter]] = {
        "--metrics-file": lambda: JsonlWriter.open(args.metrics_file, append=bool(args.load)),
        "--tensorboard-dir": lambda: TensorBoardWriter(args.tensorboard_dir, config=config),
        "--wandb-project": lambda: WandbWriter(
            args.wandb_project,
            name=args.wandb_exp_name,
            save_dir=args.wandb_save_dir,
            config=config,
        ),
    }
    targets = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in builders}
    return [GuardedWriter(f, targets[f], build) for f, build in builders.items() if targets[f]]


def _train_step(run: _Run) -> _Step:
    """One iteration: this rank's micro-batches through the schedule, then the optimizer."""
    args, start = run.args, time.perf_counter()
    batches = run.data.microbatches(
        first_sample=run.consumed_samples,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        dp_rank=run.dp_rank,
        dp_size=run.dp_size,
    )
    for chunk in run.model:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    iterators: Any = [iter(batches) for _ in run.model]
    plans = 0

    def step_func(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> Any:
        nonlocal plans
        plans += return_schedule_plan
        return forward_step(run.device, data_iterator, model, return_schedule_plan)

    store = run.forward_backward(
        forward_step_func=step_func,
        data_iterator=iterators if len(run.model) > 1 else iterators[0],
        model=run.model,
        num_microbatches=run.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    # Megatron-LM's lm loss: [loss, tokens] summed over micro-batches and the world (last stages')
    total = torch.zeros(2, dtype=torch.float64, device=run.device)
    for item in store:
        total += item["lm loss"].to(device=run.device, dtype=torch.float64)
    dist.all_reduce(total)
    loss = float(total[0] / total[1]) if total[1] > 0 else float("nan")
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"lm loss is {loss} at iteration {run.iteration + 1}: training diverged "
            "(try a lower --lr)"
        )
    _check_gradients(run, loss)
    if run.args.data_parallel_sharding_strategy == "optim":
        ok, grad_norm, _ = run.optimizer.step()
    else:
        from megatron_bfpp.runtime import sharded_optimizer_step

        ok, grad_norm, _ = sharded_optimizer_step(run.optimizer, run.model)
    if ok:
        run.scheduler.step(increment=args.global_batch_size)
    run.iteration += 1
    run.consumed_samples += args.global_batch_size
    return _Step(
        loss=loss,
        grad_norm=None if grad_norm is None else float(grad_norm),
        lr=float(run.optimizer.param_groups[0]["lr"]),
        step_time=time.perf_counter() - start,
        schedule_plans=plans,
    )


def _check_gradients(run: _Run, loss: float) -> None:
    """Megatron-LM's gradient NaN check, always on (fp32: no scaler); all ranks stop alike."""
    from megatron_bfpp.runtime import gradients_finite

    sharded = run.args.data_parallel_sharding_strategy != "optim"
    finite = gradients_finite(run.model, sharded=sharded)
    bad = torch.tensor([0 if finite else 1], dtype=torch.int64, device=run.device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        raise FloatingPointError(
            f"iteration {run.iteration + 1}: the gradient norm is not finite (NaN or inf) though "
            f"the lm loss is ({loss:.6g}): stopped before the optimizer step"
            f"{_kept_checkpoint(run.args)}; try a lower --lr"
        )


def _kept_checkpoint(args: Any) -> str:
    """The latest checkpoint (tracker, as resume reads it) of a run stopped before a bad step."""
    if not args.save:
        return "; nothing was saved (no --save)"
    try:
        latest = read_tracker(args.save)
    except CheckpointError:
        return f"; --save {args.save} holds no checkpoint"
    return f"; the latest checkpoint in --save {args.save} stays iteration {latest}"


def _metrics_record(run: _Run, step: _Step, memory: dict[str, Any]) -> dict[str, Any]:
    args = run.args
    return {
        "iteration": run.iteration,
        "consumed_samples": run.consumed_samples,
        "lm_loss": step.loss,
        "step_time_s": step.step_time,
        "pipeline_schedule": args.pipeline_schedule,
        "lr": step.lr,
        # strict JSON: a non-finite norm is null (metric_writers.scalars says when one occurs)
        "grad_norm": step.grad_norm if math.isfinite(step.grad_norm or 0.0) else None,
        "tokens_per_s": args.global_batch_size * args.seq_length / step.step_time,
        "num_microbatches": run.num_microbatches,
        "schedule_plans": step.schedule_plans,  # this rank's, with the all-to-all overlap
        **memory,
    }


def _save(run: _Run) -> None:
    from megatron_bfpp.runtime.sharding import sharded_parameters

    args = run.args
    # fully sharded: nothing gathered at once (``gather_chunk``); either strategy resumes either
    sharded = args.data_parallel_sharding_strategy != "optim"
    gather_chunk = (
        (lambda index: sharded_parameters(run.model).whole([index]))
        if sharded and args.ckpt_format == "torch"
        else None
    )
    path = save_checkpoint(
        args.save,
        ckpt_format=args.ckpt_format,
        iteration=run.iteration,
        consumed_samples=run.consumed_samples,
        model=run.model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        run=run.config,
        gather_chunk=gather_chunk,
        sharded=sharded,
    )
    if dist.get_rank() == 0 and _logs_lines(args.no_progress, sys.stdout):
        print(f"saved checkpoint {path}", flush=True)
