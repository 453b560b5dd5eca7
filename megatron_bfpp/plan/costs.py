"""How long one micro-batch takes on one stage, and what communication costs: the numbers the
simulator runs the schedule under. FLOPs follow eq. 1 of the BPipe re-evaluation, efficiency a
built-in curve or a measured profile, and communication ring collectives over NVLink or
InfiniBand (docs/planner.md, "Compute" and "Communication", has every formula)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.plan.memory import moe_layer_parameters, moe_layers_per_rank
from megatron_bfpp.plan.presets import Gpu, Model, padded_vocab_size
from megatron_bfpp.plan.profile import StageProfile
from megatron_bfpp.schedules.registry import get_spec

if TYPE_CHECKING:  # the search's types, read by stage_times (search imports this module)
    from megatron_bfpp.plan.search import Candidate, Cluster, SearchOptions

__all__ = [
    "BuiltinCurve",
    "Efficiency",
    "ProfileCurve",
    "all_to_all_time",
    "layer_forward_flops",
    "model_flops_per_step",
]

INTRA_NODE_LATENCY_S = 5e-6
INTER_NODE_LATENCY_S = 10e-6


def model_flops_per_step(model: Model, *, global_batch_size: int) -> float:
    """Eq. 1 of the BPipe re-evaluation: a step's model FLOPs (no recompute), MFU's numerator;
    a MoE model's: three times its layers' forwards (active experts) plus eq. 1's logits term."""
    b, s, h = global_batch_size, model.seq_length, model.hidden_size
    layers, v = model.num_layers, model.vocab_size
    if model.num_experts:
        forwards = (
            layer_forward_flops(model, micro_batch_size=b, tp=1, moe=m) for m in model.moe_layers
        )
        return 3.0 * sum(forwards) + 4.5 * b * s * h * v
    return 72.0 * b * s * layers * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * layers * h))


def layer_forward_flops(
    model: Model, *, micro_batch_size: int, tp: int, moe: bool = False
) -> float:
    """One layer's forward on one tensor-parallel rank: 24bsh^2(1 + s/6h) / t. A MoE model's
    layers count their MLP by its sizes (attention 8bsh^2 + 4bs^2h as eq. 1's): 6hf per token and
    expert (SwiGLU; GeLU 4hf) over top-k routed and shared experts, the router 2hE; dense alike."""
    b, s, h = micro_batch_size, model.seq_length, model.hidden_size
    if not model.num_experts:
        return 24.0 * b * s * h * h * (1.0 + s / (6.0 * h)) / tp
    per = 6 if model.arch == "llama" else 4
    ffn = model.moe_router_topk * model.moe_ffn_hidden_size
    mlp = per * h * (ffn + model.moe_shared_expert_intermediate_size) + 2 * h * model.num_experts
    mlp = mlp if moe else per * h * model.ffn_hidden_size
    return b * s * (8.0 * h * h + 4.0 * s * h + mlp) / tp


class Efficiency(Protocol):
    """Achieved fraction of peak for a layer forward of ``work`` FLOPs per GPU."""

    @property
    def source(self) -> str: ...  # where the figures come from, for the output

    def forward(self, work: float) -> float: ...

    def backward(self, work: float) -> float: ...

    def weight_share(self, work: float) -> float: ...  # W's part of a backward (split-backward)

    # (embedding, output layer and loss), forward and backward, in one layer's; None: unknown
    def end_weights(self, work: float) -> tuple[float, float] | None: ...

    @property
    def host_s(self) -> float: ...  # per compute action beyond its kernels (CostModel.t_host)


