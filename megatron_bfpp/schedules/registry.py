"""The schedule generators behind one registry keyed by the user-facing names; ``build_schedule``
is the one way in, so every caller gets a checked, lowered schedule that is proven to run."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_bfpp.ir import MAX_ACTIONS, ActionKind, Placement, Schedule, ScheduleError, parts
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.eviction import bpipe_max_stored
from megatron_bfpp.passes.grad_sync import SHARDING_STRATEGIES, add_grad_sync
from megatron_bfpp.schedules.bpipe import build_bpipe
from megatron_bfpp.schedules.breadth_first import build_breadth_first
from megatron_bfpp.schedules.dualpipe_v import LEAST_MICROBATCHES_PER_RANK, build_dualpipe_v
from megatron_bfpp.schedules.gpipe import build_gpipe
from megatron_bfpp.schedules.interleaved import build_interleaved
from megatron_bfpp.schedules.one_f_one_b import build_1f1b
from megatron_bfpp.schedules.v_shape import build_v_half, build_v_min, build_v_zb
from megatron_bfpp.validate import validate_schedule

__all__ = [
    "ALL_OPTIONS",
    "LAYOUT_VP_FLAG",
    "MAX_ACTIONS",
    "MAX_RANK_STAGES",
    "MEGATRON_VP_FLAGS",
    "PLANNER_MAX_CHUNKS",
    "SCHEDULES",
    "SHARDING_STRATEGIES",
    "PlanGrid",
    "ScheduleOption",
    "ScheduleSpec",
    "add_option_flags",
    "build_schedule",
    "check_option_flags",
    "check_sharding",
    "check_sharding_data_parallel",
    "check_size",
    "estimate_actions",
    "forward_only_schedule",
    "get_spec",
    "in_flag_terms",
    "options_from_args",
    "planned_schedules",
    "schedule_names",
]


# Megatron-LM's (and bfpp-train's) virtual-pipeline flags, named in placement errors.
MEGATRON_VP_FLAGS = (
    "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank"
)
# With a layout the stages per rank are its own (Megatron-LM and bfpp-train derive them).
LAYOUT_VP_FLAG = "--pipeline-model-parallel-layout's stages per rank (its stages / pipeline size)"

# How large a schedule may be built (figures: docs/architecture.md, "Schedule size limits"); 7
# actions per stage and micro-batch: F and B (or F, I, W), four messages, BPipe's transfers.
_ACTIONS_PER_STAGE_MICROBATCH = 7
_BYTES_PER_ACTION = 700
MAX_RANK_STAGES = 32_000_000
_BYTES_PER_RANK_STAGE = 32


@dataclass(frozen=True, slots=True)
class ScheduleOption:
    """One schedule option: its generator keyword and its flag in bfpp-train and Megatron-LM
    (``flag`` / ``dest``) and bfpp-sim (``sim_flag``); ``megatron_owned``: Megatron-LM defines and
    defaults it (its presence says nothing about the schedule); ``switch``: a bare flag, True."""

    name: str
    flag: str
    dest: str
    sim_flag: str
    help: str
    megatron_owned: bool = False
    switch: bool = False

    def argument(self, value_type: Any) -> dict[str, Any]:  # add_argument's, but name and help
        return {"action": "store_const", "const": True} if self.switch else {"type": value_type}


GROUP_SIZE = ScheduleOption(
    "group_size",
    "--breadth-first-group-size",
    "breadth_first_group_size",
    "--group-size",
    "breadth-first: micro-batches per group (bounds activation memory; default: all "
    "micro-batches in one group)",
)
MICROBATCH_GROUP_SIZE = ScheduleOption(
    "microbatch_group_size",
    "--microbatch-group-size-per-virtual-pipeline-stage",
    "microbatch_group_size_per_vp_stage",
    "--group-size",
    "interleaved: micro-batches per group (Megatron's own flag; default: pp)",
    megatron_owned=True,
)
COMBINED_1F1B = ScheduleOption(
    "combined_1f1b",
    "--combined-1f1b",
    "combined_1f1b",
    "--combined-1f1b",
    "interleaved: megatron-core's combined 1F1B order (its --overlap-moe-expert-parallel-comm's, "
    "which runs the pairs as its combined step); without that flag each pair runs F then B",
    switch=True,
)
MAX_STORED = ScheduleOption(
    "max_stored",
    "--bpipe-max-stored",
    "bpipe_max_stored",
    "--max-stored",
    "bpipe: most activations (in 1F1B stage units) any rank may hold (default: BPipe's "
    "ceil((p+2)/2))",
)


# The planners' bound on virtual stages per rank (recommend's default and auto's).
PLANNER_MAX_CHUNKS = 8

OptionGrid = Callable[[int, int], tuple[Mapping[str, Any], ...]]  # keys: Candidate fields too


def breadth_first_groups(pp: int, m: int) -> tuple[Mapping[str, int], ...]:
    """One group, or groups of pp x 2^k micro-batches below m and dividing it: each bounds the
    stored activations at one group's (pp: the least that keeps the pipeline full)."""
    grid: list[Mapping[str, int]] = [{}]
    group = pp
    while group < m:
        if m % group == 0:
            grid.append({"group_size": group})
        group *= 2
    return tuple(grid)


def bpipe_caps(pp: int, m: int) -> tuple[Mapping[str, int], ...]:
    """BPipe's own cap, and halfway from it to 1F1B's p (fewer transfers, more memory)."""
    default = bpipe_max_stored(pp)
    halfway = (default + pp + 1) // 2
    return ({},) + (({"max_stored": halfway},) if default < halfway < pp else ())


@dataclass(frozen=True, slots=True)
class PlanGrid:
    """The grid both planners (``recommend``, ``--pipeline-schedule auto``) try of a schedule."""

    shardings: tuple[str, ...] = ("optim",)  # the data-parallel sharding strategies it runs
    microbatches_per_pp: bool = False  # m must be a multiple of pp (Megatron's interleaved rule)
    least_microbatches_per_pp: int = 0  # m must be at least this x pp (dualpipe-v's 2)
    options: OptionGrid = lambda pp, m: ({},)  # generator options to try ({}: the defaults)
    # The options under which it runs pairs megatron-core combines (--overlap-moe-expert-parallel-
    # comm): for MoE models recommend's Megatron rows too; the only grid auto plans under that flag
    overlapped: tuple[Mapping[str, Any], ...] = ()
    last: bool = False  # ranks after equal predictions (GPipe holds every micro-batch)
    # long steps' lock-step times lie on lines through short ones (sim.simulate_steady), not BPipe's
    steady: bool = True


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """What a schedule name means (the one catalogue); ``options``: its generator's keywords."""

    name: str
    summary: str
    generator: Callable[..., Schedule]
    placement: Placement
    options: tuple[ScheduleOption, ...] = ()
    split_backward: bool = False
    plan: PlanGrid = field(default_factory=PlanGrid)

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(option.name for option in self.options)

    def check_option_names(self, names: Iterable[str]) -> None:
        """Reject generator options this schedule does not take, naming the ones it does."""
        if unknown := sorted(set(names) - set(self.option_names)):
            accepted = ", ".join(self.option_names) or "none"
            raise ScheduleError(
                f"{self.name} does not take option(s) {', '.join(unknown)}; it accepts: {accepted}"
            )

    @property
    def default_stages_per_rank(self) -> int:
        """What a front end's virtual-pipeline flag means when it is not given: one stage per
        rank, or two where the schedule needs virtual stages (looped) or places two (V)."""
        return 1 if self.placement is Placement.SINGLE else 2

    def stages_per_rank(self, num_chunks: int | None) -> int:
        """Stages per rank for :meth:`chunks_for`'s ``num_chunks`` (``None``: the placement's)."""
        return 2 if self.placement is Placement.V_SHAPE else num_chunks or 1

    def chunks_for(self, num_chunks: int | None, *, vp_flag: str = "--vp") -> int | None:
        """The generator's ``num_chunks`` for a requested virtual pipeline size (stages per
        rank; ``None`` when not given), or a :class:`ScheduleError` naming ``vp_flag``."""
        if self.placement is Placement.LOOPED:
            if num_chunks is None:
                raise ScheduleError(
                    f"{self.name} needs virtual pipeline stages: set {vp_flag} to at least 2 "
                    "(stages per rank)"
                )
            if num_chunks < 2:
                raise ScheduleError(
                    f"{self.name} needs virtual pipeline stages: set {vp_flag} to at least 2; "
                    f"with one chunk per rank use 1f1b (got {num_chunks})"
                )
            return num_chunks
        if self.placement is Placement.V_SHAPE and num_chunks not in (None, 2):
            raise ScheduleError(
                f"{self.name} places exactly 2 stages per rank (V-shape); "
                f"drop {vp_flag} or set it to 2, got {num_chunks}"
            )
        if self.placement is Placement.SINGLE and num_chunks not in (None, 1):
            raise ScheduleError(
                f"{self.name} runs one stage per rank; drop {vp_flag} or set it to 1 (got "
                f"{num_chunks}), or choose interleaved / breadth-first"
            )
        return None

    def planned_stages(self, layers_per_rank: int) -> tuple[tuple[int, ...], str | None]:
        """The virtual stages per rank a planner tries with this many layers per pipeline rank
        (1, 2 for a V, looped: the divisors from 2 to ``PLANNER_MAX_CHUNKS``), or none and why."""
        if self.placement is Placement.SINGLE:
            return (1,), None
        if self.placement is Placement.V_SHAPE:
            if layers_per_rank % 2:
                return (), f"{layers_per_rank} layers per rank do not split into a V's 2"
            return (2,), None
        top = min(PLANNER_MAX_CHUNKS, layers_per_rank)
        vps = tuple(v for v in range(2, top + 1) if layers_per_rank % v == 0)
        if not vps:
            return (), f"{layers_per_rank} layer(s) per rank: no virtual stages"
        return vps, None

    def planned_microbatches_problem(self, pp: int, m: int) -> str | None:
        """Why a planner may not run this schedule with ``m`` micro-batches on ``pp`` ranks."""
        if self.plan.microbatches_per_pp and (m < pp or m % pp):
            return f"needs a multiple of pp={pp} micro-batches, got {m}"
        if m < (least := self.plan.least_microbatches_per_pp * pp):
            return f"needs at least {least} micro-batches on pp={pp}, got {m}"
        return None


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec(
            "gpipe",
            "all forwards, then all backwards",
            build_gpipe,
            Placement.SINGLE,
            plan=PlanGrid(last=True),
        ),
        ScheduleSpec(
            "1f1b", "one forward one backward (megatron-core default)", build_1f1b, Placement.SINGLE
        ),
        ScheduleSpec(
            "interleaved",
            "Megatron's depth-first interleaved (looped) schedule",
            build_interleaved,
            Placement.LOOPED,
            (MICROBATCH_GROUP_SIZE, COMBINED_1F1B),
            plan=PlanGrid(microbatches_per_pp=True, overlapped=({"combined_1f1b": True},)),
        ),
        ScheduleSpec(
            "breadth-first",
            "looped, each chunk runs all micro-batches before the next",
            build_breadth_first,
            Placement.LOOPED,
            (GROUP_SIZE,),
            plan=PlanGrid(shardings=SHARDING_STRATEGIES, options=breadth_first_groups),
        ),
        ScheduleSpec(
            "bpipe",
            "1F1B with activation eviction to the partner stage",
            build_bpipe,
            Placement.SINGLE,
            (MAX_STORED,),
            plan=PlanGrid(options=bpipe_caps, steady=False),
        ),
        *(
            ScheduleSpec(name, summary, generator, Placement.V_SHAPE, split_backward=True)
            for name, summary, generator in (
                ("v-min", "V-shape, about 1/3 of 1F1B's activation memory", build_v_min),
                ("v-half", "V-shape, about 1/2 of 1F1B's activation memory", build_v_half),
                ("v-zb", "V-shape zero bubble at 1F1B's activation memory", build_v_zb),
            )
        ),
        ScheduleSpec(
            "dualpipe-v",
            "DualPipeV (DeepSeek-V3): V-shape, a forward and a backward overlapped as one action",
            build_dualpipe_v,
            Placement.V_SHAPE,
            split_backward=True,
            plan=PlanGrid(least_microbatches_per_pp=LEAST_MICROBATCHES_PER_RANK, overlapped=({},)),
        ),
    )
}
# Every option any schedule has, once (front ends add one flag each).
ALL_OPTIONS: tuple[ScheduleOption, ...] = tuple(
    {option.dest: option for spec in SCHEDULES.values() for option in spec.options}.values()
)


