"""Under torchrun or srun (no launcher of ours holds ``--save``'s lock) rank 0 takes it inside
the job, and every rank learns when it could not: rank 0 raises the one line, the others stop
quietly."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.testing.multirank import run_ranks
from megatron_bfpp.train.save_lock import SaveLock

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(120)]


def take(save: str) -> str:
    from megatron_bfpp.train.checkpoint import OtherRankFailed
    from megatron_bfpp.train.checkpoint_files import CheckpointError
    from megatron_bfpp.train.trainer import _take_save_lock

    try:
        lock = _take_save_lock(argparse.Namespace(save=save))
    except CheckpointError as error:
        return f"refused: {error}"
    except OtherRankFailed:
        return "quiet"
    if lock is None:
        return "no lock"
    lock.release()
    return "locked"


def test_rank_zero_takes_the_lock_and_every_rank_learns_a_refusal(tmp_path: Path) -> None:
    save = str(tmp_path / "ckpt")
    assert run_ranks(take, world_size=2, args=(save,)) == ["locked", "no lock"]
    held = SaveLock.acquire(save)
    try:
        results = run_ranks(take, world_size=2, args=(save,))
    finally:
        held.release()
    assert results[0].startswith(f"refused: --save {save}: another run is saving there (pid ")
    assert results[1] == "quiet"
