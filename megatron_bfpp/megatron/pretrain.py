"""``bfpp-train``'s training loop on megatron-core alone (one process = one rank).

:func:`train` runs on every rank: process group (NCCL on GPUs, gloo plus the CPU adapter on a
CPU-only machine), megatron-core parallel state, the preset model's chunks (one per virtual
stage, initialised by global layer), megatron-core DDP and the distributed optimizer (Adam), a
warm-up + cosine learning-rate schedule (megatron-core's ``OptimizerParamScheduler``), and one
``get_forward_backward_func(schedule)`` call per iteration from :mod:`megatron_bfpp`.

The loss is reported as Megatron-LM does: the last pipeline stage sums ``[loss, tokens]`` over its
micro-batches, the sum is reduced over data-parallel ranks, and ``lm_loss = loss / tokens``.
Rank 0 shows progress and writes ``--metrics-file`` (one JSON object per iteration).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any, TextIO

import torch
import torch.distributed as dist

from megatron_bfpp.megatron.data import Batch, TrainingData
from megatron_bfpp.megatron.presets import (
    ModelShape,
    build_model_chunks,
    transformer_config,
    unwrap,
)
from megatron_bfpp.schedules.registry import options_from_args

__all__ = ["TrainResult", "model_shape", "train"]

MODEL_FLAGS = (
    "model",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "seq_length",
    "vocab_size",
)


@dataclasses.dataclass
class TrainResult:
    """What rank 0 saw: (iteration, lm_loss) per iteration run by this process."""

    losses: list[tuple[int, float]]


def model_shape(args: Any) -> ModelShape:
    return ModelShape(
        preset=args.model,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
    )


# --------------------------------------------------------------------------- setup


def init_distributed(store: Any = None, timeout_s: float = 600.0) -> torch.device:
    """Process group from the environment (torchrun / our launcher). GPU: NCCL on
    ``cuda:LOCAL_RANK``. CPU only: gloo, and megatron-core's CUDA calls redirected to the CPU."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    kwargs: dict[str, Any] = dict(rank=rank, world_size=world_size)
    kwargs["timeout"] = timedelta(seconds=timeout_s)
    if store is not None:
        kwargs["store"] = store
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", **kwargs)
        return device
    from megatron_bfpp.testing.cpu import enable_cpu_megatron  # the one CPU/gloo adapter

    # megatron-core 0.16 calls these by their old names; torch warns once per rank
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )

    torch.set_num_threads(1)
    enable_cpu_megatron()
    dist.init_process_group("gloo", **kwargs)
    return torch.device("cpu")


def wrap_ddp(
    model_chunks: Sequence[torch.nn.Module],
    *,
    overlap_grad_reduce: bool = False,
    use_distributed_optimizer: bool = False,
    overlap_param_gather: bool = False,
    bucket_size: int | None = None,
    **ddp_overrides: Any,
) -> list[Any]:
    """Wrap each chunk in megatron-core DDP and set the config hooks as Megatron-LM's training
    setup does: ``no_sync_func``, ``grad_sync_func`` / ``param_sync_func`` (with overlap) and
    ``finalize_model_grads_func``. Chunks after the first get ``disable_bucketing=True``."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    config: Any = unwrap(model_chunks[0]).config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_param_gather=overlap_param_gather,
        bucket_size=bucket_size,
        **ddp_overrides,
    )
    wrapped = [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0
        )
        for index, chunk in enumerate(model_chunks)
    ]
    for chunk in wrapped:
        chunk.broadcast_params()
    no_sync = [chunk.no_sync for chunk in wrapped]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if overlap_grad_reduce:
        grad_sync = [chunk.start_grad_sync for chunk in wrapped]
        config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    if overlap_param_gather:
        param_sync = [chunk.start_param_sync for chunk in wrapped]
        config.param_sync_func = param_sync[0] if len(param_sync) == 1 else param_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def _optimizer_and_scheduler(args: Any, model: list[Any]) -> tuple[Any, Any]:
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
            bf16=False,
            fp16=False,
            params_dtype=torch.float32,
        ),
        model,
    )
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        # megatron-core needs warm-up < decay: a run shorter than the warm-up warms up less
        lr_warmup_steps=min(args.lr_warmup_iters, args.train_iters - 1) * gbs,
        lr_decay_steps=args.train_iters * gbs,
        lr_decay_style="cosine",
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


# --------------------------------------------------------------------------- steps


def _loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron-LM ``pretrain_gpt.loss_func``: summed masked token loss, token count, and
    ``{"lm loss": [summed loss, tokens]}`` for reporting."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(
    device: torch.device, data_iterator: Iterator[Batch], model: torch.nn.Module
) -> tuple[Any, Any]:
    batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


def _reduce_loss(store: list[dict[str, torch.Tensor]], device: torch.device) -> float:
    """Megatron-LM's reporting: sum ``[loss, tokens]`` over micro-batches and data-parallel
    ranks. Reduced over the world (only last-stage ranks contribute) so every rank knows it."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for item in store:
        total += item["lm loss"].to(device=device, dtype=torch.float64)
    dist.all_reduce(total)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