def schedule_names() -> tuple[str, ...]:
    return tuple(SCHEDULES)


def planned_schedules() -> tuple[ScheduleSpec, ...]:
    """The catalogue in the planners' order (``PlanGrid.last`` ones at the end), read when
    called: a schedule added to the catalogue is searched by ``recommend`` and ``auto``."""
    return tuple(sorted(SCHEDULES.values(), key=lambda spec: spec.plan.last))


def check_option_flags(name: str | None, args: Any, *, megatron: bool = False) -> None:
    """Reject an option's flag (on parsed ``args``) for a schedule not taking it (``name`` ``None``:
    one with none, like Megatron's ``default``); ``megatron``: its flags left alone."""
    mine = {option.dest for option in get_spec(name).options} if name is not None else set()
    for option in ALL_OPTIONS:
        given = getattr(args, option.dest, None) is not None
        if not given or option.dest in mine or (megatron and option.megatron_owned):
            continue
        takers = " / ".join(s.name for s in SCHEDULES.values() if option in s.options)
        raise ScheduleError(f"{option.flag} applies to --pipeline-schedule {takers}")


def add_option_flags(group: Any, value_type: Any, *, megatron: bool = False) -> None:
    """The schedule options as flags of ``group``; ``megatron``: not those Megatron-LM defines."""
    for option in ALL_OPTIONS:
        if not (megatron and option.megatron_owned):
            kind = {"dest": option.dest, "default": None, "help": option.help}
            group.add_argument(option.flag, **kind, **option.argument(value_type))


