"""Model presets for ``bfpp-train`` (``gpt``, ``llama``; fp32, no dropout or fused kernels, so CPU
and GPU alike) and :func:`init_by_global_names`, so every (tp, pp, vp, dp) layout holds the same
model and schedules and layouts compare loss for loss."""

from __future__ import annotations

import functools
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_bfpp.config.run_config import ModelShape, default_ffn_hidden_size
from megatron_bfpp.ir import Placement

__all__ = [
    "ModelShape",
    "build_model_chunks",
    "default_ffn_hidden_size",
    "full_shape",
    "global_param_names",
    "gpt_chunks",
    "init_by_global_names",
    "portable_fields",
    "tp_partition",
    "transformer_config",
    "unwrap",
    "wrap_ddp",
]

_PRESETS = ("gpt", "llama")
INIT_STD = 0.02
_LAYER_PREFIX = re.compile(r"^(.*\.)(\d+)$")


def portable_fields(*, tp: int, pp: int, vp: int | None, bf16: bool = False) -> dict[str, Any]:
    """``TransformerConfig`` fields that run alike on CPU and GPU, shared by the presets and the
    tests' tiny model: fp32 (or bf16), dropout 0, initialisation on the CPU, no fused kernels."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    return dict(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        fp16=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def transformer_config(
    shape: ModelShape,
    *,
    tp: int,
    pp: int,
    vp: int | None,
    on_cpu: bool,
    ep: int = 1,
    dispatcher: str = "alltoall",
    bf16: bool = False,
    overlap: bool = False,
    **uneven: Any,
) -> Any:
    """The megatron-core ``TransformerConfig`` of ``shape`` for a parallel layout (``uneven``:
    ``Layout.uneven_config``'s fields, checked by megatron-core here). Experts: megatron-core's
    local MoE layer on every layer, without linear biases (megatron-core adds an expert's bias in
    place on a view, which autograd refuses); ``overlap``: its all-to-all overlap."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    fields: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        ffn_hidden_size=shape.ffn,
        init_method_std=INIT_STD,
        perform_initialization=False,  # init_by_global_names fills every parameter
        **portable_fields(tp=tp, pp=pp, vp=vp, bf16=bf16),
        sequence_parallel=False,
        # gloo: batched p2p gives wrong gradients at pp=2 with looping (see megatron/cpu.py)
        batch_p2p_comm=not on_cpu,
        **uneven,
    )
    if shape.preset == "llama":
        fields.update(
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            num_query_groups=shape.num_query_groups or shape.num_attention_heads,
        )
    elif shape.preset == "gpt":
        fields.update(normalization="LayerNorm", num_query_groups=shape.num_query_groups)
    else:
        raise ValueError(f"unknown model preset {shape.preset!r} (choose from {_PRESETS})")
    if shape.num_experts:
        fields.update(
            num_moe_experts=shape.num_experts,
            moe_router_topk=shape.router_topk,
            moe_ffn_hidden_size=shape.moe_ffn,
            expert_model_parallel_size=ep,
            moe_token_dispatcher_type=dispatcher,
            moe_grouped_gemm=False,
            add_bias_linear=False,
            **({"overlap_moe_expert_parallel_comm": True} if overlap else {}),
        )
    return TransformerConfig(**fields)


def build_model_chunks(
    config: Any, shape: ModelShape, *, seed: int, placement: Placement = Placement.LOOPED
) -> list[Any]:
    """This rank's ``GPTModel`` chunks of a preset, initialised by :func:`init_by_global_names`
    and moved to the GPU when there is one (built on the CPU: ``use_cpu_initialization``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    llama = shape.preset == "llama"
    return gpt_chunks(
        config,
        layer_spec=get_gpt_layer_local_spec(
            num_experts=shape.num_experts,
            moe_grouped_gemm=False,
            normalization="RMSNorm" if llama else "LayerNorm",
        ),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        share_embeddings_and_output_weights=not llama,
        position_embedding_type="rope" if llama else "learned_absolute",
        init=functools.partial(init_by_global_names, seed=seed),
        to_gpu=torch.cuda.is_available(),
        placement=placement,
    )


def gpt_chunks(
    config: Any,
    *,
    layer_spec: Any,
    vocab_size: int,
    max_sequence_length: int,
    share_embeddings_and_output_weights: bool,
    init: Callable[[torch.nn.Module], None],
    position_embedding_type: str = "learned_absolute",
    to_gpu: bool = False,
    placement: Placement = Placement.LOOPED,
    mtp_block_spec: Any = None,
) -> list[Any]:
    """This rank's ``GPTModel`` chunks, one per stage in ``placement`` (bfpp-train's and tests');
    ``mtp_block_spec``: megatron-core's MTP block (``config.mtp_num_layers``) where it goes."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_bfpp.megatron.chunks import build_chunks

    def provider(
        *, pre_process: bool, post_process: bool, vp_stage: int | None, pg_collection: Any
    ) -> Any:
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
            vp_stage=vp_stage,
            **({} if pg_collection is None else {"pg_collection": pg_collection}),
            **({} if mtp_block_spec is None else {"mtp_block_spec": mtp_block_spec}),
        )
        if to_gpu:
            model.cuda(torch.cuda.current_device())
        init(model)
        return model

    return build_chunks(
        provider,
        placement=placement,
        num_ranks=parallel_state.get_pipeline_model_parallel_world_size(),
        num_chunks=config.virtual_pipeline_model_parallel_size or 1,
        rank=parallel_state.get_pipeline_model_parallel_rank(),
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
    )


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    from megatron.core.models.gpt import GPTModel

    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module  # type: ignore[assignment]
    return model