def _memory_per_pipeline_rank(forward_backward: Any, device: torch.device) -> dict[str, Any]:
    """The step's measured activation memory, one entry per pipeline rank (of this rank's
    tensor/data-parallel replica), gathered over the pipeline group: collective, every rank
    calls it."""
    from megatron.core import parallel_state

    report = forward_backward.last_memory
    cuda = report.cuda_max_memory_allocated
    mine = torch.tensor(
        [
            report.peak_activation_bytes,
            report.peak_stored_microbatches,
            -1 if cuda is None else cuda,
        ],
        dtype=torch.int64,
        device=device,
    )
    group = parallel_state.get_pipeline_model_parallel_group()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    rows = [[int(v) for v in t.tolist()] for t in gathered]
    memory: dict[str, Any] = {
        "peak_activation_bytes": [row[0] for row in rows],
        "peak_stored_microbatches": [row[1] for row in rows],
    }
    if cuda is not None:
        memory["cuda_max_memory_allocated"] = [row[2] for row in rows]
    return memory


class _Progress:
    """One line on rank 0, redrawn with a carriage return; ``--no-progress`` logs lines."""

    def __init__(self, enabled: bool, lines: bool, total: int, log_interval: int) -> None:
        self.enabled = enabled
        self.lines = lines
        self.total = total
        self.log_interval = log_interval
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
                print(text, flush=True)
        else:
            sys.stdout.write("\r" + text)
            sys.stdout.flush()
            self.drawn = True

    def close(self) -> None:
        if self.drawn:
            sys.stdout.write("\n")
            sys.stdout.flush()


# --------------------------------------------------------------------------- main loop


