"""``simulate_steady`` gives the whole step's figures, or times the step whole: it reads a long
step's clocks off three shorter steps only where they lie exactly on lines and the step is
bound by compute, and ``bfpp-sim`` says when it did."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from megatron_bfpp.cli.sim import main as sim_main
from megatron_bfpp.schedules.registry import SCHEDULES, build_schedule, get_spec
from megatron_bfpp.sim import CostModel, simulate, simulator
from megatron_bfpp.sim.simulator import simulate_steady, steady_lengths

_CHUNKS = {"interleaved": 2, "breadth-first": 4}


def _builder(name: str, pp: int, **options: int):
    return lambda m: build_schedule(
        name, num_ranks=pp, num_microbatches=m, num_chunks=_CHUNKS.get(name), **options
    )


def _rows(result) -> list[dict]:
    return [rank.to_dict() for rank in result.per_rank]


@pytest.fixture
def any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simulator, "STEADY_FROM_ACTIONS", 0)


def test_the_lengths_are_congruent_to_m_and_shorter() -> None:
    assert steady_lengths(100, 8) == ((12, 20, 28), (20, 28, 36), (20, 36, 52))
    assert steady_lengths(20, 8) == ()  # too short for three lengths a period apart
    for m in range(1, 200):
        for lengths in steady_lengths(m, 8):
            step = lengths[1] - lengths[0]
            assert lengths[2] - lengths[1] == step and lengths[2] < m
            assert all((m - n) % step == 0 for n in lengths)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("costs", [CostModel(), CostModel(t_grad_reduce=2.0, t_param_gather=1.0)])
def test_every_figure_equals_the_whole_steps(name: str, costs: CostModel, any_size: None) -> None:
    pp, m = 4, 40
    build = _builder(name, pp)
    schedule = build(m)
    whole = simulate(schedule, costs)
    steady = simulate_steady(schedule, costs, shorter=build, period=pp)
    assert (steady.step_time, steady.bubble_fraction) == (whole.step_time, whole.bubble_fraction)
    assert _rows(steady) == _rows(whole)
    assert steady.to_dict() == {**whole.to_dict(), "steady_from": list(steady.steady_from)}
    if get_spec(name).name != "bpipe":  # its evictions wander against the ticks: timed whole
        assert steady.steady_from, f"{name} was expected to reach a steady state by m {m}"


def test_events_are_the_whole_steps(any_size: None) -> None:
    build = _builder("breadth-first", 4)
    schedule = build(40)
    steady = simulate_steady(schedule, CostModel(), shorter=build, period=4)
    assert steady.steady_from
    assert steady.events == simulate(schedule, CostModel()).events


def test_message_bound_steps_need_a_fourth_length(any_size: None) -> None:
    """With message time the step grows by more than the busiest rank's compute per period, so
    a fourth length must lie on the lines too before they are read."""
    build = _builder("1f1b", 4)
    schedule = build(40)
    costs = CostModel(t_p2p=0.1)
    steady = simulate_steady(schedule, costs, shorter=build, period=4)
    assert steady.steady_from == (4, 8, 12, 16)
    assert _rows(steady) == _rows(simulate(schedule, costs))

    def bent(m: int):  # the fourth length one micro-batch longer: off the line
        return build(17 if m == 16 else m)

    assert simulate_steady(schedule, costs, shorter=bent, period=4).steady_from == ()


def test_steps_off_a_line_are_timed_whole(any_size: None) -> None:
    """Shorter steps that are not on one line leave the step to be timed whole (here every
    length past 8 gets micro-batches more, quadratically many, so no three lie on a line)."""
    build = _builder("gpipe", 4)
    schedule = build(40)

    def bent(m: int):
        return build(m if m <= 8 else m + (m - 8) ** 2 // 16)

    steady = simulate_steady(schedule, CostModel(), shorter=bent, period=4)
    assert steady.steady_from == ()
    assert _rows(steady) == _rows(simulate(schedule, CostModel()))


def test_small_steps_are_timed_whole() -> None:
    build = _builder("1f1b", 4)
    steady = simulate_steady(build(40), CostModel(), shorter=build, period=4)
    assert steady.steady_from == ()


def _sim_json(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert sim_main([*args, "--json"]) == 0
    return json.loads(out.getvalue())


def test_bfpp_sim_reads_the_steady_state_unless_exact(any_size: None) -> None:
    args = ("--schedule", "breadth-first", "--pp", "4", "--vp", "2", "--microbatches", "32")
    steady, exact = _sim_json(*args), _sim_json(*args, "--exact")
    assert steady["steady_from"] == [4, 8, 12]
    assert exact["steady_from"] == []
    assert {**steady, "steady_from": []} == exact
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert sim_main(list(args)) == 0
    assert "timed from its steady state: steps of 4, 8, 12 micro-batches" in text.getvalue()


def test_bfpp_sim_times_bpipe_whole(any_size: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """BPipe's steps lie on no lines (its catalogue entry says so): bfpp-sim does not time
    shorter steps for nothing."""
    calls: list[int] = []
    real = simulator.simulate_steady
    monkeypatch.setattr(
        "megatron_bfpp.cli.sim.simulate_steady",
        lambda *a, **k: calls.append(1) or real(*a, **k),
    )
    data = _sim_json("--schedule", "bpipe", "--pp", "4", "--microbatches", "32")
    assert data["steady_from"] == [] and calls == []
    _sim_json("--schedule", "1f1b", "--pp", "4", "--microbatches", "32")
    assert calls == [1]
