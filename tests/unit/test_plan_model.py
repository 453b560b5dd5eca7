"""The planner's formulas: Korthikanti's activation counts, eq. 1 FLOPs, the efficiency curve's
fit to the BPipe paper, weights with and without sharding, the memory walk over a schedule, stage
profiles, and the paper's worked example through recommend's own model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_bfpp.ir import MEMORY_DELTA, ActionKind, Placement, Schedule, ScheduleError, parts
from megatron_bfpp.passes.overlap import fuse_overlapped
from megatron_bfpp.plan.bpipe import bpipe_speedup_estimate
from megatron_bfpp.plan.costs import (
    BuiltinCurve,
    ProfileCurve,
    layer_forward_flops,
    model_flops_per_step,
)
from megatron_bfpp.plan.memory import (
    StageBytes,
    layer_activation_bytes,
    peak_activation_bytes,
    peak_points,
    weights_bytes,
)
from megatron_bfpp.plan.presets import (
    BF16_MIXED,
    FP32,
    MODELS,
    get_gpu,
    get_model,
    model_from_shape,
    padded_vocab_size,
)
from megatron_bfpp.plan.profile import (
    Measurement,
    StageProfile,
    load_profile,
    profile_from_dict,
    profile_to_dict,
)
from megatron_bfpp.plan.search import (
    Candidate,
    Cluster,
    SearchOptions,
    evaluate,
    lower_bound_of,
    recommend,
)
from megatron_bfpp.schedules.registry import build_schedule

GPT = model_from_shape(
    arch="gpt",
    num_layers=8,
    hidden_size=1024,
    num_attention_heads=16,
    seq_length=512,
    vocab_size=1000,
)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_activations_are_korthikanti_eq2_without_sequence_parallel(tp: int) -> None:
    s, b, h, a = GPT.seq_length, 2, GPT.hidden_size, GPT.num_attention_heads
    got = layer_activation_bytes(
        GPT,
        micro_batch_size=b,
        tp=tp,
        sequence_parallel=False,
        recompute="none",
        precision=BF16_MIXED,
        softmax_in_fp32=False,  # Korthikanti's count: a 16-bit softmax output
    )
    norm_stats = 2 * 2 * 4 * s * b  # two LayerNorms keep fp32 mean and rstd per token
    causal_mask = s * s  # megatron-core keeps it per layer; Korthikanti leaves it out
    assert got == (
        s * b * h * 10 + (24 * s * b * h + 5 * a * s * s * b) // tp + norm_stats + causal_mask
    )
    fp32_softmax = layer_activation_bytes(
        GPT,
        micro_batch_size=b,
        tp=tp,
        sequence_parallel=False,
        recompute="none",
        precision=BF16_MIXED,
    )
    assert fp32_softmax - got == 2 * a * s * s * b // tp  # 4 bytes a score instead of 2


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_activations_with_sequence_parallel_and_recomputation(tp: int) -> None:
    s, b, h, a = GPT.seq_length, 1, GPT.hidden_size, GPT.num_attention_heads
    kwargs = dict(micro_batch_size=b, tp=tp, sequence_parallel=True, precision=BF16_MIXED)
    stats = 2 * 2 * 4 * s * b // tp
    assert layer_activation_bytes(GPT, recompute="none", softmax_in_fp32=False, **kwargs) == (
        (34 * s * b * h + 5 * a * s * s * b) // tp + stats + s * s
    )  # Korthikanti eq. 4 (sequence parallel), plus the causal mask
    assert layer_activation_bytes(GPT, recompute="selective", **kwargs) == (
        34 * s * b * h // tp + stats
    )  # eq. 6: selective recomputation drops the attention core
    assert layer_activation_bytes(GPT, recompute="full", **kwargs) == 2 * s * b * h // tp


def test_activations_refuse_an_unknown_recomputation() -> None:
    with pytest.raises(ScheduleError, match="recompute must be one of none, selective, full"):
        layer_activation_bytes(
            GPT,
            micro_batch_size=1,
            tp=1,
            sequence_parallel=False,
            recompute="some",
            precision=FP32,
        )


def test_eq1_flops_of_gpt3_96b() -> None:
    model = get_model("gpt3-96b")
    b, s, h, layers, v = 128, 2048, 9984, 80, 50257
    expected = 72 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    assert model_flops_per_step(model, global_batch_size=b) == pytest.approx(expected, rel=1e-12)
    # The layers' share is three passes of the per-layer forward.
    per_layer = layer_forward_flops(model, micro_batch_size=b, tp=1)
    assert 3 * layers * per_layer == pytest.approx(72 * b * s * layers * h**2 * (1 + s / (6 * h)))


def test_builtin_curve_is_fit_to_the_bpipe_papers_flash_attention_stage() -> None:
    # Table 5, GPT-3 96B, t=4, flash attention 2: 57.7% at b=1, 62.4% at b=2 on A100s.
    curve = BuiltinCurve(get_gpu("a100-80gb"))
    model = get_model("gpt3-96b")
    for b, mfu in ((1, 0.577), (2, 0.624)):
        work = layer_forward_flops(model, micro_batch_size=b, tp=4)
        assert curve.forward(work) == pytest.approx(mfu, abs=0.01)
    assert curve.forward(1e9) < curve.forward(1e12) < get_gpu("a100-80gb").max_efficiency


def test_presets_have_the_published_sizes() -> None:
    sizes = {
        "gpt3-6.7b": 6.7e9,
        "gpt3-52b": 52e9,
        "gpt3-96b": 96e9,
        "gpt3-175b": 175e9,
        "llama-7b": 6.7e9,
        "llama-13b": 13e9,
        "llama-65b": 65e9,
        "llama-70b": 70e9,
    }
    from megatron_bfpp.plan.memory import rank_parameters

    for name, size in sizes.items():
        total = sum(rank_parameters(MODELS[name], tp=1, pp=1, chunks=1, placement=Placement.SINGLE))
        assert total == pytest.approx(size, rel=0.06), name


def test_vocabulary_is_padded_as_megatron_lm_pads_it() -> None:
    assert padded_vocab_size(50257, tp=1) == 50304
    assert padded_vocab_size(50257, tp=8) == 51200


def test_weights_with_and_without_sharded_parameters() -> None:
    # bf16 weights, fp32 gradients, 12 bytes of Adam state per parameter sharded over dp.
    assert weights_bytes(1000, dp=4, precision=BF16_MIXED, sharded=False) == (2000, 4000, 3000)
    # Fully sharded: the 1/dp shard of parameters and of gradients plus the full buffers at
    # their peaks (here 250 parameters gathered, 300 accumulating): (2 + 4 + 12) / dp bytes per
    # parameter plus those.
    assert weights_bytes(
        1000, dp=4, precision=BF16_MIXED, sharded=True, gathered=250, accumulated=300
    ) == (
        (250 + 250) * 2,
        (250 + 300) * 4,
        3000,
    )


def test_memory_walk_weights_first_and_last_stages() -> None:
    built = build_schedule("1f1b", num_ranks=4, num_microbatches=8, lower=False)
    points = peak_points(built)
    # 1F1B: rank r holds p - r micro-batches; rank 0's are all first-stage, rank 3 holds one.
    assert points.per_rank[0] == ((4, 4, 0),)
    assert points.per_rank[3] == ((1, 0, 1),)
    stage = StageBytes(layers=100, first=10, last=1000)
    assert peak_activation_bytes(points, stage) == (440, 300, 200, 1100)


def _every_store_front(schedule: Schedule) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """The Pareto front of the counts after every store, by pairwise comparison: what
    ``peak_points`` keeps, walked the plain way (an overlapped pair's parts in order)."""
    last_stage = schedule.num_stages - 1
    fronts = []
    for actions in schedule.per_rank:
        held = first = last = 0
        points = set()
        for action in actions:
            for step in parts(action) if action.kind is ActionKind.OVERLAP_F_B else (action,):
                delta = MEMORY_DELTA.get(step.kind, 0)
                held += delta
                first += delta if step.stage == 0 else 0
                last += delta if step.stage == last_stage else 0
                if delta > 0:
                    points.add((held, first, last))
        front = [
            p for p in points if not any(q != p and all(map(int.__ge__, q, p)) for q in points)
        ]
        fronts.append(tuple(sorted(front, reverse=True)))
    return tuple(fronts)


@pytest.mark.parametrize(
    "name", ["1f1b", "bpipe", "interleaved", "v-min", "v-half", "v-zb", "breadth-first"]
)
def test_peak_points_keep_the_front_of_every_store(name: str) -> None:
    """``peak_points`` records counts only where a run of stores ends; the front is the one of
    every count after a store, with and without overlapped pairs."""
    pairs = 0
    for pp, m in ((2, 5), (3, 7), (4, 12), (8, 17)):
        m = pp * -(-m // pp) if name == "interleaved" else m
        chunks = None if name in ("1f1b", "bpipe") else 2
        built = build_schedule(name, num_ranks=pp, num_microbatches=m, num_chunks=chunks)
        assert peak_points(built).per_rank == _every_store_front(built), (pp, m)
        if pp <= 4:
            fused = fuse_overlapped(built)
            pairs += sum(a.kind is ActionKind.OVERLAP_F_B for r in fused.per_rank for a in r)
            assert peak_points(fused).per_rank == _every_store_front(fused), (pp, m)
    assert pairs or name in ("breadth-first", "gpipe")


def _table5_profile(model_name: str = "gpt3-96b") -> StageProfile:
    """One stage of GPT-3 96B (t=4, 10 layers) timed so that its MFU is Table 5's, experiments
    (7) and (8): 37.8% at b=1 and 55.2% at b=2, on A100s."""
    model = get_model(model_name)
    peak = get_gpu("a100-80gb").peak_flops
    rows = []
    for b, mfu in ((1, 0.378), (2, 0.552)):
        work = 10 * layer_forward_flops(model, micro_batch_size=b, tp=4)
        stage = 3 * work / (mfu * peak)  # forward + backward of the stage
        rows.append(Measurement(b, stage / 3, 2 * stage / 3))
    return StageProfile("A100-SXM4-80GB", "cuda", model, 10, 4, "bf16", tuple(rows))


def test_worked_example_gpt3_96b_b1_to_b2_is_1_39_as_bpipe_estimate() -> None:
    """The seed paper's section 4: 1F1B at b=1 -> BPipe at b=2, p=8, t=4, B=128: 1.39. The
    planner times both with the simulator on the schedules build_schedule makes, from the
    stage profile, under the paper's assumptions (no communication, no optimizer step, no
    output layer: eq. 2 counts (B/b + p - 1) slots of the stage's T(b)), and with gloo's
    p2p rules: the slots of eq. 2 assume no posting order, which the runtime's lock-step
    posting adds (BPipe's evictions tie distant ranks to one tick; docs/simulator.md)."""
    model = get_model("gpt3-96b")
    gpu = get_gpu("a100-80gb")
    curve = ProfileCurve.from_profile(_table5_profile(), gpu)
    options = SearchOptions(
        efficiency=curve,
        communication=False,
        optimizer=False,
        output_layer=False,
        p2p_model="gloo",
    )
    cluster = Cluster(32, 8, gpu)
    common = dict(model=model, cluster=cluster, global_batch_size=128, options=options)
    before = evaluate(Candidate("1f1b", "optim", 4, 8, 1, 1, 1, "selective"), **common)
    after = evaluate(Candidate("bpipe", "optim", 4, 8, 1, 1, 2, "selective"), **common)
    ratio = before.step_time_s / after.step_time_s
    estimate = bpipe_speedup_estimate(
        stage_mfu_small=0.378,
        stage_mfu_large=0.552,
        micro_batch_small=1,
        micro_batch_large=2,
        global_batch_size=128,
        pp=8,
    )
    assert ratio == pytest.approx(estimate.predicted_speedup, rel=1e-6)
    assert round(ratio, 2) == 1.39
    assert after.mfu / before.mfu == pytest.approx(ratio)


def test_profile_round_trip(tmp_path: Path) -> None:
    profile = _table5_profile()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_to_dict(profile)))
    assert load_profile(path) == profile


