"""``dualpipe-v``: DualPipeV's order (torch's ``ScheduleDualPipeV`` is the reference), its
overlapped pairs as composite actions, validated and NCCL-proven, and its refusals in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron_bfpp.ir import ActionKind as K
from megatron_bfpp.ir import Schedule, ScheduleError, parts
from megatron_bfpp.schedules.registry import (
    build_schedule,
    check_sharding,
    forward_only_schedule,
    get_spec,
)
from megatron_bfpp.semantics import Rules, action_duration, combined_pairs
from megatron_bfpp.sim import CostModel, simulate
from megatron_bfpp.validate import validate_schedule

pytest.importorskip("torch.distributed.pipelining")

from torch.distributed.pipelining import schedules as torch_schedules

from megatron_bfpp.cli.sim import schedule_from_csv
from tests import torch_pipelining as tp

SIZES = [(p, m) for p in range(1, 9) for m in (2 * p, 2 * p + 1, 3 * p, 4 * p + 3)]


def _torch(p: int, m: int, *, lowered: bool = False) -> Any:
    return tp.build(
        torch_schedules.ScheduleDualPipeV,
        num_ranks=p,
        num_microbatches=m,
        stages_per_rank=2,
        lowered=lowered,
    )


def _torch_texts(order: list[Any]) -> list[str]:
    """torch's actions as our texts, an OVERLAP_F_B group as our pair ``3F5&1B2``."""
    texts = []
    for action in order:
        if action is None:
            continue
        if action.sub_actions:
            texts.append("&".join(map(_torch_text, action.sub_actions)))
        else:
            texts.append(_torch_text(action))
    return texts


def _torch_text(action: Any) -> str:
    kind = {"F": "F", "B": "B", "I": "I", "W": "W"}[action.computation_type.value]
    return f"{action.stage_index}{kind}{action.microbatch_index}"


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_the_order_is_torchs_dualpipev_pair_for_pair(p: int, m: int) -> None:
    ours = build_schedule("dualpipe-v", num_ranks=p, num_microbatches=m, lower=False)
    reference = _torch(p, m)
    for rank in range(p):
        assert [str(a) for a in ours.per_rank[rank]] == _torch_texts(
            reference.pipeline_order[rank]
        ), f"rank {rank}"


def test_two_ranks_four_microbatches_literal() -> None:
    """DeepSeek's phases on p = 2, m = 4 (docs/schedules.md): rank 0 fills its first leg, runs
    I and W while the V fills, then pairs; rank 1, the V's tip, starts its steady state with a
    forward and a backward apart (nothing to overlap yet), and both drain in split backwards."""
    schedule = build_schedule("dualpipe-v", num_ranks=2, num_microbatches=4, lower=False)
    assert [" ".join(map(str, actions)) for actions in schedule.per_rank] == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3&3B1 3F2&0B0 3B2 3F3&0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2&1B0 1F3&2B1 2F3&1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    ]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 7), (4, 8), (4, 13), (6, 12)])
def test_validated_and_nccl_proven_with_every_pair_a_composite(p: int, m: int) -> None:
    schedule = build_schedule("dualpipe-v", num_ranks=p, num_microbatches=m)
    validate_schedule(schedule, nccl=True)
    pairs = [a for actions in schedule.per_rank for a in actions if a.kind is K.OVERLAP_F_B]
    # every rank but the tip pairs 2 (m - 2p + r + 1) + (p - r - 1) times; the tip one fewer
    assert len(pairs) == sum(2 * (m - 2 * p + r + 1) + (p - r - 1) for r in range(p)) - 1
    for pair in pairs:
        forward, backward = parts(pair)
        assert forward.kind is K.FORWARD and backward.kind is K.BACKWARD
        assert {forward.stage, backward.stage} == {pair.stage, 2 * p - 1 - pair.stage}


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8), (4, 12)])
@pytest.mark.parametrize(
    "costs",
    [
        CostModel(),
        CostModel(t_forward=1.0, t_backward=2.0, t_weight=0.75, t_p2p=0.25),
        CostModel(t_forward=1.0, t_backward=3.0, t_weight=1.5, t_p2p=0.5, t_grad_reduce=1.0),
    ],
)
def test_never_slower_than_torchs_own_order_loaded_from_its_csv(
    tmp_path: Path, p: int, m: int, costs: CostModel
) -> None:
    """torch's file, lowered by torch and read by our CSV reader, against ours at the same costs
    under every timing model: torch sends an OVERLAP_F_B group's outputs after the whole group,
    ours the forward's right after the forward, so ours can only be as fast or faster."""
    torch_file = tp.dump(_torch(p, m, lowered=True), tmp_path / "dualpipev.csv")
    theirs: Schedule = schedule_from_csv(str(torch_file))
    ours = build_schedule("dualpipe-v", num_ranks=p, num_microbatches=m)
    for p2p in ("gloo", "lockstep"):
        mine = simulate(ours, costs, p2p=p2p).step_time
        assert mine <= simulate(theirs, costs, p2p=p2p).step_time + 1e-9, p2p


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (4, 7), (8, 15)])
def test_fewer_than_two_microbatches_per_rank_is_one_line(p: int, m: int) -> None:
    with pytest.raises(ScheduleError) as info:
        build_schedule("dualpipe-v", num_ranks=p, num_microbatches=m)
    assert str(info.value) == (
        f"dualpipe-v needs at least 2 x pp = {2 * p} micro-batches on {p} pipeline ranks (one "
        f"per stage of the V), got {m}; use more micro-batches, or v-zb / v-half, which run any "
        "number"
    )


