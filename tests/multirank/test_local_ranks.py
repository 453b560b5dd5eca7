"""The local process launcher on its own (no megatron-core): results by rank, the shared store,
failures by returned code and by exception, the grace period, the deadline and stack dumps."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_bfpp.local_ranks import fork_ranks
from tests.processes import left_alive


def test_results_environment_and_store() -> None:
    def target(rank: int, store: Any) -> tuple[int, str, str, str]:
        store.set(f"key{rank}", str(rank * 10))
        other = store.get(f"key{(rank + 1) % 3}").decode()  # waits until that rank set it
        return rank, os.environ["RANK"], os.environ["WORLD_SIZE"], other

    run = fork_ranks(target, 3, timeout=60)
    assert run.results == {0: (0, "0", "3", "10"), 1: (1, "1", "3", "20"), 2: (2, "2", "3", "0")}
    assert not run.errors and not run.killed and run.first_failed is None


def test_rank_0_hosts_the_store_until_every_rank_is_done() -> None:
    """Rank 0 hosts the store; ranks still sending through it (the NCCL emulation, said-once
    warnings) failed with "connection reset by peer" when rank 0 finished first and left."""

    def target(rank: int, store: Any) -> str:
        if rank == 0:
            return "first"
        time.sleep(0.5)
        store.set(f"late{rank}", "x")
        return store.get(f"late{rank}").decode()

    run = fork_ranks(target, 3, timeout=60)
    assert run.results == {0: "first", 1: "x", 2: "x"}
    assert not run.errors and not run.killed


def test_failed_result_starts_grace_then_kills_the_rest() -> None:
    def target(rank: int, store: Any) -> int:
        if rank == 1:
            return 3
        time.sleep(60)
        return 0

    # Ranks 0 and 2 would sleep 60 s and report 0: that they were killed without a result is
    # the property (no clock needed).
    run = fork_ranks(target, 3, error_grace=0.5, failed=lambda code: code != 0)
    assert run.first_failed == 1 and run.results == {1: 3}
    assert run.killed == (0, 2)  # after the grace: first_failed above, so not a timeout


def test_exception_is_reported_with_its_traceback() -> None:
    def target(rank: int, store: Any) -> int:
        if rank == 1:
            raise ValueError("rank one broke")
        return 0

    run = fork_ranks(target, 2, timeout=60, error_grace=5.0)
    assert run.first_failed == 1
    assert "ValueError: rank one broke" in run.errors[1]
    assert run.results == {0: 0}


def test_death_without_result_is_an_error() -> None:
    def target(rank: int, store: Any) -> int:
        if rank == 1:
            os._exit(7)
        return 0

    run = fork_ranks(target, 2, timeout=60, error_grace=5.0)
    assert "rank 1 died without a result (exit code 7)" in run.errors[1]
    assert run.lost == (1,) and run.culprit == 1


def test_timeout_kills_and_dumps_stacks(tmp_path: Path) -> None:
    def waits_here(rank: int, store: Any) -> int:
        time.sleep(60)
        return 0

    run = fork_ranks(waits_here, 2, timeout=2.0, stack_dir=tmp_path)
    # Killed with nothing failed: what the launchers report as a timeout (first_failed None).
    assert run.killed == (0, 1) and run.first_failed is None and not run.errors
    assert all("waits_here" in run.stacks[rank] for rank in (0, 1))


def test_bad_world_size_is_refused() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        fork_ranks(lambda rank, store: 0, 0)


def test_silent_rank_is_lost_and_blamed() -> None:
    def target(rank: int, store: Any) -> int:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
        return 0

    run = fork_ranks(target, 2, heartbeat_timeout=2.0, error_grace=0.5)
    assert run.first_failed == 1  # found by its silence, not by the run's timeout
    assert run.lost == (1,) and run.culprit == 1 and run.killed == (0,)
    assert "rank 1 stopped responding: no heartbeat for" in run.errors[1]


def test_culprit_is_the_lost_rank_even_if_another_reported_first() -> None:
    def target(rank: int, store: Any) -> int:
        if rank == 0:
            raise RuntimeError("connection closed by peer")  # what a survivor says
        time.sleep(0.5)
        os._exit(9)

    run = fork_ranks(target, 2, timeout=60, error_grace=5.0)
    assert run.first_failed == 0 and run.culprit == 1


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_processes_a_rank_started_end_with_it() -> None:
    """megatron-core's checkpoint writer starts a multiprocessing Manager in every rank; a rank
    leaves with os._exit, which skips multiprocessing's exit handlers: those processes outlived
    the job and held its output pipes open."""
    import multiprocessing

    def target(rank: int, store: Any) -> int:
        helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
        helper.start()
        return helper.pid or 0

    run = fork_ranks(target, 2, timeout=60)
    helpers = list(run.results.values())
    assert len(helpers) == 2 and all(helpers)
    left = left_alive(helpers)
    assert not left, f"processes left behind by the ranks: {left}"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_rank_the_launcher_kills_takes_its_processes_along(tmp_path: Path) -> None:
    import multiprocessing

    def target(rank: int, store: Any) -> int:
        helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
        helper.start()
        (tmp_path / f"helper{rank}").write_text(str(helper.pid))
        if rank == 1:
            return 3
        time.sleep(600)
        return 0

    run = fork_ranks(target, 2, error_grace=0.5, failed=lambda code: code != 0, timeout=60)
    assert run.killed == (0,)
    helpers = [int((tmp_path / f"helper{rank}").read_text()) for rank in (0, 1)]
    left = left_alive(helpers)
    assert not left, f"processes left behind by the ranks: {left}"
