"""``interleaved`` with ``combined_1f1b``: megatron-core's combined 1F1B order (its
``--overlap-moe-expert-parallel-comm``) worked out by hand from ``get_pp_rank_microbatches`` (one
more warm-up forward) and ``forward_backward_pipelining_with_interleaving`` (steady step k runs
forward warmup + k with backward k as one combined step), against megatron-core's own functions
where installed; validated and NCCL-proven; megatron-core's own posting of it; its flags in every
front end; the planner's Megatron baseline rows for MoE models, and auto's only grid (with
dualpipe-v) under the overlap flag."""

from __future__ import annotations

import argparse
import dataclasses
import re
from types import SimpleNamespace

import pytest

from megatron_bfpp.cli import plan as plan_cli
from megatron_bfpp.cli import sim as sim_cli
from megatron_bfpp.cli import train as train_cli
from megatron_bfpp.ir import ActionKind as K
from megatron_bfpp.ir import Schedule, ScheduleError, parts
from megatron_bfpp.native_posting import GradSyncOptions, P2POptions, megatron_posting
from megatron_bfpp.nccl import check_posting
from megatron_bfpp.plan.auto import (
    _NO_PAIRS,
    AutoRequest,
    Decision,
    _candidates,
    check_auto_flags,
    decide,
    hardware,
    label,
)
from megatron_bfpp.plan.costs import stage_times
from megatron_bfpp.plan.presets import Model, get_gpu, get_model
from megatron_bfpp.plan.search import Cluster, SearchOptions, candidates, recommend
from megatron_bfpp.schedules.fit import check_fit
from megatron_bfpp.schedules.interleaved import build_interleaved
from megatron_bfpp.schedules.registry import (
    build_schedule,
    forward_only_schedule,
    get_spec,
    options_from_args,
)
from megatron_bfpp.sim import CostModel, simulate
from megatron_bfpp.validate import validate_schedule
from tests.unit.test_native_posting import _rows

OVERLAP = P2POptions(overlap_p2p=True, batch_p2p=False)


def _texts(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, actions)) for actions in schedule.per_rank]


def _lowered(p: int, v: int, m: int, group: int | None) -> Schedule:
    """As the catalogue builds it: lowered (messages placed), validated."""
    return build_schedule(
        "interleaved",
        num_ranks=p,
        num_microbatches=m,
        num_chunks=v,
        microbatch_group_size=group,
        combined_1f1b=True,
    )


def _combined(p: int, v: int, m: int, group: int | None = None) -> Schedule:
    return build_interleaved(
        num_ranks=p,
        num_microbatches=m,
        num_chunks=v,
        microbatch_group_size=group,
        combined_1f1b=True,
    )


# --- the order, by hand ---------------------------------------------------------------------
def test_pp2_vp2_m4_by_hand() -> None:
    """Table (group 2): 0/c0 1/c0 0/c1 1/c1 2/c0 3/c0 2/c1 3/c1. Warm-up 2(p-r-1) + (v-1)g + 1:
    5 on rank 0 (plain: 4), 3 on rank 1 (plain: 2); steady step k pairs forward 5 + k (3 + k)
    with backward k; the cool-down runs the rest alone."""
    assert _texts(_combined(2, 2, 4)) == [
        "0F0 0F1 2F0 2F1 0F2 0F3&2B0 2F2&2B1 2F3&0B0 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3F1&3B0 1F2&3B1 1F3&1B0 3F2&1B1 3F3&3B2 3B3 1B2 1B3",
    ]


def test_pp4_vp2_m8_by_hand() -> None:
    """Group 4; warm-up 11, 9, 7, 5 (plain: 10, 8, 6, 4) of 16 forwards per rank."""
    assert _texts(_combined(4, 2, 8)) == [
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 "
        "0F7&4B0 4F4&4B1 4F5&4B2 4F6&4B3 4F7&0B0 "
        "0B1 0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 "
        "1F5&5B0 1F6&5B1 1F7&5B2 5F4&5B3 5F5&1B0 5F6&1B1 5F7&1B2 "
        "1B3 5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7",
        "2F0 2F1 2F2 2F3 6F0 6F1 6F2 "
        "6F3&6B0 2F4&6B1 2F5&6B2 2F6&6B3 2F7&2B0 6F4&2B1 6F5&2B2 6F6&2B3 6F7&6B4 "
        "6B5 6B6 6B7 2B4 2B5 2B6 2B7",
        "3F0 3F1 3F2 3F3 7F0 "
        "7F1&7B0 7F2&7B1 7F3&7B2 3F4&7B3 3F5&3B0 3F6&3B1 3F7&3B2 7F4&3B3 7F5&7B4 7F6&7B5 "
        "7F7&7B6 7B7 3B4 3B5 3B6 3B7",
    ]


