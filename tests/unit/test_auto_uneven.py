"""``auto`` on the user's uneven stages (issue 42, item 3, first part): Megatron's uneven-stage
flags reach the planner from every front end, each candidate is planned on the stages they give
it (per-stage layers in the memory walk and the parameter counts, per-stage weights in the
simulation, the output layer in the last stage's), and what cannot split so is said in a line."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest

from megatron_bfpp.cli import plan as plan_cli
from megatron_bfpp.config.run_config import (
    UNEVEN_CONFIG_FIELDS,
    UnevenStages,
    layout_of,
    layout_stages,
)
from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.megatron.auto import bridge_request, megatron_request
from megatron_bfpp.plan.auto import AutoRequest, decide, hardware, partitions
from megatron_bfpp.plan.costs import stage_times
from megatron_bfpp.plan.memory import peak_points
from megatron_bfpp.plan.presets import get_gpu, get_model
from megatron_bfpp.plan.search import (
    Candidate,
    Cluster,
    SearchOptions,
    memory_of,
    rank_parameters_of,
    stage_activation_shares,
    stage_weights,
)
from megatron_bfpp.schedules.registry import build_schedule
from megatron_bfpp.train.auto import train_request

LLAMA = get_model("llama-7b")  # 32 layers, a 32k vocabulary
H100 = hardware(device_name=None, device_memory=None, gpu_flag="h100-80gb")
FIRST_LAST = UnevenStages(decoder_first_pipeline_num_layers=6, decoder_last_pipeline_num_layers=6)


def _request(uneven: UnevenStages, model=LLAMA, **fields) -> AutoRequest:
    base = dict(tp=1, pp=4, dp=2, micro_batch_size=1, global_batch_size=64, hardware=H100)
    return AutoRequest(model=model, uneven=uneven, **{**base, **fields})


def test_the_walk_weighs_each_stage_by_its_layers() -> None:
    """1F1B, p 2, m 4: rank 0 holds two micro-batches of stage 0 (1 layer each), rank 1 one of
    stage 1 (3 layers); a V (stages 0 and 3 on rank 0) counts each stage's own layers."""
    f1b = build_schedule("1f1b", num_ranks=2, num_microbatches=4, lower=False, validate=False)
    assert peak_points(f1b, (1, 3)).per_rank == (((2, 2, 0),), ((3, 0, 1),))
    assert peak_points(f1b).per_rank == (((2, 2, 0),), ((1, 0, 1),))
    v = build_schedule("v-half", num_ranks=2, num_microbatches=4, lower=False, validate=False)
    assert peak_points(v, (1, 2, 3, 4)).per_rank[0] == ((7, 3, 1),)  # 3 x 1 + 1 x 4 layers


