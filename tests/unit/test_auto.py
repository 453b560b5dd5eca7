"""``--pipeline-schedule auto``'s decision (``plan.auto``) on hand cases whose answer follows
from the planner's models, its one-line refusals, and what it reads from the launcher."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_bfpp.ir import Placement, ScheduleError
from megatron_bfpp.plan.auto import (
    AutoRequest,
    Decision,
    decide,
    gpu_from_device,
    gpus_per_node_from_env,
    hardware,
    write_report,
)
from megatron_bfpp.plan.presets import GiB, get_model, model_from_shape
from megatron_bfpp.schedules.registry import get_spec

V100 = hardware(device_name=None, device_memory=None, gpu_flag="v100-32gb")
CPU = hardware(device_name=None, device_memory=None)
GPT52 = get_model("gpt3-52b")


def request(**fields: object) -> AutoRequest:
    base: dict[str, object] = dict(
        model=GPT52,
        tp=8,
        pp=8,
        dp=8,
        micro_batch_size=1,
        global_batch_size=64,
        hardware=V100,
        recompute="full",
    )
    base.update(fields)
    return AutoRequest(**base)  # type: ignore[arg-type]


def placement(decision: Decision) -> Placement:
    return get_spec(decision.schedule).placement


def test_batch_per_gpu_near_pp_with_heavy_data_parallel_traffic_loops() -> None:
    """m = pp micro-batches (one sample per GPU), dp = 8 over InfiniBand: 1F1B's bubble is
    (p-1)/(m+p-1), nearly half the step, and a looping schedule divides it by vp."""
    decision = decide(request())
    assert placement(decision) is Placement.LOOPED
    assert decision.stages_per_rank > 1
    chosen = decision.chosen.plan
    megatron = decision.megatron.plan
    assert chosen is not None and megatron is not None
    assert decision.megatron.label == "1f1b"
    assert chosen.step_time_s < megatron.step_time_s
    assert chosen.bubble_fraction < megatron.bubble_fraction


def test_activation_memory_binding_picks_a_memory_saving_schedule() -> None:
    """No recomputation, 64 micro-batches: 1F1B (p micro-batches on rank 0), interleaved and
    breadth-first do not fit 32 GB; BPipe and the V-shapes hold fewer."""
    decision = decide(request(dp=1, recompute="none"))
    assert decision.schedule in ("bpipe", "v-min", "v-half")
    assert not decision.megatron.fits  # Megatron's 1f1b
    budget = 0.9 * 32 * GiB
    for row in decision.rows:
        if row.plan is not None:
            assert row.memory is not None and row.memory.total <= budget
        elif row.memory is not None and row.lower_bound_s is None:
            assert row.memory.total > budget
    assert "does not fit" in decision.line()


def test_fewer_microbatches_than_stages_leave_out_interleaved() -> None:
    decision = decide(request(global_batch_size=32, dp=8))  # m = 4 < pp = 8
    interleaved = [row for row in decision.rows if row.candidate.schedule == "interleaved"]
    assert interleaved and all(row.plan is None and row.excluded for row in interleaved)
    assert "multiple of pp=8" in (interleaved[0].excluded or "")
    assert decision.schedule != "interleaved"


def test_virtual_stages_only_divide_the_layers_per_rank() -> None:
    model = model_from_shape(
        arch="gpt",
        num_layers=40,
        hidden_size=4096,
        num_attention_heads=32,
        seq_length=2048,
        vocab_size=50257,
    )  # 5 layers per rank at pp=8: looped vp=5 only, no V (2 stages per rank)
    decision = decide(request(model=model))
    looped = {row.candidate.vp for row in decision.rows if row.candidate.schedule == "interleaved"}
    assert looped == {5}
    v_rows = [row for row in decision.rows if row.candidate.schedule.startswith("v-")]
    assert v_rows and all(row.excluded and "V's 2" in row.excluded for row in v_rows)


def test_layers_not_divisible_by_pp_is_one_line() -> None:
    model = dataclasses.replace(GPT52, num_layers=63)
    with pytest.raises(ScheduleError, match="not divisible by --pipeline-model-parallel-size 8"):
        decide(request(model=model))


@pytest.mark.parametrize("vp", [1, 2, 4])
def test_user_fixed_virtual_stages_are_kept(vp: int) -> None:
    decision = decide(request(vp=vp))
    assert decision.stages_per_rank == vp
    assert {row.candidate.vp for row in decision.rows} == {vp}
    if vp == 4:
        assert decision.megatron.label == "interleaved vp=4"  # Megatron's own with vp


def test_user_fixed_group_and_cap_are_kept() -> None:
    grouped = decide(request(dp=1, global_batch_size=64, group_size=16))
    assert grouped.schedule == "breadth-first" and grouped.options == {"group_size": 16}
    capped = decide(request(max_stored=6))
    assert capped.schedule == "bpipe" and capped.options == {"max_stored": 6}


def test_nothing_fits_is_one_line_with_the_smallest_peak() -> None:
    with pytest.raises(ScheduleError) as caught:
        decide(request(dp=1, micro_batch_size=2, recompute="none"))
    line = str(caught.value)
    assert "\n" not in line
    assert "nothing fits v100-32gb" in line and "smallest predicted peak is" in line
    assert "activation recomputation" in line and "micro-batch size below 2" in line


def test_without_cuda_memory_is_no_constraint_and_the_line_says_so() -> None:
    decision = decide(request(dp=1, micro_batch_size=2, recompute="none", hardware=CPU))
    assert "no CUDA: memory is not a constraint" in decision.line()
    assert all(row.fits for row in decision.rows if row.excluded is None)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"vp": 4, "max_stored": 5}, "--bpipe-max-stored applies to bpipe"),
        ({"vp": 1, "group_size": 8}, "--breadth-first-group-size applies to breadth-first"),
        ({"group_size": 8, "max_stored": 5}, "exclude each other"),
        ({"pp": 1, "dp": 64}, "needs --pipeline-model-parallel-size >= 2"),
        ({"global_batch_size": 60}, "not a multiple of micro-batch size"),
        ({"vp": 3}, "not divisible by pipeline x virtual stages"),
    ],
)
def test_contradicting_constraints_are_one_line(fields: dict[str, object], words: str) -> None:
    with pytest.raises(ScheduleError, match=words) as caught:
        decide(request(**fields))
    assert "\n" not in str(caught.value)


def test_simulations_are_one_per_fitting_candidate() -> None:
    """Bounded work: each candidate that fits is simulated once, and Megatron's default once
    more, as megatron-core posts its messages (the line gives its time even when it does not
    fit)."""
    for fields in ({}, {"dp": 1, "recompute": "none"}):
        decision = decide(request(**fields))
        simulated = [row for row in decision.rows if row.plan is not None]
        assert decision.simulations == len(simulated) + 1
        assert decision.megatron.plan is not None
        assert decision.megatron.plan.p2p_model == "megatron"
        assert {row.plan.p2p_model for row in simulated if row.plan} == {"lockstep"}


def test_175b_on_4096_gpus_is_a_few_dozen_simulations() -> None:
    h100 = hardware(device_name="NVIDIA H100 80GB HBM3", device_memory=80 * GiB)
    decision = decide(
        AutoRequest(
            model=get_model("gpt3-175b"),
            tp=8,
            pp=16,
            dp=32,
            micro_batch_size=1,
            global_batch_size=1536,
            hardware=h100,
            recompute="selective",
        )
    )
    assert 0 < decision.simulations <= 32
    assert decision.chosen.fits


def test_line_and_report(tmp_path: Path) -> None:
    decision = decide(request())
    line = decision.line()
    assert line.startswith(f"auto: {decision.chosen.label} (predicted ")
    assert " over " in line and "; Megatron's 1f1b: " in line and "GiB/32" in line
    path = tmp_path / "auto.json"
    write_report(str(path), decision)
    data = json.loads(path.read_text())
    assert data["format"] == "bfpp-auto-report" and data["line"] == line
    assert data["choice"]["schedule"] == decision.schedule
    steps = [row["step_time_s"] for row in data["rows"] if row["step_time_s"] is not None]
    assert steps == sorted(steps) and len(data["rows"]) == len(decision.rows)
    assert [p.name for p in tmp_path.iterdir()] == ["auto.json"]  # no temporary left behind


def test_same_inputs_same_decision() -> None:
    assert decide(request()).to_dict() == decide(request()).to_dict()


def test_unavailable_schedules_are_left_out_with_their_reason() -> None:
    why = "Megatron-Bridge does not build V-placed chunks"
    decision = decide(
        request(dp=1, recompute="none", unavailable=(("v-min", why), ("v-half", why)))
    )
    assert decision.schedule == "bpipe"
    assert any(row.excluded == why for row in decision.rows)


@pytest.mark.parametrize(
    ("name", "memory", "preset"),
    [
        ("Tesla V100-SXM2-32GB", 32 * GiB, "v100-32gb"),
        ("NVIDIA A100-SXM4-40GB", 40 * GiB, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", 80 * GiB, "a100-80gb"),
        ("NVIDIA H100 80GB HBM3", 80 * GiB, "h100-80gb"),
        ("NVIDIA H200", 141 * GiB, "h100-80gb"),
        ("NVIDIA L40S", 48 * GiB, "h100-80gb"),
    ],
)
def test_device_to_preset(name: str, memory: int, preset: str) -> None:
    gpu, note = gpu_from_device(name, memory)
    assert gpu.name == preset and gpu.memory_bytes == memory
    assert ("unknown GPU" in note) == (name == "NVIDIA L40S")


def test_gpus_per_node_from_the_launcher() -> None:
    assert gpus_per_node_from_env({"LOCAL_WORLD_SIZE": "4"}, 16) == 4
    assert gpus_per_node_from_env({"SLURM_NTASKS_PER_NODE": "8(x2)"}, 16) == 8
    assert gpus_per_node_from_env({"SLURM_GPUS_ON_NODE": "8"}, 4) == 4
    assert gpus_per_node_from_env({}, 16) == 16


def test_profile_gives_the_efficiencies(tmp_path: Path) -> None:
    profiles = Path(__file__).resolve().parents[2] / "docs" / "profiles"
    path = sorted(profiles.glob("*.json"))[0]
    measured = hardware(device_name=None, device_memory=None, profile_path=str(path))
    assert "profile measured on" in measured.efficiency.source
    assert measured.memory_bytes is None and "profile" in measured.note


def test_auto_charges_the_profiles_host_time(tmp_path: Path) -> None:
    """A profile's ``t_host`` reaches auto's simulations: every row simulated both times (its
    bounds prune others) predicts a longer step."""
    profiles = Path(__file__).resolve().parents[2] / "docs" / "profiles"
    data = json.loads(sorted(profiles.glob("*.json"))[0].read_text())
    steps = []
    for t_host in (None, 0.01):
        path = tmp_path / f"{t_host}.json"
        path.write_text(json.dumps({**data, "t_host": t_host}))
        measured = hardware(device_name=None, device_memory=None, profile_path=str(path))
        assert measured.efficiency.host_s == (t_host or 0.0)
        decision = decide(request(hardware=measured, global_batch_size=16))
        steps.append({row.label: row.plan.step_time_s for row in decision.rows if row.plan})
    without, with_host = steps
    both = without.keys() & with_host.keys()
    assert len(both) >= 3 and all(with_host[key] > without[key] for key in both)


def test_grouped_breadth_first_extrapolates_to_the_full_simulation() -> None:
    """Groups larger than pp repeat every group: the planner's short simulations extrapolate
    to the full schedule's step (auto tries groups of pp x 2^k)."""
    from megatron_bfpp.plan.search import (
        Candidate,
        Cluster,
        SearchOptions,
        _cost_model,
        _simulated_ns,
        _size,
    )
    from megatron_bfpp.schedules.registry import build_schedule
    from megatron_bfpp.sim import simulate

    cluster = Cluster(64, 8, V100.gpu)
    candidate = Candidate("breadth-first", "optim", 8, 4, 4, 2, 1, "full", group_size=16)
    sized = _size(
        candidate,
        model=GPT52,
        cluster=cluster,
        global_batch_size=128,
        options=SearchOptions(),
        force=True,
    )
    assert sized is not None and sized.m == 64
    costs = _cost_model(sized.times)
    full = simulate(
        build_schedule(
            "breadth-first", num_ranks=4, num_microbatches=64, num_chunks=4, group_size=16
        ),
        costs,
    )
    step, _ = _simulated_ns(candidate, 64, costs, "lockstep")
    assert step == pytest.approx(full.step_time, rel=1e-9)


