"""One MoE pipeline stage: megatron-core's combined 1F1B (overlapped F&B) against F then B.

DualPipe's core idea is to run micro-batch i's forward together with micro-batch j's backward on
one stage, so that each one's expert-parallel all-to-all hides under the other's compute.
megatron-core 0.19.2 ships this as "combined 1F1B" (pipeline_parallel/combined_1f1b.py,
models/common/model_chunk_schedule_plan.py, GPTModel.build_schedule_plan). This script measures,
on ONE device with expert parallelism 1 (so the all-to-all moves nothing across devices), what
that path costs or saves against the plain sequence, and whether it computes the same numbers.

Cases (each timed on the part named "timed"; setup/teardown run untimed around it):
  plain_pair      F(mb1) then B(mb0), the plain way (forward, loss, torch.autograd.backward).
  combined_pair   the same pair through combined_1f1b.combined_forward_backward_step, which runs
                  TransformerModelChunkSchedulePlan.run over the two schedule plans.
  forward_only    F(mb1) alone (forward + loss).
  backward_only   B(mb0) alone.
  two_stream_pair F(mb1) on a side CUDA stream while B(mb0) runs on the current stream
                  (the manual fallback; always measured).
  check           one full iteration F0,F1,B0,B1 plain vs combined: losses and max |grad diff|.

It imports megatron-core and torch only, so it runs on a GPU machine's own torch as it is.
``--mixtral`` uses Mixtral 8x7B-shaped layers (hidden 4096, expert FFN 14336) instead of the small
default (hidden 2048, expert FFN 1408).
At EP 1 megatron's all-to-all returns its input, and the combined path then frees its own
dispatch output; --ep1-a2a copy (default) makes it a local copy in every case (see
make_ep1_all_to_all_copy); --ep1-a2a identity keeps the stock behaviour to show the failure.

Paths that truly need CUDA, so ``--device cpu --tiny`` (1 warm-up, 2 timed) does not really run:
  * real CUDA streams/events: on CPU, install_cpu_stream_shim collapses them to program order,
    so combined_pair, two_stream_pair and check's combined half run their Python (wiring, loss
    node, gradients) but their times mean nothing and nothing overlaps;
  * CUDA-event timing and peak-memory statistics; model_parallel_cuda_manual_seed; NCCL;
  * megatron code that places tensors on torch.cuda.current_device() (RoPE, the local
    attention's buffer): patched to return "cpu" on the dry run only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

T0 = time.perf_counter()
#: Stop starting new measurements after this many seconds (the GPU run must end under 150 s).
DEADLINE_S = 115.0


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Model and batch sizes of one run; FULL is the measured chunk, TINY the CPU dry run."""

    hidden: int
    ffn: int
    experts: int
    topk: int
    heads: int
    seq: int
    vocab: int
    layers: int = 2
    micro_batch: int = 1


FULL = Shapes(hidden=2048, ffn=1408, experts=8, topk=2, heads=16, seq=4096, vocab=32000)
MIXTRAL = Shapes(hidden=4096, ffn=14336, experts=8, topk=2, heads=32, seq=4096, vocab=32000)
TINY = Shapes(hidden=64, ffn=32, experts=4, topk=2, heads=4, seq=32, vocab=1000)


def log(msg: str) -> None:
    """Print a progress line at once, so a killed run still shows how far it got."""
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def last_line(exc: BaseException) -> dict[str, str]:
    """The traceback's last line and innermost frame: enough to see why, small enough for JSON."""
    lines = traceback.format_exception(exc)
    frames = [ln.strip().splitlines()[0] for ln in lines if ln.strip().startswith("File ")]
    ours = [f for f in frames if "/torch/" not in f]
    return {
        "error": lines[-1].strip(),
        "where": frames[-1] if frames else "",
        "where_outside_torch": ours[-1] if ours else "",
    }


