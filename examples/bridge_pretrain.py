"""Megatron-Bridge's ``pretrain()`` with a megatron_bfpp pipeline schedule.

    torchrun --nproc-per-node 4 examples/bridge_pretrain.py --pipeline-schedule breadth-first

Without a GPU (the default on a CPU-only machine) it pretrains a tiny GPT on mock data on gloo
ranks, through the CPU redirects of ``megatron_bfpp.testing.bridge_cpu``. With GPUs, name a
Bridge recipe (``--recipe megatron.bridge.recipes.llama.llama3:llama3_8b_pretrain_config``, any
function returning a ``ConfigContainer``) and the script only sets the pipeline layout and the
schedule on it. The one line that matters for your own Bridge script is
``megatron_bfpp.megatron.bridge.use_schedule(config, name, **options)`` before ``pretrain``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from datetime import timedelta
from typing import Any

from megatron_bfpp.flags import OneLineParser, positive_int
from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.plan.auto import AUTO, add_auto_flags, check_auto_flags
from megatron_bfpp.schedules.registry import add_option_flags, options_from_args, schedule_names


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="bridge_pretrain.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--pipeline-schedule",
        default="breadth-first",
        metavar="{" + ",".join(("default", AUTO, *schedule_names())) + "}",
        help="default: Bridge's own (megatron-core's) schedule; auto: the planner picks one of "
        "ours for this layout (one line says which and why)",
    )
    add_option_flags(p, positive_int)
    add_auto_flags(p)
    p.add_argument("--pipeline-model-parallel-size", type=positive_int, default=2)
    p.add_argument(
        "--virtual-pipeline-model-parallel-size",
        type=positive_int,
        default=None,
        help="virtual stages per rank (default: 2 for interleaved and breadth-first, else 1)",
    )
    p.add_argument(
        "--pipeline-model-parallel-layout",
        default=None,
        help="Megatron's layout string (config.model.pipeline_model_parallel_layout), e.g. "
        "'E|t*2|t|tL'; a V places stage s on rank s or 2p-1-s",
    )
    p.add_argument("--train-iters", type=positive_int, default=3)
    p.add_argument("--global-batch-size", type=positive_int, default=8)
    p.add_argument("--micro-batch-size", type=positive_int, default=1)
    p.add_argument(
        "--recipe",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a Bridge recipe returning a ConfigContainer (GPUs); default: a tiny GPT on CPU",
    )
    p.add_argument(
        "--exact-losses",
        action="store_true",
        help="also print each iteration's exact loss (float.hex) and grad norm, for comparing "
        "schedules bit for bit",
    )
    return p


def tiny_gpt_config(args: argparse.Namespace) -> Any:
    """A 4-layer GPT on mock data that runs on CPU ranks: local layers, fp32, no fusions."""
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        DistributedInitConfig,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.core.transformer.enums import AttnBackend

    model = GPTModelProvider(
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=256,
        num_attention_heads=4,
        seq_length=64,
        vocab_size=128,
        make_vocab_size_divisible_by=128,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        bf16=False,
        transformer_layer_spec=local_layer_spec,
        attention_backend=AttnBackend.local,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        # On gloo, megatron-core's interleaved schedule with batched p2p (Bridge's default)
        # trained a different model here (grad norm 7.85 against 1.31 at iteration 1); one
        # message at a time gives the exact reference our breadth-first is compared with.
        batch_p2p_comm=False,
    )
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=1, global_batch_size=8, micro_batch_size=1),
        validation=ValidationConfig(eval_iters=0),
        optimizer=OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            min_lr=1e-3,
            weight_decay=0.01,
            clip_grad=1.0,
            bf16=False,
            params_dtype=torch.float32,
            use_distributed_optimizer=True,
        ),
        scheduler=SchedulerConfig(
            lr_decay_style="constant",
            lr_warmup_iters=0,
            start_weight_decay=0.01,
            end_weight_decay=0.01,
            weight_decay_incr_style="constant",
        ),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=True),
        dataset=MockGPTDatasetConfig(
            seq_length=64,
            random_seed=1234,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            dataloader_type="single",
            num_workers=0,
        ),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128),
        checkpoint=CheckpointConfig(save=None),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="gloo", use_gloo_process_groups=True),
        mixed_precision=None,
    )


def recipe_config(spec: str) -> Any:
    """The ConfigContainer a Bridge recipe returns, or one line saying why there is none."""
    module, _, function = spec.partition(":")
    try:
        recipe = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError, ValueError) as error:
        raise ScheduleError(f"--recipe {spec}: cannot load it ({error})") from None
    return recipe()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.recipe is not None and not args.recipe.partition(":")[2]:
        return _refuse(
            parser, ScheduleError(f"--recipe {args.recipe}: write it as MODULE:FUNCTION")
        )
    import torch

    on_cpu = not torch.cuda.is_available()
    imports: Any = contextlib.nullcontext()
    if on_cpu:
        from megatron_bfpp.testing.bridge_cpu import bridge_imports, enable_cpu_bridge

        enable_cpu_bridge()
        imports = bridge_imports()  # Bridge without Transformer Engine
    with imports:
        from megatron.bridge.training.gpt_step import forward_step
        from megatron.bridge.training.pretrain import pretrain

    try:
        config = recipe_config(args.recipe) if args.recipe else tiny_gpt_config(args)
    except ScheduleError as error:
        return _refuse(parser, error)
    config.model.pipeline_model_parallel_size = args.pipeline_model_parallel_size
    config.model.virtual_pipeline_model_parallel_size = args.virtual_pipeline_model_parallel_size
    config.model.pipeline_model_parallel_layout = args.pipeline_model_parallel_layout
    config.train.train_iters = args.train_iters
    config.train.global_batch_size = args.global_batch_size
    config.train.micro_batch_size = args.micro_batch_size
    name = args.pipeline_schedule
    if name != "default":
        from megatron_bfpp.megatron.bridge import use_schedule

        try:
            if name == AUTO:  # the options given are constraints on auto's choice
                options = {
                    key: value
                    for key, value in (
                        ("group_size", args.breadth_first_group_size),
                        ("max_stored", args.bpipe_max_stored),
                    )
                    if value is not None
                }
            else:
                check_auto_flags(args)
                options = options_from_args(name, args)
            use_schedule(
                config,
                name,
                auto_report=args.pipeline_schedule_auto_report,
                auto_profile=args.pipeline_schedule_auto_profile,
                auto_gpu=args.pipeline_schedule_auto_gpu,
                **options,
            )
        except ScheduleError as error:
            return _refuse(parser, error)
    elif args.microbatch_group_size_per_vp_stage is not None:
        # Bridge's own interleaved schedule with this group (all micro-batches in one group:
        # what breadth-first is compared with).
        config.model.microbatch_group_size_per_vp_stage = args.microbatch_group_size_per_vp_stage
    if on_cpu and args.exact_losses:
        from megatron_bfpp.testing.bridge_cpu import record_losses

        record_losses()
    pretrain(config, forward_step)
    return 0


def _refuse(parser: argparse.ArgumentParser, error: Exception) -> int:
    """One line per node, from local rank 0. Every rank checks, and torchrun stops the others as
    soon as one exits: under torchrun the other ranks first wait (at most 60 s) for local rank
    0 to say it printed, through the launcher's own store, so that it is not stopped first."""
    key = f"bfpp_refused/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    key += f"/{os.environ.get('GROUP_RANK', '0')}"
    store = _launcher_store()
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"{parser.prog}: error: {error}", file=sys.stderr, flush=True)
        if store is not None:
            store.set(key, "printed")
    elif store is not None:
        with contextlib.suppress(Exception):  # bounded: local rank 0 may have failed otherwise
            store.wait([key], timedelta(seconds=60))
    return 2


def _launcher_store() -> Any:
    """torchrun's store (its agent's, which outlives the workers), or None outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        import torch.distributed as dist

        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=60),
        )
    except Exception:  # no store to reach: print as before
        return None


if __name__ == "__main__":
    sys.exit(main())
