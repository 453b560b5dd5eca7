"""Tiny megatron-core GPT models (for ``run_ranks`` functions) whose weights do not depend on how
they are split (each drawn whole, seeded by its global name): one process's run is the reference."""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from megatron_bfpp.ir import Placement
from megatron_bfpp.train.data import Batch
from megatron_bfpp.train.presets import (
    full_shape,
    global_param_names,
    gpt_chunks,
    init_by_global_names,
    portable_fields,
    tp_partition,
    unwrap,
    wrap_ddp,
)
from megatron_bfpp.train.step_functions import forward_step, loss_func

__all__ = [
    "MICRO_BATCH_SIZE",
    "SEQ_LENGTH",
    "Batch",
    "GradShard",
    "assert_tensors_close",
    "build_model_chunks",
    "data_parallel_share",
    "forward_step_func",
    "global_param_names",
    "grad_shards",
    "loss_func",
    "losses_from_store",
    "make_batches",
    "merge_shards",
    "reduction_tolerance",
    "reference_losses_and_grads",
    "run_schedule",
    "tiny_gpt_config",
    "tokens_per_step",
    "train_steps",
    "unwrap",
    "wrap_ddp",
]

SEQ_LENGTH = 16
_VOCAB_SIZE = 64
MICRO_BATCH_SIZE = 2


def tiny_gpt_config(
    *,
    tp: int | None = None,
    pp: int | None = None,
    vp: int | None = None,
    sequence_parallel: bool = False,
    **overrides: Any,
) -> TransformerConfig:
    """A small fp32 GPT config; ``tp``, ``pp`` (``vp`` if no ``pp``): the parallel state's, or 1."""
    initialized = parallel_state.model_parallel_is_initialized()
    if tp is None:
        tp = parallel_state.get_tensor_model_parallel_world_size() if initialized else 1
    if pp is None:
        pp = parallel_state.get_pipeline_model_parallel_world_size() if initialized else 1
        if vp is None and initialized:
            vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    fields: dict[str, Any] = dict(
        num_layers=8,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        **portable_fields(tp=tp, pp=pp, vp=vp),
        sequence_parallel=sequence_parallel,
        batch_p2p_comm=False,
    )
    return TransformerConfig(**(fields | overrides))


def build_model_chunks(
    config: TransformerConfig,
    *,
    seed: int = 0,
    vocab_size: int = _VOCAB_SIZE,
    max_sequence_length: int = SEQ_LENGTH,
    share_embeddings_and_output_weights: bool = False,
    placement: Placement = Placement.LOOPED,
) -> list[GPTModel]:
    """This rank's chunks as bfpp-train builds them (``gpt_chunks``), drawn by name (``_draw``)."""
    return gpt_chunks(
        config,
        layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        init=functools.partial(init_by_global_names, seed=seed, draw=_draw),
        placement=placement,
    )


def _draw(global_name: str, shape: Sequence[int], seed: int) -> torch.Tensor:
    """Random everywhere, biases and norms too (so equivalence tests cover them), seeded by name."""
    generator = torch.Generator().manual_seed((zlib.crc32(global_name.encode()) + seed) % 2**63)
    noise = torch.randn(*shape, generator=generator, dtype=torch.float32)
    leaf = global_name.rsplit(".", 1)[-1]
    return 1.0 + 0.1 * noise if "norm" in global_name and leaf == "weight" else 0.1 * noise


def make_batches(
    num_microbatches: int,
    micro_batch_size: int = MICRO_BATCH_SIZE,
    seq_len: int = SEQ_LENGTH,
    vocab: int = _VOCAB_SIZE,
    seed: int = 0,
) -> list[Batch]:
    """Deterministic synthetic micro-batches: random tokens and labels, ``position_ids``, and a
    ``loss_mask`` with a few zeros (so ``num_tokens`` differs between micro-batches)."""
    generator, batches = torch.Generator().manual_seed(seed), []
    for _ in range(num_microbatches):
        shape = (micro_batch_size, seq_len)
        loss_mask = (torch.rand(shape, generator=generator) > 0.15).float()
        loss_mask[0, 0] = 1.0  # never an all-masked micro-batch
        batches.append(
            {
                "tokens": torch.randint(0, vocab, shape, generator=generator),
                "labels": torch.randint(0, vocab, shape, generator=generator),
                "position_ids": torch.arange(seq_len).unsqueeze(0).expand(shape).contiguous(),
                "loss_mask": loss_mask,
            }
        )
    return batches