def options_from_args(name: str, args: Any, *, megatron: bool = False) -> dict[str, Any]:
    """The generator options of schedule ``name`` set on a parsed namespace (bfpp-train's or
    Megatron-LM's), after :func:`check_option_flags`; each value must be >= 1."""
    check_option_flags(name, args, megatron=megatron)
    options: dict[str, Any] = {}
    for option in get_spec(name).options:
        value = getattr(args, option.dest, None)
        if value is None:
            continue
        if value < 1:
            raise ScheduleError(f"{option.flag} must be >= 1, got {value}")
        options[option.name] = value
    return options


# Passes whose errors a flag can reach: their messages start with the pass's name, no use to users.
_PASS_PREFIX = re.compile(r"^(?:add_eviction|add_grad_sync|add_communication): ")


def in_flag_terms(message: str, name: str, *, sim: bool = False) -> str:
    """A schedule error as the command line said it: ``max_stored=1`` as ``--bpipe-max-stored 1``
    (bfpp-train, Megatron-LM) or ``--max-stored 1`` (``sim``), without the pass's function name."""
    for option in SCHEDULES[name].options if name in SCHEDULES else ():
        flag = option.sim_flag if sim else option.flag
        message = re.sub(rf"\b{option.name}=", f"{flag} ", message)
    return _PASS_PREFIX.sub("", message)


