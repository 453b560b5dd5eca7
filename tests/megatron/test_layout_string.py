"""The launcher reads ``--pipeline-model-parallel-layout`` before anything is imported
(``preflight.layout_stages``): it must unroll a layout string exactly as the installed
megatron-core does, or it would refuse a layout the GPUs run, or pass one they refuse."""

from __future__ import annotations

import pytest

layout_module = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")

from megatron_bfpp.config.run_config import layout_stages  # noqa: E402

KINDS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


@pytest.mark.parametrize(
    "layout",
    [
        "Ettt|(tt|)*29,m|L",  # megatron-core's own example
        "E|t*2|t|t|t|t|t|tL",
        "Et*2||t|t|t||t*2|tL",  # empty stages
        "Et*2|(t|)*3t*2L",
        "(Et|)*1t*3,L",
        "E|(t*4|)*3L",
        "Et*8|t*8L",
        "|Et|tL|",
    ],
)
def test_stages_are_megatron_cores(layout: str) -> None:
    parsed = layout_module.PipelineParallelLayerLayout.parse_str_to_list(layout)
    ours = [[KINDS[kind] for kind in stage] for stage in layout_stages(layout)]
    assert ours == [[kind.name for kind in stage] for stage in parsed]


@pytest.mark.parametrize(
    ("pp", "vp", "num_layers", "uneven"),
    [
        (4, 1, 8, {}),
        (4, 2, 16, {}),
        (4, 2, 12, {"decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 2}),
        (4, 1, 10, {"decoder_first_pipeline_num_layers": 1}),
        (3, 2, 10, {"decoder_last_pipeline_num_layers": 2}),
        (2, 2, 12, {"decoder_first_pipeline_num_layers": 4, "decoder_last_pipeline_num_layers": 8}),
        (4, 2, 14, {"account_for_embedding_in_pipeline_split": True,
                    "account_for_loss_in_pipeline_split": True}),
        (4, 1, 7, {"account_for_loss_in_pipeline_split": True}),
        (4, 2, 8, {"pipeline_model_parallel_layout": "Et*2||t|t|t||t*2|tL"}),
        (2, 2, 16, {"pipeline_model_parallel_layout": "E|t*8|(t*2|)*1t*6L"}),
    ],
)  # fmt: skip
def test_layers_per_stage_are_megatron_cores(
    pp: int, vp: int, num_layers: int, uneven: dict[str, object]
) -> None:
    """The memory estimate's layers per stage (``Layout.layers_per_stage``, stage s the looped
    slot of rank s % pp) are what megatron-core builds there."""
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from megatron_bfpp.config.run_config import Layout
    from megatron_bfpp.ir import Placement

    layout = Layout(1, pp, vp, Placement.LOOPED, 1, pp, **uneven)  # type: ignore[arg-type]
    fields = layout.uneven_config()
    if text := fields.pop("pipeline_model_parallel_layout", None):
        parsed = layout_module.PipelineParallelLayerLayout(text, pp).layout
        decoder = layout_module.LayerType.decoder
        theirs = [parsed[s % pp][s // pp].count(decoder) for s in range(pp * vp)]
    else:
        config = SimpleNamespace(
            num_layers=num_layers,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
            pipeline_model_parallel_layout=None,
            **{name: None for name in ("num_layers_in_first_pipeline_stage",
                                       "num_layers_in_last_pipeline_stage")},
            **{name: False for name in ("account_for_embedding_in_pipeline_split",
                                        "account_for_loss_in_pipeline_split")},
        )  # fmt: skip
        vars(config).update(fields)
        theirs = [
            get_num_layers_to_build(config, vp_stage=s // pp, pp_rank=s % pp)  # type: ignore[arg-type]
            for s in range(pp * vp)
        ]
    assert layout.layers_per_stage(num_layers) == theirs