def forward_step_func(
    data_iterator: Iterator[Batch], model: torch.nn.Module, return_schedule_plan: bool = False
) -> tuple[Any, Any]:
    """bfpp-train's :func:`~megatron_bfpp.train.step_functions.forward_step`, batch not moved."""
    return forward_step(None, data_iterator, model, return_schedule_plan)


def losses_from_store(store: Iterable[dict[str, torch.Tensor]]) -> list[float]:
    """Per-micro-batch mean token loss from what a forward-backward function returned."""
    return [float(d["lm loss"][0] / d["lm loss"][1]) for d in store]


def reference_losses_and_grads(
    config: TransformerConfig,
    batches: Sequence[Batch],
    *,
    seed: int = 0,
    share_embeddings_and_output_weights: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-micro-batch mean losses and gradients by global name of the unpipelined model (tp = pp
    = 1 here, each loss scaled as ``forward_step`` scales it) on ``batches``."""
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_pipeline_model_parallel_world_size() == 1
    unparallel = dataclasses.replace(
        config,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        sequence_parallel=False,
    )
    shared = share_embeddings_and_output_weights
    (model,) = build_model_chunks(unparallel, seed=seed, share_embeddings_and_output_weights=shared)
    losses = []
    for batch in batches:
        output, step_loss = forward_step_func(iter([batch]), model)
        loss, num_tokens, report = step_loss(output)
        loss /= torch.clamp(num_tokens, min=1)
        loss /= len(batches)
        loss.backward()
        losses.append(float(report["lm loss"][0] / report["lm loss"][1]))
    return losses, merge_shards([grad_shards([model])])


@dataclasses.dataclass
class GradShard:
    """One rank's piece of a parameter's gradient, keyed elsewhere by global name."""

    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    partition_dim: int | None  # None: replicated across tensor-parallel ranks
    partition_stride: int
    tp_rank: int
    tp_size: int


def grad_shards(model_chunks: Sequence[torch.nn.Module]) -> dict[str, GradShard]:
    """This rank's gradients by global name (``main_grad`` under DDP, else ``.grad``) with their
    tensor-parallel slice, for :func:`merge_shards` (distributed optimizer: compare losses)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    out: dict[str, GradShard] = {}
    for chunk in model_chunks:
        module = unwrap(chunk)
        names = global_param_names(module)
        for name, param in module.named_parameters():
            value = param.grad if (grad := getattr(param, "main_grad", None)) is None else grad
            if value is None:
                continue
            dim, stride = tp_partition(param)
            tensor, shape = value.detach().clone().float().cpu(), tuple(full_shape(param, tp_size))
            out[names[name]] = GradShard(tensor, shape, dim, stride, tp_rank, tp_size)
    return out


def merge_shards(per_rank: Iterable[dict[str, GradShard]]) -> dict[str, torch.Tensor]:
    """Full tensors by global name from every rank's shards. Copies held by several ranks (dp
    replicas, tp-replicated parameters, a tied embedding's ends) must be bitwise equal, as after
    ``finalize_model_grads``: else a reduction is missing."""
    pieces: dict[str, dict[int, GradShard]] = {}
    for shards in per_rank:
        for name, shard in shards.items():
            key = shard.tp_rank if shard.partition_dim is not None else 0
            kept = pieces.setdefault(name, {}).setdefault(key, shard)
            if kept is not shard and not torch.equal(kept.tensor, shard.tensor):
                diff = (kept.tensor - shard.tensor).abs().max().item()
                raise AssertionError(f"replicas of {name} differ (max abs diff {diff:g})")
    full: dict[str, torch.Tensor] = {}
    for name, held in pieces.items():
        first = next(iter(held.values()))
        if first.partition_dim is None:
            full[name] = first.tensor
            continue
        dim, stride, tp_size = first.partition_dim, first.partition_stride, first.tp_size
        if missing := set(range(tp_size)) - set(held):
            raise AssertionError(f"{name}: no shard from tensor-parallel rank(s) {sorted(missing)}")
        # Undo megatron-core's TP split (``_initialize_affine_weight_cpu``): rank r's tensor is
        # pieces r, r + tp_size, ... of tp_size * stride equal pieces, concatenated.
        ordered: list[torch.Tensor | None] = [None] * (tp_size * stride)
        for rank, shard in held.items():
            for i, piece in enumerate(torch.chunk(shard.tensor, stride, dim=dim)):
                ordered[rank + i * tp_size] = piece
        full[name] = torch.cat([p for p in ordered if p is not None], dim=dim)
        assert tuple(full[name].shape) == first.full_shape, name
    return full


def train_steps(
    steps: Sequence[Sequence[Batch]],
    *,
    forward_backward_func: Any = None,
    overlap: bool = False,
    placement: Placement = Placement.LOOPED,
    share_embeddings_and_output_weights: bool = False,
) -> list[list[float]]:
    """This rank's per-micro-batch losses of Adam steps (megatron-core DDP and optimizer)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks = wrap_ddp(
        build_model_chunks(
            tiny_gpt_config(),
            placement=placement,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        ),
        use_distributed_optimizer=True,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
    )
    config = OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0, use_distributed_optimizer=True
    )
    optimizer, losses = get_megatron_optimizer(config, chunks), []
    for batches in steps:
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        store = run_schedule(
            chunks, data_parallel_share(batches), forward_backward_func=forward_backward_func
        )
        update_successful, _, _ = optimizer.step()
        if not update_successful:
            raise RuntimeError("optimizer step skipped (inf/nan gradients)")
        losses.append(losses_from_store(store))
    return losses


def data_parallel_share(batches: Sequence[Batch]) -> list[Batch]:
    """This dp rank's contiguous share of a global micro-batch list (a reference runs it whole)."""
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    if len(batches) % dp:
        raise ValueError(f"{len(batches)} micro-batches do not split over {dp} data-parallel ranks")
    share = len(batches) // dp
    return list(batches[rank * share : (rank + 1) * share])


def run_schedule(
    model_chunks: Sequence[torch.nn.Module],
    batches: Sequence[Batch],
    *,
    forward_backward_func: Any = None,
    forward_only: bool = False,
    micro_batch_size: int | None = None,
    seq_length: int = SEQ_LENGTH,
) -> list[dict[str, torch.Tensor]]:
    """One forward-backward call on ``batches`` (by default megatron-core's function)."""
    if forward_backward_func is None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_backward_func = get_forward_backward_func()
    num_chunks = len(model_chunks)
    iterators: Any = [iter(batches) for _ in range(num_chunks)]
    return list(
        forward_backward_func(
            forward_step_func=forward_step_func,
            data_iterator=iterators if num_chunks > 1 else iterators[0],
            model=list(model_chunks),
            num_microbatches=len(batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size or batches[0]["tokens"].shape[0],
            forward_only=forward_only,
        )
    )


def reduction_tolerance(num_terms: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative tolerance for a sum of ``num_terms`` values in another order than the reference:
    (n-1)·eps, Higham's bound (docs/architecture.md, "Tolerances of the equivalence tests")."""
    if num_terms < 1:
        raise ValueError(f"num_terms must be >= 1, got {num_terms}")
    return max(num_terms - 1, 1) * torch.finfo(dtype).eps


def tokens_per_step(batches: list[dict[str, torch.Tensor]]) -> int:
    """Terms summed into each weight gradient in one step: every token of every micro-batch."""
    return sum(int(batch["tokens"].numel()) for batch in batches)


def assert_tensors_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, rel: float = 0.0
) -> None:
    """Same names, and per tensor ``max|got - want| <= rel * max|want|`` (``rel=0``: bitwise
    equal); the error lists every offending tensor, worst first."""
    if set(got) != set(want):
        raise AssertionError(
            f"names differ: only got {sorted(set(got) - set(want))}, "
            f"only wanted {sorted(set(want) - set(got))}"
        )
    bad = []
    for name in sorted(want):
        a, b = got[name], want[name]
        if a.shape != b.shape:
            bad.append((float("inf"), f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"))
            continue
        if rel == 0.0:
            if not torch.equal(a, b):
                err = (a - b).abs().max().item()
                bad.append((err, f"{name}: not bitwise equal (max abs diff {err:.3g})"))
            continue
        scale = b.abs().max().item()
        err = (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()
        if not err <= rel:
            bad.append((err, f"{name}: relative error {err:.3g} > {rel:g}"))
    if bad:
        lines = [text for _, text in sorted(bad, key=lambda item: -item[0])]
        raise AssertionError(f"{len(bad)}/{len(want)} tensors differ:\n  " + "\n  ".join(lines))
