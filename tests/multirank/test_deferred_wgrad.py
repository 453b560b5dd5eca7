"""runtime.deferred_wgrad on megatron-core's own linear layers: what an I defers and a W computes
is bit-identical to megatron-core's backward, outside a split step the layer runs megatron-core's
own function, and what cannot defer (frozen weights) computes in the backward as before."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_bfpp.testing import models as M
from megatron_bfpp.testing.multirank import run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(120)]


def _layer(kind: str, tp: int) -> Any:
    import torch
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(3)
    config = M.tiny_gpt_config(sequence_parallel=tp > 1)
    init = torch.nn.init.xavier_uniform_
    if kind == "column":
        return ColumnParallelLinear(
            32, 48, config=config, init_method=init, bias=True, gather_output=False
        )
    return RowParallelLinear(
        48,
        32,
        config=config,
        init_method=init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    )


def _graph_names(output: Any) -> list[str]:
    names, todo = [], [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None:
            names.append(type(node).__name__)
            todo.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def _grads(kind: str, tp: int, mode: str) -> Any:
    """Two micro-batches through one layer; ``mode`` picks megatron-core's own backward
    ("megatron"), a deferring I then W per micro-batch ("split"), or deferral active but the
    backward outside an I ("outside")."""
    import torch

    from megatron_bfpp.runtime import deferred_wgrad

    layer = _layer(kind, tp)
    routed = deferred_wgrad.install([layer])
    store = deferred_wgrad.WeightGradStore()
    observed: list[Any] = []
    width = 32 if kind == "column" else 48 // tp
    rows = 8 // tp if kind == "column" and tp > 1 else 8
    for mb in range(2):
        torch.manual_seed(10 + mb)
        x = torch.randn(rows, 2, width, requires_grad=True)
        if mode == "megatron":
            output, _ = layer(x)
            output.square().sum().backward()
        elif mode == "outside":
            with deferred_wgrad.deferring(store):
                output, _ = layer(x)
                output.square().sum().backward()
        else:
            with deferred_wgrad.deferring(store):
                output, _ = layer(x)
                with store.collect((0, mb)):
                    output.square().sum().backward()
                observed.append((layer.weight.grad is None or mb > 0, len(store.pending[(0, mb)])))
                assert store.run((0, mb)) == 1
        observed.extend(_graph_names(output))
    return routed, observed, x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2-sp"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_split_and_outside_equal_megatron_bitwise(kind: str, tp: int) -> None:
    import torch

    def both() -> Any:
        return {mode: _grads(kind, tp, mode) for mode in ("megatron", "split", "outside")}

    for result in run_ranks(both, world_size=tp, tp=tp):
        routed, megatron_trace, *want = result["megatron"]
        assert routed == 1
        assert "LinearWithGradAccumulationAndAsyncCommunicationBackward" in megatron_trace
        _, split_trace, *split = result["split"]
        # The I left the weight gradient to the W, with one deferred GEMM filed per micro-batch.
        assert split_trace.count((True, 1)) == 2 and "_DeferredLinearBackward" in split_trace
        for got in (split, result["outside"][2:]):
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)


def test_frozen_weight_is_not_deferred() -> None:
    def frozen() -> Any:
        import torch

        from megatron_bfpp.runtime import deferred_wgrad

        layer = _layer("column", 1)
        layer.weight.requires_grad_(False)
        deferred_wgrad.install([layer])
        store = deferred_wgrad.WeightGradStore()
        x = torch.randn(8, 2, 32, requires_grad=True)
        with deferred_wgrad.deferring(store):
            output, _ = layer(x)
            with store.collect((0, 0)):
                output.sum().backward()
        return store.pending[(0, 0)], _graph_names(output)

    ((pending, graph),) = run_ranks(frozen, world_size=1)
    assert pending == []
    assert "LinearWithFrozenWeightBackward" in graph


def test_w_moves_its_gradients_into_grad_without_a_copy() -> None:
    """W's weight and bias gradients become ``.grad`` themselves, as a whole backward's do:
    autograd copied every one of them when W handed finished gradients to
    ``torch.autograd.backward`` (an extra weight-sized tensor and copy per layer and W)."""

    def moved() -> bool:
        import torch

        from megatron_bfpp.runtime import deferred_wgrad

        layer = _layer("column", 1)
        deferred_wgrad.install([layer])
        computed: list[Any] = []
        original = deferred_wgrad._Deferred.compute

        def recording(self: Any) -> Any:
            result = original(self)
            # Addresses only: a reference kept here would itself make autograd copy.
            computed.extend(tensor.data_ptr() for tensor in result)
            return result

        deferred_wgrad._Deferred.compute = recording  # type: ignore[method-assign]
        try:
            store = deferred_wgrad.WeightGradStore()
            with deferred_wgrad.deferring(store):
                output, _ = layer(torch.randn(8, 2, 32, requires_grad=True))
                with store.collect((0, 0)):
                    output.sum().backward()
                store.run((0, 0))
        finally:
            deferred_wgrad._Deferred.compute = original  # type: ignore[method-assign]
        return [layer.weight.grad.data_ptr(), layer.bias.grad.data_ptr()] == computed

    assert run_ranks(moved, world_size=1) == [True]
