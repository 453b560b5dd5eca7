"""``megatron_bfpp.megatron.bridge``'s checks of a Bridge ``ConfigContainer``, without Bridge:
every refusal is one line naming Bridge's config field, before any rank starts work, and
multi-module evaluation (which Bridge runs past the hook) ends the rank with one line."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_bfpp.ir import ScheduleError

pytest.importorskip("megatron.core")
from megatron_bfpp.megatron import bridge, plugin

pytestmark = pytest.mark.megatron


def _config(**model: Any) -> SimpleNamespace:
    fields = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": None}
    return SimpleNamespace(
        model=SimpleNamespace(**{**fields, **model}),
        train=SimpleNamespace(micro_batch_size=1, global_batch_size=8),
        ddp=SimpleNamespace(use_megatron_fsdp=False),
    )


@pytest.mark.parametrize(
    ("name", "model", "kwargs", "expected"),
    [
        ("v-half", {"mtp_num_layers": 1}, {}, "does not support config.model.mtp_num_layers"),
        (
            "dualpipe-v",
            {"defer_embedding_wgrad_compute": True},
            {},
            "and does not support config.model.defer_embedding_wgrad_compute yet; unset it",
        ),
        ("v-half", {"virtual_pipeline_model_parallel_size": 4}, {}, "exactly 2 stages per rank"),
        (
            "1f1b",
            {"dist_train": SimpleNamespace(use_dist_train=True)},
            {},
            "cannot run with config.model.dist_train.use_dist_train",
        ),
        ("1f1b", {"pipeline_model_parallel_size": 1}, {}, "pipeline_model_parallel_size >= 2"),
        (
            "1f1b",
            {"virtual_pipeline_model_parallel_size": 2},
            {},
            "config.model.virtual_pipeline_model_parallel_size",
        ),
        ("nope", {}, {}, "unknown; choose one of"),
        (
            "breadth-first",
            {},
            {"sharding": "optim_grads_params"},
            "needs an optimizer that steps on the parameter shards",
        ),
    ],
)
def test_refusals_are_one_line(
    name: str, model: dict[str, Any], kwargs: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ScheduleError) as error:
        bridge.check_bridge_config(_config(**model), name, {}, **kwargs)
    assert expected in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "uneven",
    [
        {"pipeline_model_parallel_layout": "Et|t|t|tL"},
        {"num_layers_in_first_pipeline_stage": 1},
        {"account_for_loss_in_pipeline_split": True},
    ],
)
def test_v_shapes_and_auto_take_uneven_layouts(
    uneven: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A V builds Megatron's model stages in order (stage s on rank s or 2p-1-s), so Bridge's
    uneven-layout fields pass; auto plans on them (tests/unit/test_auto_uneven.py)."""
    from megatron_bfpp.config.run_config import UNEVEN_CONFIG_FIELDS, UnevenStages
    from megatron_bfpp.megatron.auto import bridge_request
    from megatron_bfpp.plan.auto import hardware

    for name in ("v-zb", "dualpipe-v", "breadth-first"):
        bridge.check_bridge_config(_config(**uneven), name, {})
    shape = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32}
    config = _config(**uneven, **shape, tensor_model_parallel_size=1)
    config.optimizer = SimpleNamespace(optimizer="adam", use_distributed_optimizer=True)
    request = bridge_request(
        config, options={}, sharding="optim", env={"WORLD_SIZE": "2"}, hw=hardware(
            device_name=None, device_memory=None
        )
    )  # fmt: skip
    assert request.uneven == UnevenStages.read(config.model, UNEVEN_CONFIG_FIELDS)
    ours = dataclasses.fields(UnevenStages)[UNEVEN_CONFIG_FIELDS.index(next(iter(uneven)))]
    assert getattr(request.uneven, ours.name)  # the field given reached the planner


def test_auto_with_combined_1f1b_is_one_line_before_auto_decides() -> None:
    with pytest.raises(ScheduleError, match=r"^combined_1f1b needs the schedule 'interleaved'"):
        bridge.use_schedule(_config(), "auto", combined_1f1b=True)


def test_megatron_fsdp_is_refused() -> None:
    config = _config()
    config.ddp.use_megatron_fsdp = True
    with pytest.raises(ScheduleError, match="Megatron-FSDP"):
        bridge.check_bridge_config(config, "breadth-first", {})


def test_looped_schedules_and_v_shapes_get_two_virtual_stages() -> None:
    for name in ("breadth-first", "v-half", "dualpipe-v"):
        config = _config()
        bridge.check_bridge_config(config, name, {})
        assert config.model.virtual_pipeline_model_parallel_size == 2
    config = _config()
    bridge.check_bridge_config(config, "1f1b", {})
    assert config.model.virtual_pipeline_model_parallel_size is None


