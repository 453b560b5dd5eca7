"""The models and GPUs the planner knows by name (the papers' shapes and hardware figures,
sources in docs/planner.md, "Presets"), and the precision a run trains in."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_bfpp.config.run_config import ModelShape, default_ffn_hidden_size
from megatron_bfpp.ir import ScheduleError, check_positive

__all__ = [
    "BF16_MIXED",
    "FFN_DEFAULTS",
    "FP32",
    "GPUS",
    "MODELS",
    "Gpu",
    "Model",
    "Precision",
    "get_gpu",
    "get_model",
    "model_description",
    "model_from_shape",
    "moe_layers_per_stage",
    "padded_vocab_size",
]

GiB = 2**30


@dataclass(frozen=True, slots=True)
class Model:
    """A transformer to plan for: ``gpt`` (LayerNorm, GeLU, biases, learned positions, tied
    embeddings) or ``llama`` (RMSNorm, SwiGLU, RoPE, untied output, GQA); ``dropout``: whether
    activations hold dropout masks. Mixture-of-Experts in Megatron-LM's names (``num_experts`` 0:
    dense; ``moe_layer_freq``: every n-th layer, or a 0/1 per layer); ``ffn_hidden_size`` is the
    dense layers'."""

    name: str
    arch: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    seq_length: int
    vocab_size: int
    dropout: bool
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_layer_freq: int | tuple[int, ...] = 1
    # Megatron-LM's --mtp-num-layers: multi-token prediction layers after the last stage's
    # decoder, each a layer of the decoder's last kind with its own output layer pass and loss
    mtp_num_layers: int = 0

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Which layers are MoE, as megatron-core reads ``--moe-layer-freq``."""
        freq, n = self.moe_layer_freq, self.num_layers
        if not self.num_experts:
            return (False,) * n
        if isinstance(freq, int):
            return tuple(i % freq == 0 for i in range(n))
        return tuple(map(bool, freq))

    def shape(self, *, tp: int) -> ModelShape:
        """bfpp-train's ``ModelShape`` with the vocabulary padded as Megatron pads it for ``tp``,
        so that ``config.model_memory`` counts the parameters megatron-core builds."""
        return ModelShape(
            self.arch,
            self.num_layers,
            self.hidden_size,
            self.num_attention_heads,
            self.num_query_groups,
            self.ffn_hidden_size,
            self.seq_length,
            padded_vocab_size(self.vocab_size, tp=tp),
        )

    def with_seq_length(self, seq_length: int) -> Model:
        return dataclasses.replace(self, seq_length=seq_length)

    def with_mtp(self, mtp_num_layers: int) -> Model:
        if isinstance(mtp_num_layers, bool) or mtp_num_layers < 0:
            raise ScheduleError(f"--mtp-num-layers must be 0 or more, got {mtp_num_layers!r}")
        return dataclasses.replace(self, mtp_num_layers=mtp_num_layers)


def moe_layers_per_stage(
    model: Model, stages: int, stage_layers: Sequence[int] = ()
) -> tuple[int, ...]:
    """MoE layers on each of ``stages`` global stages (model order), for costs and memory: equal
    stages, or ``stage_layers`` layers each (uneven stages)."""
    flags = model.moe_layers
    counts = stage_layers or (model.num_layers // stages,) * stages
    ends = list(itertools.accumulate(counts))
    return tuple(sum(flags[end - n : end]) for n, end in zip(counts, ends, strict=True))


def padded_vocab_size(vocab_size: int, *, tp: int) -> int:
    """Megatron-LM's ``--make-vocab-size-divisible-by 128``, times tp (its default)."""
    multiple = 128 * tp
    return -(-vocab_size // multiple) * multiple


def _gpt(name: str, layers: int, hidden: int, heads: int) -> Model:
    return Model(name, "gpt", layers, hidden, heads, heads, 4 * hidden, 2048, 50257, True)


def _llama(
    name: str, layers: int, hidden: int, heads: int, groups: int, ffn: int, seq: int
) -> Model:
    return Model(name, "llama", layers, hidden, heads, groups, ffn, seq, 32000, False)


_DSV3 = (256, 8, 2048, 2048, (0,) * 3 + (1,) * 58)  # experts, top-k, their FFN, shared, layers
MODELS: dict[str, Model] = {
    m.name: m
    for m in (
        _gpt("gpt3-6.7b", 32, 4096, 32),
        _gpt("gpt3-52b", 64, 8192, 64),
        _gpt("gpt3-96b", 80, 9984, 104),
        _gpt("gpt3-175b", 96, 12288, 96),
        _llama("llama-7b", 32, 4096, 32, 32, 11008, 2048),
        _llama("llama-13b", 40, 5120, 40, 40, 13824, 2048),
        _llama("llama-65b", 80, 8192, 64, 64, 22016, 2048),
        _llama("llama-70b", 80, 8192, 64, 8, 28672, 4096),
        # Mixture-of-Experts (docs/planner.md, "Mixture of Experts"): Mixtral 8x7B; DeepSeek-V3's
        # shape with its MLA attention planned as standard attention, its first 3 layers dense;
        # Qwen3-30B-A3B's with head size h/a (its heads are 128 wide: 4096 > h).
        Model("mixtral-8x7b", "llama", 32, 4096, 32, 8, 14336, 4096, 32000, False, 8, 2, 14336),
        Model("deepseek-v3", "llama", 61, 7168, 128, 128, 18432, 4096, 129280, False, *_DSV3),
        Model("qwen3-30b-a3b", "llama", 48, 2048, 32, 4, 6144, 4096, 151936, False, 128, 8, 768),
    )
}


def get_model(name: str) -> Model:
    try:
        return MODELS[name]
    except KeyError:
        raise ScheduleError(
            f"unknown model {name!r}; choose one of {', '.join(MODELS)} or give its shape "
            "(--num-layers, --hidden-size, --num-attention-heads, ...)"
        ) from None


def model_from_shape(
    *,
    arch: str,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    seq_length: int,
    vocab_size: int,
    num_query_groups: int | None = None,
    ffn_hidden_size: int | None = None,
    dropout: bool | None = None,
    moe: Mapping[str, Any] | None = None,
    mtp_num_layers: int | None = None,
) -> Model:
    """A model by its shape; defaults as Megatron's (ffn: ``default_ffn_hidden_size``; a group per
    head; dropout for GPT only; ``moe``: ``Model``'s MoE fields, None unset, expert FFN = dense;
    ``mtp_num_layers``: Megatron-LM's --mtp-num-layers, None or 0 none)."""
    if arch not in ("gpt", "llama"):
        raise ScheduleError(f"model architecture must be gpt or llama, got {arch!r}")
    named = {
        "--num-layers": num_layers,
        "--hidden-size": hidden_size,
        "--num-attention-heads": num_attention_heads,
        "--seq-length": seq_length,
        "--vocab-size": vocab_size,
    }
    check_positive(named)
    if hidden_size % num_attention_heads:
        raise ScheduleError(
            f"--hidden-size {hidden_size} is not divisible by --num-attention-heads "
            f"{num_attention_heads}"
        )
    groups = num_query_groups or num_attention_heads
    if num_attention_heads % groups:
        raise ScheduleError(
            f"--num-attention-heads {num_attention_heads} is not divisible by "
            f"--num-query-groups {groups}"
        )
    ffn = default_ffn_hidden_size(arch, hidden_size) if ffn_hidden_size is None else ffn_hidden_size
    name, heads = f"{arch}-{num_layers}x{hidden_size}", num_attention_heads
    dropout = arch == "gpt" if dropout is None else dropout
    given = {key: value for key, value in (moe or {}).items() if value is not None}
    dense = Model(
        name, arch, num_layers, hidden_size, heads, groups, ffn, seq_length, vocab_size, dropout
    ).with_mtp(mtp_num_layers or 0)
    return _with_moe(dense, given) if given.get("num_experts") else dense


def _with_moe(model: Model, given: Mapping[str, Any]) -> Model:
    """``model`` with experts, checked as megatron-core's TransformerConfig checks them."""
    moe = dataclasses.replace(model, **{"moe_ffn_hidden_size": model.ffn_hidden_size, **given})
    experts, topk, freq = moe.num_experts, moe.moe_router_topk, moe.moe_layer_freq
    sizes = (moe.moe_ffn_hidden_size, experts, topk, moe.moe_shared_expert_intermediate_size + 1)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes) or topk > experts:
        raise ScheduleError(
            f"--num-experts {experts}, --moe-router-topk {topk}, --moe-ffn-hidden-size "
            f"{moe.moe_ffn_hidden_size}: give positive sizes with top-k at most the experts"
        )
    pattern = isinstance(freq, tuple) and len(freq) == moe.num_layers and set(freq) <= {0, 1}
    if not pattern and not (isinstance(freq, int) and 1 <= freq <= moe.num_layers):
        raise ScheduleError(
            f"--moe-layer-freq must be an integer from 1 to --num-layers or a 0/1 per layer "
            f"({moe.num_layers}), got {freq!r}"
        )
    return moe


