"""Uneven stages in the model (issue 42, item 2): ``CostModel.stage_weights`` gives each global
stage its own compute, and every timing model (gloo's replay, the lock-step posting, megatron-core's
own posting) and ``simulate_steady`` time each action by its stage's. Weights of 1 are the even
model to the bit; a layout string weighs its stages by their layers, embedding and loss."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from fractions import Fraction

import pytest

from megatron_bfpp.cli.sim import main as sim_main
from megatron_bfpp.config.run_config import layout_layer_shares, layout_stage_weights
from megatron_bfpp.ir import ActionKind, ScheduleError, parse_action, parts, stored_counts
from megatron_bfpp.schedules.registry import SCHEDULES, build_schedule
from megatron_bfpp.semantics import Timing, replay
from megatron_bfpp.sim import CostModel, simulate, simulator
from megatron_bfpp.sim.simulator import simulate_steady, with_stage_memory

_CHUNKS = {"interleaved": 2, "breadth-first": 2}
_MODELS = ("gloo", "lockstep")


def _build(name: str, pp: int, m: int):
    return build_schedule(name, num_ranks=pp, num_microbatches=m, num_chunks=_CHUNKS.get(name))


def _weights(stages: int) -> tuple[float, ...]:
    """Uneven on purpose: a heavy first and last stage, a light middle, none alike in a row."""
    return tuple(1.5 if s in (0, stages - 1) else (0.5, 1.0, 1.25)[s % 3] for s in range(stages))


def _figures(result) -> tuple:
    return result.step_time, [r.to_dict() for r in result.per_rank], result.events


def test_two_stages_worked_by_hand() -> None:
    """1F1B, p 2, m 2, stage 0 twice stage 1 (F 2, B 4 against F 1, B 2), messages free.
    Rank 0: F0 0-2, F1 2-4, B0 once rank 1's B0 ends at 5: 5-9, B1 once its B1 ends at 8: 9-13.
    Rank 1: F0 2-3, B0 3-5, F1 5-6, B1 6-8."""
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    for p2p, rank_1_end in (("gloo", 8), ("lockstep", 9)):
        result = simulate(schedule, CostModel(stage_weights=(2.0, 1.0)), p2p=p2p)
        assert result.step_time == 13
        assert [r.busy_time for r in result.per_rank] == [12, 6]
        # lock-step: rank 1's last send (1SG1) is done once rank 0 posts 0RG1, after 0B0 at 9
        assert [r.compute_end for r in result.per_rank] == [13, rank_1_end]
        starts = [(e.label, e.start) for e in result.events if e.lane == "compute"]
        assert starts == [
            ("0F0", 0), ("0F1", 2), ("0B0", 5), ("0B1", 9), ("1F0", 2), ("1B0", 3), ("1F1", 5),
            ("1B1", 6),
        ]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "p2p"),
    [(name, p2p) for name in sorted(SCHEDULES) for p2p in _MODELS]
    + [("1f1b", "megatron"), ("interleaved", "megatron")],  # megatron-core's own posting: its own
)
def test_weights_of_one_are_the_even_model_to_the_bit(name: str, p2p: str) -> None:
    schedule = _build(name, 4, 8)
    costs = CostModel(t_p2p=0.25, t_grad_reduce=1.5, t_host=0.1)
    ones = replace(costs, stage_weights=(1,) * schedule.num_stages)
    assert _figures(simulate(schedule, ones, p2p=p2p)) == _figures(
        simulate(schedule, costs, p2p=p2p)
    )


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("p2p", _MODELS)
def test_scaling_every_stage_scales_the_step(name: str, p2p: str) -> None:
    """Every stage k times as heavy, messages and host free: every clock k times, on every
    schedule and in both interpreters (a stage indexed wrongly would break the ratio)."""
    schedule = _build(name, 4, 8)
    even = simulate(schedule, CostModel(t_weight=0.5), p2p=p2p)
    heavy = CostModel(t_weight=0.5, stage_weights=(3,) * schedule.num_stages)
    tripled = simulate(schedule, heavy, p2p=p2p)
    assert tripled.step_time == 3 * even.step_time
    assert [r.busy_time for r in tripled.per_rank] == [3 * r.busy_time for r in even.per_rank]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_each_action_takes_its_stages_time(name: str) -> None:
    """Every compute event lasts its kind's time on its own stage (a composite: its parts'),
    in gloo's replay and in the lock-step posting's timing alike."""
    schedule = _build(name, 4, 8)
    weights = _weights(schedule.num_stages)
    costs = CostModel(t_forward=2, t_backward=4, t_weight=2, stage_weights=weights)
    per_kind = {"F": 2, "B": 4, "I": 2, "W": 2}
    for p2p in _MODELS:
        for event in simulate(schedule, costs, p2p=p2p).events:
            if event.lane != "compute":
                continue
            expected = sum(
                per_kind[part.kind.value] * weights[part.stage] / schedule.num_chunks
                for part in parts(parse_action(event.label))
            )
            assert event.duration == pytest.approx(expected), (p2p, event)


@pytest.mark.parametrize("name", ["interleaved", "breadth-first", "1f1b", "v-half", "dualpipe-v"])
def test_uneven_stages_are_timed_whole(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shorter steps of uneven stages can lie on lines and the long step bend later: interleaved
    at pp 4, m 40 with heavier ends read 142.1 off steps of 4, 8 and 12 micro-batches against
    146.6 timed whole. ``simulate_steady`` therefore times uneven stages whole (equal weights
    are even stages scaled, and keep the steady state)."""
    monkeypatch.setattr(simulator, "STEADY_FROM_ACTIONS", 0)
    pp, m = 4, 40
    schedule = _build(name, pp, m)
    ends = (1.25, *(1.0,) * (schedule.num_stages - 2), 1.25)  # embedding, loss: heavier ends
    shorter = lambda n: _build(name, pp, n)  # noqa: E731
    for weights in (ends, (1.5,) * schedule.num_stages):
        costs = CostModel(t_p2p=0.1, stage_weights=weights)
        whole = simulate(schedule, costs)
        steady = simulate_steady(schedule, costs, shorter=shorter, period=pp)
        assert weights != ends or steady.steady_from == ()
        assert [r.to_dict() for r in steady.per_rank] == [r.to_dict() for r in whole.per_rank]
        assert steady.step_time == whole.step_time
    if name == "interleaved":
        costs = CostModel(t_p2p=0.1, stage_weights=ends)
        lines = simulator._steady_clocks(schedule, costs, shorter, pp, "lockstep", None)
        assert lines is not None and lines[0] == (4, 8, 12)  # what the lines would have said
        assert max(map(max, lines[1][0], lines[1][1])) != simulate(schedule, costs).step_time * (
            costs.exact(schedule.layout.exact_stage_fraction).per_unit
        )


