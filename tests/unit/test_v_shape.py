"""V-shape generators (v-min, v-half, v-zb): completeness, order, memory and bubble targets.

The checks run on a small unit-time model kept in this file, independent of the package's
simulator: every F, I and W of one V stage takes one slot (0.5 time units, i.e. a full stage's
forward 1 and backward 2), communication is free, and a rank starts its next action as soon as it
is free and the action's inputs exist (blocking, in program order). Memory: the activation of
(stage, micro-batch) is held from the start of its F to the end of its W; one V stage is half a
1F1B stage, so one held activation counts 0.5 units and 1F1B peaks at p units.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_bfpp.ir import ActionKind, Schedule, ScheduleError, StageLayout, parse_schedule
from megatron_bfpp.schedules import v_shape
from megatron_bfpp.schedules.v_shape import build_v_half, build_v_min, build_v_zb
from tests.growth import growth, python_lines

Builder = Callable[..., Schedule]
BUILDERS: dict[str, Builder] = {"v-min": build_v_min, "v-half": build_v_half, "v-zb": build_v_zb}

FWD, BWD_I, BWD_W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


# --- the unit-time model ------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    makespan: int  # in slots
    peak_held: tuple[int, ...]  # per rank, in held activations (0.5 units each)
    idle: int  # slots, summed over ranks

    @property
    def peak_units(self) -> float:
        return max(self.peak_held) / 2

    @property
    def bubble(self) -> float:
        return self.idle / (len(self.peak_held) * self.makespan)


def one_f_one_b_bubble(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def check_complete(schedule: Schedule) -> None:
    """Exactly one F, I and W per (stage, micro-batch), each on the rank holding the stage."""
    p, m = schedule.num_ranks, schedule.num_microbatches
    assert schedule.layout == StageLayout.v_shape(p)
    seen: Counter[tuple[ActionKind, int, int | None]] = Counter()
    for rank, _, action in schedule.iter_actions():
        assert action.kind in (FWD, BWD_I, BWD_W), f"rank {rank}: {action} is not a compute action"
        assert schedule.layout.rank_of(action.stage) == rank, f"{action} placed on rank {rank}"
        seen[(action.kind, action.stage, action.microbatch)] += 1
    expected = {(k, s, mb): 1 for k in (FWD, BWD_I, BWD_W) for s in range(2 * p) for mb in range(m)}
    assert dict(seen) == expected


Key = tuple[ActionKind, int, int]


def dependencies(key: Key, num_stages: int) -> list[Key]:
    kind, stage, mb = key
    if kind == FWD:
        return [(FWD, stage - 1, mb)] if stage > 0 else []
    if kind == BWD_I:
        deps: list[Key] = [(FWD, stage, mb)]
        if stage < num_stages - 1:
            deps.append((BWD_I, stage + 1, mb))
        return deps
    return [(BWD_I, stage, mb)]


def simulate(schedule: Schedule) -> Run:
    """Blocking, in-order execution; fails the test with the stuck actions on a deadlock."""
    check_complete(schedule)
    num_stages = schedule.num_stages
    programs: list[list[Key]] = [
        [(a.kind, a.stage, a.microbatch or 0) for a in actions] for actions in schedule.per_rank
    ]
    end: dict[Key, int] = {}
    free = [0] * len(programs)
    position = [0] * len(programs)
    left = sum(len(program) for program in programs)
    while left:
        moved = False
        for rank, program in enumerate(programs):
            while position[rank] < len(program):
                key = program[position[rank]]
                deps = dependencies(key, num_stages)
                if any(d not in end for d in deps):
                    break
                start = max([free[rank], *(end[d] for d in deps)])
                end[key] = free[rank] = start + 1
                position[rank] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = {
                r: program[position[r]]
                for r, program in enumerate(programs)
                if position[r] < len(program)
            }
            pytest.fail(f"{schedule.name}: deadlock, ranks wait at {stuck}")
    makespan = max(free)
    peaks = []
    for program in programs:
        held = peak = 0
        for kind, _, _ in program:
            if kind == FWD:
                held += 1
                peak = max(peak, held)
            elif kind == BWD_W:
                held -= 1  # freed at the end of the W, so the W itself still counts
        assert held == 0
        peaks.append(peak)
    busy = sum(len(program) for program in programs)
    return Run(makespan=makespan, peak_held=tuple(peaks), idle=len(programs) * makespan - busy)


def build(name: str, p: int, m: int) -> Schedule:
    schedule = BUILDERS[name](num_ranks=p, num_microbatches=m)
    assert schedule.name == name
    assert schedule.num_microbatches == m
    return schedule


# --- the model itself -------------------------------------------------------------------


def test_model_on_a_literal_schedule() -> None:
    layout = StageLayout.v_shape(2)
    schedule = parse_schedule(
        ["0F0 3F0 3I0 0I0 3W0 0W0", "1F0 2F0 2I0 1I0 2W0 1W0"],
        layout=layout,
        num_microbatches=1,
    )
    run = simulate(schedule)
    # 0F0 | 1F0 2F0 | 3F0 3I0 | 2I0 1I0 | 0I0 3W0 0W0 ; rank 1's W run alongside.
    assert run.makespan == 10
    assert run.idle == 2 * 10 - 12
    assert run.peak_held == (2, 2)
    assert run.bubble == pytest.approx(0.4)


def test_model_catches_a_deadlock() -> None:
    schedule = parse_schedule(
        ["0F0 3I0 3F0 0I0 3W0 0W0", "1F0 2F0 2I0 1I0 2W0 1W0"],
        layout=StageLayout.v_shape(2),
        num_microbatches=1,
    )
    with pytest.raises(pytest.fail.Exception, match="deadlock"):
        simulate(schedule)


# --- shape, order and determinism --------------------------------------------------------


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 12, 16])
def test_complete_and_deadlock_free(name: str, p: int) -> None:
    for m in sorted({1, 2, 3, p, 2 * p + 1, 3 * p, 33}):
        simulate(build(name, p, m))


@pytest.mark.parametrize("name", BUILDERS)
def test_same_rank_order(name: str) -> None:
    """F before I before W of each activation, and the V's turn at rank p-1 in order."""
    for p, m in [(1, 5), (3, 7), (6, 13)]:
        schedule = build(name, p, m)
        for actions in schedule.per_rank:
            where = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(actions)}
            for (kind, stage, mb), i in where.items():
                if kind == BWD_I:
                    assert where[(FWD, stage, mb)] < i
                if kind == BWD_W:
                    assert where[(BWD_I, stage, mb)] < i
        turn = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(schedule.per_rank[-1])}
        for mb in range(m):
            assert turn[(FWD, p - 1, mb)] < turn[(FWD, p, mb)]
            assert turn[(BWD_I, p, mb)] < turn[(BWD_I, p - 1, mb)]


