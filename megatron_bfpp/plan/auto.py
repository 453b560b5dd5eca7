"""``--pipeline-schedule auto``: the planner picks the schedule for the layout the user fixed.

Not ``recommend``: :func:`decide` ranks only what a schedule may still choose (schedule, virtual
stages, group size, BPipe cap), from what every rank sees alike: all decide the same."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from megatron_bfpp.config.run_config import (
    EVEN_STAGES,
    UnevenStages,
    layout_of,
    layout_stages,
    layout_virtual_stages,
)
from megatron_bfpp.files import write_output
from megatron_bfpp.ir import Placement, ScheduleError, first_line, paused_gc
from megatron_bfpp.plan.costs import BuiltinCurve, Efficiency, ProfileCurve
from megatron_bfpp.plan.memory import RECOMPUTE, MemoryBreakdown
from megatron_bfpp.plan.presets import BF16_MIXED, GPUS, GiB, Gpu, Model, Precision, get_gpu
from megatron_bfpp.plan.profile import load_profile
from megatron_bfpp.plan.search import (
    EVERY_PARTITION_UP_TO,
    PARTITIONS_KEPT,
    ActionBudget,
    Candidate,
    Cluster,
    OverBudget,
    Plan,
    SearchOptions,
    estimate_of,
    evaluate,
    lower_bound_of,
    memory_of,
    partitions,
)
from megatron_bfpp.schedules.fit import (
    BATCH_SCHEDULE_FLAG,
    check_overlapped_pairs,
    num_microbatches,
)
from megatron_bfpp.schedules.registry import (
    build_schedule,
    check_sharding_data_parallel,
    get_spec,
    planned_schedules,
)

__all__ = [
    "AUTO",
    "AutoRequest",
    "Decision",
    "Hardware",
    "Row",
    "add_auto_flags",
    "check_auto_flags",
    "decide",
    "gpu_from_device",
    "gpus_per_node_from_env",
    "hardware",
    "partitions",
    "write_report",
]

AUTO = "auto"
_NO_PAIRS = (
    "has no pairs to run as megatron-core's combined step (--overlap-moe-expert-parallel-comm)"
)
# What one decision may walk and simulate, in actions (docs/planner.md#pipeline-schedule-auto).
AUTO_ACTION_BUDGET = 2_000_000
# The most of it one candidate may take (a third), so one cannot leave the others untimed.
CANDIDATE_SHARE = 3
CPU_TIMING_GPU = "h100-80gb"  # what a run without CUDA is timed as, unless told otherwise
REPORT_FORMAT = "bfpp-auto-report"
# Where a front end records auto's line once it wrote the choice into the parsed arguments.
AUTO_DEST = "pipeline_schedule_auto_line"

# (flag, dest, help): the same three flags in every command line that names a schedule.
_AUTO_FLAGS = tuple(
    (f"--pipeline-schedule-auto-{name}", f"pipeline_schedule_auto_{name}", text)
    for name, text in (
        ("report", "write every candidate, ranked, as JSON to this file"),
        ("profile", "a stage profile (bfpp-plan profile) instead of the built-in efficiency curve"),
        (
            "gpu",
            "plan for this GPU preset (v100-32gb, a100-40gb, a100-80gb, h100-80gb) instead of "
            "the device found, its memory a constraint",
        ),
    )
)


def add_auto_flags(group: Any) -> None:
    for flag, dest, help_text in _AUTO_FLAGS:
        group.add_argument(
            flag,
            dest=dest,
            default=None,
            metavar="FILE" if "gpu" not in flag else "NAME",
            help=f"with --pipeline-schedule auto: {help_text}",
        )


def check_auto_flags(args: Any) -> None:
    """Auto flags with a named schedule say nothing, nor --combined-1f1b with auto (auto
    chooses it under --overlap-moe-expert-parallel-comm, and writes it back): one line."""
    if getattr(args, "pipeline_schedule", None) == AUTO:
        if getattr(args, "combined_1f1b", None):
            raise ScheduleError(
                "--combined-1f1b needs --pipeline-schedule interleaved, not auto (auto plans it "
                "under --overlap-moe-expert-parallel-comm)"
            )
        return
    if getattr(args, AUTO_DEST, None):  # auto decided: its flags were inputs, its options its own
        return
    for flag, dest, _ in _AUTO_FLAGS:
        if getattr(args, dest, None) is not None:
            raise ScheduleError(f"{flag} applies to --pipeline-schedule auto")


@dataclass(frozen=True, slots=True)
class Hardware:
    """Decision inputs for timing and budget (``memory_bytes`` None: no limit); ``note``: source."""

    gpu: Gpu
    memory_bytes: int | None
    efficiency: Efficiency
    note: str


@dataclass(frozen=True, slots=True)
class AutoRequest:
    """Everything the user fixed, and the constraints on what auto may choose (``None`` when
    not given); ``vp_flag`` the front end's virtual-pipeline flag, for its errors."""

    model: Model
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    hardware: Hardware
    cp: int = 1
    recompute: str = "none"
    precision: Precision = BF16_MIXED
    sharding: str = "optim"
    distributed_optimizer: bool = True
    gpus_per_node: int = 8
    vp: int | None = None
    group_size: int | None = None
    max_stored: int | None = None
    vp_flag: str = "--num-virtual-stages-per-pipeline-rank"
    sequence_parallel: bool = True  # with tp > 1 (Megatron-LM's --sequence-parallel)
    # (schedule, why): what the front end cannot run whatever the layout (Bridge: the V-shapes)
    unavailable: tuple[tuple[str, str], ...] = ()
    # Megatron-LM's --step-batch-size-schedule: every step's global batch, timed at the last
    batch_schedule: tuple[int, ...] = ()
    ep: int = 1  # Megatron-LM's --expert-model-parallel-size
    # --overlap-moe-expert-parallel-comm: plan only pairs megatron-core combines
    # (PlanGrid.overlapped), crediting the all-to-alls they hide; without it none is credited
    moe_overlap: bool = False
    # Megatron's uneven-stage flags: each candidate planned on the stages they give it
    uneven: UnevenStages = EVEN_STAGES

    @property
    def fixed_vp(self) -> int | None:
        """The stages per rank the user fixed: the flag, or the layout string's count."""
        layout = self.uneven.pipeline_model_parallel_layout
        if layout is not None and not self.uneven.partition:
            return len(layout_stages(layout)) // self.pp
        return self.vp

    def stage_layers(self, vp: int) -> tuple[int, ...]:
        """Each global stage's layers at ``vp`` stages per rank; () on even stages. Raises
        ``ScheduleError`` with why the uneven flags do not split so. With the planner's own
        partition to choose: even (Megatron's default row)."""
        if not self.uneven or self.uneven.partition:
            return ()
        try:
            return self.uneven.stage_layers(self.model.num_layers, self.pp, vp)
        except ValueError as error:
            raise ScheduleError(str(error)) from None

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def step_microbatches(self) -> tuple[int, ...]:
        """The micro-batches of every step the schedule will run (one without a schedule)."""
        batches = self.batch_schedule or (self.global_batch_size,)
        return tuple(batch // (self.micro_batch_size * self.dp) for batch in batches)

    @property
    def peak_batch_size(self) -> int:
        """The largest step's global batch: what memory is planned for."""
        return max(self.batch_schedule or (self.global_batch_size,))


@dataclass(frozen=True, slots=True)
class Row:
    """One candidate: its memory and, when it fits, its simulated plan; or why it cannot run."""

    candidate: Candidate
    memory: MemoryBreakdown | None
    fits: bool
    plan: Plan | None = None
    excluded: str | None = None
    lower_bound_s: float | None = None  # not simulated: this bound cannot beat the runner-up
    untimed: bool = False  # not timed: it would have exceeded auto's action budget

    @property
    def label(self) -> str:
        return label(self.candidate)

    def to_dict(self) -> dict[str, object]:
        c = self.candidate
        return {
            "schedule": c.schedule,
            "virtual_stages": c.vp,
            "group_size": c.group_size,
            "max_stored": c.max_stored,
            "combined_1f1b": c.combined_1f1b,
            "stage_layers": list(c.stage_layers) or None,
            "fits": self.fits,
            "step_time_s": None if self.plan is None else self.plan.step_time_s,
            "bubble_fraction": None if self.plan is None else self.plan.bubble_fraction,
            "memory_per_gpu_bytes": None if self.memory is None else self.memory.to_dict(),
            "excluded": self.excluded,
            "lower_bound_s": self.lower_bound_s,
            "over_budget": self.untimed,
            "p2p_model": None if self.plan is None else self.plan.p2p_model,
        }


def label(c: Candidate) -> str:
    """``breadth-first vp=4 group=8``, ``interleaved vp=2 combined-1f1b``: what a user would
    type, in short."""
    looped = get_spec(c.schedule).placement is Placement.LOOPED
    shown = (("vp", c.vp if looped else None), ("group", c.group_size), ("cap", c.max_stored))
    words = [c.schedule, *(f"{key}={value}" for key, value in shown if value is not None)]
    return " ".join(words + ["combined-1f1b"] * c.combined_1f1b)


@dataclass(frozen=True, slots=True)
class Decision:
    """Rows ranked (fastest, smallest too big, unrunnable), the choice, Megatron's default."""

    request: AutoRequest
    rows: tuple[Row, ...]
    megatron: Row
    simulations: int
    actions_spent: int = 0  # of the action budget (AUTO_ACTION_BUDGET)
    action_budget: int = AUTO_ACTION_BUDGET

    @property
    def untimed(self) -> int:
        """Candidates left untimed because the action budget was spent."""
        return sum(row.untimed for row in self.rows)

    @property
    def chosen(self) -> Row:
        return self.rows[0]

    @property
    def runner_up(self) -> Row | None:
        return next((row for row in self.rows[1:2] if row.plan is not None), None)

    @property
    def schedule(self) -> str:
        return self.chosen.candidate.schedule

    @property
    def stages_per_rank(self) -> int:
        return self.chosen.candidate.vp

    @property
    def options(self) -> dict[str, int]:
        """The chosen schedule's generator options (registry names)."""
        return self.chosen.candidate.options

    def line(self) -> str:
        """The one line a job prints: the choice, its prediction, the runner-up, Megatron's."""
        hw, chosen = self.request.hardware, self.chosen
        plan, memory = chosen.plan, chosen.memory
        assert plan is not None and memory is not None  # rows[0] is simulated by construction
        if hw.memory_bytes is None:  # MiB for what would print as 0.0 GiB (the CPU tests' models)
            total = memory.total
            shown = f"{_gib(total)} GiB" if total >= GiB // 20 else f"{total / 2**20:.1f} MiB"
            held = f"{shown}; no CUDA: memory is not a constraint"
        else:
            held = f"{_gib(memory.total)} GiB/{hw.memory_bytes / GiB:.0f}"
        text = (
            f"auto: {chosen.label} (predicted {plan.step_time_s:.3g} s, bubble "
            f"{plan.bubble_fraction:.0%}, {held})"
        )
        if (second := self.runner_up) is not None and second.plan is not None:
            text += f" over {second.label} ({second.plan.step_time_s:.3g} s)"
        text += f"; Megatron's {self.megatron.label}: {_megatron_figure(self.megatron)}"
        if self.untimed:
            text += (
                f"; {self.untimed} of {len(self.rows)} candidates not timed (over the budget "
                f"of {self.action_budget:,} simulated actions)"
            )
        stages = f"; stages of {uneven}" if (uneven := self.request.uneven.given()) else ""
        if self.request.uneven.partition:  # what reproduces the choice
            layout = layout_of(chosen.candidate.stage_layers)
            stages = f"; its layout: --pipeline-model-parallel-layout '{layout}'"
        return f"{text} [{hw.note}{stages}]"

    def to_dict(self) -> dict[str, object]:
        r, hw = self.request, self.request.hardware
        return {
            "format": REPORT_FORMAT,
            "version": 1,
            "line": self.line(),
            "choice": self.chosen.to_dict(),
            "megatron_default": self.megatron.to_dict(),
            "gpu": hw.gpu.name,
            "hardware": hw.note,
            "memory_budget_bytes": None if hw.memory_bytes is None else _budget(hw),
            "efficiency": hw.efficiency.source,
            "simulations": self.simulations,
            "actions_simulated": self.actions_spent,
            "action_budget": self.action_budget,
            "untimed": self.untimed,
            "layout": {
                "model": r.model.name,
                "tensor_parallel": r.tp,
                "pipeline_parallel": r.pp,
                "data_parallel": r.dp,
                "context_parallel": r.cp,
                "micro_batch_size": r.micro_batch_size,
                "global_batch_size": r.global_batch_size,
                "num_microbatches": r.num_microbatches,
                "step_batch_sizes": list(r.batch_schedule) or None,
                "recompute": r.recompute,
                "precision": r.precision.name,
                "sharding": r.sharding,
                "distributed_optimizer": r.distributed_optimizer,
                "gpus_per_node": r.gpus_per_node,
                "uneven_stages": r.uneven.given() or None,
            },
            "rows": [row.to_dict() for row in self.rows],
        }


def _megatron_figure(row: Row) -> str:
    if row.untimed:
        return "not timed (over the action budget)"
    if row.excluded is not None:
        return f"cannot run ({row.excluded})"
    assert row.plan is not None and row.memory is not None
    figure = f"{row.plan.step_time_s:.3g} s"
    return figure if row.fits else f"{figure}, does not fit ({_gib(row.memory.total)} GiB)"


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f}"