def test_all_micro_batches_in_warm_up_run_no_pair() -> None:
    """Warm-up capped at the total (megatron-core's are_all_microbatches_in_warmup): pp 4, vp 2,
    m 4 warms rank 0 up with 2 x 3 + 4 + 1 = 11 > 8 forwards: all of them, then the backwards."""
    schedule = _combined(4, 2, 4)
    assert _texts(schedule)[0] == "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 4B0 4B1 4B2 4B3 0B0 0B1 0B2 0B3"
    assert not any(a.kind is K.OVERLAP_F_B for a in schedule.per_rank[0])
    assert sum(a.kind is K.OVERLAP_F_B for a in schedule.per_rank[3]) == 3  # 8 - (0 + 4 + 1)


def test_without_the_option_the_order_is_unchanged() -> None:
    """The plain literal (megatron-core's order, tests/megatron) and the option off or left out."""
    plain = build_interleaved(num_ranks=2, num_microbatches=4, num_chunks=2)
    assert _texts(plain) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]
    for p, v, m, group in [(2, 2, 4, None), (4, 2, 8, None), (4, 3, 12, 6), (8, 4, 24, None)]:
        default = build_interleaved(
            num_ranks=p, num_microbatches=m, num_chunks=v, microbatch_group_size=group
        )
        off = build_interleaved(
            num_ranks=p,
            num_microbatches=m,
            num_chunks=v,
            microbatch_group_size=group,
            combined_1f1b=False,
        )
        assert off == default
        combined = _combined(p, v, m, group).per_rank
        for plain_actions, actions in zip(default.per_rank, combined, strict=True):
            assert sorted(q for a in actions for q in parts(a)) == sorted(plain_actions)


