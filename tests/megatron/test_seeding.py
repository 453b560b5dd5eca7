"""megatron_bfpp.megatron.seeding without a Megatron-LM checkout: Megatron's seeding call is
replayed as another pipeline rank sees it, Bridge's ranks' generators are gathered and set,
and every generator is put back afterwards (the Megatron-LM run itself is
tests/megatron/test_megatron_lm.py's, Bridge's tests/bridge/test_bridge_pretrain.py's)."""

from __future__ import annotations

import random
import sys
import types
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_bfpp.megatron import seeding  # noqa: E402


def test_the_seeding_is_replayed_as_another_rank_and_undone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []
    real_mpu = types.SimpleNamespace(get_pipeline_model_parallel_rank=lambda: 3, other=7)
    initialize: Any = types.ModuleType("megatron.training.initialize")
    initialize.mpu = real_mpu

    def _set_random_seed(seed_: int, *, flag: bool = False) -> None:
        rank = initialize.mpu.get_pipeline_model_parallel_rank()
        assert initialize.mpu.other == 7  # everything else is the real module's
        seen.append(rank)
        torch.manual_seed(seed_ + 100 * rank)
        random.seed(seed_ + 100 * rank)

    monkeypatch.setitem(sys.modules, "megatron.training.initialize", initialize)
    monkeypatch.setattr(seeding, "_seed_call", None)
    with seeding.seeded_as_pipeline_rank(1) as reseeded:
        assert reseeded is False  # Megatron's seeding was never seen: nothing is touched
    recorded = seeding.record_seed_call(_set_random_seed)
    recorded(1234, flag=True)  # what initialize_megatron does, as rank 3
    after_init = torch.rand(3)
    torch.manual_seed(99)
    before = torch.get_rng_state()
    with seeding.seeded_as_pipeline_rank(1) as reseeded:
        assert reseeded is True
        drawn = torch.rand(3)
    assert seen == [3, 1] and initialize.mpu is real_mpu
    torch.manual_seed(1234 + 100 * 1)
    assert torch.equal(drawn, torch.rand(3))  # rank 1's stream, from its start
    # Every generator is put back: the draws after the context are those without it.
    torch.set_rng_state(before)
    expected = torch.rand(2)
    torch.set_rng_state(before)
    with seeding.seeded_as_pipeline_rank(1):
        torch.rand(5)
    assert torch.equal(torch.rand(2), expected)
    assert not torch.equal(after_init, drawn)


def test_bridges_generators_are_gathered_and_each_ranks_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bridge reads the pipeline rank from its process group: every rank's generators where it
    starts building are gathered over that group, a chunk seeded as rank q starts from rank q's,
    and this rank's own are put back afterwards."""
    torch.manual_seed(99)
    other = torch.get_rng_state()  # what the other pipeline rank holds

    def all_gather_object(out: list[Any], mine: Any, group: Any) -> None:
        assert group == "pp"
        out[:] = [mine, (other, *mine[1:])]

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group: 2)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.setattr(seeding, "_seed_call", None)
    torch.manual_seed(1234)
    states = seeding.gathered_states("pp")
    torch.rand(7)  # drawn by this rank since
    before = torch.get_rng_state()
    for rank, seed in ((1, 99), (0, 1234)):
        with seeding.seeded_as_pipeline_rank(rank, states) as reseeded:
            drawn = torch.rand(3)
        assert reseeded and torch.equal(torch.get_rng_state(), before)
        torch.manual_seed(seed)
        assert torch.equal(drawn, torch.rand(3))
        torch.set_rng_state(before)
