"""The simulator: closed-form bubbles, hand-computed communication timings, memory, exports."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    StageLayout,
    parse_schedule,
)
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.sim import (
    CostModel,
    SimResult,
    chrome_trace,
    dump_chrome_trace,
    render_png,
    simulate,
)
from megatron_bfpp.sim.cost import cost_fields
from megatron_bfpp.validate import validate_schedule

K = ActionKind


# --- schedules written out here, independent of the generators -------------------------------


def one_f_one_b(p: int, m: int) -> Schedule:
    programs = []
    for rank in range(p):
        warmup = min(p - 1 - rank, m)
        program = [Action(rank, K.FORWARD, mb) for mb in range(warmup)]
        for mb in range(m - warmup):
            program += [Action(rank, K.FORWARD, mb + warmup), Action(rank, K.BACKWARD, mb)]
        program += [Action(rank, K.BACKWARD, mb) for mb in range(m - warmup, m)]
        programs.append(tuple(program))
    return Schedule(StageLayout.looped(p), m, tuple(programs), name="1f1b")


def gpipe(p: int, m: int) -> Schedule:
    programs = tuple(
        tuple(Action(r, K.FORWARD, mb) for mb in range(m))
        + tuple(Action(r, K.BACKWARD, mb) for mb in range(m))
        for r in range(p)
    )
    return Schedule(StageLayout.looped(p), m, programs, name="gpipe")


def looped_gpipe(p: int, v: int, m: int) -> Schedule:
    """Breadth-first without overlap: every forward stage by stage, then every backward."""
    programs: list[list[Action]] = [[] for _ in range(p)]
    for stage in range(p * v):
        programs[stage % p] += [Action(stage, K.FORWARD, mb) for mb in range(m)]
    for stage in reversed(range(p * v)):
        programs[stage % p] += [Action(stage, K.BACKWARD, mb) for mb in range(m)]
    return Schedule(StageLayout.looped(p, v), m, tuple(map(tuple, programs)), name="looped")


def lowered(schedule: Schedule) -> Schedule:
    result = add_grad_sync(add_communication(schedule))
    validate_schedule(result)
    return result


def compute_events(result: SimResult, rank: int) -> list[tuple[str, float, float]]:
    return [
        (e.label, e.start, e.end) for e in result.events if e.lane == "compute" and e.rank == rank
    ]


# --- bubbles and memory ----------------------------------------------------------------------

SHAPES = [(2, 1), (2, 4), (3, 7), (4, 4), (4, 8), (8, 16), (8, 3)]


@pytest.mark.parametrize(("p", "m"), SHAPES)
@pytest.mark.parametrize("build", [one_f_one_b, gpipe], ids=["1f1b", "gpipe"])
@pytest.mark.parametrize("lower", [False, True], ids=["compute-only", "lowered"])
def test_bubble_fraction_is_closed_form_without_communication(
    build: Callable[[int, int], Schedule], p: int, m: int, lower: bool
) -> None:
    schedule = build(p, m)
    if lower:
        schedule = lowered(schedule)
    result = simulate(schedule, CostModel(t_forward=1.0, t_backward=2.0))
    assert result.step_time == pytest.approx(3.0 * (m + p - 1))
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.exposed_dp_comm_time == 0.0
    for metrics in result.per_rank:
        assert metrics.busy_time == pytest.approx(3.0 * m)
        assert metrics.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 16), (4, 4)])
def test_1f1b_rank_r_holds_p_minus_r_activations(p: int, m: int) -> None:
    schedule = lowered(one_f_one_b(p, m))
    result = simulate(schedule)
    assert [r.peak_activations for r in result.per_rank] == [p - r for r in range(p)]
    assert result.peak_activations == schedule.peak_activations()


def test_gpipe_and_looped_peaks_match_the_schedule() -> None:
    for schedule in (gpipe(4, 6), looped_gpipe(4, 2, 6), lowered(looped_gpipe(3, 3, 5))):
        assert simulate(schedule).peak_activations == schedule.peak_activations()
    assert simulate(gpipe(4, 6)).peak_activations == (6.0,) * 4


def test_chunk_compute_time_is_scaled_by_the_stage_fraction() -> None:
    result = simulate(looped_gpipe(2, 2, 1), CostModel(t_forward=1.0, t_backward=3.0))
    durations = {e.label: e.end - e.start for e in result.events if e.lane == "compute"}
    assert durations["0F0"] == pytest.approx(0.5)
    assert durations["3B0"] == pytest.approx(1.5)
    # 4 stages in a chain forward and back, each taking half a full stage
    assert result.step_time == pytest.approx(4 * 0.5 + 4 * 1.5)


def test_split_backward_durations_and_w_waits_for_nothing() -> None:
    layout = StageLayout.looped(2)
    schedule = parse_schedule(
        ["0F0 0SA0>1 0RG0<1 0I0 0W0", "1RA0<0 1F0 1I0 1SG0>0 1W0"],
        layout=layout,
        num_microbatches=1,
    )
    validate_schedule(schedule)
    result = simulate(schedule, CostModel(t_forward=1.0, t_backward=3.0, t_weight=1.0))
    # rank 1: F [1,2], I [2,4], W [4,5]; rank 0: I waits for the gradient: [4,6], W [6,7]
    assert compute_events(result, 1) == [("1F0", 1, 2), ("1I0", 2, 4), ("1W0", 4, 5)]
    assert compute_events(result, 0) == [("0F0", 0, 1), ("0I0", 4, 6), ("0W0", 6, 7)]
    assert result.step_time == 7
    assert result.per_rank[0].peak_activations == 1.0


def test_host_time_is_added_to_every_compute_action_and_not_scaled() -> None:
    """``t_host`` is per action: the same work split into twice the actions pays it twice as
    often (the multi-chunk schedules' excess on CPU ranks, scripts/bench_fidelity.py)."""
    costs = CostModel(t_forward=1.0, t_backward=3.0, t_host=0.25)
    looped = simulate(looped_gpipe(2, 2, 1), costs)
    durations = {e.label: e.end - e.start for e in looped.events if e.lane == "compute"}
    assert durations["0F0"] == 0.75 and durations["3B0"] == 1.75  # 0.5 / 1.5 of the stage + 0.25
    # the chain of 4 forwards and 4 backwards: 4 * 0.75 + 4 * 1.75, against 8 without t_host
    assert looped.step_time == 10
    # one chunk per rank: 2 forwards of 1.25 and 2 backwards of 3.25, against 8 without t_host
    assert simulate(gpipe(2, 1), costs).step_time == 9
    assert costs.compute_time(K.FORWARD, 0.5) == 0.75
    no_weight = dataclasses.replace(costs, t_weight=0.0)
    assert no_weight.compute_time(K.BACKWARD_WEIGHT) == 0.25  # an empty W still costs the host


def test_host_time_of_split_backward_is_paid_by_i_and_w() -> None:
    layout = StageLayout.looped(2)
    schedule = parse_schedule(
        ["0F0 0SA0>1 0RG0<1 0I0 0W0", "1RA0<0 1F0 1I0 1SG0>0 1W0"],
        layout=layout,
        num_microbatches=1,
    )
    costs = CostModel(t_forward=1.0, t_backward=3.0, t_weight=1.0, t_host=0.5)
    result = simulate(schedule, costs)
    # F 1.5, I 2.5, W 1.5: rank 1 F [1.5, 3], I [3, 5.5], W [5.5, 7]; rank 0 I waits: [5.5, 8]
    assert compute_events(result, 1) == [("1F0", 1.5, 3), ("1I0", 3, 5.5), ("1W0", 5.5, 7)]
    assert compute_events(result, 0) == [("0F0", 0, 1.5), ("0I0", 5.5, 8), ("0W0", 8, 9.5)]
    assert result.step_time == 9.5


# --- point-to-point communication --------------------------------------------------------------


def test_p2p_latency_adds_two_hops_per_microbatch_on_two_ranks() -> None:
    schedule = lowered(one_f_one_b(2, 1))
    c = 0.25
    result = simulate(schedule, CostModel(t_p2p=c), p2p="gloo")  # gloo: a send never waits
    # 0F0 [0,1] -> act arrives 1+c -> 1F0, 1B0 [1+c, 4+c] -> grad arrives 4+2c -> 0B0 ends 6+2c
    assert compute_events(result, 1) == [("1F0", 1 + c, 2 + c), ("1B0", 2 + c, 4 + c)]
    assert compute_events(result, 0) == [("0F0", 0, 1), ("0B0", 4 + 2 * c, 6 + 2 * c)]
    assert result.step_time == pytest.approx(6 + 2 * c)
    p2p = sorted((e.label, e.start, e.end) for e in result.events if e.lane == "p2p")
    assert p2p == [("0SA0>1", 1, 1 + c), ("1SG0>0", 4 + c, 4 + 2 * c)]


def test_messages_on_one_link_are_serialised() -> None:
    # GPipe, 2 ranks, 2 micro-batches, a link slower than compute (t_p2p = 3):
    # rank 0: F0 [0,1] F1 [1,2]; acts travel [1,4] and [4,7] (the second waits for the link)
    # rank 1: F0 [4,5] F1 [7,8] B0 [8,10] B1 [10,12]; grads travel [10,13] and [13,16]
    # rank 0: B0 [13,15] B1 [16,18]
    result = simulate(lowered(gpipe(2, 2)), CostModel(t_p2p=3.0), p2p="gloo")
    assert compute_events(result, 1) == [
        ("1F0", 4, 5),
        ("1F1", 7, 8),
        ("1B0", 8, 10),
        ("1B1", 10, 12),
    ]
    assert compute_events(result, 0) == [
        ("0F0", 0, 1),
        ("0F1", 1, 2),
        ("0B0", 13, 15),
        ("0B1", 16, 18),
    ]
    assert result.step_time == 18


@pytest.mark.parametrize("t_p2p", [0.0, 0.3])
@pytest.mark.parametrize(
    "schedule",
    [one_f_one_b(4, 8), gpipe(3, 5), looped_gpipe(3, 2, 4), one_f_one_b(5, 2)],
    ids=lambda s: f"{s.name}-{s.num_ranks}x{s.num_chunks}x{s.num_microbatches}",
)
def test_compute_only_simulates_like_its_lowered_form(schedule: Schedule, t_p2p: float) -> None:
    costs = CostModel(t_p2p=t_p2p)
    plain = simulate(schedule, costs)
    lowered_result = simulate(add_communication(schedule), costs)
    assert plain.step_time == pytest.approx(lowered_result.step_time)
    for rank in range(schedule.num_ranks):
        assert compute_events(plain, rank) == compute_events(lowered_result, rank)
    assert len([e for e in plain.events if e.lane == "p2p"]) == len(
        [e for e in lowered_result.events if e.lane == "p2p"]
    )


def test_compute_lane_never_overlaps_and_follows_program_order() -> None:
    schedule = lowered(looped_gpipe(4, 2, 6))
    result = simulate(schedule, CostModel(t_p2p=0.2, t_grad_reduce=1.0, t_param_gather=0.5))
    for rank, program in enumerate(schedule.per_rank):
        events = [e for e in result.events if e.rank == rank and e.lane == "compute"]
        assert [e.label for e in events] == [str(a) for a in program if a.kind.is_compute]
        for before, after in itertools.pairwise(events):
            assert before.end <= after.start + 1e-12


# --- data-parallel gradient / parameter sync ------------------------------------------------


def test_grad_reduce_after_the_last_backward_is_exposed() -> None:
    schedule = lowered(one_f_one_b(2, 2))  # one chunk per rank: GS right after its last B
    base = simulate(schedule).step_time
    result = simulate(schedule, CostModel(t_grad_reduce=1.5))
    assert base == 9.0
    assert result.step_time == pytest.approx(base + 1.5)
    assert result.exposed_dp_comm_time == pytest.approx(1.5)
    for metrics, last_backward in zip(result.per_rank, (9.0, 7.0), strict=True):
        assert metrics.compute_end == pytest.approx(last_backward)
        assert metrics.exposed_dp_comm_time == pytest.approx(1.5)
        assert metrics.end_time == pytest.approx(last_backward + 1.5)
        # communication is not busy time
        assert metrics.busy_time == pytest.approx(6.0)
    grad_syncs = [(e.rank, e.start, e.end) for e in result.events if e.kind == K.GRAD_SYNC]
    assert sorted(grad_syncs) == [(0, 9.0, 10.5), (1, 7.0, 8.5)]


def test_grad_reduces_queue_on_the_dp_lane_and_overlap_compute() -> None:
    # two chunks per rank: the earlier chunk's reduce overlaps the later chunk's backward
    schedule = lowered(looped_gpipe(2, 2, 2))
    base = simulate(schedule)
    result = simulate(schedule, CostModel(t_grad_reduce=10.0))
    for rank in range(2):
        ops = sorted((e.start, e.end) for e in result.events if e.rank == rank and e.lane == "dp")
        assert len(ops) == 2
        assert ops[1][0] == pytest.approx(ops[0][1])  # FIFO: the second waits for the first
    # rank 1 finishes chunk 3 first; its two reduces run back to back from then
    first_gs = min(e.start for e in result.events if e.rank == 1 and e.kind == K.GRAD_SYNC)
    assert result.per_rank[1].end_time == pytest.approx(first_gs + 20.0)
    assert result.per_rank[1].exposed_dp_comm_time == pytest.approx(
        first_gs + 20.0 - base.per_rank[1].compute_end
    )
    assert result.step_time == pytest.approx(max(r.end_time for r in result.per_rank))


def test_first_forward_waits_for_its_parameter_gather() -> None:
    schedule = lowered(one_f_one_b(4, 8))
    result = simulate(schedule, CostModel(t_param_gather=0.5))
    # rank 0's first forward waits 0.5; everyone else's input arrives later than that anyway
    assert result.step_time == pytest.approx(33.5)
    assert [r.exposed_dp_comm_time for r in result.per_rank] == [0.5, 0.0, 0.0, 0.0]
    assert compute_events(result, 0)[0] == ("0F0", 0.5, 1.5)


def test_parameter_gathers_queue_and_only_the_first_forward_of_a_chunk_waits() -> None:
    schedule = lowered(looped_gpipe(2, 2, 2))
    result = simulate(schedule, CostModel(t_param_gather=3.0))
    gathers = sorted((e.stage, e.start, e.end) for e in result.events if e.kind == K.PARAM_SYNC)
    assert gathers == [(0, 0.0, 3.0), (1, 0.0, 3.0), (2, 3.0, 6.0), (3, 3.0, 6.0)]
    rank0 = compute_events(result, 0)
    # stage 0: F0 waits for its gather [3, 3.5], F1 does not [3.5, 4]; stage 2 waits until 6
    assert rank0[:3] == [("0F0", 3.0, 3.5), ("0F1", 3.5, 4.0), ("2F0", 6.0, 6.5)]
    assert result.per_rank[0].exposed_dp_comm_time == pytest.approx(3.0 + 6.0 - 4.0)


# --- BPipe transfers -------------------------------------------------------------------------


def test_eviction_transfers_occupy_the_link_and_delay_the_backward() -> None:
    schedule = parse_schedule(
        [
            "0F0 0SA0>1 0EV0>1 0RG0<1 0LD0<1 0B0",
            "1RA0<0 0AC0<0 1F0 1B0 1SG0>0 0RS0>0",
        ],
        layout=StageLayout.looped(2),
        num_microbatches=1,
    )
    validate_schedule(schedule)
    assert simulate(schedule, p2p="gloo").step_time == 6.0
    result = simulate(schedule, CostModel(t_evict=2.0), p2p="gloo")
    # EV leaves at 1 and lands at 3; RS waits for it and for rank 1's clock (4), lands at 6
    transfers = sorted((e.label, e.start, e.end) for e in result.events if e.lane == "p2p")
    assert transfers == [("0EV0>1", 1.0, 3.0), ("0RS0>0", 4.0, 6.0)]
    assert compute_events(result, 0)[-1] == ("0B0", 6.0, 8.0)
    assert result.step_time == 8.0
    assert result.peak_activations == schedule.peak_activations() == (1.0, 2.0)


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [f.name for f in cost_fields()])
@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_cost_model_rejects_negative_and_non_finite_values(name: str, bad: float) -> None:
    with pytest.raises(ScheduleError, match=rf"CostModel\.{name} must be a finite number >= 0"):
        CostModel(**{name: bad})