@pytest.mark.parametrize(
    ("p", "v", "m", "group"),
    [(2, 2, 4, 2), (2, 3, 6, 2), (3, 2, 9, 3), (4, 2, 8, 4), (4, 2, 14, 5), (4, 4, 8, 4),
     (8, 2, 16, 8), (8, 4, 24, 12), (4, 2, 4, 4)],
)  # fmt: skip
def test_the_order_is_megatron_cores_combined_1f1b(p: int, v: int, m: int, group: int) -> None:
    """From megatron-core's own get_schedule_table and get_pp_rank_microbatches with
    overlap_moe_expert_parallel_comm, and the pairing of its steady loop."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    table = schedules.get_schedule_table(m, v, group)
    schedule = _combined(p, v, m, group)
    for rank in range(p):
        communicator = SimpleNamespace(
            pp_group=SimpleNamespace(size=lambda: p, rank=lambda r=rank: r),
            virtual_pipeline_model_parallel_size=v,
        )
        total, _, warmup, remaining = schedules.get_pp_rank_microbatches(
            m, v, group, overlap_moe_expert_parallel_comm=True, p2p_communicator=communicator
        )

        def f(k: int, r: int = rank) -> str:
            return f"{table[k][1] * p + r}F{table[k][0]}"

        def b(k: int, r: int = rank) -> str:
            return f"{(v - 1 - table[k][1]) * p + r}B{table[k][0]}"

        expected = [f(k) for k in range(warmup)]
        expected += [f"{f(k + warmup)}&{b(k)}" for k in range(remaining)]
        expected += [b(k) for k in range(remaining, total)]
        assert _texts(schedule)[rank].split() == expected, f"rank {rank}"


# --- validation, NCCL proof, posting ---------------------------------------------------------
def _grid() -> list[tuple[int, int, int, int | None]]:
    """pp 2-8, vp 2-4, m multiples of pp, and groups above pp."""
    sizes = [(p, v, m, None) for p in (2, 3, 4, 8) for v in (2, 3, 4) for m in (p, 2 * p, 3 * p)]
    return [*sizes, (4, 2, 12, 6), (4, 3, 16, 8), (2, 4, 10, 5), (8, 2, 24, 12), (6, 2, 12, 6)]


@pytest.mark.slow
def test_validated_and_nccl_proven_across_sizes() -> None:
    for p, v, m, group in _grid():
        validate_schedule(_lowered(p, v, m, group), nccl=True)


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (3, 3, 9), (8, 2, 16)])
def test_no_chunk_ends_in_a_pair(p: int, v: int, m: int) -> None:
    """With one more warm-up forward, each chunk's last backward runs in the cool-down: where
    megatron-core starts its gradient reduction (native_posting's sync_after) is never a pair."""
    for actions in _combined(p, v, m).per_rank:
        ends = [
            a for a in actions for q in parts(a) if q.kind is K.BACKWARD and q.microbatch == m - 1
        ]
        assert len(ends) == v and all(a.kind is K.BACKWARD for a in ends)


def test_megatron_cores_posting_waits_both_receives_before_a_pair_and_posts_after_it() -> None:
    """Its combined step: pp_pre_forward's and pp_pre_backward's waits, the pair, then
    pp_post_forward's and pp_post_backward's calls (combined_1f1b.py, model_chunk_schedule_plan's
    run); the warm-up's last forward posts at once (it is no steady step now)."""
    schedule = build_schedule(
        "interleaved", num_ranks=2, num_microbatches=4, num_chunks=2, combined_1f1b=True
    )
    rows = _rows(schedule, megatron_posting(schedule, OVERLAP, GradSyncOptions(True, True)))
    assert rows[0].split(" 0B1 ")[0] == (
        "0PS 2PS 0F0 P[0SA0>1]! 0F1 P[0SA1>1 2RA0<1]! 2F0 P[2SA0>1 2RA1<1]! 2F1 P[2SA1>1]! "
        "0F2 P[0SA2>1]! P[2RG0<1] w(2RG0<1) 0F3&2B0 P[0SA3>1 2RA2<1] P[2SG0>1 2RG1<1] "
        "w(2RA2<1) w(2RG1<1) 2F2&2B1 P[2SA2>1 2RA3<1] w(0SA3>1) P[2SG1>1 0RG0<1] w(2SG0>1) "
        "w(2RA3<1) w(0RG0<1) 2F3&0B0 P[2SA3>1] w(2SA2>1) P[0RG1<1] w(2SG1>1) w(0RG1<1)"
    )


@pytest.mark.slow
def test_megatron_cores_posting_is_nccl_safe_but_at_pp_2_batched() -> None:
    """As its plain interleaved schedule (test_native_posting): only pp 2 batched cross-matches,
    which Megatron-LM refuses."""
    unsafe = set()
    for p, v, m, group in _grid():
        schedule = _lowered(p, v, m, group)
        for options in (P2POptions(), P2POptions(batch_p2p=False), OVERLAP):
            try:
                check_posting(schedule, megatron_posting(schedule, options))
            except ScheduleError:
                unsafe.add((p, options))
    assert unsafe == {(2, P2POptions())}


def test_forward_only_runs_every_forward_in_the_training_order() -> None:
    """Evaluation (megatron-core: every micro-batch in warm-up) takes the pairs' forwards too."""
    schedule = build_schedule(
        "interleaved", num_ranks=2, num_microbatches=4, num_chunks=2, combined_1f1b=True
    )
    evaluation = forward_only_schedule(schedule).compute_only()
    assert _texts(evaluation) == [
        "0F0 0F1 2F0 2F1 0F2 0F3 2F2 2F3",
        "1F0 1F1 3F0 3F1 1F2 1F3 3F2 3F3",
    ]


# --- timing and memory ----------------------------------------------------------------------
def test_pairs_cost_their_parts_and_hold_one_more_warm_up_forward() -> None:
    """Without an all-to-all in the costs nothing overlaps: each pair lasts its forward plus its
    backward, every rank is as busy as in the plain order, and at pp 4, vp 2, m 8 the step is
    the same 28.5 (docs/schedules.md); each rank holds one more chunk's activations (1/vp)."""
    plain = simulate(build_schedule("interleaved", num_ranks=4, num_microbatches=8, num_chunks=2))
    pairs = simulate(
        build_schedule(
            "interleaved", num_ranks=4, num_microbatches=8, num_chunks=2, combined_1f1b=True
        )
    )
    costs = CostModel()
    assert pairs.step_time == plain.step_time == 28.5
    assert [r.busy_time for r in pairs.per_rank] == [r.busy_time for r in plain.per_rank]
    durations = {e.end - e.start for e in pairs.events if "&" in e.label}
    assert durations == {(costs.t_forward + costs.t_backward) / 2}
    assert plain.peak_activations == (5.5, 4.5, 3.5, 2.5)
    assert pairs.peak_activations == (6.0, 5.0, 4.0, 3.0)


# --- front ends ---------------------------------------------------------------------------
def test_bfpp_sim_switch_builds_it_and_other_schedules_refuse_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--pp", "2", "--vp", "2", "--microbatches", "4", "--grid", "compute"]
    assert sim_cli.main(["--schedule", "interleaved", "--combined-1f1b", *base]) == 0
    assert "0F3&2B0" in capsys.readouterr().out
    assert sim_cli.main(["--schedule", "breadth-first", "--combined-1f1b", *base]) == 2
    assert "breadth-first takes no --combined-1f1b (interleaved do)" in capsys.readouterr().err


def test_bfpp_train_and_megatron_lm_read_the_switch() -> None:
    args = train_cli.build_parser().parse_args(["--pipeline-schedule", "interleaved"])
    assert args.combined_1f1b is None and options_from_args("interleaved", args) == {}
    args = train_cli.build_parser().parse_args(
        ["--pipeline-schedule", "interleaved", "--combined-1f1b"]
    )
    assert options_from_args("interleaved", args) == {"combined_1f1b": True}
    megatron = SimpleNamespace(pipeline_schedule="interleaved", combined_1f1b=True)
    assert options_from_args("interleaved", megatron, megatron=True) == {"combined_1f1b": True}
    with pytest.raises(ScheduleError, match=r"^--combined-1f1b applies to --pipeline-schedule"):
        options_from_args("breadth-first", megatron, megatron=True)
    assert not get_spec("interleaved").options[1].megatron_owned  # not Megatron's own flag


# A small MoE model (16 experts, ep 8 over dp 16) that every schedule fits on an H100
SMALL_MOE = Model("moe", "gpt", 16, 2048, 16, 16, 8192, 2048, 50257, False, 16, 2, 1408)


def _moe_request(**fields: object) -> AutoRequest:
    base: dict[str, object] = dict(
        model=SMALL_MOE,
        tp=1,
        pp=4,
        dp=16,
        micro_batch_size=1,
        global_batch_size=256,
        hardware=hardware(device_name=None, device_memory=None, gpu_flag="h100-80gb"),
        ep=8,
    )
    return AutoRequest(**{**base, **fields})  # type: ignore[arg-type]


def test_auto_under_the_all_to_all_overlap_plans_only_pairs_megatron_core_combines() -> None:
    """With --overlap-moe-expert-parallel-comm the job must run a schedule with pairs its
    combined step runs (the job's own check): auto times only those, credits what they hide,
    and compares with megatron-core's combined 1F1B at the user's virtual stages."""
    args = argparse.Namespace(pipeline_schedule="auto", overlap_moe_expert_parallel_comm=True)
    check_auto_flags(args)  # no longer refused
    decision = decide(_moe_request(moe_overlap=True))
    timed = [row for row in decision.rows if row.plan is not None]
    assert {(row.candidate.schedule, row.candidate.combined_1f1b) for row in timed} == {
        ("dualpipe-v", False),
        ("interleaved", True),
    }
    refused = {row.candidate.schedule for row in decision.rows if row.excluded == _NO_PAIRS}
    assert refused == {"1f1b", "gpipe", "bpipe", "breadth-first", "v-min", "v-half", "v-zb"}
    for row in timed:  # what the job checks once auto wrote its choice back
        c = row.candidate
        check_fit(
            c.schedule, pp=c.pp, vp=c.vp, dp=c.dp, micro_batch_size=1, global_batch_size=256,
            vp_flag="--vp", options=c.options, overlapped=True,
        )  # fmt: skip
    combined = next(row.candidate for row in timed if row.candidate.combined_1f1b)
    assert label(combined) == f"interleaved vp={combined.vp} combined-1f1b"  # as the line says
    fixed = decide(_moe_request(moe_overlap=True, vp=2))
    assert fixed.megatron.candidate.combined_1f1b and fixed.megatron.plan is not None
    with pytest.raises(ScheduleError, match=r"^--overlap-moe-expert-parallel-comm needs --exp"):
        decide(_moe_request(moe_overlap=True, ep=1))


def test_auto_without_the_overlap_credits_no_pair() -> None:
    """Without the flag every pair runs F then B (``RankStep.planned`` is empty): dualpipe-v is
    timed with its all-to-alls exposed, slower than under the flag by what its pairs hide."""
    plain, overlapped = (decide(_moe_request(moe_overlap=flag)) for flag in (False, True))

    def dualpipe_v(decision: Decision) -> float:
        row = next(row for row in decision.rows if row.candidate.schedule == "dualpipe-v")
        assert row.plan is not None
        return row.plan.step_time_s

    assert dualpipe_v(plain) > dualpipe_v(overlapped)
    assert not any(row.candidate.combined_1f1b for row in plain.rows)
    c = next(row.candidate for row in plain.rows if row.candidate.schedule == "dualpipe-v")
    cluster = Cluster(c.tp * c.pp * c.dp, 8, get_gpu("h100-80gb"))
    exposed, hidden = (
        stage_times(c, SMALL_MOE, cluster, SearchOptions(moe_overlap=flag), 10**9, 10**9)
        for flag in (False, True)
    )
    assert exposed.a2a == 0 < hidden.a2a
    assert exposed == dataclasses.replace(hidden, a2a=0.0)  # the all-to-alls stay in F and B


def test_auto_refuses_the_switch_but_not_its_own_choice() -> None:
    """A user's --combined-1f1b with auto is refused before auto decides; written back by auto
    (under the overlap flag), it is auto's choice and passes the job's later checks."""
    args = argparse.Namespace(pipeline_schedule="auto", combined_1f1b=True)
    with pytest.raises(ScheduleError, match=r"^--combined-1f1b needs --pipeline-schedule"):
        check_auto_flags(args)
    args.pipeline_schedule, args.pipeline_schedule_auto_line = "interleaved", "auto: ..."
    check_auto_flags(args)
    from megatron_bfpp.cli import train

    parsed = train.build_parser().parse_args(["--pipeline-schedule", "auto", "--combined-1f1b"])
    with pytest.raises(ScheduleError, match=r"^--combined-1f1b needs --pipeline-schedule"):
        train.resolve_auto(parsed, 4)  # before auto decides (and says its choice)
    allowed, _ = _candidates(_moe_request())
    assert any(c.schedule == "interleaved" for c in allowed)
    assert not any(c.combined_1f1b for c in allowed)


# --- the planner ------------------------------------------------------------------------------
H100 = get_gpu("h100-80gb")


def test_the_planner_offers_it_as_a_megatron_baseline_for_moe_models_only() -> None:
    cluster = Cluster(32, 8, H100)
    moe, dense = get_model("mixtral-8x7b"), get_model("llama-7b")

    def combined(model: object, **options: object) -> list[object]:
        found = candidates(
            model=model,  # type: ignore[arg-type]
            cluster=cluster,
            global_batch_size=128,
            options=SearchOptions(**options),  # type: ignore[arg-type]
        )
        return [c for c in found if c.combined_1f1b]

    offered = combined(moe)
    assert offered and {c.schedule for c in offered} == {"interleaved"}  # type: ignore[attr-defined]
    assert not combined(dense)
    assert not combined(moe, megatron_baselines=False)


def test_recommend_shows_the_combined_row_as_megatron_posts_it() -> None:
    result = recommend(
        model=get_model("mixtral-8x7b"),
        cluster=Cluster(32, 8, H100),
        global_batch_size=128,
        options=SearchOptions(schedules=("interleaved",), top=100),
    )
    rows = [plan for plan in result.plans if plan.candidate.combined_1f1b]
    assert rows and all(plan.p2p_model == "megatron" for plan in rows)
    assert plan_cli._name(rows[0]).startswith("interleaved combined-1f1b")
    assert plan_cli._name(rows[0]).endswith("[M]")
    assert rows[0].to_dict()["combined_1f1b"] is True
    plain = [plan for plan in result.plans if not plan.candidate.combined_1f1b]
    assert plain and all(plan.to_dict()["combined_1f1b"] is False for plan in plain)


def test_bfpp_plan_auto_takes_the_overlap_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """bfpp-plan auto prints the job's decision under the flag, and ep 1 as the job refuses it."""
    flags = [
        "auto", "--arch", "gpt", "--num-layers", "16", "--hidden-size", "2048",
        "--num-attention-heads", "16", "--num-experts", "16", "--moe-ffn-hidden-size", "1408",
        "--num-gpus", "64", "--gpu", "h100-80gb", "--pipeline-model-parallel-size", "4",
        "--global-batch-size", "256", "--overlap-moe-expert-parallel-comm",
    ]  # fmt: skip
    assert plan_cli.main([*flags, "--expert-model-parallel-size", "8"]) == 0
    line = capsys.readouterr().out
    assert re.match(r"megatron_bfpp: auto: (dualpipe-v|interleaved vp=\d combined-1f1b) \(", line)
    assert plan_cli.main(flags) == 2
    assert "--overlap-moe-expert-parallel-comm needs --expert-model-parallel-size > 1" in (
        capsys.readouterr().err
    )