@pytest.mark.parametrize("t_host", [0.0, 1.5e-4, 2.0])
def test_profile_round_trip_with_host_time(tmp_path: Path, t_host: float) -> None:
    profile = dataclasses.replace(_table5_profile(), t_host=t_host)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_to_dict(profile)))
    loaded = load_profile(path)
    assert loaded == profile and loaded.t_host == t_host


def test_a_profile_written_before_host_time_loads_without_it() -> None:
    """Profiles written before ``t_host`` was measured (docs/profiles/ holds some) have no such
    key; they load, and the planner charges no host time for them."""
    data = profile_to_dict(_table5_profile())
    assert "t_host" not in data  # a profile without it writes none
    old = profile_from_dict(data)
    assert old.t_host is None
    assert profile_from_dict({**data, "t_host": None}).t_host is None
    assert ProfileCurve.from_profile(old, get_gpu("a100-80gb")).host_s == 0.0


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: "not json", "not a JSON stage profile"),
        (lambda d: [], "the file holds no JSON object"),
        (lambda d: {**d, "format": "x"}, "'format' must be 'bfpp-stage-profile'"),
        (lambda d: {**d, "measurements": []}, "'measurements' is empty"),
        (
            lambda d: {**d, "measurements": [{**d["measurements"][0], "forward_s": -1}]},
            "'measurements[0].forward_s' must be between 1e-09 and 86400 seconds, got -1",
        ),
        (
            lambda d: {**d, "measurements": [{**d["measurements"][0], "forward_s": 1e308}]},
            "'measurements[0].forward_s' must be between 1e-09 and 86400 seconds, got 1e+308",
        ),
        (
            lambda d: {**d, "measurements": [{**d["measurements"][0], "backward_s": 1e-320}]},
            "'measurements[0].backward_s' must be between 1e-09 and 86400 seconds, got 1e-320",
        ),
        (lambda d: "[" * 100_000 + "]" * 100_000, "nested too deeply to be a stage profile"),
        (
            lambda d: {**d, "measurements": [{**d["measurements"][0], "backward_s": "fast"}]},
            "'measurements[0].backward_s' must be a number, got 'fast'",
        ),
        (lambda d: {k: v for k, v in d.items() if k != "device"}, "'device' is missing"),
        (
            lambda d: {**d, "measurements": d["measurements"] * 2},
            "'measurements' repeats a micro-batch size",
        ),
        (
            lambda d: {**d, "t_host": -0.001},
            "'t_host' must be 0 or between 1e-09 and 86400 seconds, got -0.001",
        ),
        (
            lambda d: {**d, "t_host": 1e308},
            "'t_host' must be 0 or between 1e-09 and 86400 seconds, got 1e+308",
        ),
        (lambda d: {**d, "t_host": "1 ms"}, "'t_host' must be a number, got '1 ms'"),
        (lambda d: {**d, "t_host": True}, "'t_host' must be a number, got True"),
        (
            lambda d: {
                **d,
                "measurements": [
                    {
                        **d["measurements"][0],
                        "backward_s": 0.02,
                        "backward_input_s": 0.03,
                        "backward_weight_s": 0.005,
                    }
                ],
            },
            "'measurements[0].backward_input_s' (0.03 s) exceeds 'measurements[0].backward_s' "
            "(0.02 s): half of a split backward cannot take longer than the whole backward",
        ),
        (
            lambda d: {
                **d,
                "measurements": [
                    {
                        **d["measurements"][0],
                        "backward_s": 0.02,
                        "backward_input_s": 0.015,
                        "backward_weight_s": 0.025,
                    }
                ],
            },
            "'measurements[0].backward_weight_s' (0.025 s) exceeds",
        ),
    ],
)
def test_bad_profiles_are_one_line(tmp_path: Path, mutate: object, message: str) -> None:
    data = profile_to_dict(_table5_profile())
    path = tmp_path / "p.json"
    changed = mutate(data)  # type: ignore[operator]
    path.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    with pytest.raises(ScheduleError) as error:
        load_profile(path)
    text = str(error.value)
    assert "\n" not in text and text.startswith(f"--profile {path}: ") and message in text


