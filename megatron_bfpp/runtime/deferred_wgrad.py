"""Deferred weight gradients: the cheap split backward on megatron-core's own linear layers.

Local ``ColumnParallelLinear`` / ``RowParallelLinear`` layers file their weight GEMMs under the
running ``I`` and ``W`` computes them, bit-identical to a whole backward; everything else
(Transformer Engine layers too) stays in ``I``. Why the cut is at the GEMMs: docs/design-notes.md,
"Split backward (I and W) at runtime"."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from megatron_bfpp import compat

__all__ = ["WeightGradStore", "deferring", "install"]

Key = tuple[int, int]  # (stage, micro-batch)

# The store of the split-backward step running in this process (one pipeline rank per process).
_ACTIVE: WeightGradStore | None = None
_INSTALLED = "_bfpp_deferred_wgrad"
_warned = False  # the Transformer Engine warning was logged (once per process)


@dataclass
class _Deferred:
    """A linear layer's pending weight (and bias) gradient: the operands its backward would use."""

    input: torch.Tensor  # the saved input (this rank's sequence shard under sequence parallel)
    weight: torch.Tensor
    bias: torch.Tensor | None
    grad_output: torch.Tensor
    ctx_main_grad: torch.Tensor | None
    gradient_accumulation_fusion: bool
    sequence_parallel: bool
    tp_group: Any

    def compute(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(weight gradient, bias gradient), as megatron-core's backward computes them."""
        from megatron.core.tensor_parallel.layers import prepare_input_tensors_for_wgrad_compute

        total_input = self.input
        if self.sequence_parallel:
            size = list(self.input.size())
            size[0] *= self.tp_group.size()
            total_input = torch.empty(size, dtype=self.input.dtype, device=self.input.device)
            torch.distributed.all_gather_into_tensor(total_input, self.input, group=self.tp_group)
        grad_output, total_input = prepare_input_tensors_for_wgrad_compute(
            self.grad_output, total_input
        )
        grad_weight: torch.Tensor | None
        weight = self.weight
        if self.gradient_accumulation_fusion:
            weight.main_grad = self.ctx_main_grad  # type: ignore[attr-defined]
            compat.accumulate_wgrad_fused(total_input, grad_output, weight.main_grad)  # type: ignore[attr-defined]
            if hasattr(weight, "grad_added_to_main_grad"):
                # as megatron-core: a placeholder, so DDP's hooks skip the kernel's addition
                main_grad = weight.main_grad  # type: ignore[attr-defined]
                make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
                grad_weight = make(main_grad.shape, dtype=self.input.dtype, device=main_grad.device)
                weight.grad_added_to_main_grad = True
            else:
                grad_weight = None
        else:
            grad_weight = grad_output.t().matmul(total_input)
        return grad_weight, grad_output.sum(dim=0) if self.bias is not None else None


@dataclass(eq=False)
class WeightGradStore:
    """The weight gradients filed by each micro-batch's I, until its W."""

    collecting: Key | None = None
    pending: dict[Key, list[_Deferred]] = field(default_factory=dict)

    @contextlib.contextmanager
    def collect(self, key: Key) -> Iterator[None]:
        """File what the linear layers' backward defers under ``key`` (one I)."""
        self.collecting = key
        self.pending.setdefault(key, [])
        try:
            yield
        finally:
            self.collecting = None

    def file(self, deferred: _Deferred) -> bool:
        """Keep ``deferred`` for the running I's W; False outside an I (compute it now)."""
        if self.collecting is None:
            return False
        self.pending[self.collecting].append(deferred)
        return True

    def run(self, key: Key) -> int:
        """``key``'s W: compute its weight gradients and accumulate them. Returns the GEMMs."""
        items = self.pending.pop(key, [])
        _accumulate(items)
        return len(items)

    def held_tensors(self) -> Iterable[torch.Tensor]:
        """What the pending items hold until their W (the memory accounting counts these)."""
        for items in self.pending.values():
            for item in items:
                yield from (item.input, item.grad_output)


@dataclass(frozen=True)
class _Params:
    """The layer's weight and bias as autograd knows them; the Function gets detached views, so
    ``I`` has no edge to them (megatron-core DDP's overlap hooks must not fire without a
    gradient), and ``W`` reaches them through ``torch.autograd.backward``."""

    weight: torch.Tensor
    bias: torch.Tensor | None


class _DeferredLinear(torch.autograd.Function):
    """megatron-core's linear forward; a backward whose weight GEMM waits for W."""

    @staticmethod
    def forward(ctx: Any, params: _Params, *args: Any) -> Any:
        from megatron.core.tensor_parallel import layers

        output = layers.LinearWithGradAccumulationAndAsyncCommunication.forward(ctx, *args)
        ctx.params = params
        ctx.num_args = len(args)
        weight = params.weight
        fusion = bool(ctx.gradient_accumulation_fusion)
        ctx.main_grad = weight.main_grad if fusion and hasattr(weight, "main_grad") else None
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        input, weight = ctx.saved_tensors
        tp_group = ctx.tp_group
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=tp_group)
        if ctx.sequence_parallel:
            shard = torch.empty(input.size(), dtype=input.dtype, device=grad_input.device)
            torch.distributed.reduce_scatter_tensor(shard, grad_input, group=tp_group)
            grad_input = shard
        params: _Params = ctx.params
        deferred = _Deferred(
            input=input,
            weight=params.weight,
            bias=params.bias,
            grad_output=grad_output,
            ctx_main_grad=ctx.main_grad,
            gradient_accumulation_fusion=bool(ctx.gradient_accumulation_fusion),
            sequence_parallel=bool(ctx.sequence_parallel),
            tp_group=tp_group,
        )
        store = _ACTIVE
        if store is None or not store.file(deferred):
            # Not inside an I (no caller of ours does that): the gradients now, as B would.
            _accumulate([deferred])
        return (None, grad_input) + (None,) * (ctx.num_args - 1)