def test_a_schedule_added_to_the_catalogue_is_searched_by_recommend_and_auto(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planning knowledge lives on the catalogue entry (``PlanGrid``): a new entry, with an
    option grid of its own, is a candidate of both searches with no change to either (recommend
    used to skip any schedule missing from its own FAMILIES list)."""
    from megatron_bfpp.plan.search import Cluster, SearchOptions, candidates, families
    from megatron_bfpp.schedules import registry
    from megatron_bfpp.schedules.bpipe import build_bpipe

    def caps(pp: int, m: int) -> tuple[dict[str, int], ...]:
        return ({"max_stored": pp},)  # 1F1B's own p: no transfers

    spec = registry.ScheduleSpec(
        "new-bpipe",
        "a new catalogue entry",
        build_bpipe,
        Placement.SINGLE,
        (registry.MAX_STORED,),
        plan=registry.PlanGrid(options=caps),
    )
    monkeypatch.setitem(registry.SCHEDULES, "new-bpipe", spec)
    assert ("new-bpipe", "optim") in families()
    searched = list(
        candidates(
            model=GPT52,
            cluster=Cluster(64, 8, V100.gpu),
            global_batch_size=64,
            options=SearchOptions(schedules=("new-bpipe",), recompute=("full",)),
        )
    )
    assert searched
    assert all(c.schedule == "new-bpipe" and c.max_stored == c.pp for c in searched)
    decision = decide(request())
    rows = [row for row in decision.rows if row.candidate.schedule == "new-bpipe"]
    assert [row.candidate.max_stored for row in rows] == [8]
    assert rows[0].plan is not None or rows[0].lower_bound_s is not None


def test_recommend_and_auto_search_the_same_grid() -> None:
    """Breadth-first's groups (one, or pp x 2^k dividing m) and BPipe's caps (its own and
    halfway to p): one grid, the catalogue's, for both searches."""
    from megatron_bfpp.plan.search import Cluster, SearchOptions, candidates

    searched = {
        (c.schedule, c.vp, c.group_size, c.max_stored)
        for c in candidates(
            model=GPT52,
            cluster=Cluster(512, 8, V100.gpu),
            global_batch_size=512,
            options=SearchOptions(
                tensor_parallel=(8,),
                pipeline_parallel=(8,),
                micro_batch_sizes=(1,),
                recompute=("full",),
                schedules=("breadth-first", "bpipe"),
            ),
        )
    }
    decision = decide(request(global_batch_size=512, hardware=CPU))  # m = 64, every row timed
    auto = {
        (
            row.candidate.schedule,
            row.candidate.vp,
            row.candidate.group_size,
            row.candidate.max_stored,
        )
        for row in decision.rows
        if row.candidate.schedule in ("breadth-first", "bpipe")
    }
    assert searched == auto
    groups = {group for name, _, group, _ in auto if name == "breadth-first"}
    assert groups == {None, 8, 16, 32}  # recommend tried groups of pp only before
    assert {cap for name, _, _, cap in auto if name == "bpipe"} == {None, 7}


def test_auto_is_bounded_by_its_action_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout whose timing needs more than the budget decides from what it timed, each
    candidate left out saying so in its row and the line; a count, not a clock, so every rank
    stops at the same candidate. Nothing timed at all is one line."""
    import megatron_bfpp.plan.auto as auto

    full = decide(request(hardware=CPU))
    assert full.untimed == 0 and 0 < full.actions_spent <= full.action_budget
    limit = full.actions_spent // 3
    monkeypatch.setattr(auto, "AUTO_ACTION_BUDGET", limit)
    bounded = decide(request(hardware=CPU))
    assert bounded.action_budget == limit and bounded.actions_spent <= limit
    assert bounded.untimed > 0 and bounded.simulations < full.simulations
    assert bounded.chosen.plan is not None  # decided from what it timed
    # our run of Megatron's default (1f1b here) is timed first: the choice is never slower
    ours = [row for row in bounded.rows if row.candidate == bounded.megatron.candidate]
    assert len(ours) == 1 and ours[0].plan is not None
    assert bounded.chosen.plan.step_time_s <= ours[0].plan.step_time_s
    assert f"not timed (over the budget of {limit:,} simulated actions)" in bounded.line()
    report = bounded.to_dict()
    assert report["untimed"] == bounded.untimed and report["action_budget"] == limit
    assert all("over auto's budget" in (row.excluded or "") for row in bounded.rows if row.untimed)
    again = decide(request(hardware=CPU))  # caches warm: the same candidates left out
    assert [row.to_dict() for row in again.rows] == [row.to_dict() for row in bounded.rows]
    monkeypatch.setattr(auto, "AUTO_ACTION_BUDGET", 1000)
    with pytest.raises(ScheduleError) as error:
        decide(request(hardware=CPU))
    assert "needs more than auto's budget of 1,000 simulated actions" in str(error.value)
    assert "\n" not in str(error.value)
