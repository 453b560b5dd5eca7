"""Model presets for ``bfpp-train`` and a split-independent initialisation.

* :func:`transformer_config` - a megatron-core ``TransformerConfig`` for the ``gpt`` or ``llama``
  preset (fp32, dropout 0, no fused kernels, so it runs on CPU and GPU alike).
  ``gpt``: LayerNorm, GELU, learned absolute positions, biases, tied embeddings.
  ``llama``: RMSNorm, SwiGLU, RoPE, no biases, untied embeddings, grouped-query attention
  (``num_query_groups``).
* :func:`build_model_chunks` - this rank's ``GPTModel`` chunks, one per virtual stage
  (megatron-core's looped placement, ``vp_stage``), built from megatron-core's local layer spec.
* :func:`init_by_global_names` - every parameter is drawn at its full unsplit shape from a
  generator seeded by its *global* name (global layer number), then this rank's tensor-parallel
  slice is taken: any (tp, pp, vp, dp) layout holds the same model, so schedules and layouts can be
  compared loss for loss.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "PRESETS",
    "ModelShape",
    "build_model_chunks",
    "default_ffn_hidden_size",
    "global_param_names",
    "init_by_global_names",
    "transformer_config",
    "unwrap",
]

PRESETS = ("gpt", "llama")
INIT_STD = 0.02
_LAYER_PREFIX = re.compile(r"^(.*\.)(\d+)$")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the user chose about the model (flags), independent of the parallel layout."""

    preset: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None
    ffn_hidden_size: int | None
    seq_length: int
    vocab_size: int

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or default_ffn_hidden_size(self.preset, self.hidden_size)


def default_ffn_hidden_size(preset: str, hidden_size: int) -> int:
    """GPT: 4h. LLaMA: 8h/3 rounded up to a multiple of 16 (SwiGLU keeps the parameter count)."""
    if preset == "llama":
        return -(-(8 * hidden_size // 3) // 16) * 16
    return 4 * hidden_size


def transformer_config(shape: ModelShape, *, tp: int, pp: int, vp: int | None, on_cpu: bool) -> Any:
    """The megatron-core ``TransformerConfig`` of ``shape`` for a parallel layout."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    fields: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        ffn_hidden_size=shape.ffn,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=INIT_STD,
        perform_initialization=False,  # init_by_global_names fills every parameter
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        fp16=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        sequence_parallel=False,
        # gloo: batched p2p gives wrong gradients at pp=2 with looping (see testing/cpu.py)
        batch_p2p_comm=not on_cpu,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
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
        raise ValueError(f"unknown model preset {shape.preset!r} (choose from {PRESETS})")
    return TransformerConfig(**fields)


def build_model_chunks(config: Any, shape: ModelShape, *, seed: int) -> list[Any]:
    """This rank's ``GPTModel`` chunks, one per virtual stage (chunk ``c`` of pipeline rank ``r``
    is global stage ``c * pp + r``), initialised by :func:`init_by_global_names`."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    llama = shape.preset == "llama"
    spec = get_gpt_layer_local_spec(normalization="RMSNorm" if llama else "LayerNorm")
    vp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for chunk in range(vp or 1):
        vp_stage = chunk if vp is not None else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=shape.vocab_size,
            max_sequence_length=shape.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            share_embeddings_and_output_weights=not llama,
            position_embedding_type="rope" if llama else "learned_absolute",
            vp_stage=vp_stage,
        )
        if torch.cuda.is_available():  # built on the CPU (use_cpu_initialization), then moved
            model.cuda(torch.cuda.current_device())
        init_by_global_names(model, seed=seed)
        chunks.append(model)
    return chunks


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    from megatron.core.models.gpt import GPTModel

    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module  # type: ignore[assignment]
    return model


def global_param_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> global name (``decoder.layers.<global layer index>``; a tied output
    weight on a stage without the embedding is named after the embedding it duplicates)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    module = unwrap(model)
    layer_prefix: dict[str, str] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, TransformerLayer):
            match = _LAYER_PREFIX.match(name)
            assert match, name
            layer_prefix[name + "."] = f"{match.group(1)}{sub.layer_number - 1}."
    tied = getattr(module, "share_embeddings_and_output_weights", False)
    names = {}
    for name, _ in module.named_parameters():
        global_name = name
        for local, global_ in layer_prefix.items():
            if name.startswith(local):
                global_name = global_ + name[len(local) :]
                break
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


@torch.no_grad()
def init_by_global_names(
    model: torch.nn.Module,
    *,
    seed: int,
    draw: Callable[[str, Sequence[int], int], torch.Tensor] | None = None,
) -> None:
    """Fill every parameter deterministically from its global name (see the module docstring):
    matrices and embeddings ~ N(0, 0.02), biases 0, norm weights 1. ``draw(global_name,
    full_shape, seed)`` replaces that distribution (tests randomise biases and norms too)."""
    draw = draw or _draw
    from megatron.core import parallel_state

    module = unwrap(model)
    names = global_param_names(module)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for name, param in module.named_parameters():
        if getattr(param, "tensor_model_parallel", False):
            dim = int(getattr(param, "partition_dim"))  # noqa: B009 (set by megatron-core)
            stride = int(getattr(param, "partition_stride", 1))
            full_shape = list(param.shape)
            full_shape[dim] *= tp_size
            full = draw(names[name], full_shape, seed)
            pieces = torch.chunk(full, tp_size * stride, dim=dim)
            local = torch.cat(pieces[tp_rank::tp_size], dim=dim)
        else:
            local = draw(names[name], param.shape, seed)
        param.copy_(local.to(device=param.device, dtype=param.dtype))