def write_json(path: str, result: dict[str, Any]) -> None:
    """Write the result atomically; called after every case so a timeout still leaves data."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    os.replace(tmp, path)


def free_port() -> int:
    """A free localhost TCP port for the one-rank store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(device: str, notes: list[str]) -> None:
    """One-rank process group plus parallel_state with every size 1, as megatron-core requires."""
    from megatron.core import parallel_state, tensor_parallel

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    torch.distributed.init_process_group(
        backend="nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        world_size=1,
        rank=0,
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=1,
    )
    torch.manual_seed(1234)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        return
    # CPU: the attention calls get_cuda_rng_tracker().fork(), which reads the CUDA RNG state.
    # Register the state by hand and make fork a no-op context (dropout is 0, so no RNG is drawn).
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.states_["model-parallel-rng"] = torch.get_rng_state()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    notes.append("cpu: CUDA RNG tracker state added by hand and its fork() made a no-op")
    # RoPE's get_emb and the local attention's global memory buffer place tensors on
    # torch.cuda.current_device(); on the CPU dry run that device is the CPU.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    notes.append("cpu: torch.cuda.current_device patched to return 'cpu'")
    install_cpu_stream_shim(notes)


class _FakeEvent:
    """CPU stand-in for torch.cuda.Event: one stream, so every wait is already satisfied."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        """Nothing to record on the one CPU 'stream'."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for on the one CPU 'stream'."""

    def synchronize(self) -> None:
        """CPU work is already done when the call returns."""

    def query(self) -> bool:
        """Always complete."""
        return True


class _FakeStream:
    """CPU stand-in for torch.cuda.Stream: all work runs in program order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        """Program order already orders everything."""

    def wait_event(self, event: Any) -> None:
        """Program order already orders everything."""

    def record_event(self, event: Any = None) -> _FakeEvent:
        """An event that is always complete."""
        return _FakeEvent()

    def synchronize(self) -> None:
        """CPU work is already done when the call returns."""


def install_cpu_stream_shim(notes: list[str]) -> None:
    """Dry run only: single-stream stand-ins so the combined path's Python runs on CPU.

    The combined 1F1B path and the two-stream case place work with torch.cuda.Stream/Event and
    Tensor.record_stream. On CPU all of it collapses to program order; this checks the wiring
    (arguments, loss node, gradients) before the one GPU run, and times nothing meaningful.
    """
    current = _FakeStream()
    torch.cuda.Stream = _FakeStream  # type: ignore[misc,assignment]
    torch.cuda.Event = _FakeEvent  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda *a, **k: current  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign]
    notes.append("cpu: CUDA Stream/Event/stream()/record_stream replaced by single-stream shims")


def make_ep1_all_to_all_copy(notes: list[str]) -> None:
    """At EP 1 make megatron's all-to-all return a fresh copy instead of its own input.

    _AllToAll returns its input unchanged on a one-rank group. The combined path frees the
    input storage of its moe_dispatch node after forward (should_free_input assumes the a2a
    wrote a new buffer, as it does at EP > 1), so at EP 1 it frees its own output and the next
    node fails ("storage of size 0"). A local copy is what a real one-rank all-to-all does; it
    is applied to every case, so the plain and combined paths do the same work.
    """
    from megatron.core.tensor_parallel.mappings import _AllToAll

    original = _AllToAll.forward

    def forward(ctx: Any, group: Any, input_: torch.Tensor, *args: Any) -> torch.Tensor:
        out = original(ctx, group, input_, *args)
        return out.clone() if out is input_ else out

    _AllToAll.forward = staticmethod(forward)  # type: ignore[method-assign]
    notes.append(
        "EP 1: megatron _AllToAll patched to return a copy (identity at EP 1 makes the combined "
        "path free its own dispatch output); applied to all cases"
    )


def build_config(shapes: Shapes, device: str, notes: list[str]) -> Any:
    """TransformerConfig for a bf16 MoE chunk; overlap flag is forced on later (EP is 1)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    common: dict[str, Any] = dict(
        num_layers=shapes.layers,
        hidden_size=shapes.hidden,
        num_attention_heads=shapes.heads,
        num_moe_experts=shapes.experts,
        moe_router_topk=shapes.topk,
        moe_ffn_hidden_size=shapes.ffn,
        ffn_hidden_size=shapes.ffn,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=device != "cuda",
        add_bias_linear=False,
    )
    try:
        cfg = TransformerConfig(overlap_moe_expert_parallel_comm=True, **common)
        notes.append("config accepted overlap_moe_expert_parallel_comm=True at EP 1")
        return cfg
    except Exception as exc:  # expected: the EP>1 check refuses it
        notes.append(
            "TransformerConfig refused overlap_moe_expert_parallel_comm=True at EP 1 "
            f"({last_line(exc)['error']}); built with False, set True after with object.__setattr__"
        )
    cfg = TransformerConfig(overlap_moe_expert_parallel_comm=False, **common)
    object.__setattr__(cfg, "overlap_moe_expert_parallel_comm", True)
    return cfg


