#!/usr/bin/env python3
"""Seconds and peak bytes per micro-batch of each pipeline-stage kind, on one GPU, in bf16.

First and last pipeline stages are heavier than middle ones: the first holds the word embedding,
the last the final RMSNorm, the output layer (hidden -> vocab) and the cross-entropy over the
vocabulary. The planner needs those extra costs in units of "one transformer layer", so this
script times, with megatron-core's own modules (tensor-parallel size 1), for each model shape and
micro-batch size:

- ``embedding``: LanguageModelEmbedding (rope, so no learned positions), forward, and backward
  from a random upstream gradient of the output's shape;
- ``output_loss``: final RMSNorm + ColumnParallelLinear (hidden -> vocab, no bias, as GPTModel
  builds it) + vocab_parallel_cross_entropy, forward to the mean loss, backward from it (the
  input hidden state requires grad, as it would on a last stage that sends its gradient back);
- ``layer``: one TransformerLayer of get_gpt_layer_local_spec (RMSNorm, SwiGLU, no bias, rope),
  forward, and backward from a random upstream gradient: the reference unit, "a layer" = 1.0;
- ``layer_sdpa`` (an extra, not the reference): the same layer with its core attention swapped
  for torch's scaled_dot_product_attention (flash), because without Transformer Engine the local
  spec's DotProductAttention materialises the [b, heads, s, s] scores, which inflates "a layer"
  compared with a production (TE / flash) run; the ratios are also given against this layer.

Writes one JSON file (``--out``), rewritten after every case so a killed run keeps what it had.
A failure in one case is recorded (its traceback's last line) and the run goes on.

    python measure_stage_kinds.py --out $OUT/stage_kinds.json                 # H200, bf16
    python measure_stage_kinds.py --device cpu --tiny --out /tmp/kinds.json   # dry run

CUDA-only paths (not exercised by the CPU dry run): the nccl process group,
model_parallel_cuda_manual_seed and the CUDA RNG tracker's fork (CPU: megatron-core's no-op
tracker), GPU weight initialisation (use_cpu_initialization=False), RotaryEmbedding's own forward
(it moves to CUDA unconditionally; CPU rebuilds its output), DotProductAttention's score buffer
from megatron-core's global memory buffer (allocated on CUDA; CPU hands it a CPU tensor),
torch.cuda.Event timing, the peak-memory counters, and the flash kernel behind
scaled_dot_product_attention.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SEQ_LENGTH = 4096
MICRO_BATCH_SIZES = (1, 2)
CASES = ("layer", "embedding", "output_loss", "layer_sdpa")


@dataclass(frozen=True)
class Shape:
    """One model's dimensions; only these matter to the three stage kinds measured."""

    name: str
    hidden: int
    ffn: int
    heads: int
    query_groups: int
    vocab: int


SHAPES = (
    Shape("llama2-7b", hidden=4096, ffn=11008, heads=32, query_groups=32, vocab=32000),
    Shape("llama2-70b", hidden=8192, ffn=28672, heads=64, query_groups=8, vocab=32000),
    Shape("llama3-8b-128k-vocab", hidden=4096, ffn=14336, heads=32, query_groups=8, vocab=128256),
)
TINY_SHAPES = (Shape("tiny", hidden=64, ffn=128, heads=4, query_groups=2, vocab=1000),)
TINY_SEQ_LENGTH = 32


def log(message: str) -> None:
    """Progress goes to stdout at once: the device run is watched live and may be cut short."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    """A localhost port for the one-rank TCP store (a fixed one may be taken on a shared box)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_megatron(device: str, seed: int) -> None:
    """One-rank process group and megatron-core parallel state with every size 1.

    On CPU the CUDA RNG tracker cannot save or restore CUDA states, so the tracker is replaced by
    megatron-core's own no-op one (its inference tracker: ``add`` and ``fork`` do nothing); the
    local DotProductAttention forks the tracker around its dropout in every forward.
    """
    from megatron.core import parallel_state, tensor_parallel

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    torch.distributed.init_process_group(
        backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        tensor_parallel.get_cuda_rng_tracker().add("model-parallel-rng", seed + 2718)


def build_config(shape: Shape, device: str, dtype: torch.dtype) -> Any:
    """A LLaMA-style TransformerConfig: RMSNorm, SwiGLU, no biases, no dropout, one layer."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads,
        num_query_groups=shape.query_groups,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=device == "cpu",
        perform_initialization=True,
    )


class SdpaCoreAttention(torch.nn.Module):
    """Drop-in core attention using torch's fused SDPA (flash on an H200), causal, no dropout.

    Same call signature and tensor layout as megatron-core's DotProductAttention: q [s, b, np, hn],
    k/v [s, b, ng, hn], returns [s, b, np * hn]. Exists only for the ``layer_sdpa`` extra.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, **_: Any) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any
    ) -> torch.Tensor:
        """Causal attention; the explicit mask is ignored (is_causal says the same thing)."""
        s, b, heads, head_dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=heads != k.shape[1]
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * head_dim)


