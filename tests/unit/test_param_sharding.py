"""Sharded parameters at the schedule level: where each chunk is gathered (PS) and released (RL),
what the validator refuses, and what the simulator charges and reports."""

from __future__ import annotations

import pytest

from megatron_bfpp.ir import ActionKind, Schedule, ScheduleError, StageLayout, parse_schedule
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.schedules.registry import build_schedule, get_spec
from megatron_bfpp.sim import CostModel, simulate
from megatron_bfpp.validate import validate_schedule

K = ActionKind
SHARDED = "optim_grads_params"


def sharded(name: str, p: int, v: int, m: int, **kwargs: int) -> Schedule:
    spec = get_spec(name)
    chunks = {"num_chunks": v} if spec.placement == "looped" else {}
    compute = spec.generator(num_ranks=p, num_microbatches=m, **chunks)
    schedule = add_grad_sync(add_communication(compute), sharding=SHARDED, **kwargs)
    validate_schedule(schedule)
    return schedule


def count(schedule: Schedule, rank: int, kind: ActionKind, stage: int | None = None) -> int:
    return sum(
        a.kind is kind and (stage is None or a.stage == stage) for a in schedule.per_rank[rank]
    )


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (2, 4, 8), (4, 2, 8), (4, 4, 16), (4, 8, 8)])
def test_breadth_first_gathers_each_chunk_at_most_twice_and_reduces_it_once(
    p: int, v: int, m: int
) -> None:
    """Forwards then backwards, chunk by chunk: a chunk is gathered for its forwards and again
    for its backwards, except the last chunk (its backwards follow its forwards) and the one
    before it, which two resident chunks let stay through the turn: 2v - 2 gathers per rank."""
    schedule = sharded("breadth-first", p, v, m)
    for rank in range(p):
        for stage in schedule.layout.stages_of(rank):
            assert 1 <= count(schedule, rank, K.PARAM_SYNC, stage) <= 2
            assert count(schedule, rank, K.GRAD_SYNC, stage) == 1
            assert count(schedule, rank, K.RELEASE, stage) == count(
                schedule, rank, K.PARAM_SYNC, stage
            )
        assert count(schedule, rank, K.PARAM_SYNC) == 2 * v - 2


@pytest.mark.parametrize(("name", "p", "v", "m"), [
    ("breadth-first", 4, 4, 16), ("interleaved", 4, 4, 16), ("interleaved", 2, 8, 16),
    ("1f1b", 4, 1, 8), ("v-half", 4, 2, 8), ("bpipe", 4, 1, 8),
])  # fmt: skip
def test_at_most_two_chunks_are_gathered_at_once(name: str, p: int, v: int, m: int) -> None:
    schedule = sharded(name, p, v, m)
    fraction = schedule.layout.stage_fraction
    for rank in range(p):
        held = schedule.resident_parameters(rank)
        assert max(held) <= 2 * fraction + 1e-12
        assert held[-1] == 0  # every chunk released at the end of the step


def test_depth_first_gathers_again_for_every_micro_batch_group() -> None:
    """Interleaved alternates chunks every few micro-batches, so with two chunks resident it
    gathers far more often than breadth-first, and more as the batch grows."""
    few, many = sharded("interleaved", 4, 4, 8), sharded("interleaved", 4, 4, 32)
    breadth = sharded("breadth-first", 4, 4, 32)
    assert count(breadth, 0, K.PARAM_SYNC) == 6
    assert count(many, 0, K.PARAM_SYNC) > count(few, 0, K.PARAM_SYNC) > 6


def test_with_every_chunk_resident_each_is_gathered_once() -> None:
    schedule = sharded("interleaved", 4, 4, 16, max_resident=4)
    for rank in range(4):
        assert count(schedule, rank, K.PARAM_SYNC) == 4
        assert max(schedule.resident_parameters(rank)) == 1.0


def test_with_one_chunk_resident_gathers_wait_for_their_segment() -> None:
    schedule = sharded("breadth-first", 2, 4, 4, max_resident=1)
    for rank in range(2):
        assert max(schedule.resident_parameters(rank)) == 0.25
        assert count(schedule, rank, K.PARAM_SYNC) == 2 * 4 - 1  # the last chunk: once