def build_model(config: Any, shapes: Shapes, device: str) -> torch.nn.Module:
    """GPTModel chunk with pre and post process, local (non-TE) MoE layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(num_experts=shapes.experts, moe_grouped_gemm=False)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shapes.vocab,
        max_sequence_length=shapes.seq,
        pre_process=True,
        post_process=True,
        position_embedding_type="rope",
    )
    # bf16 everywhere, as megatron's Float16Module does (module.bfloat16()); learned position
    # embeddings are created in fp32 otherwise. We skip the wrapper: the combined path unwraps it.
    return model.to(device=device, dtype=torch.bfloat16).train()


def make_batch(shapes: Shapes, device: str, seed: int) -> dict[str, torch.Tensor | None]:
    """Random tokens; labels are the next token so the loss is an ordinary LM loss."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shapes.vocab, (shapes.micro_batch, shapes.seq + 1), generator=gen)
    pos = torch.arange(shapes.seq).unsqueeze(0).expand(shapes.micro_batch, -1)
    mask = torch.triu(torch.ones(shapes.seq, shapes.seq, dtype=torch.bool), diagonal=1)[None, None]
    return {
        "tokens": tokens[:, :-1].contiguous().to(device),
        "labels": tokens[:, 1:].contiguous().to(device),
        "position_ids": pos.contiguous().to(device),
        # Explicit causal mask (True = masked): megatron's default one is created on "cuda".
        "attention_mask": mask.to(device),
    }


def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean per-token loss; the 2-tuple form megatron's forward_step_calc_loss accepts."""
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach()}


def forward_step_func(
    data_iterator: Iterator[dict], model: Any, return_schedule_plan: bool = False
) -> tuple[Any, Callable]:
    """Megatron forward_step contract; with return_schedule_plan it returns the chunk's plan."""
    b = next(data_iterator)
    args = (b["tokens"], b["position_ids"], b["attention_mask"])
    if return_schedule_plan:
        return model.build_schedule_plan(*args, labels=b["labels"]), loss_func
    return model(*args, labels=b["labels"]), loss_func


def plain_forward(model: Any, batch: dict) -> torch.Tensor:
    """Forward plus loss the plain way (same loss as the combined path with 1 micro-batch)."""
    output, lf = forward_step_func(iter([batch]), model)
    return lf(output)[0]


def plain_backward(loss: torch.Tensor) -> None:
    """Backward the plain way."""
    torch.autograd.backward(loss)


def combined_step(
    model: Any,
    config: Any,
    f_batch: dict | None,
    b_output: torch.Tensor | None,
    mb: int,
) -> torch.Tensor | None:
    """One call of combined_forward_backward_step: F of f_batch and/or B of b_output, merged.

    Mirrors combined_1f1b_schedule_for_no_pipelining with num_microbatches=1 (so the loss is not
    rescaled): the returned loss carries .schedule_plan/.loss_func for its own backward later.
    """
    from megatron.core.pipeline_parallel.combined_1f1b import (
        combined_forward_backward_step,
    )

    out, _, _ = combined_forward_backward_step(
        forward_step_func,
        iter([f_batch]) if f_batch is not None else None,
        model if f_batch is not None else None,
        1,  # num_microbatches
        None,  # input_tensor (first stage)
        [],  # forward_data_store
        model if b_output is not None else None,
        None,  # b_input_tensor (first stage: no input grad)
        b_output,
        None,  # b_output_tensor_grad (last stage: backward from the loss)
        config,
        is_first_microbatch=False,
        current_microbatch=mb if f_batch is not None else None,
    )
    return out if f_batch is not None else None


