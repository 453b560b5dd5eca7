"""The activation store alone (one process, plain torch): what it captures, and that an evicted
micro-batch rebuilt from its byte payload gives exactly the gradients it would have."""

from __future__ import annotations

import pytest
import torch

from megatron_bfpp.runtime.activations import ALIGNMENT, ActivationStore, unique_storage_bytes


class Block(torch.nn.Module):
    """Saves views that alias each other (split of one projection) and a transposed weight."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 24)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).split(8, dim=-1)
        return (torch.tanh(q) * k.sigmoid() + v.t().t() * self.scale).sum(-1)


def _grads(block: Block, x: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad.clone() for p in block.parameters() if p.grad is not None] + [x.grad.clone()]


def _run(evict: bool, half: bool = False) -> tuple[list[torch.Tensor], ActivationStore, int]:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 8, requires_grad=True)
    if half:
        block = block.to(torch.bfloat16)
        x = x.detach().to(torch.bfloat16).requires_grad_()
    store = ActivationStore.for_modules([block], x.device)
    with store.capture((0, 0)):
        out = block(x)
    held = unique_storage_bytes(store.live_tensors())
    if evict:
        buffer, record = store.evict((0, 0), [x])
        assert x.numel() == 0 and not list(store.live_tensors())
        assert record.nbytes == buffer.numel()
        assert all(offset % ALIGNMENT == 0 for offset in record.storage_offsets)
        payload = torch.empty_like(buffer).copy_(buffer)  # as if it went away and came back
        del buffer
        store.restore((0, 0), payload)
        assert x.shape == (4, 8)
    out.sum().backward()
    store.drop((0, 0))
    return _grads(block, x), store, held


@pytest.mark.parametrize("half", [False, True])
def test_evict_and_restore_give_the_same_gradients(half: bool) -> None:
    want, _, _ = _run(evict=False, half=half)
    got, store, _ = _run(evict=True, half=half)
    assert not store.evicted
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_parameters_buffers_and_their_aliases_are_not_captured() -> None:
    block = Block()
    store = ActivationStore.for_modules([block], torch.device("cpu"))
    x = torch.randn(4, 8)  # no grad: the input is not needed by any backward
    with store.capture((0, 0)):
        block(x).sum()
    parameters = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers())}
    captured = list(store.live_tensors())
    assert captured  # activations were captured
    assert not {t.untyped_storage().data_ptr() for t in captured} & parameters


def test_handles_are_released_with_the_graph() -> None:
    """The store holds weak references only: after the backward, nothing stays captured."""
    block = Block()
    store = ActivationStore.for_modules([block], torch.device("cpu"))
    with store.capture((0, 0)):
        out = block(torch.randn(4, 8, requires_grad=True))
    assert unique_storage_bytes(store.live_tensors()) > 0
    out.sum().backward()
    assert unique_storage_bytes(store.live_tensors()) == 0


def test_using_an_evicted_activation_is_a_clear_error() -> None:
    block = Block()
    store = ActivationStore.for_modules([block], torch.device("cpu"))
    x = torch.randn(4, 8, requires_grad=True)
    with store.capture((1, 3)):
        out = block(x)
    store.evict((1, 3), [])
    with pytest.raises(RuntimeError, match="stage 1, micro-batch 3 is used while evicted"):
        out.sum().backward()


def test_unique_storage_bytes_counts_shared_storage_once() -> None:
    base = torch.zeros(10)
    assert unique_storage_bytes([base, base[2:], base.view(2, 5), None]) == 40
    assert unique_storage_bytes([base, torch.zeros(3)]) == 52
