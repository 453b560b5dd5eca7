"""The execution model gives today's figures: every case of ``tests.model_fixtures``' grid
(catalogue schedules and options at pp 2-8, vp 1-4, m 1 to 3p, sharding, BPipe caps, the golden
CSV files) observed again and compared with the fixture recorded before the model was rewritten
(lock-step posting, NCCL proof and report, validation with its one-line errors and grids, step
time, bubble, exposed data-parallel time, per-rank memory and events under every p2p model)."""

from __future__ import annotations

import json

import pytest

from tests.model_fixtures import FIXTURE, cases, observe

_RECORDED = json.loads(FIXTURE.read_text())
_CASES = dict(cases())


def test_the_grid_is_the_recorded_one() -> None:
    assert sorted(_CASES) == sorted(_RECORDED)


@pytest.mark.parametrize("case", sorted(_CASES))
def test_same_figures_as_recorded(case: str) -> None:
    recorded = _RECORDED[case]
    try:
        schedule = _CASES[case]()
    except ValueError as error:  # a combination the catalogue refuses, as recorded
        assert recorded == {"error": str(error)}
        return
    assert json.loads(json.dumps(observe(schedule))) == recorded