def test_nan_in_a_profile_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_to_dict(_table5_profile())).replace("0.", 'NaN, "x": 0.', 1))
    with pytest.raises(ScheduleError, match="not a JSON stage profile"):
        load_profile(path)


def test_a_profile_above_the_gpus_peak_is_refused() -> None:
    with pytest.raises(ScheduleError, match="ran above the v100-32gb's peak"):
        ProfileCurve.from_profile(_table5_profile(), get_gpu("v100-32gb")).forward(1.0)


def _host_options(t_host: float | None, gpu_name: str = "a100-80gb") -> SearchOptions:
    """The worked example's assumptions (no communication, optimizer or output layer; gloo's
    rules), compute from the Table 5 profile with ``t_host``."""
    profile = dataclasses.replace(_table5_profile(), t_host=t_host)
    return SearchOptions(
        efficiency=ProfileCurve.from_profile(profile, get_gpu(gpu_name)),
        communication=False,
        optimizer=False,
        output_layer=False,
        p2p_model="gloo",
    )


def test_the_planner_charges_the_profiles_host_time_to_every_compute_action() -> None:
    """1F1B with free messages takes (m + p - 1)(F + B); a host time h on each action makes it
    (m + p - 1)(F + B + 2h): the profile's ``t_host`` reaches the planner's CostModel."""
    model, gpu = get_model("gpt3-96b"), get_gpu("a100-80gb")
    common = dict(model=model, cluster=Cluster(32, 8, gpu), global_batch_size=128)
    c = Candidate("1f1b", "optim", 4, 8, 1, 1, 1, "selective")
    without = evaluate(c, options=_host_options(None), **common)  # type: ignore[arg-type]
    host = 0.002
    with_host = evaluate(c, options=_host_options(host), **common)  # type: ignore[arg-type]
    m, p = 128, 8
    assert with_host.step_time_s - without.step_time_s == pytest.approx(2 * host * (m + p - 1))
    assert with_host.bubble_fraction == pytest.approx(without.bubble_fraction, abs=1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "breadth-first", "v-zb", "v-half"])
