"""The schedule catalogue is the one place a schedule is declared: a new order-only schedule
added there (a generator and a registry entry, nothing else) appears in bfpp-sim, bfpp-train,
Megatron-LM's ``--pipeline-schedule`` and the runtime, which runs it, with the catalogue's
placement check."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.cli import sim as cli_sim
from megatron_bfpp.cli import train as cli_train
from megatron_bfpp.ir import Placement, ScheduleError
from megatron_bfpp.megatron import arguments
from megatron_bfpp.runtime import get_forward_backward_func
from megatron_bfpp.schedules import registry
from megatron_bfpp.schedules.gpipe import build_gpipe
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks

NEW = "gpipe-again"


@pytest.fixture
def new_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = registry.ScheduleSpec(NEW, "a new order-only schedule", build_gpipe, Placement.SINGLE)
    monkeypatch.setitem(registry.SCHEDULES, NEW, spec)


def _choices(parser: argparse.ArgumentParser, flag: str) -> list[str]:
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return list(action.choices or [])


def test_a_catalogue_entry_reaches_every_front_end(new_schedule: None) -> None:
    assert NEW in registry.schedule_names()
    assert NEW in _choices(cli_sim.build_parser(), "--schedule")
    assert get_forward_backward_func(NEW).schedule == NEW  # type: ignore[attr-defined]

    parser = arguments.add_schedule_arguments(argparse.ArgumentParser())
    assert NEW in _choices(parser, "--pipeline-schedule")
    megatron_args = argparse.Namespace(
        pipeline_schedule=NEW,
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=None,
        micro_batch_size=1,
        global_batch_size=8,
        data_parallel_size=1,
        breadth_first_group_size=None,
        bpipe_max_stored=None,
    )
    arguments.check_schedule_args(megatron_args)

    train_args = cli_train.build_parser().parse_args(["--pipeline-schedule", NEW])
    assert train_args.num_virtual_stages_per_pipeline_rank == 1  # the catalogue's default
    cli_train.validate(train_args, world_size=4)


def test_the_catalogue_placement_check_is_the_one_every_front_end_uses(
    new_schedule: None,
) -> None:
    with pytest.raises(ScheduleError, match=f"{NEW} runs one stage per rank; drop --vp"):
        registry.build_schedule(NEW, num_ranks=2, num_microbatches=2, num_chunks=2)
    train_args = cli_train.build_parser().parse_args(
        ["--pipeline-schedule", NEW, "--num-virtual-stages-per-pipeline-rank", "2"]
    )
    with pytest.raises(cli_train.FlagError, match="drop --num-virtual-stages-per-pipeline-rank"):
        cli_train.validate(train_args, world_size=4)
    megatron_args = argparse.Namespace(
        pipeline_schedule=NEW,
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        micro_batch_size=1,
        global_batch_size=8,
        data_parallel_size=1,
    )
    with pytest.raises(ScheduleError, match="drop --num-layers-per-virtual-pipeline-stage or"):
        arguments.check_schedule_args(megatron_args)


def _step(batches: list[M.Batch], schedule: str) -> tuple[list[float], dict[str, Any]]:
    from megatron_bfpp import get_forward_backward_func

    chunks = M.build_model_chunks(M.tiny_gpt_config())
    func = get_forward_backward_func(schedule)
    store = M.run_schedule(chunks, batches, forward_backward_func=func)
    grads = {name: shard.tensor for name, shard in M.grad_shards(chunks).items()}
    return M.losses_from_store(store), grads


def test_a_catalogue_entry_runs_on_megatron_core(new_schedule: None) -> None:
    """Nothing but the entry: the runtime executes it, as the schedule it copies (same order,
    so the same losses and gradients bit for bit)."""
    import torch

    batches = M.make_batches(4)
    new = run_ranks(_step, world_size=2, pp=2, args=(batches, NEW))
    old = run_ranks(_step, world_size=2, pp=2, args=(batches, "gpipe"))
    for (new_losses, new_grads), (old_losses, old_grads) in zip(new, old, strict=True):
        assert new_losses == old_losses
        assert new_grads.keys() == old_grads.keys()
        assert all(torch.equal(new_grads[name], old_grads[name]) for name in new_grads)


def test_option_flags_come_from_the_catalogue() -> None:
    parser = cli_train.build_parser()
    for option in registry.ALL_OPTIONS:
        assert any(option.flag in a.option_strings for a in parser._actions), option.flag
    megatron = arguments.add_schedule_arguments(argparse.ArgumentParser())
    owned = {o.flag for o in registry.ALL_OPTIONS if o.megatron_owned}
    ours = {f for a in megatron._actions for f in a.option_strings if f.startswith("--")}
    assert {o.flag for o in registry.ALL_OPTIONS} - owned <= ours
    assert not owned & ours  # Megatron-LM defines those itself
    sim = cli_sim.build_parser()
    assert {o.sim_flag for o in registry.ALL_OPTIONS} <= {
        f for a in sim._actions for f in a.option_strings
    }