@pytest.mark.parametrize("name", BUILDERS)
def test_deterministic(name: str) -> None:
    assert build(name, 6, 20) == build(name, 6, 20)


# --- memory --------------------------------------------------------------------------------


def memory_bound(name: str, p: int) -> float:
    if name == "v-min":
        return float((p + 4) // 3)  # about p/3: <= p/3 + 1, or p/3 + 4/3 when p % 3 == 2
    if name == "v-half":
        return min(p / 2 + 1, p)
    return float(p)


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("p", range(1, 9))
def test_memory_bound_every_m_up_to_32(name: str, p: int) -> None:
    bound = memory_bound(name, p)
    for m in range(1, 33):
        run = simulate(build(name, p, m))
        assert run.peak_units <= bound, (name, p, m, run.peak_held)
        if name == "v-min" and m >= p:
            assert run.peak_units == bound, (p, m, run.peak_held)  # the block's exact peak


@pytest.mark.parametrize("p", [12, 16])
def test_memory_bound_large_p(p: int) -> None:
    for name in BUILDERS:
        run = simulate(build(name, p, 48))
        assert run.peak_units <= memory_bound(name, p), (name, run.peak_held)
    assert simulate(build("v-min", p, 48)).peak_units <= p / 3 + 1
    assert simulate(build("v-half", p, 48)).peak_units <= p / 2 + 1


# --- bubble --------------------------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 17))
def test_v_zb_reaches_the_fill_floor_from_p_microbatches(p: int) -> None:
    """Rank p-1 cannot start before p-1 forwards ran upstream, and every rank has 6m slots of
    work, so 6m + p - 1 slots is the floor; v-zb reaches it for every m >= p."""
    for m in sorted({p, p + 1, (3 * p) // 2, (3 * p) // 2 + 1, 2 * p, 2 * p + 1, 3 * p + 2, 64}):
        run = simulate(build("v-zb", p, m))
        assert run.makespan == 6 * m + p - 1, (p, m, run.makespan)
        if m >= 2 * p:
            assert run.bubble < 0.10, (p, m, run.bubble)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 12])
def test_zb_v_order_alone_and_where_v_zb_departs_from_it(p: int) -> None:
    """The ZB-V order takes max(6m + p - 1, 4m + 4p - 2) slots: the floor from m >= (3p-1)/2,
    where v-zb is exactly that order; below, v-zb is shorter (replayed, or the greedy for m < p)."""
    for m in range(1, 3 * p + 2):
        order = v_shape._make("v-zb", p, m, v_shape._zb_programs(p, m))
        zb_v = simulate(order).makespan
        v_zb = build("v-zb", p, m)
        if m >= p:
            assert zb_v == max(6 * m + p - 1, 4 * m + 4 * p - 2), (p, m)
        if 2 * m >= 3 * p - 1:
            assert v_zb == order, (p, m)
        else:
            assert simulate(v_zb).makespan <= zb_v, (p, m)


def test_replay_moves_input_and_weight_gradients_only_between_forwards() -> None:
    """Same actions; every F keeps the set of actions before it (so memory and the forward order
    are unchanged); and on these orders (ZB-V's, the greedy's, V-Min's blocks) the replayed one
    is never slower."""
    for p, m in [(2, 2), (4, 5), (5, 6), (8, 9), (8, 11)]:
        for programs in (
            v_shape._zb_programs(p, m),
            v_shape._greedy_programs(p, m, memory_limit=p + 2, open_limits=[p] * p),
            v_shape._block_programs(p, m),
        ):
            replayed = v_shape._input_gradients_first(p, programs)
            for before, after in zip(programs, replayed, strict=True):
                assert sorted(before) == sorted(after)
                prefix_before = [set(before[:i]) for i, a in enumerate(before) if a[0] == 0]
                prefix_after = [set(after[:i]) for i, a in enumerate(after) if a[0] == 0]
                assert prefix_before == prefix_after
            run = simulate(v_shape._make("replayed", p, m, replayed))
            assert run.makespan <= simulate(v_shape._make("listed", p, m, programs)).makespan


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8, 12, 16])
def test_bubbles_against_1f1b(p: int) -> None:
    for m in sorted({1, 2, p, 2 * p, 2 * p + 3, 4 * p, 64}):
        reference = one_f_one_b_bubble(p, m)
        bubble = {name: simulate(build(name, p, m)).bubble for name in BUILDERS}
        for name, value in bubble.items():
            assert value <= reference + 1e-12, (name, p, m, value, reference)
        if m >= 2 * p:
            assert bubble["v-half"] <= 0.7 * reference, (p, m, bubble, reference)
            assert bubble["v-min"] <= 0.85 * reference, (p, m, bubble, reference)
            assert bubble["v-zb"] <= bubble["v-half"] + 1e-12, (p, m, bubble)


