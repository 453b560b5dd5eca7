"""One translation from each front end's configuration to the planner's model
(``plan.presets.model_description``): the same model is described alike by Megatron-LM's
arguments, Megatron-Bridge's config, bfpp-train's flags and bfpp-plan's, and a gated (SwiGLU)
MLP left without an FFN size gets the size its builder gives it."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_bfpp.cli import plan as plan_cli
from megatron_bfpp.cli import train as train_cli
from megatron_bfpp.megatron.auto import bridge_request, megatron_request
from megatron_bfpp.plan.auto import hardware
from megatron_bfpp.plan.presets import Model, model_description
from megatron_bfpp.train.auto import train_request

HW = hardware(device_name=None, device_memory=None)
# A LLaMA-style model (SwiGLU, grouped-query attention) without dropout, as each front end
# spells it; ``ffn`` None: left to the front end's default.
SHAPE = {"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128}
GROUPS, VOCAB = 4, 1000


def megatron_lm(ffn: int | None) -> Model:
    args = argparse.Namespace(
        **SHAPE, swiglu=True, group_query_attention=True, num_query_groups=GROUPS,
        ffn_hidden_size=ffn, vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
        micro_batch_size=1, global_batch_size=8, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=2,
    )  # fmt: skip
    return megatron_request(args, world_size=2, env={}, hw=HW, sharding=None).model


def bridge(ffn: int | None) -> Model:
    config = SimpleNamespace(
        model=SimpleNamespace(
            **SHAPE, gated_linear_unit=True, num_query_groups=GROUPS, ffn_hidden_size=ffn,
            vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
        ),
        train=SimpleNamespace(micro_batch_size=1, global_batch_size=8),
        optimizer=SimpleNamespace(optimizer="adam", use_distributed_optimizer=True),
    )  # fmt: skip
    return bridge_request(
        config, options={}, sharding="optim", env={"WORLD_SIZE": "2"}, hw=HW
    ).model


def _flags(ffn: int | None) -> list[str]:
    sizes = [f"--{key.replace('_', '-')}={value}" for key, value in SHAPE.items()]
    extra = [] if ffn is None else [f"--ffn-hidden-size={ffn}"]
    return [*sizes, f"--num-query-groups={GROUPS}", f"--vocab-size={VOCAB}", *extra]


def bfpp_train(ffn: int | None) -> Model:
    args = train_cli.build_parser().parse_args(
        ["--model", "llama", "--pipeline-model-parallel-size", "2", *_flags(ffn)]
    )
    return train_request(args, 2, env={}, device=(None, None)).model


def bfpp_plan(ffn: int | None) -> Model:
    args = plan_cli.build_parser().parse_args(
        ["recommend", "--arch", "llama", "--num-gpus", "2", "--gpu", "h100-80gb",
         "--global-batch-size", "8", *_flags(ffn)]
    )  # fmt: skip
    return plan_cli._model_from_args(args)


FRONT_ENDS: dict[str, Any] = {
    "megatron-lm": megatron_lm,
    "bridge": bridge,
    "bfpp-train": bfpp_train,
    "bfpp-plan": bfpp_plan,
}


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_the_same_model_is_described_alike_by_every_front_end(front_end: str) -> None:
    expected = model_description(
        **SHAPE, gated=True, ffn_default="megatron-lm", ffn_hidden_size=688,
        num_query_groups=GROUPS, vocab_size=VOCAB, dropout=False,
    )  # fmt: skip
    assert FRONT_ENDS[front_end](688) == expected
    assert expected.arch == "llama" and expected.ffn_hidden_size == 688


@pytest.mark.parametrize(
    ("front_end", "ffn"),
    [
        # Megatron-LM's validate_args: SwiGLU gets 2/3 of 4h, rounded down to 64
        ("megatron-lm", int((4 * 256 * 2 / 3) / 64) * 64),
        # megatron-core's TransformerConfig (Bridge's config): 4h, gated or not
        ("bridge", 4 * 256),
        # bfpp-train's presets (and bfpp-plan's, which plans them): 8h/3 rounded up to 16
        ("bfpp-train", 688),
        ("bfpp-plan", 688),
    ],
)
def test_a_gated_mlp_without_an_ffn_size_gets_its_builders_default(
    front_end: str, ffn: int
) -> None:
    assert FRONT_ENDS[front_end](None).ffn_hidden_size == ffn


def test_experts_are_described_alike_by_bfpp_train_and_megatron_lm() -> None:
    """bfpp-train's Mixture-of-Experts flags are Megatron-LM's: the same planner model, and the
    experts' parallel size in the request ``auto`` plans."""
    moe = {"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 128}
    args = train_cli.build_parser().parse_args(
        ["--model", "llama", "--pipeline-model-parallel-size", "2", *_flags(688),
         "--num-experts=8", "--moe-ffn-hidden-size=128", "--expert-model-parallel-size=2"]
    )  # fmt: skip
    ours = train_request(args, 4, env={}, device=(None, None))
    megatron_args = argparse.Namespace(
        **SHAPE, swiglu=True, group_query_attention=True, num_query_groups=GROUPS,
        ffn_hidden_size=688, vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
        micro_batch_size=1, global_batch_size=8, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=2, expert_model_parallel_size=2, **moe,
    )  # fmt: skip
    theirs = megatron_request(megatron_args, world_size=4, env={}, hw=HW, sharding=None)
    assert ours.model == theirs.model and ours.ep == theirs.ep == 2
    assert (ours.model.num_experts, ours.model.moe_ffn_hidden_size) == (8, 128)