def global_param_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> global name (``decoder.layers.<global layer index>``, an expert by
    its global index; a tied output weight on a stage without the embedding is named after the
    embedding it duplicates)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    module = unwrap(model)
    layer_prefix: dict[str, str] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, TransformerLayer):
            match = _LAYER_PREFIX.match(name)
            assert match, name
            layer = f"{match.group(1)}{sub.layer_number - 1}."
            for index, expert in enumerate(getattr(sub.mlp, "local_expert_indices", ())):
                local = f"{name}.mlp.experts.local_experts.{index}."  # before its layer's prefix
                layer_prefix[local] = f"{layer}mlp.experts.local_experts.{expert}."
            layer_prefix[name + "."] = layer
    tied, names = getattr(module, "share_embeddings_and_output_weights", False), {}
    for name, _ in module.named_parameters():
        global_name = next(
            (g + name[len(local) :] for local, g in layer_prefix.items() if name.startswith(local)),
            name,
        )
        if tied and name == "output_layer.weight":
            global_name = "embedding.word_embeddings.weight"
        names[name] = global_name
    return names


def _draw(global_name: str, shape: Sequence[int], seed: int) -> torch.Tensor:
    leaf = global_name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(*shape)
    if "norm" in global_name and leaf in ("weight", "layer_norm_weight"):
        return torch.ones(*shape)
    generator = torch.Generator().manual_seed((zlib.crc32(global_name.encode()) + seed) % 2**63)
    return INIT_STD * torch.randn(*shape, generator=generator, dtype=torch.float32)


def tp_partition(param: torch.Tensor) -> tuple[int | None, int]:
    """(partition dim, stride) of a TP parameter as megatron-core marks it; (None, 1) if whole."""
    if getattr(param, "tensor_model_parallel", False):
        return int(getattr(param, "partition_dim")), int(getattr(param, "partition_stride", 1))  # noqa: B009
    return None, 1


def full_shape(param: torch.Tensor, tp_size: int) -> list[int]:
    """The unsplit shape of this rank's piece of ``param``."""
    dim, _ = tp_partition(param)
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= tp_size
    return shape


@torch.no_grad()
def init_by_global_names(
    model: torch.nn.Module,
    *,
    seed: int,
    draw: Callable[[str, Sequence[int], int], torch.Tensor] | None = None,
) -> None:
    """Fill every parameter from its global name at its full shape, then take this rank's tensor-
    parallel slice; ``draw(global_name, full_shape, seed)`` replaces :func:`_draw`."""
    draw = draw or _draw
    from megatron.core import parallel_state

    module = unwrap(model)
    names = global_param_names(module)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for name, param in module.named_parameters():
        full = draw(names[name], full_shape(param, tp_size), seed)
        dim, stride = tp_partition(param)
        if dim is not None:
            pieces = torch.chunk(full, tp_size * stride, dim=dim)
            full = torch.cat(pieces[tp_rank::tp_size], dim=dim)
        param.copy_(full.to(device=param.device, dtype=param.dtype))


def wrap_ddp(model_chunks: Sequence[torch.nn.Module], **ddp_overrides: Any) -> list[Any]:
    """Chunks in megatron-core DDP (buckets for the first only), hooks set as Megatron-LM does."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    config: Any = unwrap(model_chunks[0]).config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, **ddp_overrides)
    wrapped = [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0
        )
        for index, chunk in enumerate(model_chunks)
    ]
    for chunk in wrapped:
        chunk.broadcast_params()
    no_sync = [chunk.no_sync for chunk in wrapped]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if ddp_overrides.get("overlap_grad_reduce"):
        grad_sync = [chunk.start_grad_sync for chunk in wrapped]
        config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    if ddp_overrides.get("overlap_param_gather"):
        param_sync = [chunk.start_param_sync for chunk in wrapped]
        config.param_sync_func = param_sync[0] if len(param_sync) == 1 else param_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped
