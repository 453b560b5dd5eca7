"""The schedules reproduce the published properties when simulated."""

from __future__ import annotations

import math

import pytest

from megatron_bfpp.schedules.registry import build_schedule
from megatron_bfpp.sim import CostModel, simulate

NO_COMM = CostModel(t_forward=1.0, t_backward=2.0, t_weight=1.0)


@pytest.mark.parametrize("p, m", [(2, 1), (2, 8), (4, 4), (4, 8), (4, 13), (8, 8), (8, 32)])
def test_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(p: int, m: int) -> None:
    result = simulate(build_schedule("1f1b", num_ranks=p, num_microbatches=m), NO_COMM)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert result.step_time == pytest.approx((m + p - 1) * 3.0)


@pytest.mark.parametrize("name", ["interleaved", "breadth-first"])
@pytest.mark.parametrize(
    "p, v, k",
    [(2, 2, 1), (2, 2, 3), (4, 2, 1), (4, 2, 2), (4, 4, 2), (8, 2, 1), (8, 4, 2), (3, 3, 2)],
)
def test_looped_bubble_is_p_minus_1_over_vm_of_ideal(name: str, p: int, v: int, k: int) -> None:
    m = k * p
    schedule = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v)
    # The formula is the compute order's, with free messages that never hold a rank back: gloo's
    # rules. The runtime's lock-step posting can only add to it (docs/simulator.md).
    result = simulate(schedule, NO_COMM, p2p="gloo")
    ideal = m * 3.0  # forward + backward of every micro-batch through one full stage
    idle_per_rank = result.step_time - ideal
    assert idle_per_rank / ideal == pytest.approx((p - 1) / (v * m), rel=1e-9)
    assert simulate(schedule, NO_COMM).step_time >= result.step_time


@pytest.mark.parametrize("p", [2, 3, 4, 7, 8, 16])
def test_1f1b_rank_r_stores_p_minus_r(p: int) -> None:
    schedule = build_schedule("1f1b", num_ranks=p, num_microbatches=2 * p)
    assert simulate(schedule, NO_COMM).to_dict()["per_rank"][0]["peak_activations"] == p
    assert schedule.peak_activations() == tuple(float(p - r) for r in range(p))


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8, 12, 16])
@pytest.mark.parametrize("m", [1, 3, 8, 32])
def test_bpipe_stores_at_most_ceil_p_plus_2_over_2(p: int, m: int) -> None:
    schedule = build_schedule("bpipe", num_ranks=p, num_microbatches=m)
    cap = math.ceil((p + 2) / 2)
    assert max(schedule.peak_activations()) <= cap
    if m >= p and p > cap:
        # The imbalance is really gone: rank 0 no longer holds p.
        one_f_one_b = build_schedule("1f1b", num_ranks=p, num_microbatches=m)
        assert schedule.peak_activations()[0] < one_f_one_b.peak_activations()[0] == p


@pytest.mark.parametrize("p", [4, 6, 8, 12, 16])
def test_v_half_and_v_min_memory_fractions(p: int) -> None:
    m = 4 * p
    baseline = max(build_schedule("1f1b", num_ranks=p, num_microbatches=m).peak_activations())
    half = max(build_schedule("v-half", num_ranks=p, num_microbatches=m).peak_activations())
    third = max(build_schedule("v-min", num_ranks=p, num_microbatches=m).peak_activations())
    zb = max(build_schedule("v-zb", num_ranks=p, num_microbatches=m).peak_activations())
    assert half <= baseline / 2 + 1, (half, baseline)
    # V-Min's building block holds floor((p + 4) / 3) units: p/3 + 1 except when p % 3 == 2.
    assert third <= (p + 4) // 3, (third, baseline)
    assert third < half < zb <= baseline


@pytest.mark.parametrize("p", [2, 4, 8])
def test_v_zb_is_close_to_zero_bubble(p: int) -> None:
    m = 4 * p
    zb = simulate(build_schedule("v-zb", num_ranks=p, num_microbatches=m), NO_COMM)
    one_f_one_b = simulate(build_schedule("1f1b", num_ranks=p, num_microbatches=m), NO_COMM)
    assert zb.bubble_fraction < 0.06
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction / 2


@pytest.mark.parametrize("p, v", [(4, 2), (4, 4), (8, 2), (8, 4)])
def test_breadth_first_exposes_less_data_parallel_communication(p: int, v: int) -> None:
    """The breadth-first paper's central claim: a chunk's gradient reduction overlaps the backward
    of every chunk that finishes later. Depth-first finishes its chunks one group (p micro-batches)
    apart at the very end, so a reduction longer than one group's backward stays exposed."""
    m = 4 * p
    group_backward = p * 2.0 / v  # p micro-batches through one chunk, t_backward = 2
    costs = CostModel(
        t_forward=1.0, t_backward=2.0, t_grad_reduce=2 * group_backward, t_param_gather=0.5
    )
    breadth = simulate(
        build_schedule("breadth-first", num_ranks=p, num_microbatches=m, num_chunks=v), costs
    )
    depth = simulate(
        build_schedule("interleaved", num_ranks=p, num_microbatches=m, num_chunks=v), costs
    )
    # Breadth-first exposes only the last chunk's reduction (plus the first gather).
    assert breadth.exposed_dp_comm_time == pytest.approx(costs.t_grad_reduce + 0.5)
    assert breadth.exposed_dp_comm_time < depth.exposed_dp_comm_time
    assert breadth.step_time < depth.step_time
