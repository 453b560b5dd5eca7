"""When is BPipe worth it: the performance estimate of "Re-evaluating BPipe" (section 4, eq. 2-4).

BPipe caps every rank's stored activations at ceil((p+2)/2) micro-batches instead of 1F1B's p,
and spends the memory on a larger micro-batch: one stage gets faster by MFU_stage(x) /
MFU_stage(y), while with a fixed batch B per pipeline the bubble grows by (B + y(p-1)) /
(B + x(p-1)) (eq. 2); eq. 4 multiplies the two, ignoring communication, the optimizer and
BPipe's own transfers, as the paper does (it measured 1.35 where eq. 4 predicts 1.39)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_bfpp.ir import ScheduleError, check_positive
from megatron_bfpp.passes.eviction import bpipe_max_stored

__all__ = ["Estimate", "bpipe_speedup_estimate", "pipeline_factor", "pipeline_mfu"]


@dataclass(frozen=True, slots=True)
class Estimate:
    """Eq. 4 for raising the micro-batch size from ``micro_batch_small`` (1F1B) to
    ``micro_batch_large`` (BPipe), and the busiest rank's activation memory each side needs."""

    pp: int
    global_batch_size: int
    micro_batch_small: int
    micro_batch_large: int
    stage_mfu_small: float
    stage_mfu_large: float
    stage_speedup: float  # MFU_stage(x) / MFU_stage(y)
    pipeline_factor: float  # (B + y(p-1)) / (B + x(p-1)): the longer bubble of larger micro-batches
    predicted_speedup: float  # eq. 4: pipeline_factor * stage_speedup
    pipeline_mfu_small: float  # eq. 3 at y without BPipe
    pipeline_mfu_large: float  # eq. 3 at x, BPipe overhead ignored
    one_f_one_b_stored: int  # p: 1F1B's rank 0
    bpipe_stored: int  # ceil((p+2)/2)
    memory_ratio: float  # (x * ceil((p+2)/2)) / (y * p): BPipe at x vs 1F1B at y
    memory_ratio_without_bpipe: float  # x / y: 1F1B at x vs 1F1B at y
    faster: bool  # predicted_speedup > 1
    fits: bool  # memory_ratio <= 1
    worth_it: bool  # faster and fits
    verdict: str

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


def pipeline_factor(
    *, micro_batch_small: int, micro_batch_large: int, global_batch_size: int, pp: int
) -> float:
    """(B + y(p-1)) / (B + x(p-1)): how much of a stage speedup survives the longer bubble."""
    _check_batches(global_batch_size, (micro_batch_small, micro_batch_large))
    _check_pp(pp)
    small, large = micro_batch_small, micro_batch_large
    return (global_batch_size + small * (pp - 1)) / (global_batch_size + large * (pp - 1))


def pipeline_mfu(
    stage_mfu: float,
    micro_batch_size: int,
    global_batch_size: int,
    pp: int,
    stage_fraction: float | None = None,
) -> float:
    """Eq. 3: the whole pipeline's MFU from one stage's at the same micro-batch size,
    F * MFU_stage(b) / ((1 + b/B (p-1)) * F_stage) over p (the paper's P is one device's peak);
    a ``stage_fraction`` above 1/p models a heavier stage that paces the pipeline."""
    _check_mfu("stage MFU", stage_mfu)
    _check_batches(global_batch_size, (micro_batch_size,))
    _check_pp(pp)
    fraction = 1.0 / pp if stage_fraction is None else stage_fraction
    if not (1.0 / pp - 1e-12 <= fraction <= 1.0):
        raise ScheduleError(
            f"stage_fraction (F_stage / F) must lie in [1/pp, 1] = [{1.0 / pp:.4g}, 1]; got "
            f"{fraction} (uniform stages use 1/pp)"
        )
    slots = 1.0 + micro_batch_size / global_batch_size * (pp - 1)
    return stage_mfu / (pp * fraction * slots)