@pytest.mark.parametrize("p2p", _MODELS)
def test_bpipe_moves_each_stages_own_activations(p2p: str) -> None:
    """BPipe on uneven stages: an evict or restore moves its stage's stored activations
    (``CostModel.stage_activations``), so it lasts ``t_evict`` times that share, in gloo's replay
    and the lock-step posting alike; shares of 1 are the even model to the bit. pp 6 caps at 4
    stored micro-batches: stages 0 and 1 evict."""
    schedule = _build("bpipe", 6, 12)
    costs = CostModel(t_p2p=0.1, t_evict=1.2)
    ones = replace(costs, stage_activations=(1,) * 6)
    even = simulate(schedule, costs, p2p=p2p)
    assert _figures(simulate(schedule, ones, p2p=p2p)) == _figures(even)
    shares = (0.5, 1.5, 1.0, 1.0, 1.0, 1.0)
    uneven = simulate(schedule, replace(costs, stage_activations=shares), p2p=p2p)
    moves = [  # lock-step: an EV's size header goes as a message, its payload after ("+")
        e
        for e in uneven.events
        if e.kind is ActionKind.RESTORE
        or (e.kind is ActionKind.EVICT and (p2p == "gloo" or e.label.endswith("+")))
    ]
    assert {e.stage for e in moves} == {0, 1}
    for event in moves:
        assert event.duration == pytest.approx(1.2 * shares[event.stage]), event
    assert uneven.step_time != even.step_time
    with pytest.raises(ScheduleError, match="transfers for 2 stages, the schedule has 6"):
        simulate(schedule, replace(costs, stage_activations=(1, 1)), p2p=p2p)


