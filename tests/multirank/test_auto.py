"""``--pipeline-schedule auto`` decides on every rank alike with no communication: four forked
ranks (torchrun's environment, no process group at all) each decide from the same Megatron-LM
arguments; the decisions are equal, only rank 0 prints the line, and torch.distributed was never
initialised on the way (so no collective can have run before a model is built)."""

from __future__ import annotations

import contextlib
import io
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_bfpp.local_ranks import fork_ranks

pytest.importorskip("torch")

WORLD = 4


def _megatron_args() -> SimpleNamespace:
    """Megatron-LM's parsed arguments as validate_args receives them (the ones auto reads)."""
    return SimpleNamespace(
        pipeline_schedule="auto",
        num_layers=16,
        hidden_size=1024,
        num_attention_heads=16,
        seq_length=1024,
        ffn_hidden_size=None,
        vocab_size=None,
        tokenizer_type="GPT2BPETokenizer",
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=4,
        context_parallel_size=1,
        micro_batch_size=1,
        global_batch_size=16,
        recompute_granularity=None,
        bf16=True,
        use_distributed_optimizer=True,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        num_virtual_stages_per_pipeline_rank=None,
        num_layers_per_virtual_pipeline_stage=None,
        breadth_first_group_size=None,
        bpipe_max_stored=None,
        pipeline_schedule_auto_report=None,
        pipeline_schedule_auto_profile=None,
        pipeline_schedule_auto_gpu="a100-40gb",
        world_size=None,
    )


def _decide_on_this_rank(rank: int, store: Any) -> tuple[dict[str, Any], str, bool]:
    import torch.distributed as dist

    from megatron_bfpp.megatron.auto import probe_device, resolve_megatron_auto

    assert os.environ["RANK"] == str(rank)
    args = _megatron_args()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        decision = resolve_megatron_auto(args, sharding=None, device=probe_device())
    assert decision is not None
    initialised = dist.is_initialized()
    # Only now, after deciding: wait for every rank at the launcher's store, which rank 0 hosts
    # (leaving first, it would take the store away from ranks still connecting to it).
    store.add("decided", 1)
    while int(store.add("decided", 0)) < WORLD:
        time.sleep(0.05)
    store.add("left", 1)  # the last store call of ranks 1..n-1; rank 0 waits for all of them
    while rank == 0 and int(store.add("left", 0)) < WORLD:
        time.sleep(0.05)
    return decision.to_dict(), printed.getvalue(), initialised


def test_every_rank_reaches_the_same_decision_without_communicating() -> None:
    run = fork_ranks(_decide_on_this_rank, WORLD, timeout=300, daemon=True)
    assert not run.errors, run.errors
    results = [run.results[rank] for rank in range(WORLD)]
    decisions = [decision for decision, _, _ in results]
    assert all(decision == decisions[0] for decision in decisions)
    printed = [text for _, text, _ in results]
    assert printed[0].count("megatron_bfpp: auto: ") == 1 and not any(printed[1:])
    assert not any(initialised for _, _, initialised in results)
    assert decisions[0]["layout"]["data_parallel"] == 1  # WORLD_SIZE 4 / (tp 1 x pp 4)