@pytest.mark.parametrize(
    ("schedule", "vp"), [("1f1b", 1), ("interleaved", 2), ("breadth-first", 4), ("v-half", 2)]
)
def test_even_stages_given_as_layers_keep_the_even_memory(schedule: str, vp: int) -> None:
    even = Candidate(schedule, "optim", 1, 4, vp, 2, 1, "none")
    given = dataclasses.replace(even, stage_layers=(32 // (4 * vp),) * (4 * vp))
    assert memory_of(given, model=LLAMA, global_batch_size=64) == memory_of(
        even, model=LLAMA, global_batch_size=64
    )


def test_a_layer_moved_moves_its_parameters_and_activations() -> None:
    even = Candidate("1f1b", "optim", 1, 4, 1, 2, 1, "none")
    moved = dataclasses.replace(even, stage_layers=(9, 8, 8, 7))
    counts = [
        rank_parameters_of(LLAMA, schedule="1f1b", tp=1, pp=4, vp=1, stage_layers=c.stage_layers)
        for c in (even, moved)
    ]
    layer = counts[0][1] // 8  # a middle rank holds only its 8 layers
    assert [b - a for a, b in zip(*counts, strict=True)] == [layer, 0, 0, -layer]
    kept = [memory_of(c, model=LLAMA, global_batch_size=64) for c in (even, moved)]
    assert kept[1].activations > kept[0].activations  # rank 0 holds 4 micro-batches: 9 layers


def test_stage_weights_by_hand() -> None:
    """(12, 20) layers on 2 ranks: an even stage holds 16, so 0.75 and 1.25, the last plus its
    output layer and loss against an even stage's forward and backward."""
    c = Candidate("1f1b", "optim", 1, 2, 1, 1, 1, "none", stage_layers=(12, 20))
    times = stage_times(c, LLAMA, Cluster(2, 8, get_gpu("h100-80gb")), SearchOptions(), 10**9, 0)
    output = times.output / (times.forward + times.backward)
    assert stage_weights(c, LLAMA, times) == (0.75, round(1.25 + output, 6))
    assert stage_weights(dataclasses.replace(c, stage_layers=()), LLAMA, times) == ()


@pytest.mark.parametrize(
    "uneven",
    [
        FIRST_LAST,
        UnevenStages(pipeline_model_parallel_layout="Et*3|t*5|t*5|t*3|t*3|t*5|t*5|t*3L"),
        UnevenStages(
            account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True
        ),
    ],
    ids=["first-last", "layout", "account-for"],
)
def test_auto_plans_every_candidate_on_the_users_stages(uneven: UnevenStages) -> None:
    model = LLAMA if not uneven.account_for_embedding_in_pipeline_split else _layers(30)
    decision = decide(_request(uneven, model=model))
    timed = [row for row in decision.rows if row.plan is not None]
    assert timed and decision.megatron.plan is not None
    for row in (*timed, decision.megatron):
        c = row.candidate
        assert c.stage_layers == uneven.stage_layers(model.num_layers, 4, c.vp)
        assert sum(c.stage_layers) == model.num_layers
    assert decision.line().endswith(f"; stages of {uneven.given()}]")
    assert decision.to_dict()["layout"]["uneven_stages"] == uneven.given()
    said = {row.candidate.schedule: row.excluded for row in decision.rows if row.excluded}
    if uneven.pipeline_model_parallel_layout:  # two stages per rank: 1F1B's one is said
        assert said["1f1b"] == "places 1 stage(s) per rank, the layout 2"
    if uneven == FIRST_LAST:  # 6, 10, 10, 6 layers per rank: not into thirds or fifths
        assert not any(row.candidate.vp in (3, 5) for row in timed)


def _layers(n: int):
    return dataclasses.replace(LLAMA, num_layers=n)


def test_a_lighter_last_stage_pays_for_a_large_vocabulary() -> None:
    """At a 128k vocabulary the output layer with its loss costs about two layers of LLaMA 7B:
    1F1B with four layers fewer on the last stage is predicted faster than even stages."""
    model = dataclasses.replace(LLAMA, vocab_size=128256)
    steps = []
    for layout in ("Et*8|t*8|t*8|t*8L", "Et*9|t*9|t*9|t*5L"):
        request = _request(UnevenStages(pipeline_model_parallel_layout=layout), model=model)
        row = next(r for r in decide(request).rows if r.candidate.schedule == "1f1b")
        assert row.plan is not None
        steps.append(row.plan.step_time_s)
    assert steps[1] < 0.95 * steps[0]


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        (
            {"uneven": UnevenStages(pipeline_model_parallel_layout="Et*8|t*8|t*8|t*8L"), "vp": 2},
            "--pipeline-model-parallel-layout lists 1 stages per rank; drop "
            "--num-virtual-stages-per-pipeline-rank 2",
        ),
        (
            {"uneven": UnevenStages(pipeline_model_parallel_layout="Et*8|t*8|t*8|t*8|L")},
            "lists 5 stages, not a multiple of --pipeline-model-parallel-size 4",
        ),
        (
            {
                "uneven": UnevenStages(pipeline_model_parallel_layout="Et*8|t*8m|t*8|t*8L"),
                "model": LLAMA.with_mtp(1),
            },
            "the planner plans layouts with E in the first stage, L in the last and MTP layers "
            "(m) only in the last",
        ),
    ],
    ids=["layout-and-vp", "layout-stages", "mtp"],
)
def test_what_auto_cannot_plan_is_one_line(request_fields: dict, message: str) -> None:
    fields = {"uneven": UnevenStages(), **request_fields}
    with pytest.raises(ScheduleError) as error:
        decide(_request(**fields))
    assert message in str(error.value) and "\n" not in str(error.value)