def build_layer(config: Any, sdpa: bool) -> torch.nn.Module:
    """One TransformerLayer from get_gpt_layer_local_spec, as GPTModel's TransformerBlock builds."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if sdpa:
        spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    return build_module(spec, config=config, layer_number=1)


def rotary_embedding(config: Any, seq: int, device: str) -> torch.Tensor:
    """RoPE frequencies as GPTModel computes them once per forward (cheap; kept out of timing)."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    rope_cls = rotary_pos_embedding.RotaryEmbedding

    rope = rope_cls(
        kv_channels=config.kv_channels,
        rotary_percent=1.0,
        rotary_base=10000,
        use_cpu_initialization=device == "cpu",
    )
    if device == "cuda":
        return rope(seq)
    # RotaryEmbedding.get_emb moves its frequencies to CUDA unconditionally; on CPU rebuild its
    # result from the same frequencies (rotary_interleaved is False).
    freqs = rope.get_freqs_non_repeated(seq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


Step = tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None], list[torch.Tensor]]


def make_layer_step(
    config: Any, shape: Shape, seq: int, mb: int, device: str, dtype: torch.dtype, sdpa: bool
) -> Step:
    """Forward/backward closures of one layer on a [s, b, h] input that requires grad."""
    layer = build_layer(config, sdpa).to(device)  # the local spec's torch norm is built on CPU
    if device == "cpu":
        # DotProductAttention takes its score buffer from megatron-core's global memory buffer,
        # which allocates on CUDA; hand it a CPU tensor big enough that it never reallocates.
        from megatron.core import parallel_state

        scores = mb * shape.heads * seq * seq
        buffers = parallel_state.get_global_memory_buffer().buffer
        buffers[("mpu", dtype)] = torch.empty(scores, dtype=dtype, device="cpu")
    rope = rotary_embedding(config, seq, device)
    # An explicit causal mask (True = masked): with None the local softmax builds one on "cuda".
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1)[None, None]
    hidden = torch.randn(seq, mb, shape.hidden, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(seq, mb, shape.hidden, device=device, dtype=dtype)

    def forward() -> torch.Tensor:
        out, _ = layer(hidden, attention_mask=mask, rotary_pos_emb=rope)
        return out

    def backward(out: torch.Tensor) -> None:
        out.backward(grad_out)

    return forward, backward, [*layer.parameters(), hidden]


def make_embedding_step(
    config: Any, shape: Shape, seq: int, mb: int, device: str, dtype: torch.dtype
) -> Step:
    """Forward/backward closures of the word embedding (rope: no position table)."""
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )

    embedding = LanguageModelEmbedding(
        config=config,
        vocab_size=shape.vocab,
        max_sequence_length=seq,
        position_embedding_type="rope",
    ).to(device)
    input_ids = torch.randint(0, shape.vocab, (mb, seq), device=device)
    position_ids = torch.arange(seq, device=device)[None].expand(mb, seq)
    grad_out = torch.randn(seq, mb, shape.hidden, device=device, dtype=dtype)

    def forward() -> torch.Tensor:
        return embedding(input_ids=input_ids, position_ids=position_ids)

    def backward(out: torch.Tensor) -> None:
        out.backward(grad_out)

    return forward, backward, list(embedding.parameters())