def test_the_search_bound_stays_below_the_step_with_host_time(schedule: str) -> None:
    """recommend prunes by ``lower_bound_of``: with host time per action it must stay a bound."""
    model, gpu = get_model("gpt3-96b"), get_gpu("a100-80gb")
    common = dict(model=model, cluster=Cluster(32, 8, gpu), global_batch_size=64)
    vp = 1 if schedule == "1f1b" else 2
    c = Candidate(schedule, "optim", 4, 8, vp, 1, 1, "selective")
    options = dataclasses.replace(_host_options(0.05), communication=True)
    bound = lower_bound_of(c, options=options, **common)  # type: ignore[arg-type]
    step = evaluate(c, options=options, **common).step_time_s  # type: ignore[arg-type]
    without = lower_bound_of(c, options=_host_options(None), **common)  # type: ignore[arg-type]
    # The simulation runs on durations rounded to whole nanoseconds; the bound on the floats
    # (breadth-first's is tight: equal to its step without host time too, up to that rounding).
    assert without < bound <= step + 1e-6


@pytest.mark.parametrize(("pp", "vp", "group", "m"), [(2, 4, 2, 7), (4, 2, 4, 12), (4, 4, 8, 27)])
@pytest.mark.parametrize("host", [None, 0.05])
def test_grouped_breadth_first_bound_counts_each_groups_idle(
    pp: int, vp: int, group: int, m: int, host: float | None
) -> None:
    """Grouped breadth-first's bound adds rank 0's idle at every group's turn (the fill alone
    left most of it out), and stays below the simulated step, with host time too (1,856
    layouts of 4 models, pp 2-16, vp 2-4, groups pp and 2pp, lock-step and gloo, checked when
    it was written: the step at least 1.03 times the bound)."""
    model, gpu = get_model("gpt3-96b"), get_gpu("a100-80gb")
    common = dict(model=model, cluster=Cluster(4 * pp, 8, gpu), global_batch_size=m)
    c = Candidate("breadth-first", "optim", 4, pp, vp, 1, 1, "selective", group)
    options = dataclasses.replace(_host_options(host), communication=True)
    fill = lower_bound_of(c, options=options, grouped=False, **common)  # type: ignore[arg-type]
    bound = lower_bound_of(c, options=options, **common)  # type: ignore[arg-type]
    step = evaluate(c, options=options, **common).step_time_s  # type: ignore[arg-type]
    assert fill <= bound <= step + 1e-6
    if host is None:  # (a host time of 50 ms an action covers the idle of the larger group)
        assert fill < bound