FLAGS = {
    "pipeline_model_parallel_layout": None,
    "decoder_first_pipeline_num_layers": 6,
    "decoder_last_pipeline_num_layers": 6,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
}


def test_every_front_end_reads_the_uneven_flags() -> None:
    shape = dict(num_layers=32, hidden_size=256, num_attention_heads=8, seq_length=128)
    args = argparse.Namespace(
        **shape, **FLAGS, micro_batch_size=1, global_batch_size=8, vocab_size=1000,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=4,
    )  # fmt: skip
    assert megatron_request(args, world_size=8, env={}, hw=H100, sharding=None).uneven == FIRST_LAST
    config = SimpleNamespace(
        model=SimpleNamespace(
            **shape, **dict(zip(UNEVEN_CONFIG_FIELDS, FLAGS.values(), strict=True)),
            vocab_size=1000, tensor_model_parallel_size=1, pipeline_model_parallel_size=4,
        ),
        train=SimpleNamespace(micro_batch_size=1, global_batch_size=8),
        optimizer=SimpleNamespace(optimizer="adam", use_distributed_optimizer=True),
    )  # fmt: skip
    bridge = bridge_request(config, options={}, sharding="optim", env={"WORLD_SIZE": "8"}, hw=H100)
    assert bridge.uneven == FIRST_LAST
    config.model.pipeline_model_parallel_layout = [["embedding"], ["decoder"]]  # parsed: refused
    with pytest.raises(ScheduleError, match="reads a pipeline_model_parallel_layout given as a"):
        bridge_request(config, options={}, sharding="optim", env={"WORLD_SIZE": "8"}, hw=H100)
    planned = plan_cli.build_parser().parse_args(
        ["auto", "--model", "llama-7b", "--num-gpus", "8", "--gpu", "h100-80gb",
         "--pipeline-model-parallel-size", "4", "--global-batch-size", "64",
         "--decoder-first-pipeline-num-layers", "6", "--decoder-last-pipeline-num-layers", "6"]
    )  # fmt: skip
    assert UnevenStages.read(planned) == FIRST_LAST
    from megatron_bfpp.cli.train import build_parser as train_parser

    trained = train_parser().parse_args(
        ["--pipeline-schedule", "auto", "--num-layers", "32", "--pipeline-model-parallel-size",
         "4", "--decoder-first-pipeline-num-layers", "6", "--decoder-last-pipeline-num-layers",
         "6"]
    )  # fmt: skip
    assert train_request(trained, 8, env={}, device=(None, None)).uneven == FIRST_LAST