def test_cost_model_rejects_weight_time_above_backward_time() -> None:
    with pytest.raises(ScheduleError, match="t_weight"):
        CostModel(t_backward=1.0, t_weight=1.5)
    assert CostModel(t_backward=1.0, t_weight=1.0).compute_time(K.BACKWARD_INPUT) == 0.0


def test_deadlocked_compute_order_raises() -> None:
    # rank 0 needs 1B0's gradient before it sends F1; rank 1 runs micro-batch 1 first
    schedule = parse_schedule(
        ["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], layout=StageLayout.looped(2), num_microbatches=2
    )
    with pytest.raises(ScheduleError, match="deadlock") as error:
        simulate(schedule)
    assert "<-- waits for" in str(error.value)


def test_missing_send_raises() -> None:
    schedule = parse_schedule(
        ["0F0 0RG0<1 0B0", "1RA0<0 1F0 1B0 1SG0>0"],
        layout=StageLayout.looped(2),
        num_microbatches=1,
    )
    with pytest.raises(ScheduleError, match=r"deadlock: ranks \[0, 1\]"):
        simulate(schedule)


# --- results and exports --------------------------------------------------------------------


def test_to_dict_is_json_ready_with_the_documented_keys() -> None:
    result = simulate(lowered(one_f_one_b(3, 4)), CostModel(t_p2p=0.1, t_grad_reduce=0.5))
    data = json.loads(json.dumps(result.to_dict()))
    assert {
        "schedule",
        "num_ranks",
        "num_chunks",
        "num_microbatches",
        "step_time",
        "bubble_fraction",
        "exposed_dp_comm_time",
        "per_rank",
    } <= set(data)
    assert data["schedule"] == "1f1b" and data["num_ranks"] == 3 and data["num_microbatches"] == 4
    assert [r["rank"] for r in data["per_rank"]] == [0, 1, 2]
    for row in data["per_rank"]:
        assert {
            "rank",
            "busy_time",
            "bubble_fraction",
            "peak_activations",
            "exposed_dp_comm_time",
        } <= set(row)
    with_events = json.loads(json.dumps(result.to_dict(include_events=True)))
    assert len(with_events["events"]) == len(result.events)
    assert (result.step_time * 3 - sum(r.busy_time for r in result.per_rank)) / (
        3 * result.step_time
    ) == pytest.approx(result.bubble_fraction)


def test_chrome_trace_has_an_event_per_compute_action(tmp_path: Path) -> None:
    schedule = lowered(looped_gpipe(3, 2, 4))
    result = simulate(schedule, CostModel(t_p2p=0.1, t_grad_reduce=0.5, t_param_gather=0.2))
    path = tmp_path / "trace.json"
    dump_chrome_trace(result, path, us_per_unit=1000.0)
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(chrome_trace(result)))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names: dict[int, dict[int, str]] = {e["pid"]: {} for e in complete}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[e["pid"]][e["tid"]] = e["args"]["name"]
    compute = [e for e in complete if names[e["pid"]][e["tid"]] == "compute"]
    expected = sorted((r, str(a)) for r, _, a in schedule.iter_actions() if a.kind.is_compute)
    assert sorted((e["pid"], e["name"]) for e in compute) == expected
    first = next(e for e in compute if e["name"] == "0F0")
    assert first["ts"] == pytest.approx(200.0) and first["dur"] == pytest.approx(500.0)
    assert first["args"] == {"stage": 0, "microbatch": 0, "kind": "F"}
    lanes = {names[e["pid"]][e["tid"]] for e in complete}
    assert lanes == {"compute", "p2p", "dp"}
    processes = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert [e["args"]["name"] for e in processes] == ["rank 0", "rank 1", "rank 2"]