def make_output_loss_step(
    config: Any, shape: Shape, seq: int, mb: int, device: str, dtype: torch.dtype
) -> Step:
    """Final RMSNorm + output layer + vocab-parallel cross-entropy, as GPTModel's last stage."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norm = WrappedTorchNorm(config=config, hidden_size=shape.hidden, eps=config.layernorm_epsilon)
    norm = norm.to(device=device, dtype=dtype)
    output_layer = tensor_parallel.ColumnParallelLinear(
        shape.hidden,
        shape.vocab,
        config=config,
        init_method=config.init_method,
        bias=False,
        skip_bias_add=False,
        gather_output=False,
    )
    hidden = torch.randn(seq, mb, shape.hidden, device=device, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, shape.vocab, (mb, seq), device=device)

    def forward() -> torch.Tensor:
        logits, _ = output_layer(norm(hidden))
        # GPTModel.compute_language_model_loss: labels [b, s] -> [s, b]; loss back to [b, s].
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.t().contiguous())
        return loss.t().contiguous().float().mean()

    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    return forward, backward, [*norm.parameters(), *output_layer.parameters(), hidden]


@contextlib.contextmanager
def cpu_timer(times: list[float]) -> Iterator[None]:
    """Wall time of a CPU block (CPU kernels run synchronously, so this is the op's time)."""
    start = time.perf_counter()
    yield
    times.append(time.perf_counter() - start)


def time_step(step: Step, device: str, warmup: int, iters: int) -> dict[str, Any]:
    """Median forward and backward seconds over ``iters`` after ``warmup``, and peak bytes.

    Gradients are dropped before every iteration (outside the timed region) so each backward
    allocates fresh ones, as the first micro-batch of a step does.
    """
    forward, backward, tensors = step
    fwd_s: list[float] = []
    bwd_s: list[float] = []
    events: list[tuple[Any, Any, Any]] = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if device == "cuda" else None
    for i in range(warmup + iters):
        for tensor in tensors:
            tensor.grad = None
        if device == "cuda":
            start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record()
            out = forward()
            mid.record()
            backward(out)
            end.record()
            if i >= warmup:
                events.append((start, mid, end))
        else:
            fwd: list[float] = []
            bwd: list[float] = []
            with cpu_timer(fwd):
                out = forward()
            with cpu_timer(bwd):
                backward(out)
            if i >= warmup:
                fwd_s += fwd
                bwd_s += bwd
        del out
    if device == "cuda":
        torch.cuda.synchronize()
        fwd_s = [s.elapsed_time(m) / 1e3 for s, m, _ in events]
        bwd_s = [m.elapsed_time(e) / 1e3 for _, m, e in events]
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return {
        "forward_s": statistics.median(fwd_s),
        "backward_s": statistics.median(bwd_s),
        "forward_s_all": fwd_s,
        "backward_s_all": bwd_s,
        "peak_bytes": peak,
        "baseline_bytes": baseline,
        "peak_above_baseline_bytes": None if baseline is None else peak - baseline,
    }


def count_params(tensors: list[torch.Tensor]) -> int:
    """Parameters only (the step's input activation, also listed for its grad, is not one)."""
    return sum(t.numel() for t in tensors if isinstance(t, torch.nn.Parameter))


def make_step(
    case: str, config: Any, shape: Shape, seq: int, mb: int, device: str, dtype: torch.dtype
) -> Step:
    """The closures for one case name."""
    if case == "embedding":
        return make_embedding_step(config, shape, seq, mb, device, dtype)
    if case == "output_loss":
        return make_output_loss_step(config, shape, seq, mb, device, dtype)
    return make_layer_step(config, shape, seq, mb, device, dtype, sdpa=case == "layer_sdpa")


def release(device: str) -> None:
    """Free the previous case's modules and megatron-core's attention-score buffer (kept
    globally between forwards) so one case's peak does not carry over into the next."""
    from megatron.core import parallel_state

    parallel_state.get_global_memory_buffer().buffer.clear()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure_case(
    case: str, shape: Shape, seq: int, mb: int, device: str, dtype: torch.dtype, args: Any
) -> dict[str, Any]:
    """One row of results; a failure becomes an ``error`` field instead of ending the run."""
    row: dict[str, Any] = {"shape": shape.name, "micro_batch": mb, "case": case, "error": None}
    start = time.perf_counter()
    try:
        config = build_config(shape, device, dtype)
        step = make_step(case, config, shape, seq, mb, device, dtype)
        row["num_params"] = count_params(step[2])
        row.update(time_step(step, device, args.warmup, args.iters))
        del step
    except Exception as exc:  # a failed case is data; the next one runs
        last = traceback.format_exc().strip().splitlines()[-1]
        row["error"] = last or repr(exc)
        log(f"  FAILED {shape.name} mb={mb} {case}: {row['error']}")
    row["case_wall_s"] = time.perf_counter() - start
    return row


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Embedding / layer and (output + loss) / layer, forward and forward + backward."""
    ok = {(r["shape"], r["micro_batch"], r["case"]): r for r in rows if r.get("forward_s")}
    out = []
    for shape, mb in sorted({(r["shape"], r["micro_batch"]) for r in rows}):
        entry: dict[str, Any] = {"shape": shape, "micro_batch": mb}
        for ref in ("layer", "layer_sdpa"):
            layer = ok.get((shape, mb, ref))
            for case in ("embedding", "output_loss"):
                row = ok.get((shape, mb, case))
                fwd = fb = None
                if layer and row:
                    fwd = row["forward_s"] / layer["forward_s"]
                    fb = (row["forward_s"] + row["backward_s"]) / (
                        layer["forward_s"] + layer["backward_s"]
                    )
                suffix = "" if ref == "layer" else "_vs_sdpa_layer"
                entry[f"{case}_per_layer_fwd{suffix}"] = fwd
                entry[f"{case}_per_layer_fwd_bwd{suffix}"] = fb
        out.append(entry)
    return out


def environment(device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Versions and device, so the numbers can be told apart from another machine's."""
    import megatron.core

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "megatron_core": getattr(megatron.core, "__version__", "unknown"),
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor(),
        "dtype": str(dtype).removeprefix("torch."),
        "hostname": socket.gethostname(),
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Atomic rewrite: a run killed at its time limit still leaves a readable file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp_", suffix=".json")
    with os.fdopen(fd, "w") as handle:
        json.dump(payload, handle, indent=1)
    os.replace(tmp, path)


def parse_args() -> argparse.Namespace:
    """Command line; ``--device cpu --tiny`` is the dry run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="hidden 64, vocab 1000, seq 32")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="cuda: bf16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=120.0, help="skip cases after this")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    t0 = time.perf_counter()
    device = args.device
    dtype_name = args.dtype or ("bf16" if device == "cuda" else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    shapes = TINY_SHAPES if args.tiny else SHAPES
    seq = TINY_SEQ_LENGTH if args.tiny else SEQ_LENGTH
    payload: dict[str, Any] = {
        "script": "measure_stage_kinds.py",
        "argv": sys.argv[1:],
        "settings": {
            "seq_length": seq,
            "micro_batch_sizes": list(MICRO_BATCH_SIZES),
            "warmup": args.warmup,
            "iters": args.iters,
            "tensor_parallel": 1,
            "timing": "cuda events, median" if device == "cuda" else "perf_counter, median",
            "shapes": [asdict(s) for s in shapes],
            "notes": (
                "layer = get_gpt_layer_local_spec (no TE: unfused DotProductAttention, torch "
                "RMSNorm, core fusion defaults off); layer_sdpa = same with torch SDPA "
                "attention; output_loss = final RMSNorm + output layer + "
                "vocab_parallel_cross_entropy + mean; peak_bytes absolute, baseline_bytes = "
                "allocated before the first iteration (weights + inputs)"
            ),
        },
        "results": [],
        "ratios": [],
        "errors": [],
    }
    try:
        init_megatron(device, args.seed)
        payload["env"] = environment(device, dtype)
    except Exception:  # recorded in the JSON, then exit 1
        payload["errors"].append("init: " + traceback.format_exc().strip().splitlines()[-1])
        write_json(args.out, payload)
        log(f"init failed: {payload['errors'][-1]}")
        return 1
    log(f"env {payload['env']}")
    write_json(args.out, payload)
    for shape in shapes:
        for case in CASES:
            for mb in MICRO_BATCH_SIZES:
                if time.perf_counter() - t0 > args.budget_s:
                    row = {"shape": shape.name, "micro_batch": mb, "case": case}
                    row["error"] = "skipped: time budget spent"
                    payload["results"].append(row)
                    continue
                row = measure_case(case, shape, seq, mb, device, dtype, args)
                release(device)  # here, once the case's frames (and any traceback) are gone
                payload["results"].append(row)
                if row["error"] is None:
                    peak = row["peak_bytes"]
                    peak_txt = f" peak {peak / 2**30:.2f} GiB" if peak is not None else ""
                    log(
                        f"{shape.name:22s} mb={mb} {case:12s} fwd {row['forward_s'] * 1e3:8.2f} ms"
                        f" bwd {row['backward_s'] * 1e3:8.2f} ms{peak_txt}"
                    )
                payload["ratios"] = ratios(payload["results"])
                payload["wall_s"] = time.perf_counter() - t0
                write_json(args.out, payload)
    payload["errors"] += [
        f"{r['shape']} mb={r['micro_batch']} {r['case']}: {r['error']}"
        for r in payload["results"]
        if r["error"]
    ]
    payload["wall_s"] = time.perf_counter() - t0
    write_json(args.out, payload)
    for entry in payload["ratios"]:
        log(json.dumps(entry))
    log(f"done in {payload['wall_s']:.1f} s, {len(payload['errors'])} errors -> {args.out}")
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
