"""The launcher reads ``--pipeline-model-parallel-layout`` before anything is imported
(``preflight.layout_stages``): it must unroll a layout string exactly as the installed
megatron-core does, or it would refuse a layout the GPUs run, or pass one they refuse."""

from __future__ import annotations

import pytest

layout_module = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")

from megatron_bfpp.megatron.preflight import layout_stages  # noqa: E402

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
