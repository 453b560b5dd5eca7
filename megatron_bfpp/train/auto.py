"""``bfpp-train --pipeline-schedule auto``: the run's flags as an
:class:`~megatron_bfpp.plan.auto.AutoRequest`, decided before any rank builds a model and written
back into the flags as if the user had named the schedule (:mod:`megatron_bfpp.megatron.auto`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from megatron_bfpp.config.run_config import UnevenStages, layout_of, model_shape
from megatron_bfpp.megatron.auto import (
    announce,
    auto_inputs,
    decide_alike,
    hardware_from_args,
    precision_of,
    probe_device,
)
from megatron_bfpp.plan.auto import AUTO, AUTO_DEST, AutoRequest, Decision, gpus_per_node_from_env
from megatron_bfpp.plan.presets import model_description

__all__ = ["resolve_train_auto", "train_request"]


def train_request(
    args: argparse.Namespace,
    world_size: int,
    *,
    env: Mapping[str, str],
    device: tuple[str | None, int | None] | None,
) -> AutoRequest:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    shape = model_shape(args)
    model = model_description(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        seq_length=shape.seq_length,
        gated=shape.preset == "llama",
        ffn_default="bfpp-train",
        ffn_hidden_size=shape.ffn_hidden_size,
        num_query_groups=shape.num_query_groups,
        vocab_size=shape.vocab_size,
        dropout=False,  # bfpp-train's models train without dropout
        moe={
            "num_experts": shape.num_experts,
            "moe_router_topk": shape.moe_router_topk,
            "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
        },
    )
    return AutoRequest(
        model=model,
        tp=tp,
        pp=pp,
        dp=world_size // (tp * pp),
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        hardware=hardware_from_args(args, device=device),
        precision=precision_of(sixteen_bit=args.bf16),
        sharding=args.data_parallel_sharding_strategy,
        gpus_per_node=gpus_per_node_from_env(env, world_size),
        vp=args.num_virtual_stages_per_pipeline_rank,
        group_size=args.breadth_first_group_size,
        max_stored=args.bpipe_max_stored,
        sequence_parallel=False,  # bfpp-train's presets (train.presets)
        ep=args.expert_model_parallel_size,
        moe_overlap=args.overlap_moe_expert_parallel_comm,
        uneven=UnevenStages.read(args),
    )


def resolve_train_auto(args: argparse.Namespace, world_size: int) -> Decision | None:
    """Decide, announce (rank 0) and write the choice into ``args``; ``None`` without auto.
    Raises ``ScheduleError``."""
    if args.pipeline_schedule != AUTO:
        return None
    if world_size % (args.tensor_model_parallel_size * args.pipeline_model_parallel_size):
        return None  # the flags' own check says it in their words
    device = probe_device()  # CUDA's name and memory, asked of torch
    env = os.environ
    inputs = auto_inputs(
        profile_path=args.pipeline_schedule_auto_profile,
        gpu_flag=args.pipeline_schedule_auto_gpu,
        device=device,
        env=env,
    )
    decision = decide_alike(
        lambda: train_request(args, world_size, env=env, device=device), inputs=inputs, env=env
    )
    announce(decision, report=args.pipeline_schedule_auto_report, prog="bfpp-train", env=env)
    c = decision.chosen.candidate
    args.pipeline_schedule = c.schedule
    if decision.request.uneven.partition:  # --pipeline-model-parallel-layout auto: its choice
        args.pipeline_model_parallel_layout = layout_of(c.stage_layers)
    if not args.pipeline_model_parallel_layout:  # a layout string fixes them itself
        args.num_virtual_stages_per_pipeline_rank = decision.stages_per_rank
    args.breadth_first_group_size = c.group_size
    args.bpipe_max_stored = c.max_stored
    if c.combined_1f1b:  # chosen under --overlap-moe-expert-parallel-comm
        args.combined_1f1b = True
    setattr(args, AUTO_DEST, decision.line())
    return decision
