"""A V-shape model in Megatron-LM starts from the weights a 1F1B run of the same seed draws: V
stage ``s`` is built with the generators Megatron's ``_set_random_seed`` seeds for 1F1B's rank
``s // 2`` (docs/architecture.md#megatron-integration); dropout streams still differ."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["gathered_states", "record_seed_call", "seeded_as_pipeline_rank"]

# Megatron's _set_random_seed as it was called (arguments), and the function itself.
_seed_call: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None


def record_seed_call(original: Any) -> Any:
    """Wrap ``megatron.training.initialize._set_random_seed`` to remember its call."""

    def _set_random_seed(*args: Any, **kwargs: Any) -> Any:
        global _seed_call
        _seed_call = (original, args, dict(kwargs))
        return original(*args, **kwargs)

    _set_random_seed.__wrapped__ = original  # type: ignore[attr-defined]
    return _set_random_seed


def gathered_states(group: Any) -> list[Any]:
    """Every rank of ``group``'s generators that build a model, now (a collective): Bridge seeds by
    the pipeline rank its process group reports, a call no stand-in can replay as another rank's."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    mine = (torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states())
    states: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(states, mine, group)
    return states


class _MpuAs:
    """``megatron.core.mpu`` with another pipeline rank: what ``_set_random_seed`` reads."""

    def __init__(self, real: Any, pipeline_rank: int) -> None:
        self._real = real
        self._rank = pipeline_rank

    def get_pipeline_model_parallel_rank(self, *args: Any, **kwargs: Any) -> int:
        return self._rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def seeded_as_pipeline_rank(pipeline_rank: int, states: list[Any] | None = None) -> Iterator[bool]:
    """Inside: every generator seeded as Megatron seeded ``pipeline_rank`` or as ``states`` hold it
    (True; restored after), or untouched when Megatron's seeding was not seen (False)."""
    if _seed_call is None and states is None:
        yield False
        return
    import importlib

    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    python, numpy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    tracker = get_cuda_rng_tracker().get_states()
    if states is not None:
        torch.set_rng_state(states[pipeline_rank][0])
        if states[pipeline_rank][1] is not None:
            torch.cuda.set_rng_state(states[pipeline_rank][1])
        get_cuda_rng_tracker().set_states(states[pipeline_rank][2])
    else:
        original, args, kwargs = _seed_call  # type: ignore[misc]
        initialize: Any = importlib.import_module("megatron.training.initialize")
        real = initialize.mpu
        kwargs = {k: v for k, v in kwargs.items() if k != "pp_group"}  # the rank comes from mpu
        initialize.mpu = _MpuAs(real, pipeline_rank)
        try:
            original(*args, **kwargs)
        finally:
            initialize.mpu = real
    try:
        yield True
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        get_cuda_rng_tracker().set_states(tracker)
