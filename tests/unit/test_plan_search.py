"""The configuration search: its shortcuts give what the long way gives (memory walked at a short
length, steps extrapolated from three short simulations, the closed-form bound below every
simulated step), its size, its output, and the breadth-first paper's qualitative result."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from megatron_bfpp.ir import Placement, ScheduleError
from megatron_bfpp.plan import search
from megatron_bfpp.plan.memory import (
    full_buffer_peaks,
    peak_points,
    stage_parameters,
    weights_bytes,
)
from megatron_bfpp.plan.presets import get_gpu, get_model
from megatron_bfpp.plan.search import (
    EXACT_UP_TO,
    MEGATRON_SCHEDULES,
    ActionBudget,
    Candidate,
    Cluster,
    OverBudget,
    SearchOptions,
    _cost_model,
    _full_buffers,
    _points,
    _simulated_ns,
    _size,
    _weights,
    candidates,
    evaluate,
    grad_reduce_of,
    memory_microbatches,
    no_candidates_reason,
    p2p_model_of,
    recommend,
    sharded_walk_length,
)
from megatron_bfpp.schedules.registry import build_schedule, estimate_actions, get_spec
from megatron_bfpp.sim import CostModel, simulate, simulator

V100_64 = Cluster(64, 8, get_gpu("v100-32gb"))
GPT52 = get_model("gpt3-52b")


@pytest.mark.parametrize(
    ("schedule", "pp", "vp"),
    [
        *((s, p, 1) for s in ("1f1b", "bpipe") for p in (2, 3, 4, 8)),
        *(("interleaved", p, v) for p in (2, 4) for v in (2, 4, 8)),
        *((s, p, 2) for s in ("v-min", "v-half", "v-zb") for p in (2, 3, 4, 8)),
    ],
)
def test_memory_walked_at_a_short_length_is_the_long_walk(schedule: str, pp: int, vp: int) -> None:
    """One length for every schedule, chunk count and option the planner tries (BPipe's caps)."""
    chunks = None if schedule in ("1f1b", "bpipe") else vp
    spec = get_spec(schedule)
    for m in sorted({5 * pp, 7 * pp, 9 * pp, 5 * pp + 1, 6 * pp + pp // 2}):
        if spec.planned_microbatches_problem(pp, m) is not None:
            continue
        assert memory_microbatches(pp, m) < m
        for options in spec.plan.options(pp, m) + spec.plan.overlapped:
            full = build_schedule(
                schedule,
                num_ranks=pp,
                num_microbatches=m,
                num_chunks=chunks,
                lower=False,
                **options,
            )
            assert _points(schedule, pp, vp, m, **options) == peak_points(full), (m, options)


@pytest.mark.parametrize(("pp", "vp"), [(2, 2), (2, 4), (4, 4), (2, 8), (3, 4)])
def test_fully_sharded_walk_at_a_short_length_is_the_long_walk(pp: int, vp: int) -> None:
    """The planner walks fully sharded breadth-first at groups of one and at most three
    micro-batches; every group size and batch gives the same full-buffer peaks, weighed by
    each chunk's parameters (the embedding's and the output layer's chunks are larger)."""
    model = GPT52
    weights = stage_parameters(model, tp=8, pp=pp, chunks=vp, placement=Placement.LOOPED)
    for m, group in [(1, None), (8, None), (8, 1), (8, 2), (8, 3), (12, 4), (12, 5), (16, 8)]:
        full = build_schedule(
            "breadth-first",
            num_ranks=pp,
            num_microbatches=m,
            num_chunks=vp,
            sharding="optim_grads_params",
            **({} if group is None else {"group_size": group}),
        )
        walked = _full_buffers(model, 8, pp, vp, sharded_walk_length(m, group))
        assert walked == full_buffer_peaks(full, weights), (m, group)
        # Two chunks at most, whatever the group size: never every chunk (vp > 2).
        for rank, (gathered, accumulated) in enumerate(walked):
            mine = sorted(weights[s] for s in full.layout.stages_of(rank))
            assert gathered <= sum(mine[-2:]) and accumulated <= sum(mine[-2:])
            if vp > 2:
                assert accumulated < sum(mine)


def test_the_planner_budgets_grouped_sharded_breadth_first_as_it_runs() -> None:
    """The issue's case: 52B on 64 V100s, tp 8, pp 2, vp 8, dp 4, group 2 (8 micro-batches).
    Each rank's gradients are the kept shard plus the walk's two chunks, whatever the group
    size: 6.8 GB of the unsharded run's 13.2 GB (budgeted so before too, but run with every
    chunk whole from its first group to its last)."""
    precision = SearchOptions().precision
    per_group = {
        group: _weights(
            Candidate("breadth-first", "optim_grads_params", 8, 2, 8, 4, 1, "selective", group),
            8,
            GPT52,
            precision,
        )
        for group in (1, 2, None)
    }
    assert per_group[1] == per_group[2] == per_group[None]
    counts = stage_parameters(GPT52, tp=8, pp=2, chunks=8, placement=Placement.LOOPED)
    for rank, (params, grads, _) in enumerate(per_group[2]):
        mine = sorted(counts[s] for s in range(rank, 16, 2))
        kept = -(-sum(mine) // 4)
        assert grads == (kept + sum(mine[-2:])) * precision.grad_bytes
        assert params == (kept + sum(mine[-2:])) * precision.param_bytes
        unsharded = weights_bytes(sum(mine), dp=4, precision=precision, sharded=False)
        assert grads < 0.55 * unsharded[1]


@pytest.mark.parametrize(
    ("schedule", "pp", "vp"), [("gpipe", 4, 1), ("breadth-first", 4, 2), ("breadth-first", 3, 4)]
)
def test_closed_form_peaks_of_all_forwards_first_schedules(schedule: str, pp: int, vp: int) -> None:
    chunks = None if schedule == "gpipe" else vp
    for m in (1, pp, 3 * pp + 1):
        full = build_schedule(
            schedule, num_ranks=pp, num_microbatches=m, num_chunks=chunks, lower=False
        )
        assert _points(schedule, pp, vp, m) == peak_points(full)


@pytest.mark.parametrize(("pp", "vp"), [(2, 2), (3, 4), (4, 2), (8, 2)])
def test_closed_form_peaks_of_grouped_breadth_first(pp: int, vp: int) -> None:
    """The planner's grouped breadth-first peaks (one group's micro-batches per chunk, no walk)
    are the full schedule's, with the last group smaller or whole, and what the walk of the
    first group the planner used to do gives; the budget is charged as for that walk."""
    for m, group in [(1, 1), (7, 2), (8, 8), (12, 5), (3 * pp + 1, pp), (9 * pp, 4 * pp)]:
        full = build_schedule(
            "breadth-first", num_ranks=pp, num_microbatches=m, num_chunks=vp, group_size=group
        )
        budget = ActionBudget(10**9)
        assert _points("breadth-first", pp, vp, m, budget, group_size=group) == peak_points(full)
        length = min(m, max(memory_microbatches(pp, m), group))
        walked = build_schedule(
            "breadth-first", num_ranks=pp, num_microbatches=length, num_chunks=vp, group_size=group
        )
        assert peak_points(walked) == peak_points(full), (m, group)
        charged = estimate_actions(num_ranks=pp, stages_per_rank=vp, num_microbatches=length)
        assert budget.spent == charged


def _sample(global_batch_size: int, every: int) -> list[Candidate]:
    options = SearchOptions(micro_batch_sizes=(1, 2), recompute=("selective",))
    found = candidates(
        model=GPT52, cluster=V100_64, global_batch_size=global_batch_size, options=options
    )
    return [c for c in itertools.islice(found, 0, None, every) if c.pp > 1][:24]


EXPLICIT = [
    Candidate("1f1b", "optim", 8, 8, 1, 1, 1, "selective"),
    Candidate("gpipe", "optim", 4, 4, 1, 4, 2, "full"),
    Candidate("v-min", "optim", 8, 4, 2, 2, 1, "none"),
    Candidate("bpipe", "optim", 4, 8, 1, 2, 1, "selective"),
]


@pytest.mark.parametrize(
    ("candidate", "p2p"),
    [
        (candidate, p2p)
        for candidate in [*_sample(128, 7), *EXPLICIT]
        for p2p in ("lockstep", "gloo", "megatron")
        if p2p != "megatron" or candidate.schedule in MEGATRON_SCHEDULES
    ],
    ids=str,
)
def test_bound_and_extrapolation_agree_with_full_simulation(candidate: Candidate, p2p: str) -> None:
    sized = _size(
        candidate,
        model=GPT52,
        cluster=V100_64,
        global_batch_size=128,
        options=SearchOptions(),
        force=True,
    )
    assert sized is not None
    costs = _cost_model(sized.times)
    chunks = None if candidate.vp == 1 else candidate.vp
    full = simulate(
        build_schedule(
            candidate.schedule,
            num_ranks=candidate.pp,
            num_microbatches=sized.m,
            num_chunks=chunks,
            sharding=candidate.sharding,
            **({"group_size": candidate.group_size} if candidate.group_size else {}),
        ),
        costs,
        p2p=p2p,
    )
    step, _ = _simulated_ns(candidate, sized.m, costs, p2p)
    assert step == pytest.approx(full.step_time, rel=1e-9)
    total = step / 1e9 + sized.m * sized.times.output + sized.times.optimizer
    assert sized.lower_bound <= total * (1 + 1e-12)


def test_search_size_and_json_fields() -> None:
    result = recommend(model=GPT52, cluster=V100_64, global_batch_size=64)
    assert result.candidates_evaluated >= 2000
    assert 0 < result.rejected_out_of_memory < result.candidates_evaluated
    data = result.to_dict()
    assert set(data) == {"p2p_model", "candidates_evaluated", "rejected_out_of_memory", "configs"}
    assert data["p2p_model"] == "lockstep"
    steps = [c["step_time_s"] for c in data["configs"]]
    assert steps == sorted(steps) and len(steps) == 10
    config = data["configs"][0]
    assert set(config) == {
        "schedule",
        "tensor_parallel",
        "pipeline_parallel",
        "virtual_stages",
        "data_parallel",
        "expert_parallel",
        "micro_batch_size",
        "sharding",
        "recompute",
        "group_size",
        "max_stored",
        "combined_1f1b",
        "stage_layers",
        "pipeline_model_parallel_layout",
        "sequence_parallel",
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "memory_per_gpu_bytes",
        "p2p_model",
        "megatron_grad_reduce",
    }
    memory = config["memory_per_gpu_bytes"]
    assert memory["total"] == sum(
        memory[k] for k in ("parameters", "gradients", "optimizer", "activations")
    )
    assert memory["total"] <= 0.9 * V100_64.gpu.memory_bytes
    tp, pp, dp = config["tensor_parallel"], config["pipeline_parallel"], config["data_parallel"]
    assert tp * pp * dp == 64


def _advantage(global_batch_size: int, *, megatron: bool = True) -> tuple[float, float, float]:
    """Best step of breadth-first (either sharding), interleaved and 1F1B at one batch size;
    ``megatron``: the last two as Megatron runs them (megatron-core's posting), else as ours."""
    result = recommend(
        model=GPT52,
        cluster=V100_64,
        global_batch_size=global_batch_size,
        options=SearchOptions(
            schedules=("breadth-first", "interleaved", "1f1b"),
            best_per_family=True,
            megatron_baselines=megatron,
        ),
    )
    best = result.best_per_family
    breadth = min(best[f].step_time_s for f in best if f.startswith("breadth-first"))
    return breadth, best["interleaved"].step_time_s, best["1f1b"].step_time_s


@pytest.mark.slow
def test_breadth_first_wins_at_small_batch_per_gpu_and_the_gap_closes() -> None:
    """The breadth-first paper's Figure 3 (52B, 64 x V100-32GB): at 0.25 samples per GPU
    breadth-first is as fast as depth-first interleaved, within 1%, and well ahead of 1F1B; at
    8 per GPU its lead over 1F1B is gone. With m = pp micro-batches the two orders differ only
    on the last rank (interleaved runs its last chunk one forward, one backward; breadth-first
    all forwards first), which gloo's rules time alike and the lock-step posting 0.5% apart in
    interleaved's favour at the best layout (pp 8, vp 8). Megatron's own interleaved posts its
    order differently (non-batched, p2p overlapped), also within 1%."""
    breadth, ours, _ = _advantage(16, megatron=False)
    assert abs(breadth / ours - 1) < 0.01
    breadth, interleaved, one_f_one_b = _advantage(16)
    assert abs(breadth / interleaved - 1) < 0.01
    small = 1 - breadth / one_f_one_b
    assert small > 0.15
    breadth, interleaved, one_f_one_b = _advantage(512)
    large = 1 - breadth / one_f_one_b
    assert large < small / 2 and large < 0.05


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(global_batch_size=0), "--global-batch-size must be positive"),
        (dict(global_batch_size=True), "--global-batch-size must be an integer"),
    ],
)
def test_bad_search_input(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        recommend(model=GPT52, cluster=V100_64, **kwargs)  # type: ignore[arg-type]


def _has_candidates(num_gpus: int, model_name: str, batch: int, options: SearchOptions) -> bool:
    cluster = Cluster(num_gpus, 8, get_gpu("h100-80gb"))
    found = candidates(
        model=get_model(model_name), cluster=cluster, global_batch_size=batch, options=options
    )
    return next(found, None) is not None


def test_an_empty_search_says_the_gpus_cannot_be_split_and_the_nearest_counts_that_can() -> None:
    """1,000 H100s for GPT-3 175B at batch 1536: no tp x pp x dp exists (a dp of 125, 250, 500
    or 1000 never divides 1536), which is not a memory problem; the nearest whole-node counts
    with a candidate are named, and every count between them has none."""
    options = SearchOptions()
    cluster = Cluster(1000, 8, get_gpu("h100-80gb"))
    model = get_model("gpt3-175b")
    assert (
        next(
            candidates(model=model, cluster=cluster, global_batch_size=1536, options=options), None
        )
        is None
    )
    reason = no_candidates_reason(
        model=model, cluster=cluster, global_batch_size=1536, options=options
    )
    assert reason.startswith(
        "1000 x h100-80gb cannot be split into tp x pp x dp for gpt3-175b at global batch 1536: "
        "with tp in 1, 2, 4, 8 dividing the 96 heads and pp the 96 layers, every split leaves a "
        "data parallel size (125, 250, 500, 1000) that does not divide the global batch; "
        "the nearest GPU counts that can: "
    ), reason
    below, above = (int(c) for c in reason.rsplit(": ", 1)[1].split(" and "))
    assert below < 1000 < above
    assert _has_candidates(below, "gpt3-175b", 1536, options)
    assert _has_candidates(above, "gpt3-175b", 1536, options)
    between = range(below + 8, above, 8)
    assert not any(_has_candidates(n, "gpt3-175b", 1536, options) for n in between)


def test_an_empty_search_for_the_schedules_says_so() -> None:
    """A split exists but none suits the chosen schedules: interleaved at batch 1 on 2 GPUs
    (pp 1 runs only 1F1B, one micro-batch is not a multiple of pp 2), at any GPU count."""
    options = SearchOptions(schedules=("interleaved",))
    reason = no_candidates_reason(
        model=get_model("llama-7b"),
        cluster=Cluster(2, 8, get_gpu("h100-80gb")),
        global_batch_size=1,
        options=options,
    )
    assert reason.startswith(
        "the chosen schedules run on no split of 2 x h100-80gb for llama-7b at global batch 1: "
        "all but 1f1b need pp >= 2, interleaved a multiple of pp micro-batches"
    ), reason
    assert reason.endswith("; no GPU count can; change the global batch or the schedules")


def test_cluster_checks() -> None:
    with pytest.raises(ScheduleError, match="not a whole number of nodes"):
        Cluster(12, 8, get_gpu("a100-80gb"))
    with pytest.raises(ScheduleError, match="--num-gpus must be a positive integer"):
        Cluster(0, 8, get_gpu("a100-80gb"))


def test_sequence_parallelism_off_is_the_2022_papers_setting() -> None:
    """`recommend --sequence-parallel off`: tensor-parallel candidates keep the norms' and
    dropouts' activations whole on every tp rank (Korthikanti's eq. 2 instead of eq. 4) and send
    whole pipeline messages; tp = 1 is the same either way."""
    off = SearchOptions(micro_batch_sizes=(1,), recompute=("none",), sequence_parallel=False)
    on = SearchOptions(micro_batch_sizes=(1,), recompute=("none",))
    plain = list(candidates(model=GPT52, cluster=V100_64, global_batch_size=64, options=off))
    default = list(candidates(model=GPT52, cluster=V100_64, global_batch_size=64, options=on))
    assert len(plain) == len(default)
    assert all(c.sequence_parallel == (c.tp > 1) for c in default)
    assert not any(c.sequence_parallel for c in plain)
    picked = next(c for c in plain if c.tp == 4 and c.pp == 8 and c.schedule == "1f1b")
    twin = next(c for c in default if c.tp == 4 and c.pp == 8 and c.schedule == "1f1b")
    with_sp = evaluate(twin, model=GPT52, cluster=V100_64, global_batch_size=64, options=on)
    without = evaluate(picked, model=GPT52, cluster=V100_64, global_batch_size=64, options=off)
    assert without.memory.activations > with_sp.memory.activations
    assert with_sp.to_dict()["sequence_parallel"] is True
    assert without.to_dict()["sequence_parallel"] is False


def test_megatron_rows_are_timed_by_megatron_cores_own_posting() -> None:
    """1f1b / interleaved rows stand for Megatron's own schedules: timed by megatron-core's
    posting while the rest are timed by the runtime's lock-step posting; a search under gloo's
    rules (or with megatron_baselines off) times every row alike."""
    plain = SearchOptions()
    interleaved = Candidate("interleaved", "optim", 8, 4, 8, 2, 2, "selective")
    breadth = Candidate("breadth-first", "optim", 8, 4, 8, 2, 2, "selective", 4)
    assert p2p_model_of(interleaved, plain) == "megatron"
    assert p2p_model_of(breadth, plain) == "lockstep"
    assert p2p_model_of(interleaved, SearchOptions(p2p_model="gloo")) == "gloo"
    assert p2p_model_of(interleaved, SearchOptions(megatron_baselines=False)) == "lockstep"
    result = recommend(model=GPT52, cluster=V100_64, global_batch_size=32)
    models = {plan.candidate.schedule: plan.p2p_model for plan in result.plans}
    assert models.get("interleaved") == "megatron" and models.get("v-zb") == "lockstep"
    assert result.to_dict()["configs"][0]["p2p_model"] in ("megatron", "lockstep")


def test_megatron_rows_can_be_timed_as_megatron_lm_ran_in_2022() -> None:
    """`recommend --megatron-p2p blocking`: Megatron's interleaved rows are timed by
    megatron-core's posting with --no-overlap-p2p-communication (every call batched and waited
    at once), never slower to overlap, and the layout Megatron-LM refuses then (interleaved at
    pp 2) is not searched."""
    blocking = SearchOptions(megatron_p2p_overlap=False)
    interleaved = Candidate("interleaved", "optim", 8, 4, 8, 2, 2, "selective")
    assert p2p_model_of(interleaved, blocking) == "megatron-blocking"
    schedule = build_schedule("interleaved", num_ranks=4, num_microbatches=8, num_chunks=2)
    costs = CostModel(t_p2p=0.3)
    overlapped = simulate(schedule, costs, p2p="megatron").step_time
    assert simulate(schedule, costs, p2p="megatron-blocking").step_time >= overlapped
    found = candidates(model=GPT52, cluster=V100_64, global_batch_size=64, options=blocking)
    assert not any(c.schedule == "interleaved" and c.pp == 2 for c in found)
    default = candidates(
        model=GPT52, cluster=V100_64, global_batch_size=64, options=SearchOptions()
    )
    assert any(c.schedule == "interleaved" and c.pp == 2 for c in default)


def test_megatron_rows_can_reduce_gradients_at_the_end() -> None:
    """`recommend --megatron-grad-reduce at-end`: Megatron's rows start every reduction after
    the schedule (Megatron-LM without --overlap-grad-reduce), never faster than overlapped; our
    rows keep their GS and say none."""
    at_end = SearchOptions(megatron_overlap_grad_reduce=False)
    assert grad_reduce_of("megatron", SearchOptions()) == "overlap"
    assert grad_reduce_of("megatron-blocking", at_end) == "at-end"
    assert grad_reduce_of("lockstep", at_end) is None
    interleaved = Candidate("interleaved", "optim", 8, 4, 8, 2, 2, "selective")
    breadth = Candidate("breadth-first", "optim", 8, 4, 8, 2, 2, "selective", 4)
    kwargs = dict(model=GPT52, cluster=V100_64, global_batch_size=32)
    overlapped = evaluate(interleaved, **kwargs)
    late = evaluate(interleaved, **kwargs, options=at_end)
    assert (overlapped.megatron_grad_reduce, late.megatron_grad_reduce) == ("overlap", "at-end")
    assert late.to_dict()["megatron_grad_reduce"] == "at-end"
    assert late.step_time_s > overlapped.step_time_s
    ours = evaluate(breadth, **kwargs, options=at_end)
    assert ours.megatron_grad_reduce is None
    assert ours.step_time_s == evaluate(breadth, **kwargs).step_time_s


def _timed(candidate: Candidate, global_batch_size: int) -> tuple[int, CostModel]:
    sized = _size(
        candidate,
        model=GPT52,
        cluster=V100_64,
        global_batch_size=global_batch_size,
        options=SearchOptions(),
        force=True,
    )
    assert sized is not None
    return sized.m, _cost_model(sized.times)


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths ``_simulated_ns`` simulates, in order."""
    lengths: list[int] = []
    step = search._step
    monkeypatch.setattr(search, "_step", lambda c, m, *args: lengths.append(m) or step(c, m, *args))
    return lengths


def test_each_short_length_is_simulated_and_charged_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interleaved at pp 8 with one data-parallel rank lies on none of the three lines: the
    attempts share lengths (p+r, 2p+r, 3p+r, then 4p+r, then 2p apart), each simulated and
    charged once, then the whole schedule is; the step is the full simulation's."""
    candidate = Candidate("interleaved", "optim", 8, 8, 2, 1, 1, "selective")
    m, costs = _timed(candidate, 128)
    lengths = _recording(monkeypatch)
    budget = ActionBudget(10**9)
    step, _ = _simulated_ns(candidate, m, costs, "lockstep", budget=budget)
    assert len(lengths) > 4 and lengths[-1] == m  # every attempt, then the whole
    assert len(set(lengths)) == len(lengths)
    assert budget.spent == sum(
        estimate_actions(num_ranks=8, stages_per_rank=2, num_microbatches=n) for n in lengths
    )
    full = build_schedule("interleaved", num_ranks=8, num_microbatches=m, num_chunks=2)
    assert step == pytest.approx(simulate(full, costs).step_time, rel=1e-9)


def test_a_line_that_bends_later_is_not_read_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counterexample docs/simulator.md gives: interleaved at pp 8, vp 2 lies on one line
    from 24 to 72 micro-batches and bends at 80, so lengths from three periods would read its
    step at 128 short. The attempts (from one and two periods) see no line: bfpp-sim times it
    whole, as the planner does above."""
    candidate = Candidate("interleaved", "optim", 8, 8, 2, 1, 1, "selective")
    m, costs = _timed(candidate, 128)

    def build(n: int):
        return build_schedule("interleaved", num_ranks=8, num_microbatches=n, num_chunks=2)

    steps = {n: simulate(build(n), costs).step_time for n in (24, 32, 40, 48, 72, 80, 88)}
    slope = steps[32] - steps[24]
    assert steps[40] - steps[32] == slope == steps[48] - steps[40]  # on a line ...
    assert steps[80] - steps[72] > slope  # ... that bends later
    monkeypatch.setattr(simulator, "STEADY_FROM_ACTIONS", 0)
    steady = simulator.simulate_steady(build(m), costs, shorter=build, period=8)
    assert steady.steady_from == ()
    assert steady.step_time == simulate(build(m), costs).step_time


@pytest.mark.parametrize(
    ("schedule", "vp", "m"), [("v-zb", 2, 24), ("1f1b", 1, 30), ("v-min", 2, 27)]
)
def test_a_schedule_no_longer_than_the_attempts_is_simulated_whole(
    monkeypatch: pytest.MonkeyPatch, schedule: str, vp: int, m: int
) -> None:
    """At pp 4, m up to 6p + 3r (attempt 1's lengths together) is simulated whole, once, and
    charged as such; the step is the full simulation's, which the line also gives (to
    rounding) when it holds."""
    candidate = Candidate(schedule, "optim", 8, 4, vp, 2, 1, "selective")
    sized_m, costs = _timed(candidate, 2 * m)
    assert sized_m == m
    lengths = _recording(monkeypatch)
    budget = ActionBudget(10**9)
    step, bubble = _simulated_ns(candidate, m, costs, "lockstep", budget=budget)
    assert lengths == [m]
    assert budget.spent == estimate_actions(num_ranks=4, stages_per_rank=vp, num_microbatches=m)
    chunks = None if vp == 1 else vp
    full = simulate(
        build_schedule(schedule, num_ranks=4, num_microbatches=m, num_chunks=chunks), costs
    )
    assert (step, bubble) == (full.step_time, full.bubble_fraction)


def test_a_timing_that_cannot_finish_in_the_budget_does_not_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Short of attempt 1's three lengths, nothing is simulated or charged (auto's untimed
    row); with them, the step is timed from those three alone."""
    candidate = Candidate("interleaved", "optim", 8, 4, 2, 2, 1, "selective")
    m, costs = _timed(candidate, 64)
    cheapest = sum(
        estimate_actions(num_ranks=4, stages_per_rank=2, num_microbatches=n) for n in (4, 8, 12)
    )
    lengths = _recording(monkeypatch)
    short = ActionBudget(cheapest - 1)
    with pytest.raises(OverBudget, match="4 \\+ 8 \\+ 12 micro-batches"):
        _simulated_ns(candidate, m, costs, "lockstep", budget=short)
    assert lengths == [] and short.spent == 0
    enough = ActionBudget(cheapest)
    _simulated_ns(candidate, m, costs, "lockstep", budget=enough)
    assert lengths == [4, 8, 12] and enough.spent == cheapest


@pytest.mark.parametrize(("pp", "extra"), [(4, 1), (4, 7), (8, 3)])
def test_past_the_exact_range_bpipe_is_within_half_a_percent(
    pp: int, extra: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BPipe's lock-step steps lie on no exact line; past EXACT_UP_TO periods the planner reads
    the step off an approximating line (``_approximate``), held to the full simulation."""
    candidate = Candidate("bpipe", "optim", 4, pp, 1, 2, 1, "selective")
    m = EXACT_UP_TO * pp + extra
    sized = _size(
        candidate,
        model=GPT52,
        cluster=V100_64,
        global_batch_size=m * candidate.dp,
        options=SearchOptions(),
        force=True,
    )
    assert sized is not None and sized.m == m
    costs = _cost_model(sized.times)
    full = simulate(build_schedule("bpipe", num_ranks=pp, num_microbatches=m), costs).step_time
    lengths: list[int] = []
    build = search._schedule
    monkeypatch.setattr(search, "_schedule", lambda *args: lengths.append(args[3]) or build(*args))
    step, bubble = _simulated_ns(candidate, m, costs, "lockstep")
    assert step == pytest.approx(full, rel=5e-3)
    assert max(lengths) < m  # the approximation answered, no full simulation
    assert 0 < bubble < 1


@pytest.mark.parametrize(
    ("schedule", "vp"),
    [
        ("1f1b", 1),
        ("gpipe", 1),
        ("interleaved", 2),
        ("breadth-first", 2),
        ("v-min", 2),
        ("v-half", 2),
        ("v-zb", 2),
        ("dualpipe-v", 2),
    ],
)
def test_a_steady_lines_bubble_is_the_full_simulations_with_host_time(
    schedule: str, vp: int
) -> None:
    """Read off the line, the bubble is the full simulation's, host time included: the busy
    time extends along the line with the step. (Counting 2 or 3 host actions per micro-batch
    and chunk gave dualpipe-v, which splits only the backwards around its fill and drain, a
    bubble too small by the host time of the B-in-pairs it counted as I and W.)"""
    candidate = Candidate(schedule, "optim", 8, 4, vp, 2, 1, "selective")
    m, costs = _timed(candidate, 2 * 40)
    costs = dataclasses.replace(costs, t_host=0.05 * costs.t_forward)
    step, bubble = _simulated_ns(candidate, m, costs, "lockstep")
    chunks = None if vp == 1 else vp
    full = simulate(
        build_schedule(schedule, num_ranks=4, num_microbatches=m, num_chunks=chunks), costs
    )
    assert step == pytest.approx(full.step_time, rel=1e-9)
    assert bubble == pytest.approx(full.bubble_fraction, rel=1e-9, abs=1e-12)