def test_png_is_written(tmp_path: Path) -> None:
    result = simulate(lowered(one_f_one_b(4, 8)), CostModel(t_p2p=0.1, t_grad_reduce=1.0))
    path = render_png(result, tmp_path / "step.png", title="1F1B")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


@pytest.fixture
def saved_figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The matplotlib figures ``render_png`` saves, to inspect what they draw."""
    from matplotlib.figure import Figure

    saved: list[Any] = []
    original = Figure.savefig

    def keep(figure: Any, *args: Any, **kwargs: Any) -> Any:
        saved.append(figure)
        return original(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def test_png_of_a_large_schedule_draws_a_bounded_number_of_artists(
    tmp_path: Path, saved_figures: list[Any]
) -> None:
    """What kept large pictures quick (about 3 s for 1,024 boxes): one collection per kind of
    box and of message, not an artist per box, and at most
    ``max_labels`` labels. Checked on the figure that is saved, not by a clock."""
    from matplotlib.collections import PolyCollection

    schedule = lowered(looped_gpipe(8, 2, 32))  # 1024 compute actions
    result = simulate(schedule, CostModel(t_p2p=0.05, t_grad_reduce=1.0, t_param_gather=0.5))
    render_png(result, tmp_path / "big.png", max_labels=100)
    assert (tmp_path / "big.png").stat().st_size > 10_000
    (axes,) = saved_figures[0].axes
    boxes = [c for c in axes.collections if isinstance(c, PolyCollection)]
    assert len(boxes) <= len(ActionKind) + 2  # compute kinds, p2p and dp lanes
    assert sum(len(c.get_paths()) for c in boxes) >= 1024
    assert len(axes.texts) <= 100
    assert len(axes.patches) == 0


def test_sim_imports_neither_torch_megatron_nor_matplotlib() -> None:
    code = (
        "import sys, megatron_bfpp.sim; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'matplotlib')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_png_boxes_of_a_multi_chunk_schedule_name_their_stage(
    tmp_path: Path, saved_figures: list[Any]
) -> None:
    """Forward boxes too narrow for "4F3" used to carry no text: which chunk they ran was not
    shown. Now they carry their stage ("4"), and the legend says how to read the labels."""
    schedule = lowered(looped_gpipe(4, 2, 8))
    render_png(simulate(schedule, CostModel()), tmp_path / "bf.png")
    (axes,) = saved_figures[0].axes
    texts = [t.get_text() for t in axes.texts]
    stage_only = [t for t in texts if t.isdigit()]
    assert {str(s) for s in range(8)} <= set(stage_only), texts  # (8 is also a peak figure)
    legend = [t.get_text() for t in saved_figures[0].legends[0].get_texts()]
    assert "4F3 = stage 4, micro-batch 3" in legend