def test_the_heaviest_stage_paces_a_long_1f1b() -> None:
    """One stage twice as heavy: past the fill, the pipeline runs at that stage's pace, so each
    extra micro-batch adds its F + B (2 x 3 = 6), not an even stage's 3."""
    weights = (1.0, 2.0, 1.0, 1.0)
    steps = [
        simulate(_build("1f1b", 4, m), CostModel(stage_weights=weights), p2p="gloo").step_time
        for m in (16, 17)
    ]
    assert steps[1] - steps[0] == 6


def test_the_exact_units_keep_each_weight_exact() -> None:
    """The integer unit spans every stage's compute: no weight is rounded."""
    exact = CostModel(t_host=0.1, stage_weights=(0.3, 1.0, 1.25)).exact(Fraction(1, 3))
    rows = [[Fraction(d, exact.per_unit) for d in row] for row in exact.timing.stages]
    host = Fraction(1, 10)
    for row, weight in zip(rows, (Fraction(3, 10), Fraction(1), Fraction(5, 4)), strict=True):
        assert row == [w * weight / 3 + host for w in (1, 2, 1, 1)]


def test_bad_weights_are_refused() -> None:
    with pytest.raises(ScheduleError, match="stage weights must be finite numbers >= 0"):
        CostModel(stage_weights=(1.0, -1.0))
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="costs for 3 stages, the schedule has 2"):
        simulate(schedule, CostModel(stage_weights=(1, 1, 1)), p2p="gloo")
    with pytest.raises(ScheduleError, match="costs for 1 stages"):
        replay(schedule, Timing(stages=((1, 2, 1, 1),)))


def test_a_layout_weighs_its_stages_by_layers_embedding_and_loss() -> None:
    """'Et*3|t*4|t*4|t*3L': 14 layers over 4 stages, 3.5 an even stage's."""
    weights = layout_stage_weights("Et*3|t*4|t*4|t*3L", 4, embedding=0.5, loss=1.0)
    assert weights == pytest.approx((3.5 / 3.5, 4 / 3.5, 4 / 3.5, 4 / 3.5))
    assert layout_stage_weights("Et*4|t*4|t*4|t*4L", 2, embedding=0, loss=0) == (1, 1, 1, 1)
    mtp = layout_stage_weights("Et*2|t*2mL", 2, embedding=0, loss=0.5)  # m: a layer and a loss
    assert mtp == pytest.approx((1.0, (2 + 1.5 + 0.5) / 2))
    with pytest.raises(ValueError, match="not a multiple of --pipeline-model-parallel-size 4"):
        layout_stage_weights("Et|tL", 4, embedding=0, loss=0)