def test_recommend_says_it_charges_the_profiles_host_time() -> None:
    result = recommend(
        model=get_model("gpt3-96b"),
        cluster=Cluster(32, 8, get_gpu("a100-80gb")),
        global_batch_size=128,
        options=dataclasses.replace(_host_options(0.002), schedules=("1f1b",), top=1),
    )
    assert "host 2 ms per action" in result.efficiency_source


def test_time_and_cost_follow_the_papers_model() -> None:
    from megatron_bfpp.plan.plot import time_and_cost, trade_off

    # 64 GPUs at 0.5 samples each (B = 32), B_crit = 32: twice the minimum samples.
    time_s, cost = time_and_cost(
        samples_per_s_per_gpu=2.0, batch_per_gpu=0.5, num_gpus=64, critical_batch_size=32
    )
    assert cost == pytest.approx((1 + 0.5 * 64 / 32) / 2.0) and time_s == pytest.approx(cost / 64)
    frontier = trade_off([(0.5, 2.0), (4.0, 2.5)], num_gpus=64, critical_batch_size=32)
    costs, times = [c for c, _ in frontier], [t for _, t in frontier]
    assert costs == sorted(costs) and times == sorted(times, reverse=True)
    with pytest.raises(ScheduleError, match="--critical-batch-size must be positive"):
        time_and_cost(samples_per_s_per_gpu=1, batch_per_gpu=1, num_gpus=1, critical_batch_size=0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-gpus", "1000000000000"], "argument --num-gpus: at most 1,048,576"),
        (["--num-layers", "1000000000"], "argument --num-layers: at most 100,000"),
        (["--global-batch-size", "99999999999"], "argument --global-batch-size: at most"),
    ],
    ids=["gpus", "layers", "batch"],
)
def test_search_sizes_past_their_bounds_are_one_line_at_once(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """They ran silently for minutes (every integer tried as a divisor); now the parser refuses
    them before the search, in a bounded number of lines run."""
    from megatron_bfpp.cli import plan as cli_plan
    from tests.growth import python_lines

    base = {"--model": "gpt3-6.7b", "--num-gpus": "8", "--gpu": "a100-80gb",
            "--global-batch-size": "8"}  # fmt: skip
    if "--num-layers" in flags:
        base = {"--arch": "gpt", "--hidden-size": "1024", "--num-attention-heads": "16",
                "--num-gpus": "8", "--gpu": "a100-80gb", "--global-batch-size": "8"}  # fmt: skip
    base.update(dict(zip(flags[::2], flags[1::2], strict=True)))
    argv = ["recommend", *[part for pair in base.items() for part in pair]]

    def run() -> None:
        with pytest.raises(SystemExit) as exit_info:
            cli_plan.main(argv)
        assert exit_info.value.code == 2

    assert python_lines(run) < 50_000
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], lines