def test_the_next_chunks_gather_is_posted_before_this_chunks_compute() -> None:
    """Prefetch: the gather for segment k + 1 comes before segment k's first compute."""
    rows = [str(a) for a in sharded("breadth-first", 2, 4, 4).per_rank[0]]
    assert rows[:2] == ["0PS", "2PS"]
    assert rows.index("4PS") < rows.index("2F0") < rows.index("4F0")
    assert rows.index("0RL") < rows.index("4PS")  # room for it: chunk 0 waits for its backward


def test_dense_optim_is_unchanged_by_the_option() -> None:
    compute = get_spec("interleaved").generator(num_ranks=4, num_microbatches=8, num_chunks=2)
    lowered = add_communication(compute)
    assert add_grad_sync(lowered, sharding="optim") == add_grad_sync(lowered)
    assert all(count(add_grad_sync(lowered), r, K.RELEASE) == 0 for r in range(4))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sharding": "zero3"}, "sharding='zero3' is not one of optim, optim_grads_params"),
        ({"sharding": SHARDED, "max_resident": 0}, "max_resident=0 must be an integer >= 1"),
    ],
)
def test_bad_options_say_what_works(kwargs: dict[str, object], message: str) -> None:
    lowered = add_communication(get_spec("1f1b").generator(num_ranks=2, num_microbatches=2))
    with pytest.raises(ScheduleError, match=message):
        add_grad_sync(lowered, **kwargs)  # type: ignore[arg-type]


# --- the validator -------------------------------------------------------------------------


def one_rank(row: str) -> Schedule:
    return parse_schedule([row], layout=StageLayout.looped(1, 2), num_microbatches=1)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("0PS 0F0 0RL 1PS 1F0 1B0 1GS 1RL 0B0 0GS 0RL", r"step 8: 0B0: runs with stage 0's"),
        ("0PS 1PS 0F0 0PS 1F0 1B0 1GS 1RL 0B0 0GS 0RL", "step 3: 0PS: gathers parameters already"),
        ("0PS 1PS 0F0 1F0 1B0 1GS 1RL 1RL 0B0 0GS 0RL", "step 7: 1RL: releases parameters that"),
        ("0PS 1PS 0F0 1F0 1B0 1GS 1RL 0B0 0GS", r"stage\(s\) \[0\] end the step with their"),
        (
            "1PS 0F0 1F0 1B0 1GS 1RL 0B0 0GS",
            r"step 1: 0F0: runs with stage 0's parameters released",
        ),
    ],
)
def test_the_validator_refuses_compute_on_released_parameters(row: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(one_rank(row), require_communication=False)


def test_a_sharded_rank_passes_when_each_compute_has_its_chunk() -> None:
    validate_schedule(
        one_rank("0PS 1PS 0F0 0RL 1F0 1B0 1GS 0PS 1RL 0B0 0GS 0RL"), require_communication=False
    )


def test_release_round_trips_through_text() -> None:
    schedule = one_rank("0PS 1PS 0F0 1F0 1B0 1GS 1RL 0B0 0GS 0RL")
    assert [str(a) for a in schedule.per_rank[0]][6] == "1RL"


# --- the simulator -------------------------------------------------------------------------


def test_a_compute_after_a_regather_waits_for_it() -> None:
    schedule = one_rank("0PS 1PS 0F0 0RL 1F0 1B0 1GS 0PS 1RL 0B0 0GS 0RL")
    result = simulate(schedule, CostModel(t_param_gather=5.0))
    backward = next(e for e in result.events if e.label == "0B0")
    # Stages are half a full stage: F 0.5, B 1. Lane: 0PS 0-5, 1PS 5-10; 0F0 5-5.5, 1F0 10-10.5,
    # 1B0 10.5-11.5, 1GS at 11.5 (free), then 0PS from its position's time 11.5 to 16.5.
    assert backward.start == 16.5
    assert result.per_rank[0].peak_parameters == 1.0


def test_breadth_first_beats_interleaved_when_gathers_cost_like_compute() -> None:
    costs = CostModel(t_param_gather=1.0, t_grad_reduce=1.0)
    breadth = simulate(build_schedule("breadth-first", num_ranks=4, num_microbatches=16,
                                      num_chunks=4, sharding=SHARDED), costs)  # fmt: skip
    depth = simulate(build_schedule("interleaved", num_ranks=4, num_microbatches=16,
                                    num_chunks=4, sharding=SHARDED), costs)  # fmt: skip
    dense = simulate(build_schedule("interleaved", num_ranks=4, num_microbatches=16,
                                    num_chunks=4), costs)  # fmt: skip
    assert breadth.step_time < depth.step_time
    assert breadth.exposed_dp_comm_time < depth.exposed_dp_comm_time
    assert breadth.peak_parameters == depth.peak_parameters == (0.5,) * 4
    assert dense.peak_parameters == (1.0,) * 4


def test_a_forward_only_schedule_releases_each_chunk_after_its_last_forward() -> None:
    """Evaluation has no backward: no GS, and the RL follows the chunk's last forward."""
    training = get_spec("breadth-first").generator(num_ranks=2, num_microbatches=4, num_chunks=2)
    forwards = training.with_programs(
        [a for a in actions if a.kind is K.FORWARD] for actions in training.per_rank
    )
    schedule = add_grad_sync(add_communication(forwards), sharding=SHARDED)
    validate_schedule(schedule, require_backward=False)
    rows = [str(a) for a in schedule.per_rank[0]]
    assert count(schedule, 0, K.GRAD_SYNC) == 0
    assert rows.index("0RL") > rows.index("0F3") and rows.index("2RL") > rows.index("2F3")
    assert schedule.resident_parameters(0)[-1] == 0


# --- sharded gradients ---------------------------------------------------------------------


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (2, 4, 8), (4, 2, 8), (4, 4, 16), (4, 8, 8)])
def test_breadth_first_holds_at_most_two_chunks_of_full_gradients(p: int, v: int, m: int) -> None:
    """A chunk's gradient buffer exists from its first backward until its reduction lands (at
    the rank's next GS): breadth-first's backwards run chunk by chunk, so two at most, and
    the planner weighs that walk (tests/unit/test_plan_search.py)."""
    schedule = sharded("breadth-first", p, v, m)
    fraction = schedule.layout.stage_fraction
    for rank in range(p):
        held = schedule.resident_gradients(rank)
        assert held[0] == 0  # nothing before the first backward
        assert max(held) == pytest.approx(min(2, v) * fraction)
        assert held[-1] == pytest.approx(fraction)  # the last reduction lands at the step's end
    assert max(schedule.peak_gradients()) == pytest.approx(min(2, v) / v)
    assert schedule.peak_gradients() == schedule.peak_parameters()