def _accumulate(items: list[_Deferred]) -> None:
    """Compute the deferred gradients and let autograd accumulate them (``.grad`` and DDP's hooks
    see what a whole backward gives), inside a Function's backward so each is moved, not cloned."""
    params = [param for item in items for param in (item.weight, item.bias) if param is not None]
    if params:
        # ``Function.apply`` is untyped in torch 2.13, typed in 2.14: called through Any for both
        with torch.enable_grad():  # also when called from a backward (outside an I)
            total = cast(Any, _WeightGradients).apply(items, *params)
        torch.autograd.backward(total)


class _WeightGradients(torch.autograd.Function):
    """A scalar that depends on the deferred layers' parameters; its backward computes their
    gradients (``_Deferred.compute``), one per parameter in ``_accumulate``'s order."""

    @staticmethod
    def forward(ctx: Any, items: list[_Deferred], *params: torch.Tensor) -> torch.Tensor:
        ctx.items = items
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, *unused: Any) -> Any:
        items, ctx.items = ctx.items, None
        grads: list[torch.Tensor | None] = []
        for item in items:
            grad_weight, grad_bias = item.compute()
            grads.append(grad_weight)
            if item.bias is not None:
                grads.append(grad_bias)
        return (None, *grads)


def _forward_impl(original: Any) -> Any:
    def forward_impl(input: Any, weight: Any, *args: Any, **kwargs: Any) -> Any:
        if _ACTIVE is None or not weight.requires_grad:
            return original(input, weight, *args, **kwargs)
        margs = compat.linear_function_args(input, weight, *args, **kwargs)
        if (
            not torch.is_grad_enabled()
            or hasattr(weight, "__fsdp_param__")
            or compat.linear_function_option(margs, "grad_output_buffer") is not None
            or compat.linear_function_option(margs, "gtp_remat_size", 1) > 1
        ):
            return original(input, weight, *args, **kwargs)
        bias = margs[2]
        params = _Params(weight, bias if bias is not None and bias.requires_grad else None)
        detached = (margs[0], weight.detach(), None if bias is None else bias.detach())
        return cast(Any, _DeferredLinear).apply(params, *detached, *margs[3:])

    return forward_impl


def install(chunks: Iterable[torch.nn.Module]) -> int:
    """Route the chunks' local linear layers through the deferring function during a split backward
    step (idempotent; returns the count); warns once of TE layers, whose weight GEMMs stay in I."""
    global _warned
    count = 0
    chunks = list(chunks)
    if not _warned and any(compat.transformer_engine_layers(chunk) for chunk in chunks):
        _warned = True
        logging.getLogger("megatron_bfpp").warning(
            "split backward: Transformer Engine layers compute their weight gradients in I (their "
            "delayed weight-gradient path is not wired yet), so v-min/v-half/v-zb keep their "
            "memory but lose their W time; use --transformer-impl local to defer every linear "
            "layer's weight GEMM to W"
        )
    for chunk in chunks:
        for layer in compat.local_linear_layers(chunk):
            if not getattr(layer, _INSTALLED, False):
                layer._forward_impl = _forward_impl(layer._forward_impl)
                setattr(layer, _INSTALLED, True)
            count += 1
    return count


@contextlib.contextmanager
def deferring(store: WeightGradStore) -> Iterator[WeightGradStore]:
    """Make ``store`` the running step's store (the routed layers defer into it)."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, store
    try:
        yield store
    finally:
        _ACTIVE = previous
