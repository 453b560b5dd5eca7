"""torch.distributed.pipelining's own schedule classes and CSV writer, run in-process.

Tests that load torch's CSVs generate them here, with torch, rather than from hand-written
fixtures. Building a torch schedule needs no process group: its constructor computes every
rank's compute order (``pipeline_order``) and, for the multi-stage runtime schedules, their
lowering with UNSHARD / RESHARD / REDUCE_GRAD and messages (``pipeline_order_with_comms``),
from what it reads of the local stages: their number and indices, the number of stages, this
rank and the number of ranks. ``StubStage`` provides just that. Import this module after
``pytest.importorskip("torch.distributed.pipelining")``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any
from unittest import mock

from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping
from torch.distributed.pipelining.stage import _PipelineStageBase

# Classes whose stages sit in a V (two per rank); the others loop.
V_SHAPED = (torch_schedules.ScheduleZBVZeroBubble, torch_schedules.ScheduleDualPipeV)


class StubStage(_PipelineStageBase):
    """A stage as far as a schedule's constructor looks: no module, no process group."""

    def __init__(self, *, stage_index: int, num_stages: int, rank: int, num_ranks: int) -> None:
        # _PipelineStageBase.__init__ wants a module and a process group: set what the
        # schedules read instead.
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_rank = rank
        self.group_size = num_ranks
        self.group = None
        self.submod = None  # the torch.compile check skips a stage without a module
        self.stage_index_to_group_rank: dict[int, int] = {}

    # Abstract in torch; only a step (with a process group) calls them.
    def _create_grad_recv_info(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> None:
        return None


def build(
    cls: type[Any],
    *,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int = 1,
    lowered: bool = True,
    **options: Any,
) -> Any:
    """Rank 0's instance of torch's schedule ``cls`` (every rank's order is in it).

    ``lowered=False`` skips the lowering that torch's runtime schedules compute in their
    constructor (``pipeline_order_with_comms`` is then left unset): a compute-only CSV needs
    only ``pipeline_order``, and for ScheduleZBVZeroBubble over p = 2..16, m = p..4p the
    lowering took 16x as long as everything else (37 s against 2.2 s)."""
    skip = (
        mock.patch.object(cls, "_prepare_schedule_with_comms", _no_lowering)
        if not lowered and issubclass(cls, torch_schedules._PipelineScheduleRuntime)
        else contextlib.nullcontext()
    )
    with skip:
        if issubclass(cls, torch_schedules.PipelineScheduleSingle):
            stage = StubStage(stage_index=0, num_stages=num_ranks, rank=0, num_ranks=num_ranks)
            return cls(stage, num_microbatches, **options)
        num_stages = num_ranks * stages_per_rank
        style = "v" if issubclass(cls, V_SHAPED) else "loop"
        stages = [
            StubStage(stage_index=index, num_stages=num_stages, rank=0, num_ranks=num_ranks)
            for index in generate_rank_to_stage_mapping(num_ranks, num_stages, style)[0]
        ]
        return cls(stages, num_microbatches, **options)


def _no_lowering(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def dump(schedule: Any, path: Path, fmt: str = "compute_comms") -> Path:
    """The CSV torch writes for ``schedule``: ``_dump_csv(path, format=fmt)`` for the runtime
    (multi-stage) schedules, whose default is the lowered "compute_comms". torch 2.13's
    single-stage classes (GPipe, 1F1B) have no ``_dump_csv`` and no lowering; their
    ``pipeline_order`` is written by the multi-stage schedules' compute-only writer, torch's
    ``PipelineScheduleMulti._dump_csv`` (one csv row per rank), and ``fmt`` must be
    "compute_only"."""
    if isinstance(schedule, torch_schedules._PipelineScheduleRuntime):
        schedule._dump_csv(str(path), format=fmt)
    elif fmt == "compute_only":
        torch_schedules.PipelineScheduleMulti._dump_csv(schedule, str(path))
    else:
        raise ValueError(f"{type(schedule).__name__} has no lowered ({fmt}) order in torch")
    return path


def compute_order(order: list[Any]) -> list[str]:
    """torch's compute actions of one rank in program order, OVERLAP_F_B groups opened, as our
    action strings ("3F5"); idle steps, REDUCE_GRAD, UNSHARD / RESHARD and messages left out."""
    texts = []
    for action in order:
        if action is None:
            continue
        for part in action.sub_actions or (action,):
            if part.computation_type.value in ("F", "B", "I", "W"):
                texts.append(f"{part.stage_index}{part.computation_type.value}"
                             f"{part.microbatch_index}")  # fmt: skip
    return texts


def computes_before_reduce_grad(order: list[Any]) -> dict[int, int]:
    """Per stage, how many compute actions the rank runs before that stage's REDUCE_GRAD."""
    count, found = 0, {}
    for action in order:
        if action is None:
            continue
        if action.computation_type.value == "REDUCE_GRAD":
            found[action.stage_index] = count
        else:
            parts = action.sub_actions or (action,)
            count += sum(p.computation_type.value in ("F", "B", "I", "W") for p in parts)
    return found
