"""Loading what torch.distributed.pipelining really writes: each CSV here is produced in the
test by torch's own schedule classes and ``_dump_csv`` (``tests/torch_pipelining.py``), then
loaded, validated and simulated as ``bfpp-sim --load-csv`` does it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch.distributed.pipelining")

from torch.distributed.pipelining import schedules as torch_schedules

from megatron_bfpp.cli.sim import schedule_from_csv
from megatron_bfpp.ir import ActionKind, ScheduleError, load_csv, parts
from megatron_bfpp.sim import CostModel, simulate
from tests import torch_pipelining as tp

K = ActionKind
COSTS = CostModel(t_p2p=0.25)  # messages cost time, so where sends sit matters

# (class, stages per rank, (pp, m) cases): small cases each class accepts.
RUNTIME_CASES = [
    (torch_schedules.ScheduleInterleaved1F1B, 2, [(2, 4), (4, 8)]),
    (torch_schedules.ScheduleInterleaved1F1B, 1, [(3, 6)]),  # one stage per rank: 1F1B
    (torch_schedules.ScheduleLoopedBFS, 2, [(2, 4), (3, 6)]),
    (torch_schedules.ScheduleLoopedBFS, 1, [(4, 4)]),  # one stage per rank: GPipe
    (torch_schedules.ScheduleInterleavedZeroBubble, 2, [(2, 4), (4, 8)]),
    (torch_schedules.ScheduleZBVZeroBubble, 2, [(2, 4), (4, 8)]),
    (torch_schedules.ScheduleDualPipeV, 2, [(2, 4), (3, 6), (4, 8)]),
]
RUNTIME = [
    pytest.param(cls, per_rank, pp, m, id=f"{cls.__name__}-v{per_rank}-pp{pp}-m{m}")
    for cls, per_rank, cases in RUNTIME_CASES
    for pp, m in cases
]


def _build(cls: type[Any], per_rank: int, pp: int, m: int, **options: Any) -> Any:
    return tp.build(cls, num_ranks=pp, num_microbatches=m, stages_per_rank=per_rank, **options)


def _compute(schedule: Any) -> list[list[str]]:
    """Each rank's compute actions, an overlapped pair opened into its parts (as torch's
    ``compute_order`` opens an OVERLAP_F_B group)."""
    return [
        [str(part) for a in actions if a.kind.is_compute for part in parts(a)]
        for actions in schedule.per_rank
    ]


def _computes_before_gs(schedule: Any) -> list[dict[int, int]]:
    found = []
    for actions in schedule.per_rank:
        count, at = 0, {}
        for action in actions:
            if action.kind is K.GRAD_SYNC:
                at[action.stage] = count
            count += len(parts(action)) if action.kind.is_compute else 0  # a pair's parts
        found.append(at)
    return found


@pytest.mark.parametrize("cls, per_rank, pp, m", RUNTIME)
def test_compute_only_csv_loads_in_torch_order(
    tmp_path: Path, cls: type[Any], per_rank: int, pp: int, m: int
) -> None:
    torch_schedule = _build(cls, per_rank, pp, m)
    path = tp.dump(torch_schedule, tmp_path / "compute.csv", "compute_only")
    loaded = load_csv(path)
    assert (loaded.num_ranks, loaded.num_chunks, loaded.num_microbatches) == (pp, per_rank, m)
    want = [tp.compute_order(torch_schedule.pipeline_order[r]) for r in range(pp)]
    assert _compute(loaded) == want  # OVERLAP_F_B groups opened in order, idle steps dropped
    lowered = schedule_from_csv(str(path))  # our messages and GS / PS; validated
    assert _compute(lowered) == want
    # Our GS lands where torch's own lowering puts REDUCE_GRAD (after the same compute action).
    torch_reduce = [
        tp.computes_before_reduce_grad(torch_schedule.pipeline_order_with_comms[r])
        for r in range(pp)
    ]
    assert _computes_before_gs(lowered) == torch_reduce
    assert simulate(lowered, COSTS).step_time > 0


@pytest.mark.parametrize("cls, per_rank, pp, m", RUNTIME)
def test_lowered_csv_keeps_torchs_messages_and_sharding(
    tmp_path: Path, cls: type[Any], per_rank: int, pp: int, m: int
) -> None:
    torch_schedule = _build(cls, per_rank, pp, m)
    path = tp.dump(torch_schedule, tmp_path / "lowered.csv")  # _dump_csv's default format
    text = path.read_text()
    assert "UNSHARD" in text and "RESHARD" in text and "REDUCE_GRAD" in text
    loaded = schedule_from_csv(str(path))  # validated: messages pair up in posting order
    assert loaded.name == "torch-csv"
    torch_counts: dict[str, int] = {}
    for r in range(pp):
        for action in torch_schedule.pipeline_order_with_comms[r]:
            kind = action.computation_type.value
            torch_counts[kind] = torch_counts.get(kind, 0) + 1
    ours = {kind: sum(a.kind is kind for actions in loaded.per_rank for a in actions) for kind in K}
    for torch_kind, kind in (
        ("UNSHARD", K.PARAM_SYNC),
        ("RESHARD", K.RELEASE),
        ("REDUCE_GRAD", K.GRAD_SYNC),
        ("SEND_F", K.SEND_ACT),
        ("RECV_F", K.RECV_ACT),
        ("SEND_B", K.SEND_GRAD),
        ("RECV_B", K.RECV_GRAD),
    ):
        assert ours[kind] == torch_counts.get(torch_kind, 0), torch_kind
    assert _compute(loaded) == [
        tp.compute_order(torch_schedule.pipeline_order_with_comms[r]) for r in range(pp)
    ]
    # UNSHARD / RESHARD make every rank sharded: gathered from PS to RL, checked by the
    # validator, at most torch's three active stages (max_active_stages) at a time.
    assert all(K.RELEASE in {a.kind for a in actions} for actions in loaded.per_rank)
    peak = max(loaded.peak_parameters())
    assert peak <= 3 * loaded.layout.stage_fraction + 1e-9
    timed = simulate(loaded, COSTS).step_time
    ours_lowered = simulate(
        schedule_from_csv(str(tp.dump(torch_schedule, tmp_path / "c.csv", "compute_only"))),
        COSTS,
    ).step_time
    if cls is torch_schedules.ScheduleDualPipeV:
        # torch posts both sends of an OVERLAP_F_B group after the whole group, ours send the
        # forward's output right after the forward: torch's program can only be slower.
        assert timed >= ours_lowered
    else:
        assert timed == pytest.approx(ours_lowered)


def test_looped_bfs_with_four_stages_per_rank_gathers_and_releases_mid_step(
    tmp_path: Path,
) -> None:
    torch_schedule = _build(torch_schedules.ScheduleLoopedBFS, 4, 2, 4)
    loaded = schedule_from_csv(str(tp.dump(torch_schedule, tmp_path / "bfs.csv")))
    kinds = [a.kind for a in loaded.per_rank[0]]
    assert kinds.count(K.PARAM_SYNC) == 5  # stage 0 is gathered again for its backwards
    assert loaded.peak_parameters() == pytest.approx((0.75, 0.75))  # 3 of 4 chunks
    assert simulate(loaded, COSTS).step_time > 0


@pytest.mark.parametrize(
    "cls, per_rank, pp, m",
    [
        (torch_schedules.ScheduleInterleaved1F1B, 2, 4, 8),
        (torch_schedules.ScheduleInterleavedZeroBubble, 2, 2, 4),
        (torch_schedules.ScheduleZBVZeroBubble, 2, 4, 8),
        (torch_schedules.ScheduleDualPipeV, 2, 4, 8),
    ],
)
def test_deferred_receives_are_rederived_when_their_order_differs(
    tmp_path: Path, cls: type[Any], per_rank: int, pp: int, m: int
) -> None:
    """defer_pp_recv=True moves torch's receives to their consumers; between some pairs of
    ranks they are then posted in another order than the sends (the validator's posting-order
    matching would swap messages), so bfpp-sim re-derives the messages from the compute order
    and keeps torch's UNSHARD / RESHARD / REDUCE_GRAD."""
    torch_schedule = _build(cls, per_rank, pp, m, defer_pp_recv=True)
    loaded = schedule_from_csv(str(tp.dump(torch_schedule, tmp_path / "deferred.csv")))
    compute_only = schedule_from_csv(
        str(tp.dump(torch_schedule, tmp_path / "c.csv", "compute_only"))
    )
    assert _compute(loaded) == _compute(compute_only)
    assert sum(a.kind is K.RELEASE for actions in loaded.per_rank for a in actions) > 0
    if loaded.name == "torch-csv":  # this case's deferral kept every channel in order
        return
    assert loaded.name == "torch-csv, messages re-derived"
    assert simulate(loaded, COSTS).step_time == pytest.approx(
        simulate(compute_only, COSTS).step_time
    )