def start_comm_stream(config: Any) -> bool:
    """Create the a2a stream as combined_1f1b_schedule_for_no_pipelining does before any step.

    Without it get_comm_stream() is None and every node silently runs on the current stream.
    Returns whether the comm stream is a different stream from the compute stream.
    """
    from megatron.core.pipeline_parallel.utils import get_comm_stream, set_streams

    set_streams(high_priority=config.high_priority_a2a_comm_stream)
    comm = get_comm_stream()
    return comm is not None and comm != torch.cuda.current_stream()


class Clock:
    """Times the 'timed' callable with CUDA events (median of N after warm-up) or perf_counter."""

    def __init__(self, device: str, warmup: int, iters: int) -> None:
        self.cuda = device == "cuda"
        self.warmup = warmup
        self.iters = iters

    def sync(self) -> None:
        """Wait for the device so host timestamps and events bracket finished work."""
        if self.cuda:
            torch.cuda.synchronize()

    def run(
        self,
        setup: Callable[[], Any],
        timed: Callable[[Any], Any],
        teardown: Callable[[Any], None],
    ) -> dict[str, Any]:
        """Run warm-up plus iters rounds; report device ms, host (launch) ms and peak memory."""
        if self.cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        dev_ms: list[float] = []
        host_ms: list[float] = []
        for i in range(self.warmup + self.iters):
            state = setup()
            self.sync()
            h0 = time.perf_counter()
            if self.cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
            result = timed(state)
            if self.cuda:
                end.record()
            h1 = time.perf_counter()
            self.sync()
            h2 = time.perf_counter()
            teardown(result)
            if i >= self.warmup:
                dev_ms.append(start.elapsed_time(end) if self.cuda else (h2 - h0) * 1e3)
                host_ms.append((h1 - h0) * 1e3)
        rec: dict[str, Any] = {
            "ok": True,
            "median_ms": statistics.median(dev_ms),
            "min_ms": min(dev_ms),
            "times_ms": [round(t, 3) for t in dev_ms],
            "host_launch_median_ms": statistics.median(host_ms),
        }
        if self.cuda:
            rec["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            rec["mem_at_start_bytes"] = base
        return rec


def case_plain_pair(model: Any, b0: dict, b1: dict) -> tuple[Callable, Callable, Callable]:
    """(a) setup F(mb0); timed F(mb1) then B(mb0); teardown B(mb1)."""

    def setup() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        return plain_forward(model, b0)

    def timed(loss0: torch.Tensor) -> torch.Tensor:
        loss1 = plain_forward(model, b1)
        plain_backward(loss0)
        return loss1

    return setup, timed, plain_backward


def case_combined_pair(
    model: Any, config: Any, b0: dict, b1: dict
) -> tuple[Callable, Callable, Callable]:
    """(b) setup combined F(mb0); timed combined F(mb1)+B(mb0); teardown combined B(mb1)."""

    def setup() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        return combined_step(model, config, b0, None, 0)

    def timed(out0: torch.Tensor) -> torch.Tensor:
        return combined_step(model, config, b1, out0, 1)

    def teardown(out1: torch.Tensor) -> None:
        combined_step(model, config, None, out1, 1)

    return setup, timed, teardown


def case_forward_only(model: Any, b1: dict) -> tuple[Callable, Callable, Callable]:
    """(c) F(mb1) alone; its graph is dropped untimed."""
    return (lambda: None), (lambda _: plain_forward(model, b1)), (lambda loss: None)


def case_backward_only(model: Any, b0: dict) -> tuple[Callable, Callable, Callable]:
    """(c) B(mb0) alone, after an untimed F(mb0)."""

    def setup() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        return plain_forward(model, b0)

    return setup, plain_backward, (lambda _: None)


def case_two_stream_pair(model: Any, b0: dict, b1: dict) -> tuple[Callable, Callable, Callable]:
    """Fallback: F(mb1) enqueued on a side stream, then B(mb0) on the current stream, joined.

    The host launches them one after the other (autograd blocks the caller), so GPU overlap only
    happens where the host runs ahead of the device; host syncs in the MoE dispatcher limit it.
    """
    side = torch.cuda.Stream()

    def timed(loss0: torch.Tensor) -> torch.Tensor:
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            loss1 = plain_forward(model, b1)
        plain_backward(loss0)
        cur.wait_stream(side)
        return loss1

    setup = case_plain_pair(model, b0, b1)[0]
    return setup, timed, plain_backward


def grads(model: Any) -> dict[str, torch.Tensor]:
    """fp32 copies of all parameter grads (None grads recorded as zeros)."""
    return {
        n: (p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p).float())
        for n, p in model.named_parameters()
    }