def test_divisors_come_from_the_square_root() -> None:
    from megatron_bfpp.plan.search import _divisors
    from tests.growth import python_lines

    assert _divisors(1) == [1] and _divisors(12) == [1, 2, 3, 4, 6, 12]
    assert _divisors(1 << 20) == [1 << k for k in range(21)]
    assert python_lines(lambda: _divisors(1 << 20)) < 20_000  # 1,024 steps, not a million


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[2] / "docs" / "profiles").glob("*.json"))
)
def test_shipped_gpu_profiles_load_and_say_what_the_docs_say(path: Path) -> None:
    """The H100 and H200 profiles in docs/profiles/ are valid data for ``recommend --profile``,
    and the figures docs/planner.md draws from them hold: I + W within 6% of B, W well under half
    of B; the H200 ones, recorded since ``t_host`` is measured, carry it (about 0.09 ms)."""
    profile = load_profile(path)
    assert profile.device.startswith(("NVIDIA H100", "NVIDIA H200")) and profile.dtype == "bf16"
    if profile.device.startswith("NVIDIA H200"):
        assert profile.t_host is not None and 1e-5 < profile.t_host < 1e-3
    curve = ProfileCurve.from_profile(profile, get_gpu("h100-80gb"))
    assert 0 < curve.forward(1.0) < 1
    for row in profile.measurements:
        assert row.backward_input_s is not None and row.backward_weight_s is not None
        split = row.backward_input_s + row.backward_weight_s
        assert abs(split / row.backward_s - 1) <= 0.06
        assert row.backward_weight_s / row.backward_s < 0.4


def test_a_cpu_profile_may_spend_longer_on_half_a_split_backward() -> None:
    """On CPU the deferral machinery can outweigh a small stage's whole backward (measured with
    `bfpp-plan profile` at hidden 64: I 6 ms, B 3 ms): a CPU profile loads; a GPU's does not."""
    from megatron_bfpp.plan.profile import profile_from_dict

    data = profile_to_dict(_table5_profile())
    data["measurements"] = [
        {
            **data["measurements"][0],
            "backward_s": 0.02,
            "backward_input_s": 0.03,
            "backward_weight_s": 0.005,
        }
    ]
    with pytest.raises(ScheduleError, match="exceeds"):
        profile_from_dict(data)
    loaded = profile_from_dict({**data, "device_type": "cpu"})
    assert loaded.measurements[0].backward_input_s == 0.03
