"""Run a function on N gloo ranks with megatron-core's parallel state set up; fast, never hangs
(forked by :func:`megatron_bfpp.local_ranks.fork_ranks`, as bfpp-train forks its own ranks)."""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from megatron_bfpp.local_ranks import LocalRun, fork_ranks

__all__ = ["RanksFailed", "preload_megatron", "run_ranks"]

DEFAULT_TIMEOUT = 120.0
ERROR_GRACE = 1.0  # seconds the other ranks get to report after the first error


class RanksFailed(RuntimeError):
    """One or more ranks raised, died or timed out. ``reports``: each rank's traceback, its stacks
    when killed, or "finished normally"; ``first_failed``: whose failure came first."""

    def __init__(
        self, summary: str, reports: dict[int, str], first_failed: int | None = None
    ) -> None:
        self.summary = summary
        self.reports = dict(reports)
        self.first_failed = first_failed  # None: nothing failed, something timed out
        body = "\n".join(
            f"----- rank {rank} -----\n{text.rstrip()}" for rank, text in sorted(reports.items())
        )
        super().__init__(f"{summary}\n{body}")


def preload_megatron() -> None:
    """Import torch and the megatron-core modules the tests use, once, in the parent."""
    import megatron.core.distributed
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.optimizer
    import megatron.core.parallel_state
    import megatron.core.pipeline_parallel.schedules
    import megatron.core.tensor_parallel  # noqa: F401

    from megatron_bfpp.megatron import cpu  # noqa: F401
    from megatron_bfpp.testing import models  # noqa: F401


def run_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    vp: int | None = None,
    ep: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
    args: Sequence[Any] = (),
    seed: int = 1234,
    error_grace: float = ERROR_GRACE,
    daemon: bool = True,
) -> list[Any]:
    """``fn(*args)``'s results (picklable) on ``world_size`` forked gloo ranks (``daemon=False``:
    ``fn`` may start processes); :class:`RanksFailed`, all children dead, if one fails or hangs."""
    if world_size < 1 or world_size % (tp * pp):
        raise ValueError(f"world_size={world_size} is not a multiple of tp*pp={tp * pp}")
    preload_megatron()

    def target(rank: int, store: Any) -> Any:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random as mrandom

        from megatron_bfpp.megatron.cpu import enable_cpu_megatron
        from megatron_bfpp.testing import nccl_emulation

        torch.set_num_threads(1)
        enable_cpu_megatron()
        limit = timedelta(seconds=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=limit
        )
        if os.environ.get(nccl_emulation.ENV) == "1":  # NCCL's rules on gloo: tests/conftest.py
            nccl_emulation.install()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
            expert_model_parallel_size=ep,
        )
        random.seed(seed)
        torch.manual_seed(seed)
        mrandom.model_parallel_cuda_manual_seed(seed)
        return fn(*args)

    with tempfile.TemporaryDirectory(prefix="bfpp-ranks-") as tmp:
        run = fork_ranks(
            target,
            world_size,
            timeout=timeout,
            error_grace=error_grace,
            store_timeout=timeout,
            after=_teardown,
            stack_dir=Path(tmp),
            daemon=daemon,
        )
    if run.errors or run.killed:
        raise _failure(run, timeout)
    if len(run.results) != world_size:  # rank 0 returned without ever reporting its port
        raise RanksFailed("rank 0 never reported the rendezvous port", {})
    return [run.results[rank] for rank in range(world_size)]


def _teardown() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _failure(run: LocalRun, timeout: float) -> RanksFailed:
    reports = dict(run.errors)
    for rank in run.killed:
        reports[rank] = "still running when killed; its stacks:\n" + run.stacks.get(rank, "")
    for rank in run.results:
        reports.setdefault(rank, "finished normally")
    first, stuck = run.first_failed, list(run.killed)
    if first is None:
        summary = f"timed out after {timeout:g} s; ranks still running: {stuck}"
    else:
        summary = f"rank {first} failed first"
        if len(run.failed_at) > 1:
            summary += f"; then ranks {sorted(set(run.failed_at) - {first})} failed"
        if stuck:
            summary += f"; killed ranks {stuck}"
    return RanksFailed(summary, reports, first_failed=first)