def _sim(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = sim_main(list(argv))
        except SystemExit as exit:  # argparse's own refusals
            code = exit.code
    return code, out.getvalue(), err.getvalue()


def test_bfpp_sim_times_a_megatron_layout() -> None:
    layout = "Et*3|t*4|t*4|t*4|t*4|t*4|t*4|t*3L"
    base = ["--schedule", "interleaved", "--pp", "4", "--vp", "2", "--microbatches", "8"]
    code, out, _ = _sim(*base, "--pipeline-model-parallel-layout", layout, "--json")
    assert code == 0
    data = json.loads(out)
    expected = layout_stage_weights(layout, 4, embedding=0.02, loss=0.25)
    assert data["costs"]["stage_weights"] == list(expected)
    shares = layout_layer_shares(layout)  # what each stage stores: BPipe's transfers move it
    assert data["costs"]["stage_activations"] == list(shares)
    schedule = _build("interleaved", 4, 8)
    direct = simulate(schedule, CostModel(stage_weights=expected, stage_activations=shares))
    assert data["step_time"] == direct.step_time
    assert data["per_rank"] == [
        r.to_dict()
        for r in with_stage_memory(direct, schedule, layout_layer_shares(layout)).per_rank
    ]
    code, out, _ = _sim(*base, "--stage-weights", ",".join(["1"] * 8))
    assert code == 0
    assert "stage weights: 1, 1, 1, 1, 1, 1, 1, 1 (uneven stages; memory per even stage)" in out
    code, out, _ = _sim(*base, "--pipeline-model-parallel-layout", layout)
    assert code == 0 and "(uneven stages; memory by layers)" in out


def test_memory_weighs_each_stage_by_its_layers() -> None:
    """1F1B pp 2, m 4, layers (1, 3) against an even stage's 2: rank 0 peaks at two stored
    micro-batches of weight 0.5, rank 1 at one of 1.5; parameters and gradients 0.5 and 1.5.
    Equal weights keep every figure; sharded parameters (PS / RL) count the gathered stages'."""
    f1b = _build("1f1b", 2, 4)
    even = simulate(f1b)
    assert with_stage_memory(even, f1b, (1.0, 1.0)).per_rank == even.per_rank
    uneven = with_stage_memory(even, f1b, layout_layer_shares("Et|tttL"))
    assert uneven.peak_activations == (1.0, 1.5)
    assert uneven.peak_parameters == (0.5, 1.5) and uneven.peak_gradients == (0.5, 1.5)
    assert uneven.stage_memory == (0.5, 1.5) and uneven.step_time == even.step_time
    v = _build("v-half", 2, 4)
    shares = (0.25, 0.5, 0.75, 2.5)  # stages 0 and 3 on rank 0, 1 and 2 on rank 1
    weighed = with_stage_memory(simulate(v), v, shares)
    assert weighed.peak_parameters == (2.75 / 2, 1.25 / 2)
    counts = [list(stored_counts(v.per_rank[r], shares)) for r in range(2)]
    assert weighed.peak_activations == tuple(max(c) / 2 for c in counts)
    sharded = build_schedule(
        "breadth-first",
        num_ranks=2,
        num_chunks=2,
        num_microbatches=4,
        sharding="optim_grads_params",
    )
    plain = simulate(sharded)
    assert with_stage_memory(plain, sharded, (1.0,) * 4).per_rank == plain.per_rank
    heavier = with_stage_memory(plain, sharded, (2.0,) * 4)
    assert heavier.peak_parameters == tuple(2 * p for p in plain.peak_parameters)
    assert heavier.peak_gradients == tuple(2 * g for g in plain.peak_gradients)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stage-weights", "1,2"], "--stage-weights gives 2 stages; the schedule has 4"),
        (["--stage-weights", "1,x"], "is not a comma-separated list of numbers >= 0"),
        (["--loss-weight", "1"], "--loss-weight weighs a layout's E / L"),
        (
            ["--stage-weights", "1,1,1,1", "--pipeline-model-parallel-layout", "Et|t|t|tL"],
            "pass --stage-weights or --pipeline-model-parallel-layout, not both",
        ),
        (
            ["--pipeline-model-parallel-layout", "Et|tL"],
            "not a multiple of --pipeline-model-parallel-size 4",
        ),
        (
            ["--pipeline-model-parallel-layout", "Et|t|t|t|t|t|t|tL"],
            "--pipeline-model-parallel-layout gives 8 stages; the schedule has 4",
        ),
    ],
)
def test_bfpp_sim_refuses_bad_weights_in_one_line(argv: list[str], message: str) -> None:
    code, out, err = _sim("--schedule", "1f1b", "--pp", "4", *argv)
    assert code != 0 and not out
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_every_catalogue_schedule_takes_weights() -> None:
    """No schedule falls back to even stages: each one's figures change with the weights."""
    for name in SCHEDULES:
        schedule = _build(name, 4, 8)
        weights = _weights(schedule.num_stages)
        even = simulate(schedule, CostModel(), p2p="lockstep")
        uneven = simulate(schedule, CostModel(stage_weights=weights), p2p="lockstep")
        assert uneven.step_time != even.step_time, name