def test_depth_first_reduces_each_chunk_once_per_visit() -> None:
    """Interleaved visits each chunk once per micro-batch group, a backward or two at a time:
    fully sharded, every run of a chunk's backwards is reduced, so each chunk is reduce-scattered
    at least m / p times a step where breadth-first needs one (which is why the runtime refuses
    it); unsharded, every chunk's gradients are held all step."""
    p, v, m = 4, 4, 16
    schedule = sharded("interleaved", p, v, m)
    for stage in schedule.layout.stages_of(0):
        assert count(schedule, 0, K.GRAD_SYNC, stage) >= m // p
    dense = build_schedule("breadth-first", num_ranks=4, num_microbatches=8, num_chunks=4)
    assert dense.peak_gradients() == (1.0,) * 4


@pytest.mark.parametrize(("p", "v", "m"), [(2, 4, 8), (2, 8, 8), (4, 4, 16), (2, 2, 6)])
@pytest.mark.parametrize("group", [1, 2, 3, None])
def test_grouped_breadth_first_reduces_each_chunk_once_per_group(
    p: int, v: int, m: int, group: int | None
) -> None:
    """With groups every chunk runs its backwards once per group: one GS per chunk per group
    (the shard accumulates them), so two chunks of full gradients and two of parameters at
    most, whatever the group size, as with one group."""
    if group is not None and group > m:
        pytest.skip("a group larger than the step")
    options = {} if group is None else {"group_size": group}
    schedule = build_schedule(
        "breadth-first", num_ranks=p, num_microbatches=m, num_chunks=v, sharding=SHARDED, **options
    )
    groups = -(-m // (group or m))
    fraction = schedule.layout.stage_fraction
    for rank in range(p):
        for stage in schedule.layout.stages_of(rank):
            assert count(schedule, rank, K.GRAD_SYNC, stage) == groups
        assert max(schedule.resident_gradients(rank)) == pytest.approx(min(2, v) * fraction)
        assert max(schedule.resident_parameters(rank)) == pytest.approx(min(2, v) * fraction)


def test_a_backward_whose_buffer_is_still_reducing_waits_for_it() -> None:
    """A chunk's next run of backwards before any other GS: the runtime lands the run before
    (the buffer is allocated again), so the walk counts that chunk once, not twice."""
    row = "0PS 1PS 0F0 0F1 1F0 1F1 1B0 1GS 1B1 1GS 1RL 0B0 0B1 0GS 0RL"
    schedule = parse_schedule([row], layout=StageLayout.looped(1, 2), num_microbatches=2)
    validate_schedule(schedule, require_communication=False)
    assert max(schedule.resident_gradients(0)) == pytest.approx(0.5 * 2)
    assert schedule.resident_gradients(0)[8] == pytest.approx(0.5)  # after 1B1: stage 1 once


def test_the_simulator_reports_peak_gradients() -> None:
    costs = CostModel(t_param_gather=1.0, t_grad_reduce=1.0)
    breadth = simulate(build_schedule("breadth-first", num_ranks=4, num_microbatches=8,
                                      num_chunks=4, sharding=SHARDED), costs)  # fmt: skip
    dense = simulate(build_schedule("breadth-first", num_ranks=4, num_microbatches=8,
                                    num_chunks=4), costs)  # fmt: skip
    assert breadth.peak_gradients == (0.5,) * 4
    assert dense.peak_gradients == (1.0,) * 4
    assert breadth.to_dict()["per_rank"][0]["peak_gradients"] == 0.5
    assert [(r.grad_syncs, r.param_syncs) for r in breadth.per_rank] == [(4, 6)] * 4
    assert [(r.grad_syncs, r.param_syncs) for r in dense.per_rank] == [(4, 4)] * 4


def test_the_simulator_counts_a_reduction_per_chunk_per_group() -> None:
    """The issue's case in bfpp-sim's numbers: pp=2 vp=8, 8 micro-batches in groups of 2: 8 x 4
    reduce-scatters and 50 gathers per rank, peaks of two chunks (0.25 of a full stage) as
    with one group (8 and 14)."""
    grouped, one = (
        simulate(
            build_schedule(
                "breadth-first",
                num_ranks=2,
                num_microbatches=8,
                num_chunks=8,
                sharding=SHARDED,
                **options,
            ),
            CostModel(t_param_gather=1.0, t_grad_reduce=1.0),
        )
        for options in ({"group_size": 2}, {})
    )
    assert [(r.grad_syncs, r.param_syncs) for r in grouped.per_rank] == [(32, 50)] * 2
    assert [(r.grad_syncs, r.param_syncs) for r in one.per_rank] == [(8, 14)] * 2
    assert grouped.peak_gradients == one.peak_gradients == (0.25, 0.25)
    assert grouped.peak_parameters == one.peak_parameters == (0.25, 0.25)
    assert grouped.to_dict()["per_rank"][0]["grad_syncs"] == 32


def test_the_validator_refuses_a_backward_after_its_reduction() -> None:
    row = "0PS 1PS 0F0 0F1 1F0 1F1 1B0 1GS 1B1 1RL 0B0 0B1 0GS 0RL"
    schedule = parse_schedule([row], layout=StageLayout.looped(1, 2), num_microbatches=2)
    with pytest.raises(
        ScheduleError, match=r"step 8: 1B1: computes a backward of stage 1 after its"
    ):
        validate_schedule(schedule, require_communication=False)


@pytest.mark.parametrize("name", ["interleaved", "1f1b", "v-half"])
def test_full_sharding_is_refused_where_it_would_not_pay(name: str) -> None:
    from megatron_bfpp.schedules.registry import check_sharding

    with pytest.raises(ScheduleError, match="needs breadth-first"):
        check_sharding(name, SHARDED)
    check_sharding("breadth-first", SHARDED)