def test_some_deferred_file_needs_rederiving(tmp_path: Path) -> None:
    torch_schedule = _build(torch_schedules.ScheduleZBVZeroBubble, 2, 4, 8, defer_pp_recv=True)
    loaded = schedule_from_csv(str(tp.dump(torch_schedule, tmp_path / "deferred.csv")))
    assert loaded.name == "torch-csv, messages re-derived"


@pytest.mark.parametrize("pp, m", [(1, 3), (2, 4), (4, 8)])
def test_gpipe_order_with_reduce_grad_cells(tmp_path: Path, pp: int, m: int) -> None:
    torch_schedule = _build(torch_schedules.ScheduleGPipe, 1, pp, m)
    path = tp.dump(torch_schedule, tmp_path / "gpipe.csv", "compute_only")
    assert "REDUCE_GRAD" in path.read_text()
    loaded = load_csv(path)
    assert not any(a.kind is K.GRAD_SYNC for actions in loaded.per_rank for a in actions)
    lowered = schedule_from_csv(str(path))
    order = [torch_schedule.pipeline_order[r] for r in range(pp)]
    assert _compute(lowered) == [tp.compute_order(o) for o in order]
    assert _computes_before_gs(lowered) == [tp.computes_before_reduce_grad(o) for o in order]
    # GPipe: (m + pp - 1) forward and backward slots of 1 + 2 time units, plus messages.
    assert simulate(lowered, CostModel()).step_time == pytest.approx(3 * (m + pp - 1))