# Whose FFN size a model gets when the front end leaves it unset: Megatron-LM's validate_args
# (SwiGLU: 2/3 of 4h rounded down to 64), megatron-core's TransformerConfig (4h whatever the MLP:
# what Megatron-Bridge's config builds) or bfpp-train's presets (``default_ffn_hidden_size``).
FFN_DEFAULTS = ("megatron-lm", "megatron-core", "bfpp-train")


def _default_ffn(rule: str, *, gated: bool, hidden_size: int) -> int:
    if rule == "megatron-lm":
        return int((4 * hidden_size * 2 / 3) / 64) * 64 if gated else 4 * hidden_size
    if rule == "megatron-core":
        return 4 * hidden_size
    if rule == "bfpp-train":
        return default_ffn_hidden_size("llama" if gated else "gpt", hidden_size)
    raise ScheduleError(f"FFN default must be one of {', '.join(FFN_DEFAULTS)}, got {rule!r}")


def model_description(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    seq_length: int,
    gated: bool,
    ffn_default: str,
    ffn_hidden_size: int | None = None,
    num_query_groups: int | None = None,
    vocab_size: int | None = None,
    dropout: bool | None = None,
    moe: Mapping[str, Any] | None = None,
    mtp_num_layers: int | None = None,
) -> Model:
    """The planner's model of what a front end builds, the one translation every front end calls.
    ``gated``: a SwiGLU MLP, planned as llama (default vocabulary 32000, else GPT-2's 50257)."""
    ffn = ffn_hidden_size or _default_ffn(ffn_default, gated=gated, hidden_size=hidden_size)
    return model_from_shape(
        arch="llama" if gated else "gpt",
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        ffn_hidden_size=ffn,
        seq_length=seq_length,
        vocab_size=vocab_size or (32000 if gated else 50257),
        dropout=dropout,
        moe=moe,
        mtp_num_layers=mtp_num_layers,
    )


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU model in its usual 8-GPU server; bandwidths per GPU and direction in bytes/s (NVLink,
    its InfiniBand share); ``max_efficiency``, ``layer_overhead_s``: ``costs.BuiltinCurve``'s."""

    name: str
    peak_flops: float  # dense fp16/bf16 tensor-core FLOP/s
    memory_bytes: int
    hbm_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    max_efficiency: float
    layer_overhead_s: float
    dtype: str  # the 16-bit format it trains in


GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        # V100 SXM2 32GB in a DGX-1 (the breadth-first paper's cluster): 125 TFLOP/s fp16, NVLink2
        # 300 GB/s per GPU both directions, 4 x 100 Gb/s EDR InfiniBand per 8 GPUs.
        Gpu("v100-32gb", 125e12, 32 * GiB, 900e9, 150e9, 6.25e9, 0.70, 1.0e-3, "fp16"),
        # A100 SXM4 in a DGX A100: 312 TFLOP/s bf16, NVLink3 600 GB/s, 8 x 200 Gb/s HDR.
        Gpu("a100-40gb", 312e12, 40 * GiB, 1555e9, 300e9, 25e9, 0.68, 1.0e-3, "bf16"),
        Gpu("a100-80gb", 312e12, 80 * GiB, 2039e9, 300e9, 25e9, 0.68, 1.0e-3, "bf16"),
        # H100 SXM5 in a DGX H100: 989 TFLOP/s bf16 dense, NVLink4 900 GB/s, 8 x 400 Gb/s NDR.
        Gpu("h100-80gb", 989e12, 80 * GiB, 3350e9, 450e9, 50e9, 0.60, 1.0e-3, "bf16"),
    )
}


def get_gpu(name: str) -> Gpu:
    try:
        return GPUS[name]
    except KeyError:
        raise ScheduleError(f"unknown GPU {name!r}; choose one of {', '.join(GPUS)}") from None


@dataclass(frozen=True, slots=True)
class Precision:
    """Bytes per element of what a rank keeps: weights, their gradients, the optimizer's state per
    parameter (Adam's moments, plus an fp32 master copy of 16-bit weights), activations."""

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int


# Megatron-LM with --bf16/--fp16: 16-bit weights, fp32 gradient accumulation and reduction
# (--accumulate-allreduce-grads-in-fp32, on by default with bf16), fp32 master weights and moments.
BF16_MIXED = Precision("bf16-mixed", 2, 4, 12, 2)
# bfpp-train and the CPU tests: fp32 weights are the optimizer's own, so only the moments count.
FP32 = Precision("fp32", 4, 4, 8, 4)