def test_batch_and_schedule_fit_under_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")  # pp=2, so dp=2
    config = _config()
    config.train.global_batch_size = 6  # 3 micro-batches per replica
    bridge.check_bridge_config(config, "1f1b", {})
    config.train.global_batch_size = 7
    with pytest.raises(ScheduleError, match="is not a multiple of"):
        bridge.check_bridge_config(config, "1f1b", {})
    config.train.global_batch_size = 8
    with pytest.raises(ScheduleError, match="--pipeline-schedule bpipe cannot run 4"):
        bridge.check_bridge_config(config, "bpipe", {"max_stored": 1})
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ScheduleError, match="WORLD_SIZE 3 is not a multiple"):
        bridge.check_bridge_config(_config(), "1f1b", {})


def test_interleaved_reads_bridges_group_field() -> None:
    config = _config(microbatch_group_size_per_vp_stage=4)
    assert bridge._with_config_options(config, "interleaved", {}) == {"microbatch_group_size": 4}
    assert bridge._with_config_options(config, "interleaved", {"microbatch_group_size": 2}) == {
        "microbatch_group_size": 2
    }
    assert bridge._with_config_options(config, "breadth-first", {}) == {}


class MultiModulePipelineCommunicator:
    """Named as megatron-core's multi-module communicator is."""


def test_multi_module_evaluation_ends_the_rank_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[object] = []

    def evaluate(state: object, *rest: object, p2p_communicator: object = None) -> str:
        calls.append(p2p_communicator)
        return "evaluated"

    guarded = bridge._guard_multi_module(evaluate)
    multi = MultiModulePipelineCommunicator()
    assert guarded("state", p2p_communicator=multi) == "evaluated"  # default schedule: Bridge's
    monkeypatch.setenv("LOCAL_RANK", "0")
    plugin.set_schedule("1f1b")
    try:
        assert guarded("state", p2p_communicator=object()) == "evaluated"
        with pytest.raises(SystemExit) as exit_:
            guarded("state", p2p_communicator=multi)
    finally:
        plugin.set_schedule("default")
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "multi-module (MegatronMIMO) evaluation" in lines[0]
    assert len(calls) == 2


class Provider:
    """A Bridge model provider as ``_create_model`` calls it: the groups on ``_pg_collection``."""

    def __init__(self) -> None:
        self._pg_collection = SimpleNamespace(pp=SimpleNamespace(size=lambda: 2, rank=lambda: 0))
        self.built: list[tuple[Any, ...]] = []

    def provide(
        self, pre_process: Any = None, post_process: Any = None, vp_stage: Any = None
    ) -> Any:
        self.built.append((pre_process, post_process, vp_stage, self._pg_collection.pp.rank()))
        return SimpleNamespace()


def test_a_v_shape_has_bridges_provider_build_the_v(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a V, pipeline rank 0's chunks from Bridge's provider are stages 0 and 3 (pp 2),
    each built as the looped slot holding it (its groups' view for that build only), seeded from
    the generators gathered once over the pipeline group; under another schedule the provider's
    own ``provide`` builds."""
    from megatron_bfpp.megatron import seeding

    torch = pytest.importorskip("torch")
    provider = Provider()
    groups = provider._pg_collection
    gathered: list[Any] = []

    def gathered_states(group: Any) -> list[Any]:
        gathered.append(group)
        return [(torch.get_rng_state(), None, {})] * 2

    monkeypatch.setattr(seeding, "gathered_states", gathered_states)
    monkeypatch.setattr(seeding, "_seed_call", None)
    provider.provide = bridge._v_shape_provide(provider.provide)  # type: ignore[method-assign]
    plugin.set_schedule("v-half")
    try:
        provider.provide(pre_process=True, post_process=False, vp_stage=0)
        provider.provide(pre_process=False, post_process=False, vp_stage=1)
    finally:
        plugin.set_schedule("default")
    # stage 3 is the second half of 1F1B rank 1's layers: stage 2 is drawn first, then dropped
    assert provider.built == [(True, False, 0, 0), (False, False, 1, 0), (False, True, 1, 1)]
    assert provider._pg_collection is groups and gathered == [groups.pp]
    provider.provide(pre_process=True, post_process=False, vp_stage=1)
    assert provider.built[-1] == (True, False, 1, 0)


def test_a_layout_left_to_auto_needs_auto() -> None:
    with pytest.raises(ScheduleError, match=r"^config.model.pipeline_model_parallel_layout 'auto'"):
        bridge.check_bridge_config(_config(pipeline_model_parallel_layout="auto"), "1f1b", {})