def _budget(hw: Hardware) -> int:
    """The planner's budget: its ``memory_fraction`` of the GPU (the rest: allocator, NCCL)."""
    assert hw.memory_bytes is not None
    return int(SearchOptions().memory_fraction * hw.memory_bytes)


def gpu_from_device(name: str, total_memory: int | None = None) -> tuple[Gpu, str]:
    """A planner preset for a CUDA device name (its memory if given); unknown: an H100, noted."""
    lowered, large = name.lower(), total_memory is None or total_memory > 48 * GiB
    families = {  # the first whose names the device's contains
        "v100-32gb": ("v100",),
        "a100-80gb" if large else "a100-40gb": ("a100", "a800"),
        "h100-80gb": ("h100", "h200", "h800", "gh200"),
    }
    found = next((p for p, names in families.items() if any(f in lowered for f in names)), None)
    preset = found or CPU_TIMING_GPU
    note = f"{name} timed as {preset}" if found else f"unknown GPU {name!r}: timed as {preset}"
    gpu = GPUS[preset]
    if total_memory is not None:
        gpu = dataclasses.replace(gpu, memory_bytes=int(total_memory))
    return gpu, note


def hardware(
    *,
    device_name: str | None,
    device_memory: int | None,
    gpu_flag: str | None = None,
    profile_path: str | None = None,
) -> Hardware:
    """The hardware a front end found: torch's device (``None`` without CUDA) unless ``gpu_flag``
    names a preset (its memory binding even so); efficiencies from ``profile_path`` or built in."""
    profile = load_profile(profile_path) if profile_path else None
    if gpu_flag is not None:
        gpu = get_gpu(gpu_flag)
        memory: int | None = gpu.memory_bytes
        note = f"{gpu_flag} as given"
    elif device_name is not None:
        gpu, note = gpu_from_device(device_name, device_memory)
        memory = gpu.memory_bytes
    elif profile is not None:
        gpu, memory = gpu_from_device(profile.device)[0], None
        note = f"no CUDA: timed as {gpu.name} (the profile's {profile.device})"
    else:
        gpu, memory = GPUS[CPU_TIMING_GPU], None
        note = f"no CUDA: timed as {CPU_TIMING_GPU}"
    if profile is not None:
        efficiency: Efficiency = ProfileCurve.from_profile(profile, gpu)
        note += f", {efficiency.source}"
    else:
        efficiency = BuiltinCurve(gpu)
    return Hardware(gpu=gpu, memory_bytes=memory, efficiency=efficiency, note=note)


