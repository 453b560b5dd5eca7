"""A schedule whose GS comes before its chunk's last backward is refused before any work, on
every rank, under megatron-core DDP with ``overlap_grad_reduce`` (pp=2, dp=2): run anyway
(the validator bypassed, as it was before every strategy was checked), it leaves the
data-parallel replicas' gradients unreduced without a word."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.ir import Action, ActionKind, Schedule, ScheduleError
from megatron_bfpp.schedules.registry import build_schedule
from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

MICROBATCHES = 4  # per data-parallel rank


def early_gs() -> tuple[Schedule, Schedule]:
    """1F1B at pp=2 as built, and with rank 0's GS moved before its last backward."""
    built = build_schedule("1f1b", num_ranks=2, num_microbatches=MICROBATCHES)
    program = [a for a in built.per_rank[0] if a.kind is not ActionKind.GRAD_SYNC]
    last = max(i for i, a in enumerate(program) if a.kind is ActionKind.BACKWARD)
    program.insert(last, Action(0, ActionKind.GRAD_SYNC))
    return built, built.with_programs([tuple(program), built.per_rank[1]])


def _reduce_at_issue() -> None:
    """Make each bucket's reduction read its buffer when it is issued, as under NCCL, where
    the reduction runs in stream order after the compute issued before it and none issued
    after. Gloo's async reduction runs on its own thread and may read the buffer after the
    last backward has added to it; on a loaded machine the early GS then looked harmless."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    group = buffers._ParamAndGradBucketGroup
    issue = group.start_grad_sync

    def issue_and_complete(self: Any, *args: Any, **kwargs: Any) -> None:
        issue(self, *args, **kwargs)
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()  # finish_grad_sync's wait then returns at once

    group.start_grad_sync = issue_and_complete


def _replica_difference(schedule: Schedule | None) -> dict[str, Any]:
    """Train one step with DDP (overlap_grad_reduce); the largest difference between the two
    data-parallel replicas' reduced gradients (0 when reduced). ``schedule=None``: what
    get_forward_backward_func says of the early-GS schedule."""
    import torch
    from megatron.core import parallel_state

    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.runtime.api import ForwardBackwardFunc

    built, early = early_gs()
    if schedule is None:
        try:
            get_forward_backward_func(early)
        except ScheduleError as error:
            return {"refused": str(error).splitlines()[0]}
        return {"refused": None}
    _reduce_at_issue()
    chunks = M.wrap_ddp(
        M.build_model_chunks(M.tiny_gpt_config(num_layers=2)), overlap_grad_reduce=True
    )
    func = (
        get_forward_backward_func(built)
        if schedule == built
        else ForwardBackwardFunc(schedule=early.name, prebuilt=early)  # the check bypassed
    )
    batches = M.make_batches(MICROBATCHES * 2, seed=7)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    M.run_schedule(chunks, M.data_parallel_share(batches), forward_backward_func=func)
    grads = torch.cat([p.main_grad.flatten() for c in chunks for p in c.parameters()])
    group = parallel_state.get_data_parallel_group()
    gathered = [torch.empty_like(grads) for _ in range(group.size())]
    torch.distributed.all_gather(gathered, grads, group=group)
    return {"difference": float((gathered[0] - gathered[1]).abs().max())}


def test_early_grad_sync_is_refused_before_any_work_and_would_leave_replicas_unreduced() -> None:
    built, early = early_gs()
    common: dict[str, Any] = dict(world_size=4, pp=2)
    refused = run_ranks(_replica_difference, args=(None,), **common)
    for result in refused:
        line = result["refused"]
        assert line is not None and "0GS: starts stage 0's gradient reduction before its last " \
            "backward" in line, result  # fmt: skip
    good = run_ranks(_replica_difference, args=(built,), **common)
    assert all(r["difference"] == 0.0 for r in good), good
    bypassed = run_ranks(_replica_difference, args=(early,), **common)
    assert bypassed[0]["difference"] > 1e-3, bypassed  # what the refusal prevents