def train(args: Any, *, store: Any = None) -> TrainResult:
    """Run ``args`` (a parsed ``bfpp-train`` namespace) on this rank; collective."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_bfpp.megatron.checkpoint import load_checkpoint
    from megatron_bfpp.runtime import get_forward_backward_func

    device = init_distributed(store)
    try:
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        vp = args.num_virtual_stages_per_pipeline_rank
        vp = vp if vp and vp > 1 else None
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
        )
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)

        shape = model_shape(args)
        config = transformer_config(shape, tp=tp, pp=pp, vp=vp, on_cpu=device.type == "cpu")
        model = wrap_ddp(
            build_model_chunks(config, shape, seed=args.seed), use_distributed_optimizer=True
        )
        optimizer, scheduler = _optimizer_and_scheduler(args, model)
        flags = {name: getattr(args, name) for name in MODEL_FLAGS}

        iteration = 0
        if args.load:
            iteration, _ = load_checkpoint(
                args.load, model=model, optimizer=optimizer, scheduler=scheduler, flags=flags
            )
        options = options_from_args(args.pipeline_schedule, args)
        forward_backward = get_forward_backward_func(
            args.pipeline_schedule, measure_memory=bool(args.metrics_file), **options
        )

        data = TrainingData(
            seq_length=args.seq_length,
            vocab_size=args.vocab_size,
            seed=args.seed,
            data_path=args.data_path,
        )
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        num_microbatches = args.global_batch_size // (args.micro_batch_size * dp_size)
        forward_step = functools.partial(_forward_step, device)

        rank0 = dist.get_rank() == 0
        metrics: TextIO | None = None
        if rank0 and args.metrics_file:
            metrics = open(args.metrics_file, "a" if args.load else "w")  # noqa: SIM115
        progress = _Progress(
            rank0 and args.train_iters > iteration,
            args.no_progress,
            args.train_iters,
            args.log_interval,
        )
        if rank0 and args.no_progress:
            print(
                f"bfpp-train: {args.model} {shape.num_layers} layers, hidden {shape.hidden_size}, "
                f"tp={tp} pp={pp} vp={vp or 1} dp={dp_size}, {num_microbatches} micro-batches per "
                f"step, schedule {args.pipeline_schedule}, device {device.type}, from iteration "
                f"{iteration}",
                flush=True,
            )
        losses: list[tuple[int, float]] = []
        last_saved = iteration if args.load else -1
        try:
            while iteration < args.train_iters:
                start = time.perf_counter()
                batches = data.microbatches(
                    iteration=iteration,
                    global_batch_size=args.global_batch_size,
                    micro_batch_size=args.micro_batch_size,
                    dp_rank=dp_rank,
                    dp_size=dp_size,
                )
                for chunk in model:
                    chunk.zero_grad_buffer()
                optimizer.zero_grad()
                iterators: Any = [iter(batches) for _ in model]
                store_ = forward_backward(
                    forward_step_func=forward_step,
                    data_iterator=iterators if len(model) > 1 else iterators[0],
                    model=model,
                    num_microbatches=num_microbatches,
                    seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size,
                    forward_only=False,
                )
                ok, grad_norm, _ = optimizer.step()
                if ok:
                    scheduler.step(increment=args.global_batch_size)
                loss = _reduce_loss(list(store_), device)
                iteration += 1
                step_time = time.perf_counter() - start
                lr = float(optimizer.param_groups[0]["lr"])
                losses.append((iteration, loss))
                if not math.isfinite(loss):
                    raise FloatingPointError(f"lm loss is {loss} at iteration {iteration}")
                progress.update(iteration, loss, step_time, lr)
                memory = (
                    _memory_per_pipeline_rank(forward_backward, device) if args.metrics_file else {}
                )
                if metrics is not None:
                    record = {
                        "iteration": iteration,
                        "lm_loss": loss,
                        "step_time_s": step_time,
                        "pipeline_schedule": args.pipeline_schedule,
                        "lr": lr,
                        "grad_norm": None if grad_norm is None else float(grad_norm),
                        "tokens_per_s": args.global_batch_size * args.seq_length / step_time,
                        "num_microbatches": num_microbatches,
                        **memory,
                    }
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                if args.save and args.save_interval and iteration % args.save_interval == 0:
                    _save(args, iteration, model, optimizer, scheduler, flags, progress)
                    last_saved = iteration
                if args.exit_interval and iteration % args.exit_interval == 0:
                    break  # Megatron-LM's --exit-interval: stop here (checkpoint below)
            if args.save and last_saved != iteration:
                _save(args, iteration, model, optimizer, scheduler, flags, progress)
        finally:
            progress.close()
            if metrics is not None:
                metrics.close()
        return TrainResult(losses=losses)
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _save(
    args: Any,
    iteration: int,
    model: list[Any],
    optimizer: Any,
    scheduler: Any,
    flags: dict[str, Any],
    progress: _Progress,
) -> None:
    from megatron_bfpp.megatron.checkpoint import save_checkpoint

    path = save_checkpoint(
        args.save,
        ckpt_format=args.ckpt_format,
        iteration=iteration,
        consumed_samples=iteration * args.global_batch_size,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        flags=flags,
    )
    if dist.get_rank() == 0 and args.no_progress:
        print(f"saved checkpoint {path}", flush=True)