def estimate_actions(*, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> int:
    """About how many actions the lowered schedule has: ``_ACTIONS_PER_STAGE_MICROBATCH`` per
    stage and micro-batch, and a gradient sync and a parameter gather per stage."""
    return num_ranks * stages_per_rank * (_ACTIONS_PER_STAGE_MICROBATCH * num_microbatches + 2)


def check_size(*, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> None:
    """Refuse a schedule too large to build in about a minute, from its sizes alone, before
    anything is allocated; sizes that are not integers are left to the generator's checks."""
    sizes_given = (num_ranks, stages_per_rank, num_microbatches)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes_given):
        return
    actions = estimate_actions(
        num_ranks=num_ranks, stages_per_rank=stages_per_rank, num_microbatches=num_microbatches
    )
    sizes = f"pp={num_ranks} x {stages_per_rank} stage(s) per rank"
    if actions > MAX_ACTIONS:
        raise ScheduleError(
            f"schedule too large: {sizes} x {num_microbatches} micro-batches is about "
            f"{actions:,} actions and {_gigabytes(actions * _BYTES_PER_ACTION)} (limit "
            f"{MAX_ACTIONS:,} actions, about a minute and "
            f"{_gigabytes(MAX_ACTIONS * _BYTES_PER_ACTION)}); use fewer micro-batches, ranks "
            "or stages per rank"
        )
    if (tables := num_ranks * num_ranks * stages_per_rank) > MAX_RANK_STAGES:
        raise ScheduleError(
            f"schedule too large: {sizes} needs per-rank tables of ranks x stages = {tables:,} "
            f"entries, about {_gigabytes(tables * _BYTES_PER_RANK_STAGE)} (limit "
            f"{MAX_RANK_STAGES:,}, about 10 s and "
            f"{_gigabytes(MAX_RANK_STAGES * _BYTES_PER_RANK_STAGE)}); use fewer ranks or stages "
            "per rank"
        )


def _gigabytes(size: int) -> str:
    return f"{size / 1e9:,.1f} GB"


def get_spec(name: str) -> ScheduleSpec:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def build_schedule(
    name: str,
    *,
    num_ranks: int,
    num_microbatches: int,
    num_chunks: int | None = None,
    lower: bool = True,
    sharding: str = "optim",
    validate: bool = True,
    **options: Any,
) -> Schedule:
    """A validated schedule (``validate=False``: the planner's many builds; test_generators.py
    validates every generator); ``lower=False`` stops at the compute order, which ``sharding``
    leaves alone; ``num_chunks``: the virtual pipeline size; ``None`` options: the defaults."""
    spec = get_spec(name)
    chosen = {key: value for key, value in options.items() if value is not None}
    spec.check_option_names(chosen)
    chunks = spec.chunks_for(num_chunks)
    stages = spec.stages_per_rank(chunks)
    check_size(num_ranks=num_ranks, stages_per_rank=stages, num_microbatches=num_microbatches)
    chunk_args = {} if chunks is None else {"num_chunks": chunks}
    schedule = spec.generator(
        num_ranks=num_ranks, num_microbatches=num_microbatches, **chunk_args, **chosen
    )
    if lower:
        schedule = add_grad_sync(add_communication(schedule), sharding=sharding)
    if validate:
        # NCCL safety is proven by whoever posts it (validate's docstring): it costs 20x the rest
        validate_schedule(schedule, require_communication=lower, nccl=False)
    return schedule


def check_sharding(schedule: str, strategy: str) -> None:
    """Megatron's ``--data-parallel-sharding-strategy`` for a schedule, or one line before any work:
    sharded parameters go per model chunk, which only breadth-first runs back to back."""
    if strategy not in SHARDING_STRATEGIES:
        raise ScheduleError(
            f"data-parallel sharding strategy {strategy!r} is not one of "
            f"{', '.join(SHARDING_STRATEGIES)}"
        )
    if strategy == "optim":
        return
    if (placement := get_spec(schedule).placement) is not Placement.LOOPED:
        held = "two V chunks'" if placement is Placement.V_SHAPE else "one chunk's"
        raise ScheduleError(
            "--data-parallel-sharding-strategy optim_grads_params shards parameters and "
            "gradients per model chunk and needs breadth-first (several chunks per rank, each "
            f"chunk's backwards back to back); {schedule!r} keeps its {held} parameters for the "
            "whole step"
        )
    if schedule != "breadth-first":
        raise ScheduleError(
            "--data-parallel-sharding-strategy optim_grads_params needs breadth-first: "
            f"{schedule!r} visits each chunk once per micro-batch group, so its gradients would "
            "be reduce-scattered once per visit (or held whole all step); use "
            "--pipeline-schedule breadth-first"
        )


def check_sharding_data_parallel(strategy: str, data_parallel_size: int) -> None:
    """Refuse sharded parameters and gradients without data parallelism, where there is
    nothing to split them over: every front end and the runtime say this one line."""
    if strategy != "optim" and data_parallel_size < 2:
        raise ScheduleError(
            f"--data-parallel-sharding-strategy {strategy} needs data parallelism "
            f"(data-parallel size is {data_parallel_size}: there is nothing to shard over); add "
            "ranks or lower the model-parallel sizes"
        )


def forward_only_schedule(schedule: Schedule) -> Schedule:
    """The evaluation schedule: every rank's forwards in the training order, lowered again
    (megatron-core's forward-only order for ``interleaved``), sharded parameters kept."""
    compute = schedule.with_programs(
        [p for a in actions for p in parts(a) if p.kind is ActionKind.FORWARD]
        for actions in schedule.per_rank
    )
    lowered = add_communication(compute)
    if any(a.kind is ActionKind.RELEASE for actions in schedule.per_rank for a in actions):
        lowered = add_grad_sync(lowered, sharding="optim_grads_params")
    validate_schedule(lowered, require_backward=False, nccl=False)  # posted: proven then
    return lowered