def gpus_per_node_from_env(env: Mapping[str, str], world_size: int) -> int:
    """GPUs per node from torchrun's or SLURM's environment (``8`` or ``8(x2)``), else one node."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        digits = env.get(key, "").split("(")[0].split(",")[0].strip()
        if digits.isdigit() and int(digits) > 0:
            return min(int(digits), world_size)
    return world_size


def _check_request(r: AutoRequest) -> None:
    """One-line refusals for a layout auto cannot choose in, or constraints that contradict."""
    if r.pp < 2:
        raise ScheduleError(
            f"--pipeline-schedule auto needs --pipeline-model-parallel-size >= 2 (got {r.pp}): "
            "without pipeline parallelism there is no schedule to choose"
        )
    if r.recompute not in RECOMPUTE:
        raise ScheduleError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {r.recompute}")
    for batch in r.batch_schedule or (r.global_batch_size,):
        num_microbatches(
            global_batch_size=batch,
            micro_batch_size=r.micro_batch_size,
            data_parallel_size=r.dp,
            what=f"{BATCH_SCHEDULE_FLAG}'s batch size {batch}" if r.batch_schedule else None,
        )
    if r.uneven.partition and (others := r.uneven.given().split(" --")[1:]):
        raise ScheduleError(
            f"--pipeline-model-parallel-layout auto chooses the layers per stage itself; drop "
            f"--{others[0]}"
        )
    if (layout := r.uneven.pipeline_model_parallel_layout) is not None and not r.uneven.partition:
        try:
            stages = layout_virtual_stages(layout, r.pp, r.model.num_layers)
        except ValueError as error:
            raise ScheduleError(str(error)) from None
        if (placed := "".join(layout_stages(layout)).count("m")) != r.model.mtp_num_layers:
            raise ScheduleError(
                f"--pipeline-model-parallel-layout places {placed} MTP layer(s) (m) and "
                f"--mtp-num-layers is {r.model.mtp_num_layers}: give the same number"
            )
        if r.vp not in (None, stages):
            raise ScheduleError(
                f"--pipeline-model-parallel-layout lists {stages} stages per rank; drop "
                f"{r.vp_flag} {r.vp}"
            )
    if r.model.num_layers % r.pp and not r.uneven:
        raise ScheduleError(
            f"--num-layers {r.model.num_layers} is not divisible by --pipeline-model-parallel-"
            f"size {r.pp}: no schedule can split it"
        )
    if r.vp is not None and r.model.num_layers % (r.pp * r.vp) and not r.uneven:
        raise ScheduleError(
            f"--num-layers {r.model.num_layers} is not divisible by pipeline x virtual stages "
            f"({r.pp} x {r.vp} = {r.pp * r.vp}) given by {r.vp_flag}"
        )
    if r.group_size is not None and r.max_stored is not None:
        raise ScheduleError(
            "--breadth-first-group-size (breadth-first) and --bpipe-max-stored (bpipe) exclude "
            "each other under --pipeline-schedule auto: give at most one"
        )
    if r.max_stored is not None and r.vp not in (None, 1):
        raise ScheduleError(
            f"--bpipe-max-stored applies to bpipe, which runs one stage per rank, but "
            f"{r.vp_flag} {r.vp} fixes {r.vp}: drop one of them"
        )
    if r.group_size is not None and r.vp == 1:
        raise ScheduleError(
            f"--breadth-first-group-size applies to breadth-first, which needs virtual stages, "
            f"but {r.vp_flag} 1 fixes one stage per rank: drop one of them"
        )
    if r.sharding != "optim" and (r.max_stored is not None or r.vp == 1):
        raise ScheduleError(
            "--data-parallel-sharding-strategy optim_grads_params runs only breadth-first, "
            "which needs virtual stages: drop --bpipe-max-stored / set virtual stages >= 2"
        )
    experts = r.model.num_experts
    if r.ep > 1 and (not experts or experts % r.ep or (r.dp * r.cp) % r.ep):
        raise ScheduleError(
            f"--expert-model-parallel-size {r.ep} must divide --num-experts ({experts}) and the "
            f"data x context parallel size ({r.dp * r.cp}): choose another, or 1"
        )
    if r.moe_overlap and r.ep < 2:
        raise ScheduleError(
            "--overlap-moe-expert-parallel-comm needs --expert-model-parallel-size > 1 "
            f"(megatron-core's condition; got {r.ep}): there is no all-to-all to hide"
        )
    check_sharding_data_parallel(r.sharding, r.dp)


MTP_ON_A_V = "--mtp-num-layers does not run with a V-shape"  # the runtime refuses it


def _candidates(r: AutoRequest) -> tuple[list[Candidate], list[Row]]:
    """What a schedule may choose on the user's layout, and (as rows) what it may not and why:
    the grid ``recommend`` searches too, narrowed by what the user fixed."""
    layers_per_rank, fixed_vp = _layers_per_rank(r), r.fixed_vp
    allowed: list[Candidate] = []
    excluded: list[Row] = []

    def refuse(name: str, vp: int, why: str) -> None:
        candidate = _candidate(r, name, vp, r.sharding, layers=())
        excluded.append(Row(candidate, None, False, excluded=why))

    unavailable = dict(r.unavailable)
    given = {"group_size": r.group_size, "max_stored": r.max_stored}
    fixed = {key: value for key, value in given.items() if value is not None}
    for spec in planned_schedules():
        name = spec.name
        if r.sharding not in spec.plan.shardings:
            continue
        if name in unavailable:
            refuse(name, spec.default_stages_per_rank, unavailable[name])
            continue
        if r.model.mtp_num_layers and spec.placement is Placement.V_SHAPE:
            refuse(name, spec.default_stages_per_rank, MTP_ON_A_V)
            continue
        if not set(fixed) <= set(spec.option_names):
            continue  # the user's option belongs to another schedule
        if r.moe_overlap and (fixed or not spec.plan.overlapped):
            refuse(name, spec.default_stages_per_rank, _NO_PAIRS)
            continue
        if spec.placement is Placement.LOOPED and fixed_vp is not None:
            vps: tuple[int, ...] = (fixed_vp,)
        else:
            vps, why = spec.planned_stages(layers_per_rank)
            if why is not None and not r.uneven:
                refuse(name, spec.default_stages_per_rank, why)
                continue
            if r.uneven and spec.placement is not Placement.LOOPED:  # its own stages per rank
                vps = (spec.default_stages_per_rank,)
            if fixed_vp is not None:
                if fixed_vp not in vps:
                    if r.uneven.pipeline_model_parallel_layout:  # said, not silently left out
                        why = f"places {vps[0]} stage(s) per rank, the layout {fixed_vp}"
                        refuse(name, spec.default_stages_per_rank, why)
                    continue  # the user's virtual stages rule this placement out
                vps = (fixed_vp,)
        split, unsplit = _splits(r, vps)
        if unsplit and not split:  # said once: the first stages per rank it tried
            refuse(name, unsplit[0][0], unsplit[0][1])
        for vp, layers in split:
            problems = (spec.planned_microbatches_problem(r.pp, m) for m in r.step_microbatches)
            if (problem := next((p for p in problems if p), None)) is not None:
                refuse(name, vp, problem)
                continue
            # the timed (last) step's grid; the other steps are checked per candidate
            m = r.num_microbatches
            grid: Sequence[Mapping[str, Any]] = [fixed] if fixed else spec.plan.options(r.pp, m)
            if r.moe_overlap:  # only pairs megatron-core combines can take the flag
                grid = spec.plan.overlapped
            allowed += [_candidate(r, name, vp, r.sharding, chosen, layers) for chosen in grid]
    return allowed, excluded


def _layers_per_rank(r: AutoRequest) -> int:
    """The most layers a pipeline rank holds at one stage per rank, whose divisors are the
    virtual stages tried (uneven flags that do not split so: an even rank's)."""
    even = r.model.num_layers // r.pp
    if not r.uneven or r.uneven.partition or r.fixed_vp is not None:
        return even
    try:
        return max(r.stage_layers(1))
    except ScheduleError:
        return even


def _splits(
    r: AutoRequest, vps: Sequence[int]
) -> tuple[list[tuple[int, tuple[int, ...]]], list[tuple[int, str]]]:
    """(vp, its stages' layers) for each of ``vps`` the uneven flags split, and (vp, why not);
    with ``--pipeline-model-parallel-layout auto``, each of its partitions."""
    if r.uneven.partition:
        return [(vp, p) for vp in vps for p in partitions(r.model.num_layers, r.pp * vp)], []
    split, unsplit = [], []
    for vp in vps:
        try:
            split.append((vp, r.stage_layers(vp)))
        except ScheduleError as error:
            unsplit.append((vp, first_line(error)))
    return split, unsplit


def _candidate(
    r: AutoRequest,
    name: str,
    vp: int,
    sharding: str,
    chosen: Mapping[str, Any] | None = None,
    layers: tuple[int, ...] = (),
) -> Candidate:
    """``name`` on the user's layout (``layers``: its uneven stages), with the generator options
    ``chosen``."""
    return Candidate(
        name, sharding, r.tp, r.pp, vp, r.dp, r.micro_batch_size, r.recompute,
        plain_tensor_parallel=r.tp > 1 and not r.sequence_parallel, ep=r.ep,
        stage_layers=layers, **(chosen or {}),
    )  # fmt: skip


@paused_gc()  # its builds and simulations make millions of objects and no cycles
def decide(r: AutoRequest) -> Decision:
    """Rank the schedules the layout admits, or refuse in one line (:class:`ScheduleError`) when
    none does or fits. Each fitting candidate is simulated once, Megatron's default also under
    megatron-core's posting, within :data:`AUTO_ACTION_BUDGET`; one over what is left is untimed."""
    _check_request(r)
    judge = _Judge.of(r)
    allowed, excluded = _candidates(r)
    # Megatron's default (interleaved at the user's vp, else 1F1B) first: the line compares with it
    # (with the all-to-all overlap: its combined 1F1B, which megatron-core runs only interleaved)
    fixed = r.fixed_vp
    name, vp = ("interleaved", fixed) if fixed not in (None, 1) else ("1f1b", 1)
    combined = {"combined_1f1b": True} if r.moe_overlap and name == "interleaved" else None
    try:
        default = _candidate(r, name, vp or 1, "optim", combined, r.stage_layers(vp or 1))
    except ScheduleError as error:  # the uneven flags do not split for Megatron's default
        default = _candidate(r, name, vp or 1, "optim", combined)
        excluded.append(Row(default, None, False, excluded=first_line(error)))
    found = next((row for row in excluded if row.candidate == default), None)
    megatron = found or judge.row(default, megatron=True)
    simulated: list[Row] = []
    too_big: list[Row] = []
    untimed: list[Row] = []
    # A candidate whose bound cannot beat the runner-up is not simulated (choice, runner-up: exact).
    bounded: list[tuple[float, float, int, Candidate]] = []  # (order, bound, index, candidate)
    bound_of = partial(
        lower_bound_of, model=judge.model, cluster=judge.cluster, options=judge.options
    )
    for index, c in enumerate(allowed):
        try:
            bound, order = (
                bound_of(c, global_batch_size=r.global_batch_size, grouped=grouped)
                for grouped in (True, False)
            )
        except ScheduleError as error:
            excluded.append(Row(c, None, False, excluded=first_line(error)))
            continue
        bounded.append((order, bound, index, c))
    if r.uneven.partition and r.num_microbatches > EVERY_PARTITION_UP_TO * r.pp:
        expected = partial(
            estimate_of, model=judge.model, cluster=judge.cluster, options=judge.options,
            global_batch_size=r.global_batch_size,
        )  # fmt: skip
        bounded = _best_partitions(bounded, expected)  # of each candidate's, the best expected
    pruned: list[Row] = []
    # Megatron's default first, then by cheapest bound: a cut budget never picks worse than Megatron
    for *_, bound, c in sorted((c != default, o, i, b, c) for o, b, i, c in bounded):
        steps = sorted(row.plan.step_time_s for row in simulated if row.plan)
        row = judge.row(c, bound=bound if len(steps) >= 2 and bound >= steps[1] else None)
        if row.untimed:
            untimed.append(row)
        elif row.excluded is not None:
            excluded.append(row)
        elif row.plan is not None:
            simulated.append(row)
        elif row.lower_bound_s is not None and row.fits:
            pruned.append(row)
        else:
            too_big.append(row)
    simulated.sort(key=lambda row: row.plan.step_time_s if row.plan else math.inf)
    simulated += sorted(pruned, key=lambda row: row.lower_bound_s or 0.0)
    too_big.sort(key=lambda row: row.memory.total if row.memory else math.inf)
    if not simulated:
        raise ScheduleError(_refusal(r, too_big, excluded, untimed, judge))
    rows = tuple(simulated + too_big + untimed + excluded)
    simulations = sum(row.plan is not None for row in (*rows, megatron))  # each row simulated once
    return Decision(r, rows, megatron, simulations, judge.actions.spent, judge.actions.limit)


def _best_partitions(
    bounded: list[tuple[float, float, int, Candidate]], expected: Callable[[Candidate], float]
) -> list[tuple[float, float, int, Candidate]]:
    """Of each candidate's partitions, the ``PARTITIONS_KEPT`` ``expected`` fastest
    (``search.estimate_of``: BPipe's evictions too, which its bound leaves out) and the first
    generated, the most even (``partitions``), so the choice is never timed worse than the even
    stages."""
    groups: dict[Candidate, list[tuple[float, float, int, Candidate]]] = {}
    for item in bounded:
        groups.setdefault(dataclasses.replace(item[3], stage_layers=()), []).append(item)
    kept = [
        sorted(group, key=lambda item: (expected(item[3]), item))[:PARTITIONS_KEPT] + group[:1]
        for group in groups.values()
    ]
    return [item for group in kept for item in dict.fromkeys(group)]


@dataclass(frozen=True, slots=True)
class _Judge:
    """How :func:`decide` sizes and times a candidate of one request, and the budgets it spends."""

    request: AutoRequest
    model: Model
    cluster: Cluster
    options: SearchOptions
    memory_budget: int | None
    actions: ActionBudget

    @staticmethod
    def of(r: AutoRequest) -> _Judge:
        model = r.model if r.cp == 1 else r.model.with_seq_length(r.model.seq_length // r.cp)
        n = r.tp * r.pp * r.dp
        cluster = Cluster(n, math.gcd(n, max(1, r.gpus_per_node // r.cp)), r.hardware.gpu)
        options = SearchOptions(
            precision=r.precision,
            distributed_optimizer=r.distributed_optimizer,
            efficiency=r.hardware.efficiency,
            megatron_baselines=False,
            moe_overlap=r.moe_overlap,
        )
        memory = None if r.hardware.memory_bytes is None else _budget(r.hardware)
        return _Judge(r, model, cluster, options, memory, ActionBudget(AUTO_ACTION_BUDGET))

    def row(self, c: Candidate, *, megatron: bool = False, bound: float | None = None) -> Row:
        """Its memory (at a batch-size schedule's largest step) and, when it fits or is Megatron's
        default (``megatron``: timed under megatron-core's posting), its simulated plan, or why
        not; with a ``bound`` that cannot beat the runner-up, only its memory and the bound."""
        try:
            memory = memory_of(
                c,
                model=self.model,
                global_batch_size=self.request.peak_batch_size,
                options=self.options,
                budget=self.actions,
            )
            if bound is None:
                _check_every_step(c, self.request, self.actions, pairs=not megatron)
        except OverBudget as error:
            return _untimed(c, None, self.actions, error)
        except ScheduleError as error:
            return Row(c, None, False, excluded=first_line(error))
        fits = self.memory_budget is None or memory.total <= self.memory_budget
        if bound is not None:
            return Row(c, memory, fits, lower_bound_s=bound)
        if not fits and not megatron:
            return Row(c, memory, False)
        options = dataclasses.replace(self.options, megatron_baselines=megatron)
        share = self.actions.part(self.actions.limit // CANDIDATE_SHARE)
        try:
            plan = evaluate(
                c,
                model=self.model,
                cluster=self.cluster,
                global_batch_size=self.request.global_batch_size,
                options=options,
                budget=share,
            )
        except OverBudget as error:
            return _untimed(c, memory, self.actions, error)
        except ScheduleError as error:
            return Row(c, memory, False, excluded=first_line(error))
        finally:
            self.actions.spent += share.spent
        return Row(c, memory, fits, plan)


def _untimed(
    c: Candidate, memory: MemoryBreakdown | None, actions: ActionBudget, error: OverBudget
) -> Row:
    why = (
        f"not timed: over auto's budget of {actions.limit:,} simulated actions, of which one "
        f"candidate may take 1/{CANDIDATE_SHARE} ({error})"
    )
    return Row(c, memory, False, excluded=why, untimed=True)


def _check_every_step(
    c: Candidate, r: AutoRequest, actions: ActionBudget, *, pairs: bool = True
) -> None:
    """A batch-size schedule's other steps must build too (the timed one is simulated); with
    ``AutoRequest.moe_overlap`` (and ``pairs``) every step, timed too, must have pairs that
    megatron-core combines, as the job's own check (``schedules.fit.check_fit``) requires."""
    overlapped = r.moe_overlap and pairs
    steps = set(r.step_microbatches) - (set() if overlapped else {r.num_microbatches})
    for m in sorted(steps):
        actions.charge(num_ranks=c.pp, stages_per_rank=c.vp, num_microbatches=m)
        try:
            built = build_schedule(
                c.schedule,
                num_ranks=c.pp,
                num_microbatches=m,
                num_chunks=c.vp,  # build_schedule reads it as the schedule's own (chunks_for)
                lower=False,
                validate=False,
                **c.options,
            )
            if overlapped:
                check_overlapped_pairs(built)
        except ScheduleError as error:
            raise ScheduleError(
                f"cannot run a step of {m} micro-batches: {first_line(error)}"
            ) from None


def _refusal(
    r: AutoRequest, too_big: list[Row], excluded: list[Row], untimed: list[Row], judge: _Judge
) -> str:
    budget = judge.memory_budget
    if not too_big and untimed:
        return (
            f"--pipeline-schedule auto: timing this layout's schedules (pp={r.pp}, "
            f"{r.num_microbatches} micro-batches) needs more than auto's budget of "
            f"{judge.actions.limit:,} simulated actions; name the schedule with "
            "--pipeline-schedule (bfpp-plan auto shows the candidates)"
        )
    if not too_big:
        by_reason: dict[str | None, list[str]] = {}  # the same reason said once, for all its rows
        for row in excluded:
            by_reason.setdefault(row.excluded, []).append(row.label)
        reasons = "; ".join(
            f"{', '.join(dict.fromkeys(by))}: {why}" for why, by in by_reason.items()
        )
        return f"--pipeline-schedule auto: no schedule can run this layout ({reasons})"
    smallest = too_big[0]
    assert smallest.memory is not None and budget is not None
    hints = []
    if r.recompute != "full":
        more = "full" if r.recompute == "selective" else "selective or full"
        hints.append(f"{more} activation recomputation")
    if r.micro_batch_size > 1:
        hints.append(f"a micro-batch size below {r.micro_batch_size}")
    hints.append(f"larger tensor / pipeline parallel sizes than tp={r.tp}, pp={r.pp}")
    gpu = r.hardware.gpu.name
    return (
        f"--pipeline-schedule auto: nothing fits {gpu} ({_gib(budget)} GiB usable): the smallest "
        f"predicted peak is {_gib(smallest.memory.total)} GiB per GPU ({smallest.label}); use "
        + ", ".join(hints)
    )


def write_report(path: str, decision: Decision) -> None:
    """The ranked table as JSON, written as :func:`megatron_bfpp.files.write_output` writes."""
    write_output(path, (json.dumps(decision.to_dict(), indent=2, allow_nan=False) + "\n").encode())