def test_bfpp_plan_auto_prints_the_decision_on_the_users_stages(capsys) -> None:
    code = plan_cli.main(
        ["auto", "--model", "llama-7b", "--num-gpus", "8", "--gpu", "h100-80gb",
         "--pipeline-model-parallel-size", "4", "--global-batch-size", "64",
         "--pipeline-model-parallel-layout", "Et*7|t*9|t*9|t*7L"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("megatron_bfpp: auto: ")
    assert out.rstrip().endswith("stages of --pipeline-model-parallel-layout Et*7|t*9|t*9|t*7L]")
    code = plan_cli.main(
        ["auto", "--model", "llama-7b", "--num-gpus", "8", "--gpu", "h100-80gb",
         "--pipeline-model-parallel-size", "4", "--global-batch-size", "64",
         "--account-for-loss-in-pipeline-split"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and len(err.strip().splitlines()) == 1  # 33 layers over 4: said once each
    assert "1f1b, bpipe, gpipe: --account-for-loss-in-pipeline-split does not split 32" in err


# --- --pipeline-model-parallel-layout auto: the planner's own partition ----------------------


def test_partitions_lighten_the_ends_and_keep_every_layer() -> None:
    found = partitions(32, 4)
    assert (8, 8, 8, 8) in found and (6, 10, 10, 6) in found and (4, 12, 12, 4) in found
    assert all(sum(p) == 32 and len(p) == 4 and min(p) >= 0 for p in found)
    assert all(p[0] >= 4 and p[-1] >= 4 for p in found)  # at most PARTITION_SHIFT lighter
    assert len(found) == len(set(found)) == 25
    assert set(partitions(8, 2)) == {(8 - k, k) for k in range(9)}  # two stages: every split
    assert partitions(8, 2)[0] == (4, 4) and found[0] == (8, 8, 8, 8)  # the most even first
    assert set(partitions(8, 8)) == {(1,) * 8, (0, 2, 1, 1, 1, 1, 1, 1), (1, 2, 1, 1, 1, 1, 1, 0),
                                     (0, 2, 2, 1, 1, 1, 1, 0)}  # fmt: skip


@pytest.mark.parametrize(
    "layers", [(1,) * 32, (8, 9, 8, 7), (0, 1, 1, 0), (5,), (3, 5), (2, 2, 2, 3, 3, 1), (0, 0)]
)
def test_a_partition_prints_as_a_layout_megatron_reads_back(layers: tuple[int, ...]) -> None:
    text = layout_of(layers)
    stages = layout_stages(text)
    assert [stage.count("t") for stage in stages] == list(layers)
    assert stages[0].startswith("E") and stages[-1].endswith("L")
    assert "".join(stages).count("E") == "".join(stages).count("L") == 1


def test_auto_chooses_the_partition_with_the_schedule_and_prints_its_layout() -> None:
    """At a 128k vocabulary the output layer weighs about two layers: auto's own partition
    takes layers off the last stage, beats the even layout's prediction, and prints the layout
    string that reproduces it (Megatron's row stays on even stages)."""
    model = dataclasses.replace(LLAMA, vocab_size=128256)
    auto = UnevenStages(pipeline_model_parallel_layout="auto")
    decision = decide(_request(auto, model=model, vp=1))  # one stage per rank: 1F1B, BPipe, ...
    chosen = decision.chosen.candidate
    assert chosen.stage_layers[-1] < 8 and sum(chosen.stage_layers) == 32
    layout = layout_of(chosen.stage_layers)
    assert decision.line().endswith(f"its layout: --pipeline-model-parallel-layout '{layout}']")
    assert decision.megatron.candidate.stage_layers == ()
    even = decide(_request(UnevenStages(pipeline_model_parallel_layout="Et*8|t*8|t*8|t*8L"),
                           model=model, vp=1))  # fmt: skip
    assert decision.chosen.plan is not None and even.chosen.plan is not None
    assert decision.chosen.plan.step_time_s < even.chosen.plan.step_time_s
    # of each candidate's 25 partitions, only the three best bounds and the most even one
    shapes = [dataclasses.replace(row.candidate, stage_layers=()) for row in decision.rows]
    assert 3 <= max(map(shapes.count, shapes)) <= 4


def test_the_planners_partition_takes_no_other_uneven_flag() -> None:
    both = UnevenStages(pipeline_model_parallel_layout="auto", decoder_first_pipeline_num_layers=6)
    with pytest.raises(ScheduleError, match="chooses the layers per stage itself; drop "
                       "--decoder-first-pipeline-num-layers"):  # fmt: skip
        decide(_request(both))


def _profile_with_ends(embedding: float | None, output: float | None):
    """A one-layer H100 stage of llama-7b at 50% of peak (F 1, B 2 units), ends as given (in
    layers' forward and backward), written and read back as ``bfpp-plan profile`` would."""
    from megatron_bfpp.plan.costs import layer_forward_flops
    from megatron_bfpp.plan.profile import (
        Measurement,
        StageProfile,
        profile_from_dict,
        profile_to_dict,
    )

    forward = layer_forward_flops(LLAMA, micro_batch_size=1, tp=1) / (
        0.5 * get_gpu("h100-80gb").peak_flops
    )
    ends = [None if w is None else w * 3 * forward for w in (embedding, output)]
    row = Measurement(1, forward, 2 * forward, None, None, *ends)
    profile = StageProfile("H100", "cuda", LLAMA, 1, 1, "bf16", (row,))
    return profile_from_dict(profile_to_dict(profile))


def test_a_profiles_ends_weigh_the_first_and_last_stage() -> None:
    """With the embedding and output layer measured (bfpp-plan profile), the last stage's
    output layer and loss are its measured weight times a layer, not the FLOP estimate, and the
    first stage carries the embedding; a profile without them keeps the FLOP estimate."""
    from megatron_bfpp.plan.costs import ProfileCurve

    gpu = get_gpu("h100-80gb")
    c = Candidate("1f1b", "optim", 1, 2, 1, 1, 1, "none", stage_layers=(12, 20))
    cluster = Cluster(2, 8, gpu)
    measured = _profile_with_ends(0.25, 3.0)
    assert measured.measurements[0].end_weights(1) == pytest.approx((0.25, 3.0))
    curve = ProfileCurve.from_profile(measured, gpu)
    options = SearchOptions(efficiency=curve, communication=False)
    times = stage_times(c, LLAMA, cluster, options, 10**9, 0)
    layer = (times.forward + times.backward) / 16  # 16 layers: an even stage, all compute
    assert times.output == pytest.approx(3.0 * layer) and times.embedding == pytest.approx(
        0.25 * layer
    )
    assert stage_weights(c, LLAMA, times) == pytest.approx((0.75 + 0.25 / 16, 1.25 + 3.0 / 16))
    old = ProfileCurve.from_profile(_profile_with_ends(None, None), gpu)
    assert old.end_weights(1.0) is None
    before = stage_times(c, LLAMA, cluster, dataclasses.replace(options, efficiency=old), 10**9, 0)
    assert before.embedding == 0.0 and before.output > 0.0  # the logits' FLOPs
    assert stage_weights(c, LLAMA, before)[0] == 0.75


BIG_VOCAB = dataclasses.replace(LLAMA, name="llama-7b-128k", vocab_size=128256)


def test_recommend_searches_partitions_and_never_predicts_worse() -> None:
    """``recommend --pipeline-model-parallel-layout auto``: each row is also tried on the lighter
    ends of ``partitions``; a row kept uneven is predicted faster than the same row on even
    stages, and the best is no slower than the even search's best."""
    from megatron_bfpp.plan.search import evaluate, recommend

    query = dict(
        model=BIG_VOCAB, cluster=Cluster(64, 8, get_gpu("h100-80gb")), global_batch_size=64
    )
    even = recommend(**query, options=SearchOptions(top=5))
    uneven = recommend(**query, options=SearchOptions(top=5, partitions=True))
    assert uneven.plans[0].step_time_s <= even.plans[0].step_time_s
    assert uneven.simulated > even.simulated
    moved = [p for p in uneven.plans if p.candidate.stage_layers]
    assert moved
    for plan in moved:
        c = plan.candidate
        assert sum(c.stage_layers) == BIG_VOCAB.num_layers and len(c.stage_layers) == c.pp * c.vp
        assert c.stage_layers in partitions(BIG_VOCAB.num_layers, c.pp * c.vp)
        flat = evaluate(dataclasses.replace(c, stage_layers=()), **query, options=SearchOptions())
        assert plan.step_time_s < flat.step_time_s
        row = plan.to_dict()
        stages = layout_stages(row["pipeline_model_parallel_layout"])
        assert [s.count("t") for s in stages] == list(c.stage_layers)


def test_recommend_prints_the_layout_of_each_uneven_row(capsys) -> None:
    argv = [
        "recommend", "--arch", "llama", "--num-layers", "32", "--hidden-size", "4096",
        "--num-attention-heads", "32", "--vocab-size", "128256", "--seq-length", "4096",
        "--num-gpus", "64", "--gpu", "h100-80gb", "--global-batch-size", "64", "--top", "3",
        "--pipeline-model-parallel-layout", "auto",
    ]  # fmt: skip
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "uneven stages (the rest even):" in out
    assert "--pipeline-model-parallel-layout 'E" in out
    with pytest.raises(SystemExit) as refused:  # only auto: a given layout is auto's to read
        plan_cli.main([*argv[:-1], "Et|t"])
    assert refused.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# A DeepSeek-like mix: the first 2 of 8 layers dense, the rest MoE
MIXED = dataclasses.replace(
    get_model("mixtral-8x7b"), name="mixed", num_layers=8, moe_layer_freq=(0, 0, 1, 1, 1, 1, 1, 1)
)


def test_moe_layers_follow_uneven_stages() -> None:
    from megatron_bfpp.plan.memory import moe_layers_per_rank
    from megatron_bfpp.plan.presets import moe_layers_per_stage

    assert moe_layers_per_stage(MIXED, 4) == (0, 2, 2, 2)
    assert moe_layers_per_stage(MIXED, 4, (3, 2, 2, 1)) == (1, 2, 2, 1)
    assert moe_layers_per_stage(MIXED, 2, (1, 7)) == (0, 6)
    from megatron_bfpp.ir import Placement

    v = moe_layers_per_rank(
        MIXED, pp=2, vp=2, placement=Placement.V_SHAPE, stage_layers=(3, 2, 2, 1)
    )
    assert v == (1 + 1, 2 + 2)  # a V: rank 0 holds stages 0 and 3


def test_a_moe_stage_weighs_its_own_layers_time_and_bytes() -> None:
    """Uneven MoE stages: a stage's compute weight is its dense layers' time plus its MoE layers'
    against an even stage's, and the walk weighs a stored micro-batch by its stage's bytes."""
    from megatron_bfpp.plan.memory import layer_activation_bytes
    from megatron_bfpp.plan.presets import BF16_MIXED
    from megatron_bfpp.plan.search import _stage_bytes, _stored_weights

    c = Candidate("1f1b", "optim", 1, 2, 1, 2, 1, "none", ep=2, stage_layers=(3, 5))
    times = stage_times(c, MIXED, Cluster(4, 8, get_gpu("h100-80gb")), SearchOptions(), 10**9, 0)
    dense, sparse = times.layer
    assert sparse > dense > 0
    per_stage = times.forward + times.backward  # rank 1's 4 MoE layers: the even base
    assert per_stage == pytest.approx(4 * sparse)
    weights = stage_weights(c, MIXED, times)
    assert weights[0] == pytest.approx((2 * dense + sparse) / per_stage + 0, abs=1e-6)
    assert weights[1] == pytest.approx((5 * sparse + times.output) / per_stage, abs=1e-6)
    bytes_of = {
        moe: layer_activation_bytes(
            MIXED, micro_batch_size=1, tp=1, sequence_parallel=False, recompute="none",
            precision=BF16_MIXED, moe=moe,
        )
        for moe in (False, True)
    }  # fmt: skip
    stored, per = _stored_weights(c, MIXED, BF16_MIXED, _stage_bytes(c, MIXED, BF16_MIXED))
    assert stored == (2 * bytes_of[False] + bytes_of[True], 5 * bytes_of[True])
    assert per.layers == 1
    # BPipe's transfers move those bytes: against an even stage's (4 MoE layers, the busier)
    even = 4 * bytes_of[True]
    assert stage_activation_shares(c, MIXED, BF16_MIXED) == pytest.approx(
        (stored[0] / even, stored[1] / even), abs=1e-6
    )


def test_bpipe_transfers_weigh_each_stages_layers() -> None:
    """(4, 10, 10, 8) layers on 4 ranks: stage 0's evictions move half an even stage's
    activations, and where they pace the step (across nodes) a BPipe plan is the faster."""
    from megatron_bfpp.plan.presets import BF16_MIXED
    from megatron_bfpp.plan.search import evaluate

    c = Candidate("bpipe", "optim", 4, 4, 1, 4, 1, "none", stage_layers=(4, 10, 10, 8))
    assert stage_activation_shares(c, LLAMA, BF16_MIXED) == (0.5, 1.25, 1.25, 1.0)
    assert stage_activation_shares(dataclasses.replace(c, stage_layers=()), LLAMA, BF16_MIXED) == ()
    cluster = Cluster(64, 8, get_gpu("h100-80gb"))  # rank 0 evicts across nodes: the bottleneck
    planned = evaluate(c, model=LLAMA, cluster=cluster, global_batch_size=128)
    with pytest.MonkeyPatch.context() as patch:  # as before: every stage moved an even one's
        patch.setattr("megatron_bfpp.plan.search.stage_activation_shares", lambda *_: ())
        unweighed = evaluate(c, model=LLAMA, cluster=cluster, global_batch_size=128)
    assert planned.step_time_s < unweighed.step_time_s


def test_auto_plans_a_moe_model_on_uneven_stages() -> None:
    """Formerly refused in one line: every timed row is on the user's stages."""
    model = get_model("qwen3-30b-a3b")
    fields = dict(tp=2, pp=4, dp=8, ep=8, global_batch_size=256, recompute="full")
    even = decide(_request(UnevenStages(), model=model, **fields))
    uneven = decide(_request(FIRST_LAST_MOE, model=model, **fields))
    assert all(row.candidate.stage_layers for row in uneven.rows if row.plan is not None)
    assert "stages of --decoder-first-pipeline-num-layers 10" in uneven.line()
    assert even.chosen.plan.step_time_s != uneven.chosen.plan.step_time_s
    chosen = decide(
        _request(UnevenStages(pipeline_model_parallel_layout="auto"), model=model, **fields)
    )
    assert chosen.chosen.plan.step_time_s <= even.chosen.plan.step_time_s


FIRST_LAST_MOE = UnevenStages(
    decoder_first_pipeline_num_layers=10, decoder_last_pipeline_num_layers=10
)


def test_auto_plans_sharded_parameters_on_uneven_stages() -> None:
    """Formerly refused: fully sharded breadth-first on the user's stages, the gathered-buffer
    walk weighing each chunk's own parameters (measured: tests/multirank/test_plan_memory.py)."""
    fields = dict(sharding="optim_grads_params", global_batch_size=64, recompute="selective")
    decision = decide(_request(FIRST_LAST, **fields))
    rows = [row for row in decision.rows if row.plan is not None]
    assert rows and all(row.candidate.stage_layers for row in rows)
    assert {row.candidate.schedule for row in rows} == {"breadth-first"}
    chosen = decision.chosen.candidate
    assert chosen.stage_layers == FIRST_LAST.stage_layers(32, 4, chosen.vp)
    even = dataclasses.replace(rows[0].candidate, stage_layers=())
    kept = [memory_of(c, model=LLAMA, global_batch_size=64) for c in (even, rows[0].candidate)]
    assert kept[0] != kept[1]


def test_mtp_layers_are_planned_on_the_last_stage() -> None:
    """--mtp-num-layers: each MTP layer adds a layer of the last kind and another output pass
    with its loss to the last stage's time, its activations to the last stage's, its parameters
    to the last rank's (measured: tests/multirank/test_plan_memory.py); V-shapes, which the
    runtime refuses with MTP, are left out."""
    from megatron_bfpp.plan.auto import MTP_ON_A_V
    from megatron_bfpp.plan.costs import BuiltinCurve
    from megatron_bfpp.plan.memory import rank_parameters, stage_activation_bytes
    from megatron_bfpp.plan.presets import BF16_MIXED
    from megatron_bfpp.plan.search import recommend

    mtp = LLAMA.with_mtp(2)
    c = Candidate("1f1b", "optim", 1, 4, 1, 2, 1, "none")
    cluster = Cluster(8, 8, get_gpu("h100-80gb"))
    plain, with_mtp = (stage_times(c, m, cluster, SearchOptions(), 10**9, 0) for m in (LLAMA, mtp))
    layer = plain.forward / 8 + plain.backward / 8  # 8 layers per rank, dense
    h, s = LLAMA.hidden_size, LLAMA.seq_length
    eh = 4.0 * s * h * h  # eh_proj's forward FLOPs (b 1, tp 1), at the built-in efficiency
    eh_time = (
        3 * eh / (BuiltinCurve(get_gpu("h100-80gb")).forward(eh) * get_gpu("h100-80gb").peak_flops)
    )
    assert with_mtp.output == pytest.approx(plain.output + 2 * (plain.output + eh_time + layer))
    sizes = dict(micro_batch_size=1, tp=1, layers_per_stage=8, vocab_size=32000,
                 sequence_parallel=False, recompute="none", precision=BF16_MIXED)  # fmt: skip
    before, after = (stage_activation_bytes(m, **sizes) for m in (LLAMA, mtp))
    assert (after.layers, after.first) == (before.layers, before.first)
    assert after.last > before.last + 2 * before.layers // 8
    looped = dict(tp=1, pp=4, chunks=1, placement=get_spec_placement("1f1b"))
    pairs = zip(rank_parameters(LLAMA, **looped), rank_parameters(mtp, **looped), strict=True)
    grown = [b - a for a, b in pairs]
    assert grown[:3] == [0, 0, 0] and grown[3] > 0
    decision = decide(_request(UnevenStages(), model=mtp))
    assert {row.excluded for row in decision.rows if row.candidate.schedule.startswith("v-")} == {
        MTP_ON_A_V
    }
    ranked = recommend(model=mtp, cluster=cluster, global_batch_size=64, options=SearchOptions())
    assert ranked.plans and not any(p.candidate.schedule.startswith("v-") for p in ranked.plans)


def get_spec_placement(name: str):
    from megatron_bfpp.schedules.registry import get_spec

    return get_spec(name).placement


def test_mtp_in_a_layout_and_the_flag_agree(capsys) -> None:
    layout = UnevenStages(pipeline_model_parallel_layout="Et*8|t*8|t*8|t*8mL")
    assert decide(_request(layout, model=LLAMA.with_mtp(1))).rows
    with pytest.raises(ScheduleError, match=r"places 1 MTP layer.*--mtp-num-layers is 0"):
        decide(_request(layout))
    argv = ["auto", "--model", "llama-7b", "--num-gpus", "8", "--gpu", "h100-80gb",
            "--pipeline-model-parallel-size", "4", "--global-batch-size", "64"]  # fmt: skip
    assert plan_cli.main([*argv, "--mtp-num-layers", "1"]) == 0
    assert plan_cli.main([*argv, "--mtp-num-layers", "-1"]) != 0
    assert "--mtp-num-layers must be 0 or more, got -1" in capsys.readouterr().err


def test_every_front_end_reads_mtp() -> None:
    shape = dict(num_layers=32, hidden_size=256, num_attention_heads=8, seq_length=128)
    args = argparse.Namespace(
        **shape, micro_batch_size=1, global_batch_size=8, vocab_size=1000, mtp_num_layers=1,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=4,
    )  # fmt: skip
    assert megatron_request(args, world_size=8, env={}, hw=H100, sharding=None).model.mtp_num_layers
    config = SimpleNamespace(
        model=SimpleNamespace(
            **shape, vocab_size=1000, tensor_model_parallel_size=1,
            pipeline_model_parallel_size=4, mtp_num_layers=2,
        ),
        train=SimpleNamespace(micro_batch_size=1, global_batch_size=8),
        optimizer=SimpleNamespace(optimizer="adam", use_distributed_optimizer=True),
    )  # fmt: skip
    bridge = bridge_request(config, options={}, sharding="optim", env={"WORLD_SIZE": "8"}, hw=H100)
    assert bridge.model.mtp_num_layers == 2