def bpipe_speedup_estimate(
    *,
    stage_mfu_small: float,
    stage_mfu_large: float,
    micro_batch_small: int,
    micro_batch_large: int,
    global_batch_size: int,
    pp: int,
) -> Estimate:
    """Eq. 4 for 1F1B at ``micro_batch_small`` -> BPipe at ``micro_batch_large``, with memory;
    ``stage_mfu_*``: MFUs in (0, 1] of one stage run alone at each size (the paper's Table 5)."""
    _check_mfu("stage MFU at the small micro-batch", stage_mfu_small)
    _check_mfu("stage MFU at the large micro-batch", stage_mfu_large)
    _check_pp(pp)
    _check_batches(global_batch_size, (micro_batch_small, micro_batch_large))
    small, large, batch = micro_batch_small, micro_batch_large, global_batch_size
    if large <= small:
        raise ScheduleError(
            f"the BPipe micro-batch size must be larger than the 1F1B one; got {small} then "
            f"{large} (pass the smaller first, e.g. {min(small, large)} {max(small, large)})"
        )
    if batch // large < pp:
        raise ScheduleError(
            f"global batch {batch} at micro-batch {large} gives {batch // large} micro-batches, "
            f"fewer than pp={pp}, so no rank stores p of them and BPipe saves nothing "
            f"(use a global batch of at least {large * pp})"
        )
    stage_speedup = stage_mfu_large / stage_mfu_small
    if not math.isfinite(stage_speedup):
        raise ScheduleError(
            f"stage MFU {stage_mfu_small} at the small micro-batch is too small: the stage "
            f"speedup {stage_mfu_large} / {stage_mfu_small} is not a finite number"
        )
    factor = pipeline_factor(
        micro_batch_small=small, micro_batch_large=large, global_batch_size=batch, pp=pp
    )
    predicted = factor * stage_speedup
    cap = bpipe_max_stored(pp)  # ceil((p+2)/2); 1F1B's rank 0 stores p
    memory_ratio = (large * cap) / (small * pp)
    faster, fits = predicted > 1.0, memory_ratio <= 1.0
    return Estimate(
        pp=pp,
        global_batch_size=batch,
        micro_batch_small=small,
        micro_batch_large=large,
        stage_mfu_small=stage_mfu_small,
        stage_mfu_large=stage_mfu_large,
        stage_speedup=stage_speedup,
        pipeline_factor=factor,
        predicted_speedup=predicted,
        pipeline_mfu_small=pipeline_mfu(stage_mfu_small, small, batch, pp),
        pipeline_mfu_large=pipeline_mfu(stage_mfu_large, large, batch, pp),
        one_f_one_b_stored=pp,
        bpipe_stored=cap,
        memory_ratio=memory_ratio,
        memory_ratio_without_bpipe=large / small,
        faster=faster,
        fits=fits,
        worth_it=faster and fits,
        verdict=_verdict(predicted, memory_ratio, small, large, cap, pp),
    )


def _verdict(
    predicted: float, memory_ratio: float, small: int, large: int, cap: int, pp: int
) -> str:
    memory = (
        f"BPipe at b={large} stores {cap} micro-batches of {large}, {memory_ratio:.3g}x the "
        f"activations 1F1B stored at b={small} ({pp} of {small}; 1F1B at b={large} would need "
        f"{large / small:.3g}x)"
    )
    if predicted <= 1.0:
        return (
            f"not worth it: the predicted speedup {predicted:.3f} is not above 1, the longer "
            f"bubble of b={large} eats the stage speedup; stay with 1F1B at b={small}"
        )
    if memory_ratio <= 1.0:
        return f"worth it: predicted {predicted:.3f}x and {memory}, so it fits"
    return (
        f"faster only if it fits: predicted {predicted:.3f}x, but {memory}; worth it only if "
        f"that extra memory is free (e.g. with activation recomputation)"
    )


# The formulas run in floating point: larger integers lose exactness, then overflow.
_MAX_EXACT = 2**53


def _check_pp(pp: int) -> None:
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 2:
        raise ScheduleError(f"pp must be an integer >= 2 (BPipe pairs stages); got {pp!r}")
    if pp > _MAX_EXACT:
        raise ScheduleError(f"pp must be at most 2**53 (computed in floating point); got {pp}")


def _check_mfu(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ScheduleError(f"{what} must be a number in (0, 1]; got {value!r}")
    if value > 1.0 and value <= 100.0:
        raise ScheduleError(
            f"{what} must be a fraction in (0, 1]; got {value}, a percentage? "
            f"(pass {value / 100:.4g}, or --percent on the command line)"
        )
    if not 0.0 < value <= 1.0:
        raise ScheduleError(f"{what} must be a fraction in (0, 1]; got {value}")


def _check_batches(global_batch_size: int, micro_batch_sizes: tuple[int, ...]) -> None:
    sizes = [("micro-batch size", b) for b in micro_batch_sizes]
    for name, value in [("global batch size", global_batch_size), *sizes]:
        check_positive({name: value})
        if value > _MAX_EXACT:
            raise ScheduleError(
                f"{name} must be at most 2**53 (computed in floating point); got {value}"
            )
    for b in micro_batch_sizes:
        if global_batch_size % b:
            lower = global_batch_size - global_batch_size % b
            raise ScheduleError(
                f"global batch size {global_batch_size} is not divisible by micro-batch size {b} "
                f"(use a multiple of {b}, e.g. {lower or b} or {lower + b})"
            )
