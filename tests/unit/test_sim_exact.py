"""The simulator times in integer units: exact results, and the same step times as before.

Before the integer replay, stage shares like 1/3 were floats and sums of them drifted
(interleaved pp=2 vp=3 m=4 gave 12.999999999999996 for 13). The step times below were recorded
with that float simulator; the integer one must agree with them to 1e-9 and hit closed forms and
integers exactly.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from megatron_bfpp.config.run_config import flag_name
from megatron_bfpp.ir import StageLayout
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.schedules.registry import SCHEDULES, build_schedule
from megatron_bfpp.semantics import Timing
from megatron_bfpp.sim import CostModel, simulate
from megatron_bfpp.sim.cost import ExactTiming, cost_fields

# Costs that are not binary fractions, split backwards included.
ODD = CostModel(
    t_forward=1.3,
    t_backward=2.7,
    t_weight=0.9,
    t_p2p=0.05,
    t_grad_reduce=0.7,
    t_param_gather=0.3,
    t_evict=0.4,
)
# (schedule, pp, vp, m) -> (step time, bubble fraction) under ODD, from the float simulator.
BEFORE = {
    ("gpipe", 3, None, 6): (33.2, 0.27710843373493993),
    ("gpipe", 4, None, 9): (49.300000000000026, 0.2697768762677489),
    ("1f1b", 3, None, 6): (33.50000000000001, 0.28358208955223896),
    ("1f1b", 4, None, 9): (49.89999999999999, 0.2785571142284567),
    ("interleaved", 3, 3, 6): (28.46666666666666, 0.15690866510538654),
    ("breadth-first", 3, 3, 6): (27.866666666666656, 0.13875598086124397),
    ("breadth-first", 4, 3, 9): (41.299999999999976, 0.12832929782082325),
    ("bpipe", 3, None, 6): (33.50000000000001, 0.28358208955223896),
    ("bpipe", 4, None, 9): (49.89999999999999, 0.2785571142284567),
    ("v-min", 3, None, 6): (39.949999999999974, 0.39924906132665816),
    ("v-min", 4, None, 9): (59.2499999999999, 0.39240506329113856),
    ("v-half", 3, None, 6): (35.19999999999999, 0.31818181818181823),
    ("v-half", 4, None, 9): (55.54999999999992, 0.3519351935193514),
    ("v-zb", 3, None, 6): (27.499999999999986, 0.1272727272727273),
    ("v-zb", 4, None, 9): (40.69999999999997, 0.11547911547911507),
}


def test_interleaved_pp2_vp3_m4_is_exactly_13() -> None:
    schedule = build_schedule("interleaved", num_ranks=2, num_microbatches=4, num_chunks=3)
    result = simulate(schedule)
    assert result.step_time == 13.0
    assert result.bubble_fraction == 1 / 13  # idle 2 of 26 rank-units, rounded once


@pytest.mark.parametrize(("name", "p", "v", "m"), sorted(BEFORE, key=str))
def test_step_times_are_those_of_the_float_simulator(
    name: str, p: int, v: int | None, m: int
) -> None:
    step, bubble = BEFORE[(name, p, v, m)]
    schedule = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v)
    result = simulate(schedule, ODD, p2p="gloo")  # the float simulator timed gloo's rules
    assert result.step_time == pytest.approx(step, rel=1e-9, abs=0)
    assert result.bubble_fraction == pytest.approx(bubble, rel=1e-9, abs=0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "bpipe"])
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (3, 7), (4, 4), (5, 12), (8, 16)])
@pytest.mark.parametrize(("f", "b"), [(1, 2), (1.1, 2.3), (0.7, 1.9)])
def test_single_stage_schedules_take_m_plus_p_minus_1_slots_exactly(
    name: str, p: int, m: int, f: float, b: float
) -> None:
    """GPipe and 1F1B: (m + p - 1)(f + b), rounded once from the exact decimal value, under
    gloo's rules and, for GPipe and 1F1B, lock-step. BPipe's lock-step posting pays for its
    eviction ticks (an acceptor's CPU reads the header when the evictor reaches that tick), so
    it takes at least that long."""
    schedule = build_schedule(name, num_ranks=p, num_microbatches=m)
    costs = CostModel(t_forward=f, t_backward=b, t_weight=min(1.0, b))
    exact = float((m + p - 1) * (Fraction(repr(f)) + Fraction(repr(b))))
    assert simulate(schedule, costs, p2p="gloo").step_time == exact
    lockstep = simulate(schedule, costs).step_time
    assert lockstep == exact if name != "bpipe" else lockstep >= exact


@pytest.mark.parametrize("name", ["interleaved", "breadth-first"])
@pytest.mark.parametrize(("p", "v"), [(2, 2), (2, 3), (3, 3), (4, 2), (4, 3), (3, 5)])
@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize(("f", "b"), [(1, 2), (1.5, 2.5), (0.3, 0.9)])
def test_looped_schedules_take_m_slots_plus_a_bubble_of_p_minus_1_over_v_exactly(
    name: str, p: int, v: int, groups: int, f: float, b: float
) -> None:
    """With m a multiple of p: m(f + b) + (p - 1)(f + b) / v (Narayanan et al.), exactly under
    gloo's rules; lock-step never beats it, and meets it for breadth-first (interleaved at
    pp=4 with b = 3f loses a few percent: its unit-time ticks hold a send behind a batch)."""
    m = groups * p
    schedule = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v)
    costs = CostModel(t_forward=f, t_backward=b, t_weight=min(1.0, b))
    slot = Fraction(repr(f)) + Fraction(repr(b))
    closed = float(m * slot + (p - 1) * slot / v)
    assert simulate(schedule, costs, p2p="gloo").step_time == closed
    lockstep = simulate(schedule, costs).step_time
    assert lockstep == closed if name == "breadth-first" else lockstep >= closed


def test_exact_timing_scales_by_the_least_common_denominator() -> None:
    exact = ODD.exact(StageLayout.looped(2, 3).exact_stage_fraction)
    # 1.3/3, 2.7/3, 1.8/3, 0.9/3, 0.05, 0.4/3, 0.7, 0.3: lcm(30, 10, 30, 10, 20, 15, 10, 10)
    assert exact == ExactTiming(exact.timing, 60)
    assert (exact.timing.forward, exact.timing.backward, exact.timing.p2p) == (26, 54, 3)
    assert (exact.timing.backward_input, exact.timing.backward_weight) == (36, 18)
    assert (exact.timing.transfer, exact.timing.grad_sync, exact.timing.param_sync) == (8, 42, 18)


def test_the_default_costs_are_the_replays_unit_timing() -> None:
    """CostModel's defaults come from the replay's ``Timing`` (I is the rest of B once W is
    taken out): both say the same unit step, written once."""
    assert CostModel().exact() == ExactTiming(Timing(), 1)


def test_bfpp_sims_cost_flags_are_the_cost_models_fields() -> None:
    from megatron_bfpp.cli.sim import build_parser

    flags = {flag: a for a in build_parser()._actions for flag in a.option_strings}
    for cost in cost_fields():
        action = flags[flag_name(cost.name)]
        assert action.dest == cost.name and action.help is not None
        assert action.help.startswith(cost.metadata["help"])
        assert action.default in (cost.default, None)  # None: the schedule's own (t_evict)


def test_compute_only_sends_use_the_links_add_communication_would() -> None:
    """A link slower than compute queues messages: a compute-only schedule must queue them on
    the link to the neighbour's rank, as its lowered form does (each micro-batch's message
    used to pick a link by its key, spreading them over links that do not exist)."""
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=4, lower=False)
    costs = CostModel(t_forward=0.25, t_backward=0.5, t_weight=0.25, t_p2p=1.0)
    plain = simulate(schedule, costs, p2p="gloo")
    lowered = simulate(add_communication(schedule), costs, p2p="gloo")
    assert plain.step_time == lowered.step_time == 8.0
    # lock-step times the lowered form in both cases
    assert (
        simulate(schedule, costs).step_time
        == simulate(add_communication(schedule), costs).step_time
    )

    def p2p(result: object) -> list[tuple[str, float, float]]:
        events = result.events  # type: ignore[attr-defined]
        return sorted((e.label, e.start, e.end) for e in events if e.lane == "p2p")

    assert p2p(plain) == p2p(lowered)


def test_times_too_large_for_a_float_are_infinite_not_an_error() -> None:
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    result = simulate(schedule, CostModel(t_forward=1e308, t_backward=1e308, t_weight=0.0))
    assert result.step_time == float("inf")
    assert all(e.end == float("inf") for e in result.events if e.label == "1B1")


@pytest.mark.parametrize("p2p", ["gloo", "lockstep"])
def test_events_are_built_once_rank_by_rank_in_program_order(p2p: str) -> None:
    schedule = build_schedule("interleaved", num_ranks=2, num_microbatches=4, num_chunks=3)
    result = simulate(schedule, CostModel(t_p2p=0.1, t_grad_reduce=0.5), p2p=p2p)
    assert result.events is result.events
    ranks = [e.rank for e in result.events]
    assert ranks == sorted(ranks)
    for rank, program in enumerate(schedule.per_rank):
        computes = [e.label for e in result.events if e.rank == rank and e.lane == "compute"]
        assert computes == [str(a) for a in program if a.kind.is_compute]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_family_reports_integer_steps_as_integers(name: str) -> None:
    """Unit costs with 1/v (or 1/2) stages: every step time here is a multiple of 1/v, so
    scaled by v it must come out an integer exactly."""
    spec = SCHEDULES[name]
    v = 3 if spec.placement == "looped" else None
    result = simulate(build_schedule(name, num_ranks=3, num_microbatches=6, num_chunks=v))
    scale = 3 if spec.placement == "looped" else (2 if spec.placement == "v-shape" else 1)
    assert (result.step_time * scale).is_integer()