def test_it_places_two_stages_per_rank_and_is_never_sharded() -> None:
    spec = get_spec("dualpipe-v")
    with pytest.raises(ScheduleError, match="places exactly 2 stages per rank"):
        spec.chunks_for(4)
    with pytest.raises(ScheduleError, match="optim_grads_params") as info:
        check_sharding("dualpipe-v", "optim_grads_params")
    assert "\n" not in str(info.value)
    with pytest.raises(ScheduleError, match="overlapped pair"):
        build_schedule("dualpipe-v", num_ranks=2, num_microbatches=4, sharding="optim_grads_params")


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 1, 3])
@pytest.mark.parametrize("f", [1.0, 2.5])
@pytest.mark.parametrize("p2p", ["gloo", "lockstep"])
def test_the_bubble_is_deepseeks_published_one(p: int, extra: int, f: float, p2p: str) -> None:
    """DeepSeek-V3's report gives DualPipe's bubble as (PP/2 - 1)(F&B + B - 3W) per rank, PP the
    number of stages: for DualPipeV on p ranks (2p stages) that is (p - 1)(F&B + B - 3W), with F,
    B, W one stage's forward, whole backward and weight gradient and F&B an overlapped pair's
    time. Under the zero-bubble papers' costs (F = I = W, B = 2F) and a pair costing its parts'
    sum (F&B = 3F: no overlap credited), that is (p - 1)(3F + 2F - 3F) = 2F (p - 1): at p = 4 and
    F = 1, 6 on every rank; its step, 2m (F + B) = 6m of busy time plus those 6."""
    m = 2 * p + extra
    costs = CostModel(t_forward=2 * f, t_backward=4 * f, t_weight=2 * f)  # full 1F1B stages
    result = simulate(build_schedule("dualpipe-v", num_ranks=p, num_microbatches=m), costs, p2p=p2p)
    stage_f = f  # a V stage is half a 1F1B stage
    pair, backward, weight = 3 * stage_f, 2 * stage_f, stage_f
    bubble = (p - 1) * (pair + backward - 3 * weight)
    assert bubble == 2 * stage_f * (p - 1)
    busy = 2 * m * (stage_f + backward)
    assert [rank.busy_time for rank in result.per_rank] == [busy] * p
    assert result.step_time == busy + bubble


@pytest.mark.parametrize(
    ("f", "b", "a2a", "expected"),
    [
        (4, 8, 0, 12),  # nothing to hide: the parts' sum
        (4, 8, 1, 10),  # each part's 1 under the other's compute (3 and 7)
        (4, 8, 3, 8),  # F's 3 under B's compute of 5; B's 3 under F's 1 only: 12 - 3 - 1
        (4, 8, 4, 8),  # F is all all-to-all: the communication stream's 8, not less
    ],
)
def test_an_overlapped_pair_hides_each_parts_all_to_all_under_the_others_compute(
    f: int, b: int, a2a: int, expected: int
) -> None:
    """Two streams: F's dispatch and combine run under B's compute and B's under F's, never a
    part's under its own, and the pair lasts at least either stream's sum (worked by hand)."""
    from megatron_bfpp.ir import Composite, unchecked_action

    pair = Composite(unchecked_action(0, K.FORWARD, 1), unchecked_action(1, K.BACKWARD, 0))
    durations = {K.FORWARD: f, K.BACKWARD: b, K.BACKWARD_INPUT: b // 2, K.BACKWARD_WEIGHT: b // 2}
    durations = {kind: (d, d) for kind, d in durations.items()}  # stages 0 and 1 alike
    assert action_duration(durations, pair, a2a) == expected
    assert action_duration(durations, unchecked_action(0, K.FORWARD, 1), a2a) == f  # alone: all


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("p2p", ["gloo", "lockstep"])
def test_dualpipe_v_is_credited_only_for_the_all_to_all_its_pairs_hide(p: int, p2p: str) -> None:
    """With a V stage's forward 1, backward 2 and all-to-all 0.5 in each, a combined pair lasts
    3 - 2 x 0.5 = 2: each rank's busy time (and its compute events') drops by 1 per pair of
    ``combined_pairs`` and by nothing else (a pair run as F then B hides nothing), the step
    drops, and a schedule without pairs (v-zb, 1f1b) times exactly as without the cost."""
    m = 2 * p + 1
    plain = CostModel(t_forward=2, t_backward=4, t_weight=2)
    moe = CostModel(t_forward=2, t_backward=4, t_weight=2, t_a2a=1)  # 0.5 in a V stage's
    schedule = build_schedule("dualpipe-v", num_ranks=p, num_microbatches=m)
    pairs = [len(combined_pairs(actions)) for actions in schedule.per_rank]
    overlapped = [sum(a.kind is K.OVERLAP_F_B for a in actions) for actions in schedule.per_rank]
    assert all(0 < n < total for n, total in zip(pairs, overlapped, strict=True))
    before, after = (simulate(schedule, costs, p2p=p2p) for costs in (plain, moe))
    busy = [r.busy_time - n for r, n in zip(before.per_rank, pairs, strict=True)]
    assert [r.busy_time for r in after.per_rank] == busy
    computes = [0.0] * p
    for event in after.events:
        computes[event.rank] += event.duration if event.lane == "compute" else 0
    assert computes == busy
    assert after.step_time < before.step_time
    for name, chunks in (("v-zb", 2), ("1f1b", 1)):
        other = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=chunks)
        assert simulate(other, moe, p2p=p2p).step_time == simulate(other, plain, p2p=p2p).step_time


