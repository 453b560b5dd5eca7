"""The CPU adapter's wrapper around Megatron-LM's ``load_checkpoint`` (megatron_bfpp.megatron.
cpu_launch): torch Adam has a state for the load to describe, the load runs without autograd,
and each parameter's step is the checkpoint's afterwards."""

from __future__ import annotations

from typing import Any

import torch

from megatron_bfpp.megatron.cpu_launch import _with_torch_adam_state


class _Chained:  # what get_megatron_optimizer returns: the torch optimizers one level down
    def __init__(self, adam: torch.optim.Adam) -> None:
        self.chained_optimizers = [type("Dist", (), {"optimizer": adam})()]


def test_load_sees_adam_state_without_grad_and_steps_are_restored() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    adam = torch.optim.Adam([param])
    seen: dict[str, Any] = {}

    def load_checkpoint(model: Any, optimizer: Any, scheduler: Any) -> tuple[int, int]:
        seen["state"] = dict(adam.state[param])
        seen["grad"] = torch.is_grad_enabled()
        # megatron-core's load: one step tensor shared by every parameter, the group's step set
        shared = torch.tensor(7.0)
        adam.state[param]["step"] = shared
        adam.param_groups[0]["step"] = 3
        return 3, 24

    result = _with_torch_adam_state(load_checkpoint)(None, _Chained(adam), None)
    assert result == (3, 24)
    assert seen["grad"] is False
    assert float(seen["state"]["step"]) == 0.0
    assert torch.equal(seen["state"]["exp_avg"], torch.zeros(4))
    assert float(adam.state[param]["step"]) == 3.0  # the group's step, in its own tensor


def test_no_optimizer_is_passed_through() -> None:
    calls = []
    _with_torch_adam_state(lambda model, optimizer: calls.append(optimizer))(None, None)
    assert calls == [None]