@pytest.mark.parametrize("pp, m", [(1, 2), (2, 4), (4, 8)])
def test_1f1b_order_is_checked_for_exactly_m_forwards_per_stage(
    tmp_path: Path, pp: int, m: int
) -> None:
    """torch's Schedule1F1B.pipeline_order (a display order; its runtime does not run it) is
    loaded when every stage's forwards are 0..m-1; torch 2.13 numbers the last stage's forwards
    1..m, and then the one line says so."""
    torch_schedule = _build(torch_schedules.Schedule1F1B, 1, pp, m)
    path = tp.dump(torch_schedule, tmp_path / "1f1b.csv", "compute_only")
    last = pp - 1
    forwards = sorted(
        a.microbatch_index
        for a in torch_schedule.pipeline_order[last]
        if a is not None and a.computation_type.value == "F"
    )
    if forwards == list(range(m)):
        assert simulate(schedule_from_csv(str(path)), COSTS).step_time > 0
        return
    assert forwards == list(range(1, m + 1))
    with pytest.raises(ScheduleError) as caught:
        schedule_from_csv(str(path))
    message = str(caught.value)
    assert "\n" not in message
    assert message == (
        f"{path}: {pp} of {pp} stages run forwards for {m} micro-batches, so every stage needs "
        f"forwards for micro-batches 0..{m - 1}, each once: stage {last} (row {pp}) misses 0 "
        f"and has extra {m}"
    )