def test_single_rank_has_no_bubble() -> None:
    for name in BUILDERS:
        for m in (1, 2, 9):
            run = simulate(build(name, 1, m))
            assert run.idle == 0
            assert run.peak_units <= 1.0


def test_report_against_1f1b(capsys: pytest.CaptureFixture[str]) -> None:
    """The table in the module docstring; visible with ``pytest -s``."""
    lines = ["   p    m | v-min        | v-half       | v-zb         | 1F1B"]
    for p in (4, 8, 16):
        for m in (8, 32, 128):
            cells = []
            for name in BUILDERS:
                run = simulate(build(name, p, m))
                cells.append(f"{run.peak_units:4.1f}u {100 * run.bubble:5.1f}%")
            reference = 100 * one_f_one_b_bubble(p, m)
            lines.append(f"{p:4d} {m:4d} | " + " | ".join(cells) + f" | {p:4d}u {reference:5.1f}%")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert len(lines) == 10


# --- the greedy's progress guarantee ----------------------------------------------------------


def test_greedy_never_needs_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a limit of 2 or more, some rank can always act (see ``_greedy_programs``)."""

    def refuse(*args: object) -> None:
        raise AssertionError("fallback used")

    monkeypatch.setattr(v_shape, "_oldest_ready_forward", refuse)
    for p in (1, 2, 3, 5, 8):
        for m in (1, 4, 17):
            for limit in (2, 3, p + 2, 2 * p):
                programs = v_shape._greedy_programs(p, m, memory_limit=limit, open_limits=[1] * p)
                run = simulate(v_shape._make("greedy", p, m, programs))
                assert max(run.peak_held) <= limit
            for name in ("v-half", "v-zb"):
                simulate(build(name, p, m))


def test_greedy_makes_progress_below_one_microbatch() -> None:
    """A limit of 1 cannot pass a micro-batch; the oldest F then runs over the limit."""
    for p, m in [(1, 3), (3, 4), (4, 9)]:
        programs = v_shape._greedy_programs(p, m, memory_limit=1, open_limits=[1] * p)
        run = simulate(v_shape._make("greedy", p, m, programs))
        assert max(run.peak_held) >= 2


# --- inputs, purity, speed ---------------------------------------------------------------


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize(
    ("p", "m"), [(0, 4), (-1, 4), (4, 0), (4, -3), (True, 4), (2.0, 4), (4, "8")]
)
def test_bad_input(name: str, p: object, m: object) -> None:
    with pytest.raises(ScheduleError, match="positive integer"):
        BUILDERS[name](num_ranks=p, num_microbatches=m)


@pytest.mark.parametrize("name", BUILDERS)
def test_keyword_only(name: str) -> None:
    with pytest.raises(TypeError):
        BUILDERS[name](4, 8)


def test_module_imports_neither_torch_nor_megatron() -> None:
    tree = ast.parse(Path(v_shape.__file__).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    assert roots <= {"__future__", "collections", "megatron_bfpp"}, roots


@pytest.mark.parametrize("name", BUILDERS)
def test_large_build_is_linear_in_the_microbatches(name: str) -> None:
    """Doubling m at most doubles the lines the builder runs (4x would be a quadratic scan)."""
    assert growth(python_lines, lambda m: build(name, 8, m), 64) < 2.3
    schedule = build(name, 16, 512)
    assert schedule.num_actions == 16 * 2 * 512 * 3