@dataclass(frozen=True, slots=True)
class BuiltinCurve:
    """``e_max * w / (w + e_max * P * tau)``: a layer takes ``w / (e_max P) + tau``, fit for the
    A100 to the BPipe re-evaluation's Table 5 (docs/planner.md), the same shape elsewhere.
    Backward: twice the forward's work at its efficiency, half of it weight gradients."""

    gpu: Gpu
    # 0: a GPU's host enqueues its kernels ahead of them (nothing measured says otherwise)
    host_s: ClassVar[float] = 0.0

    @property
    def source(self) -> str:
        return f"built-in efficiency curve for {self.gpu.name}"

    def forward(self, work: float) -> float:
        e = self.gpu.max_efficiency
        return e * work / (work + e * self.gpu.peak_flops * self.gpu.layer_overhead_s)

    def backward(self, work: float) -> float:
        return self.forward(work)

    def weight_share(self, work: float) -> float:
        return 0.5

    def end_weights(self, work: float) -> tuple[float, float] | None:
        return None  # the output layer is then timed from its FLOPs, the embedding left out


@dataclass(frozen=True, slots=True)
class ProfileCurve:
    """Efficiencies measured by ``bfpp-plan profile`` against ``gpu``'s peak per work per layer:
    linear in log(work) between points, nearest outside; ``host``: the profile's ``t_host`` or 0."""

    works: tuple[float, ...]
    forwards: tuple[float, ...]
    backwards: tuple[float, ...]
    weight_shares: tuple[float, ...]
    source: str
    host_s: float = 0.0
    embeddings: tuple[float, ...] = ()  # Measurement.end_weights per work; empty: not measured
    outputs: tuple[float, ...] = ()

    @staticmethod
    def from_profile(profile: StageProfile, gpu: Gpu) -> ProfileCurve:
        rows = []
        for m in profile.measurements:
            work = layer_forward_flops(
                profile.model, micro_batch_size=m.micro_batch_size, tp=profile.tensor_parallel
            )
            total = work * profile.num_layers
            forward = total / (m.forward_s * gpu.peak_flops)
            backward = 2.0 * total / (m.backward_s * gpu.peak_flops)
            split = (m.backward_input_s or 0.0) + (m.backward_weight_s or 0.0)
            weight = m.backward_weight_s
            share = weight / split if weight is not None and split > 0 else 0.5
            ends = m.end_weights(profile.num_layers) or (math.nan, math.nan)
            rows.append((work, forward, backward, share, *ends))
        rows.sort()
        for work, forward, backward, *_ in rows:
            if forward > 1.0 or backward > 1.0:
                raise ScheduleError(
                    f"the profile's {profile.device} ran above the {gpu.name}'s peak "
                    f"({max(forward, backward):.0%} at {work:.3g} FLOPs per layer): plan with the "
                    "GPU it was measured on (--gpu)"
                )
        works, forwards, backwards, shares, embeddings, outputs = (
            tuple(column) for column in zip(*rows, strict=True)
        )
        if any(math.isnan(e) for e in embeddings):  # a profile from before the ends were timed
            embeddings = outputs = ()
        host = f", host {1e3 * profile.t_host:.3g} ms per action" if profile.t_host else ""
        source = f"profile measured on {profile.device}{host}"
        return ProfileCurve(
            works, forwards, backwards, shares, source, profile.t_host or 0.0, embeddings, outputs
        )

    def _interpolate(self, values: tuple[float, ...], work: float) -> float:
        works = self.works
        if work <= works[0]:
            return values[0]
        if work >= works[-1]:
            return values[-1]
        i = bisect.bisect_right(works, work)
        lo, hi = works[i - 1], works[i]
        x = (math.log(work) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return values[i - 1] + x * (values[i] - values[i - 1])

    def forward(self, work: float) -> float:
        return self._interpolate(self.forwards, work)

    def backward(self, work: float) -> float:
        return self._interpolate(self.backwards, work)

    def weight_share(self, work: float) -> float:
        return self._interpolate(self.weight_shares, work)

    def end_weights(self, work: float) -> tuple[float, float] | None:
        if not self.embeddings:
            return None
        return self._interpolate(self.embeddings, work), self._interpolate(self.outputs, work)


def _ring_collective_time(nbytes: float, group: int, link: tuple[float, float]) -> float:
    """A ring reduce-scatter or all-gather of ``nbytes`` (the full tensor) over ``group`` ranks on
    a (bandwidth, latency) ``link``: ``(n-1)/n * bytes / bandwidth`` plus a latency per step."""
    if group <= 1:
        return 0.0
    bandwidth, latency = link
    return (group - 1) / group * nbytes / bandwidth + (group - 1) * latency


def all_to_all_time(nbytes: float, group: int, link: tuple[float, float]) -> float:
    """An all-to-all of ``nbytes`` per rank over ``group`` ranks: all but its own 1/n leave each
    rank at once (NCCL's pairwise sends), at the link's bandwidth, one latency."""
    if group <= 1:
        return 0.0
    bandwidth, latency = link
    return (group - 1) / group * nbytes / bandwidth + latency


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Seconds, for the simulator's ``CostModel``: one micro-batch through one full stage
    (``forward`` / ``backward`` / ``weight``), the last stage's extra ``output`` (MTP layers
    included), one message or
    collective, BPipe's eviction, the optimizer step and the host's time per action."""

    forward: float
    backward: float
    weight: float
    output: float
    p2p: float
    grad_reduce: float
    param_gather: float
    evict: float
    optimizer: float
    host: float = 0.0
    embedding: float = 0.0  # the first stage's extra: measured by a profile, else left out
    # one dense and one MoE layer's forward + backward: uneven stages' weights (MoE models)
    layer: tuple[float, float] = (0.0, 0.0)
    # the expert all-to-alls inside ``forward`` (and again in ``backward``) that pairs run as
    # megatron-core's combined step may hide: 0 unless ``SearchOptions.moe_overlap``
    a2a: float = 0.0


def stage_times(
    c: Candidate,
    model: Model,
    cluster: Cluster,
    options: SearchOptions,
    rank_parameters: int,
    stage_activation_bytes: int,
) -> StageTimes:
    """The durations of candidate ``c`` (see the module docstring for each)."""
    gpu, precision, tp, pp, dp = cluster.gpu, options.precision, c.tp, c.pp, c.dp
    efficiency = options.efficiency or BuiltinCurve(gpu)
    layers = model.num_layers // pp
    placement = get_spec(c.schedule).placement
    moe = max(moe_layers_per_rank(model, pp=pp, vp=c.vp, placement=placement))
    # the busiest rank's experts, whose gradients it reduces (uneven stages: its own layers)
    rank_experts = max(
        moe_layers_per_rank(model, pp=pp, vp=c.vp, placement=placement, stage_layers=c.stage_layers)
    )
    peak = gpu.peak_flops
    b, s, h = c.micro_batch_size, model.seq_length, model.hidden_size
    activation = b * s * h * precision.activation_bytes
    p2p = grad_reduce = param_gather = evict = tp_comm = a2a = 0.0
    if options.communication:
        intra = (gpu.intra_node_bandwidth, INTRA_NODE_LATENCY_S)
        inter = (gpu.inter_node_bandwidth, INTER_NODE_LATENCY_S)
        tp_comm = 4 * _ring_collective_time(activation, tp, intra)  # 2 all-reduces of 2 rings
        bandwidth, latency = intra if tp * dp * pp <= cluster.gpus_per_node else inter
        message = activation / (tp if c.sequence_parallel else 1)
        p2p = message / bandwidth + latency if pp > 1 else 0.0
        evict = stage_activation_bytes / bandwidth + latency
        dp_link = intra if tp * dp <= cluster.gpus_per_node else inter
        # experts' over the expert data-parallel group (dp / ep), the rest over dp, in turn
        experts = rank_experts * moe_layer_parameters(model, tp=tp, ep=c.ep)[1]
        grad_reduce, param_gather = (
            _ring_collective_time((rank_parameters - experts) / c.vp * size, dp, dp_link)
            + (
                _ring_collective_time(experts / c.vp * size, dp // c.ep, dp_link)
                if rank_experts
                else 0.0
            )
            for size in (precision.grad_bytes, precision.param_bytes)
        )
        # Expert parallelism's dispatch or combine: the rank's tokens, top-k copies each
        ep_link = intra if c.ep * tp <= cluster.gpus_per_node else inter
        a2a = all_to_all_time(message * model.moe_router_topk, c.ep, ep_link)
    dense = _layer_times(c, model, efficiency, peak, tp_comm, moe=False)
    sparse = _layer_times(c, model, efficiency, peak, tp_comm + 2 * a2a, moe=True)
    output, embedding = _end_times(model, c, efficiency, peak)
    if not options.output_layer:
        output = embedding = 0.0
    if mtp := model.mtp_num_layers:  # each: an embedding lookup, eh_proj (2h -> h), a layer
        kind = sparse if model.moe_layers[-1] else dense  # of the last kind, an output pass, loss
        eh = 4.0 * b * s * h * h / tp
        eh_time = 3.0 * eh / (efficiency.forward(eh) * peak)
        output += mtp * (output + embedding + eh_time + kind[0] + kind[1])
    optimizer_time = 0.0
    if options.optimizer:
        # Adam reads gradient, master weight and moments and writes master, moments and weight.
        per_parameter = precision.grad_bytes + 2 * precision.optimizer_bytes + precision.param_bytes
        optimizer_time = rank_parameters / dp * per_parameter / gpu.hbm_bandwidth
    forward, backward, weight = (
        (layers - moe) * d + moe * m for d, m in zip(dense, sparse, strict=True)
    )
    return StageTimes(
        forward=forward,
        backward=backward,
        weight=weight,
        output=output,
        embedding=embedding,
        layer=(dense[0] + dense[1], sparse[0] + sparse[1]),
        p2p=p2p,
        grad_reduce=grad_reduce,
        param_gather=param_gather,
        evict=evict,
        optimizer=optimizer_time,
        host=efficiency.host_s,
        a2a=moe * 2 * a2a if options.moe_overlap else 0.0,  # what combined pairs may hide
    )


def _end_times(
    model: Model, c: Candidate, efficiency: Efficiency, peak: float
) -> tuple[float, float]:
    """(output layer and loss, embedding) seconds per micro-batch, forward and backward: a
    profile's measured weights times a dense layer's compute here; without one, the output
    layer's logits from their FLOPs and the embedding left out (a gather: no FLOPs to count)."""
    b, s, h, tp = c.micro_batch_size, model.seq_length, model.hidden_size, c.tp
    work = layer_forward_flops(model, micro_batch_size=b, tp=tp)
    if weights := efficiency.end_weights(work):
        layer = work / (efficiency.forward(work) * peak) + 2 * work / (
            efficiency.backward(work) * peak
        )
        return weights[1] * layer, weights[0] * layer
    out_work = 2.0 * b * s * h * padded_vocab_size(model.vocab_size, tp=tp) / tp
    return 3.0 * out_work / (efficiency.forward(out_work) * peak), 0.0


def _layer_times(
    c: Candidate, model: Model, efficiency: Efficiency, peak: float, comm: float, *, moe: bool
) -> tuple[float, float, float]:
    """One layer's (forward, backward, weight) seconds: its compute, plus ``comm`` each way
    (tensor parallelism's, and a MoE layer's all-to-alls), plus what recomputation runs again."""
    b, s, h, tp = c.micro_batch_size, model.seq_length, model.hidden_size, c.tp
    work = layer_forward_flops(model, micro_batch_size=b, tp=tp, moe=moe)
    forward_compute = work / (efficiency.forward(work) * peak)
    backward_compute = 2.0 * work / (efficiency.backward(work) * peak)
    weight_compute = backward_compute * efficiency.weight_share(work)
    recompute_time = 0.0
    if c.recompute == "full":
        recompute_time = forward_compute + comm
    elif c.recompute == "selective":  # core attention (QK^T, over V: 4bs^2h / t) runs again
        recompute_time = 4.0 * b * s * s * h / tp / (efficiency.forward(work) * peak)
    return forward_compute + comm, backward_compute + comm + recompute_time, weight_compute