def test_only_pairs_megatron_core_can_combine_hide_the_all_to_all() -> None:
    """p = 2, m = 4 by hand. A pair runs as megatron-core's combined step only if its B part is
    a whole B and its forward's own backward on that rank is one too (a schedule plan's backward
    is whole). Rank 0: 7 ``0F3&3B1`` is not (0F3's backward is 0I3 0W3); 8 ``3F2&0B0`` (3B2 at
    9) and 10 ``3F3&0B1`` (3B3 at 11) are. Rank 1: 6 ``2F2&1B0`` is (2B2 at 9); 7 ``1F3&2B1``
    and 8 ``2F3&1B1`` are not (1I3 1W3, 2I3 2W3: the drain's split backwards)."""
    schedule = build_schedule("dualpipe-v", num_ranks=2, num_microbatches=4, lower=False)
    texts = [[str(a) for a in actions] for actions in schedule.per_rank]
    assert [texts[0][i] for i in (7, 8, 10)] == ["0F3&3B1", "3F2&0B0", "3F3&0B1"]
    assert [texts[1][i] for i in (6, 7, 8)] == ["2F2&1B0", "1F3&2B1", "2F3&1B1"]
    assert texts[0][12:] == ["0I2", "0W2", "0I3", "0W3"]
    assert texts[1][9:] == ["2B2", "1B2", "2I3", "1I3", "2W3", "1W3"]
    assert list(map(combined_pairs, schedule.per_rank)) == [{8, 10}, {6}]
    durations = {K.FORWARD: (4,) * 4, K.BACKWARD: (8,) * 4, K.BACKWARD_INPUT: (4,) * 4}
    rules = Rules(schedule)
    assert [rules.hidden(0, i, 1) for i in (7, 8, 10)] == [0, 1, 1]
    hidden = [
        action_duration(durations, a, rules.hidden(1, i, 1))
        for i, a in enumerate(schedule.per_rank[1])
        if a.kind is K.OVERLAP_F_B
    ]
    assert hidden == [10, 12, 12]  # each part's 1 under the other's compute, or nothing


def test_interleaved_combined_1f1b_combines_every_pair() -> None:
    """megatron-core's combined 1F1B pairs whole backwards only, with forwards whose backwards
    are whole: every one of its pairs hides the all-to-all."""
    for p, v, m in ((2, 2, 4), (4, 2, 8), (4, 3, 12)):
        schedule = build_schedule(
            "interleaved", num_ranks=p, num_microbatches=m, num_chunks=v, combined_1f1b=True
        )
        for actions in schedule.per_rank:
            pairs = {i for i, a in enumerate(actions) if a.kind is K.OVERLAP_F_B}
            assert pairs and combined_pairs(actions) == pairs


def test_an_all_to_all_longer_than_the_forward_is_refused_in_one_line() -> None:
    with pytest.raises(ScheduleError, match=r"^CostModel.t_a2a \(3\) is part of a forward") as info:
        CostModel(t_forward=2, t_backward=4, t_weight=2, t_a2a=3)
    assert "\n" not in str(info.value)


def test_evaluation_runs_every_forward_the_pairs_included() -> None:
    """The forward-only schedule (evaluation) keeps the training order's forwards, a pair's too."""
    schedule = build_schedule("dualpipe-v", num_ranks=2, num_microbatches=4)
    evaluation = forward_only_schedule(schedule).compute_only()
    assert [" ".join(map(str, actions)) for actions in evaluation.per_rank] == [
        "0F0 0F1 0F2 3F0 3F1 0F3 3F2 3F3",
        "1F0 2F0 1F1 2F1 1F2 2F2 1F3 2F3",
    ]