def check(model: Any, config: Any, b0: dict, b1: dict, device: str) -> dict[str, Any]:
    """Full iteration F0,F1,B0,B1 both ways: same losses and (nearly) the same gradients?"""
    model.zero_grad(set_to_none=True)
    l0 = plain_forward(model, b0)
    l1 = plain_forward(model, b1)
    plain_backward(l0)
    plain_backward(l1)
    ref_losses = [l0.item(), l1.item()]
    ref = grads(model)
    rec: dict[str, Any] = {"ok": True, "plain_losses": ref_losses}
    if device != "cuda":
        rec["combined_ran_under_cpu_stream_shim"] = True
    model.zero_grad(set_to_none=True)
    o0 = combined_step(model, config, b0, None, 0)
    c0 = o0.item()
    o1 = combined_step(model, config, b1, o0, 1)
    c1 = o1.item()
    combined_step(model, config, None, o1, 1)
    if device == "cuda":
        torch.cuda.synchronize()
    got = grads(model)
    diffs = {n: (got[n] - ref[n]).abs().max().item() for n in ref}
    worst = max(diffs, key=diffs.get)
    rec.update(
        combined_losses=[c0, c1],
        loss_max_abs_diff=max(abs(c0 - ref_losses[0]), abs(c1 - ref_losses[1])),
        grad_max_abs_diff=diffs[worst],
        grad_max_abs_diff_param=worst,
        grad_max_abs_ref=max(g.abs().max().item() for g in ref.values()),
        grad_rel_diff_norm=(
            sum(((got[n] - ref[n]) ** 2).sum().item() for n in ref) ** 0.5
            / max(sum((g**2).sum().item() for g in ref.values()) ** 0.5, 1e-30)
        ),
        params_without_grad_combined=[n for n, p in model.named_parameters() if p.grad is None],
    )
    model.zero_grad(set_to_none=True)
    return rec


def plan_construction(model: Any, b0: dict, b1: dict) -> dict[str, Any]:
    """Build both schedule plans (what the combined path builds first); CPU can go this far."""
    out: dict[str, Any] = {"ok": True}
    for name, b in (("mb0", b0), ("mb1", b1)):
        plan, _ = forward_step_func(iter([b]), model, return_schedule_plan=True)
        layer = plan.get_layer(0)
        out[name] = {
            "type": type(plan).__name__,
            "num_layers": plan.num_layers(),
            "has_pre_process": plan.pre_process is not None,
            "has_post_process": plan.post_process is not None,
            "layer0_nodes": {
                k: type(getattr(layer, k)).__name__
                for k in (
                    "pre_dispatch_computation",
                    "moe_dispatch",
                    "mlp",
                    "moe_combine",
                )
            },
        }
    return out


def guarded(result: dict, key: str, out: str, fn: Callable[[], dict]) -> None:
    """Run one measurement; record its failure (last traceback line) instead of crashing."""
    if time.perf_counter() - T0 > DEADLINE_S:
        result["cases"][key] = {
            "ok": False,
            "error": f"skipped: past {DEADLINE_S}s deadline",
        }
        log(f"{key}: skipped (deadline)")
        write_json(out, result)
        return
    log(f"{key}: start")
    try:
        result["cases"][key] = fn()
        log(f"{key}: {json.dumps(result['cases'][key], default=str)[:300]}")
    except Exception as exc:  # one failure must not end the run
        result["cases"][key] = {"ok": False, **last_line(exc)}
        log(f"{key}: FAILED {result['cases'][key]}")
        traceback.print_exc(file=sys.stdout)
    finally:
        gc.collect()
        if torch.cuda.is_available() and result["device"] == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    write_json(out, result)


