"""``--pipeline-schedule auto`` decides on every rank alike with no process group: four forked
ranks (torchrun's environment, its store up before any rank starts) each decide from the same
Megatron-LM arguments and compare their choices in the store; the decisions are equal, only rank
0 prints the line, and torch.distributed was never initialised on the way (so no collective can
have run before a model is built). Ranks that read different profiles under one relative path
stop, every one, with one line naming them, before rank 0 says anything."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_bfpp.local_ranks import fork_ranks

pytest.importorskip("torch")

WORLD = 4
PROFILES = Path(__file__).resolve().parents[2] / "docs" / "profiles"


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
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # as torchrun: its store is up already
    args = _megatron_args()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        decision = resolve_megatron_auto(args, sharding=None, device=probe_device())
    assert decision is not None
    initialised = dist.is_initialized()
    _leave_together(rank, store)
    return decision.to_dict(), printed.getvalue(), initialised


def _leave_together(rank: int, store: Any) -> None:
    """Wait for every rank at the launcher's store, which rank 0 hosts here (torchrun's agent
    does in a job): leaving first, it would take the store away from ranks still reading it."""
    store.add("decided", 1)
    while int(store.add("decided", 0)) < WORLD:
        time.sleep(0.05)
    store.add("left", 1)  # the last store call of ranks 1..n-1; rank 0 waits for all of them
    while rank == 0 and int(store.add("left", 0)) < WORLD:
        time.sleep(0.05)


def _decide_in_own_directory(rank: int, store: Any, root: str) -> tuple[str, str]:
    """Ranks 0-1 and 2-3 run in two working directories, each with its own ``profile.json``
    (the same relative path, other contents): what the rank raised and what it printed."""
    from megatron_bfpp.ir import ScheduleError
    from megatron_bfpp.megatron.auto import resolve_megatron_auto

    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    os.chdir(Path(root) / ("a" if rank < 2 else "b"))
    args = _megatron_args()
    args.pipeline_schedule_auto_profile = "profile.json"
    args.pipeline_schedule_auto_gpu = "h100-80gb"
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            resolve_megatron_auto(args, sharding=None, device=(None, None))
        raised = ""
    except ScheduleError as error:
        raised = str(error)
    _leave_together(rank, store)
    return raised, printed.getvalue()


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


def test_ranks_that_read_different_profiles_stop_in_one_line_before_any_output(
    tmp_path: Path,
) -> None:
    """The same relative profile path in two working directories: two profiles, two choices
    (interleaved vp=4 and v-zb). Every rank stops with the same one line, naming both groups of
    ranks, what they read and chose; rank 0 printed no choice."""
    for name, profile in (("a", "h100-gpt3-6.7b.json"), ("b", "h100-gpt3-175b.json")):
        (tmp_path / name).mkdir()
        shutil.copy(PROFILES / profile, tmp_path / name / "profile.json")
    digests = {
        name: hashlib.sha256((tmp_path / name / "profile.json").read_bytes()).hexdigest()[:12]
        for name in ("a", "b")
    }
    run = fork_ranks(
        lambda rank, store: _decide_in_own_directory(rank, store, str(tmp_path)),
        WORLD,
        timeout=300,
        daemon=True,
    )
    assert not run.errors, run.errors
    results = [run.results[rank] for rank in range(WORLD)]
    assert [printed for _, printed in results] == [""] * WORLD
    lines = {raised for raised, _ in results}
    assert lines == {
        "--pipeline-schedule auto: the ranks chose differently, their profile differs (ranks "
        f"0-1: profile.json sha256 {digests['a']} -> interleaved vp=4; ranks 2-3: profile.json "
        f"sha256 {digests['b']} -> v-zb); give every rank the same profile, by an absolute path "
        "every node reads, or name the schedule"
    }


def _only_rank_0_decides(rank: int, store: Any) -> str:
    from megatron_bfpp.ir import ScheduleError
    from megatron_bfpp.megatron.auto import agree_across_ranks

    raised = ""
    if rank == 0:  # rank 1 stands for a rank that stopped before deciding
        env = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True"}
        try:
            agree_across_ranks({"decision": "v-zb"}, env=env, timeout=1.0)
        except ScheduleError as error:
            raised = str(error)
    store.add("left", 1)
    while rank == 0 and int(store.add("left", 0)) < 2:
        time.sleep(0.05)
    return raised


def test_a_rank_that_never_decides_is_named_after_the_wait() -> None:
    run = fork_ranks(_only_rank_0_decides, 2, timeout=120, daemon=True)
    assert not run.errors, run.errors
    assert run.results[0] == (
        "--pipeline-schedule auto: rank 1 did not decide within 1 s; see its log"
    )