def parse_args() -> argparse.Namespace:
    """Command line: --out is required; --device cpu --tiny is the dry run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="path of the JSON result")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run)")
    p.add_argument("--mixtral", action="store_true", help="Mixtral 8x7B-shaped layers")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument(
        "--ep1-a2a",
        choices=("copy", "identity"),
        default="copy",
        help="copy: one-rank all-to-all returns a copy (needed by the combined path); "
        "identity: megatron's stock behaviour, where the combined path fails",
    )
    return p.parse_args()


def main() -> int:
    """Build the chunk once, run every case guarded, write JSON after each."""
    args = parse_args()
    shapes = TINY if args.tiny else MIXTRAL if args.mixtral else FULL
    warmup, iters = (1, 2) if args.device == "cpu" else (args.warmup, args.iters)
    notes: list[str] = []
    result: dict[str, Any] = {
        "script": "measure_moe_overlap.py",
        "device": args.device,
        "shapes": dataclasses.asdict(shapes),
        "warmup": warmup,
        "iters": iters,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "notes": notes,
        "cases": {},
    }
    try:
        import megatron.core as mcore

        result["megatron_core"] = getattr(mcore, "__version__", "?")
        if args.device == "cuda":
            result["device_name"] = torch.cuda.get_device_name(0)
            result["cuda"] = torch.version.cuda
        else:
            result["device_name"] = "cpu"
        init_parallel(args.device, notes)
        result["ep1_a2a"] = args.ep1_a2a
        if args.ep1_a2a == "copy":
            make_ep1_all_to_all_copy(notes)
        config = build_config(shapes, args.device, notes)
        result["dispatcher"] = config.moe_token_dispatcher_type
        model = build_model(config, shapes, args.device)
        result["num_params"] = sum(p.numel() for p in model.parameters())
        result["comm_stream_separate"] = start_comm_stream(config)
        log(f"model built: {result['num_params']} params")
    except Exception as exc:  # record why setup failed, then stop
        result["setup_error"] = last_line(exc)
        log(f"setup FAILED {result['setup_error']}")
        write_json(args.out, result)
        return 1
    b0 = make_batch(shapes, args.device, seed=10)
    b1 = make_batch(shapes, args.device, seed=11)
    clock = Clock(args.device, warmup, iters)
    guarded(result, "plan_construction", args.out, lambda: plan_construction(model, b0, b1))
    guarded(result, "check", args.out, lambda: check(model, config, b0, b1, args.device))
    guarded(
        result,
        "plain_pair",
        args.out,
        lambda: clock.run(*case_plain_pair(model, b0, b1)),
    )
    guarded(
        result,
        "combined_pair",
        args.out,
        lambda: clock.run(*case_combined_pair(model, config, b0, b1)),
    )
    guarded(
        result,
        "forward_only",
        args.out,
        lambda: clock.run(*case_forward_only(model, b1)),
    )
    guarded(
        result,
        "backward_only",
        args.out,
        lambda: clock.run(*case_backward_only(model, b0)),
    )
    guarded(
        result,
        "two_stream_pair",
        args.out,
        lambda: clock.run(*case_two_stream_pair(model, b0, b1)),
    )
    c = result["cases"]
    a_ms = c.get("plain_pair", {}).get("median_ms")
    for key in ("combined_pair", "two_stream_pair"):
        if a_ms and c.get(key, {}).get("ok"):
            result[f"ratio_{key}_over_plain_pair"] = c[key]["median_ms"] / a_ms
    f_ms, b_ms = (
        c.get("forward_only", {}).get("median_ms"),
        c.get("backward_only", {}).get("median_ms"),
    )
    if f_ms and b_ms:
        result["sum_forward_backward_only_ms"] = f_ms + b_ms
    result["wall_s"] = time.perf_counter() - T0
    write_json(args.out, result)
    log(f"done in {result['wall_s']:.1f}s -> {args.out}")
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
