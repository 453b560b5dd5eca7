"""The schedule as data: actions, stage layouts and per-rank programs.

A pipeline schedule is, for each pipeline rank, the ordered list of actions it performs in one
training step. Everything else in the package (passes, validation, simulation, the runtime) reads
or transforms this one representation, so the schedule the simulator draws is the schedule the
GPUs run.

Text form of one action: ``{stage}{kind}{microbatch}`` with an optional peer, written ``>peer`` for
actions that ship data away and ``<peer`` for actions that receive it: ``3F5``, ``0SA5>1``,
``1RA5<0``, ``2GS`` (per-chunk actions carry no micro-batch). ``parse_action`` is the inverse of
``str``.
"""

from __future__ import annotations

import csv
import gc
import io
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from itertools import accumulate
from operator import attrgetter
from pathlib import Path

__all__ = [
    "COMPUTE_KINDS",
    "MEMORY_DELTA",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "StageLayout",
    "dump_csv",
    "dump_csv_text",
    "format_schedule",
    "load_csv",
    "load_csv_text",
    "parse_action",
    "parse_schedule",
    "paused_gc",
    "unchecked_action",
]


class ScheduleError(ValueError):
    """Any invalid schedule, layout or generator input; the message says what would work."""


class ActionKind(StrEnum):
    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    BACKWARD_INPUT = "I"  # input gradient only (zero-bubble split)
    BACKWARD_WEIGHT = "W"  # weight gradient only (zero-bubble split)
    SEND_ACT = "SA"  # send this stage's output to the next stage's rank
    RECV_ACT = "RA"  # receive this stage's input from the previous stage's rank
    SEND_GRAD = "SG"  # send the gradient of this stage's input to the previous stage's rank
    RECV_GRAD = "RG"  # receive the gradient of this stage's output from the next stage's rank
    EVICT = "EV"  # BPipe evictor: ship a micro-batch's stored activations to the acceptor
    ACCEPT = "AC"  # BPipe acceptor: receive and hold them
    RESTORE = "RS"  # BPipe acceptor: send them back to the evictor
    LOAD = "LD"  # BPipe evictor: receive them back before the backward
    GRAD_SYNC = "GS"  # start this chunk's data-parallel gradient reduction
    PARAM_SYNC = "PS"  # start this chunk's data-parallel parameter gather
    RELEASE = "RL"  # sharded parameters: free this chunk's gathered ones, keep the local shard

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self in _SENDS

    @property
    def is_recv(self) -> bool:
        return self in _RECVS

    @property
    def is_p2p(self) -> bool:
        return self in _SENDS or self in _RECVS


COMPUTE_KINDS = frozenset(
    {
        ActionKind.FORWARD,
        ActionKind.BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
    }
)
_SENDS = frozenset(
    {ActionKind.SEND_ACT, ActionKind.SEND_GRAD, ActionKind.EVICT, ActionKind.RESTORE}
)
_RECVS = frozenset({ActionKind.RECV_ACT, ActionKind.RECV_GRAD, ActionKind.ACCEPT, ActionKind.LOAD})
_CHUNK_LEVEL = frozenset({ActionKind.GRAD_SYNC, ActionKind.PARAM_SYNC, ActionKind.RELEASE})

# Longest kinds first so "SA" is not read as "S" + "A".
_KIND_PATTERN = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_KIND_PATTERN})(\d+)?(?:([<>])(\d+))?$")


@dataclass(frozen=True, slots=True, order=True, init=False)
class Action:
    """One step of one rank's program.

    ``stage`` is the global virtual stage the action belongs to (for communication: the local
    stage that sends or receives; for BPipe transfers: the evictor's stage). ``peer`` is the
    other pipeline rank of a point-to-point action and ``None`` otherwise.

    The constructor checks the fields (``ScheduleError`` says what is wrong); generators and
    passes that build valid actions by construction use ``unchecked_action``.
    """

    stage: int
    kind: ActionKind
    microbatch: int | None = None
    peer: int | None = None

    def __init__(
        self, stage: int, kind: ActionKind, microbatch: int | None = None, peer: int | None = None
    ) -> None:
        # Common case first and cheap: user code and tests create many compute actions.
        if not (
            kind in COMPUTE_KINDS
            and peer is None
            and microbatch is not None
            and microbatch >= 0
            and stage >= 0
        ):
            _check_action(stage, kind, microbatch, peer)
        # Frozen: set the slots through their descriptors (what object.__setattr__ does, faster).
        _set_stage(self, stage)
        _set_kind(self, kind)
        _set_microbatch(self, microbatch)
        _set_peer(self, peer)

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}"
        if self.microbatch is not None:
            text += str(self.microbatch)
        if self.peer is not None:
            text += (">" if self.kind.is_send else "<") + str(self.peer)
        return text

    def __repr__(self) -> str:
        return f"Action({self})"


_set_stage: Callable[[Action, int], None] = Action.__dict__["stage"].__set__
_set_kind: Callable[[Action, ActionKind], None] = Action.__dict__["kind"].__set__
_set_microbatch: Callable[[Action, int | None], None] = Action.__dict__["microbatch"].__set__
_set_peer: Callable[[Action, int | None], None] = Action.__dict__["peer"].__set__
_new_object = object.__new__


def unchecked_action(
    stage: int, kind: ActionKind, microbatch: int | None = None, peer: int | None = None
) -> Action:
    """``Action(stage, kind, microbatch, peer)`` without the field checks, for trusted callers.

    Generators and passes build hundreds of thousands of actions whose fields are right by
    construction (and ``validate_schedule`` checks every one of them in context); skipping the
    checks halves the cost of each. The result is an ordinary ``Action``: equality, hashing,
    ordering and text are the same.
    """
    action: Action = _new_object(Action)
    _set_stage(action, stage)
    _set_kind(action, kind)
    _set_microbatch(action, microbatch)
    _set_peer(action, peer)
    return action


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for a bulk build, check or simulation of a schedule.

    These allocate up to millions of actions, keys and events that form no reference cycles;
    left on, the collector rescans the growing heap again and again, which costs as much as
    the work itself on large schedules. Restores the previous state; nests.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _check_action(stage: int, kind: ActionKind, microbatch: int | None, peer: int | None) -> None:
    """The constructor's checks, with the message for the first field that is wrong."""
    if stage < 0:
        raise ScheduleError(f"action stage must be >= 0, got {stage}")
    if kind in _CHUNK_LEVEL:
        if microbatch is not None:
            raise ScheduleError(f"{kind.name} is per chunk and takes no micro-batch")
    elif microbatch is None or microbatch < 0:
        raise ScheduleError(f"{kind.name} needs a micro-batch index >= 0")
    if kind in _SENDS or kind in _RECVS:
        if peer is None or peer < 0:
            raise ScheduleError(f"{kind.name} needs a peer rank >= 0")
    elif peer is not None:
        raise ScheduleError(f"{kind.name} is not a point-to-point action; drop the peer")


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)``; raises ScheduleError naming the bad text."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ScheduleError(
            f"cannot parse action {text!r}: expected e.g. '3F5', '0SA5>1', '1RA5<0' or '2GS'"
        )
    stage, kind, microbatch, arrow, peer = match.groups()
    action_kind = ActionKind(kind)
    if arrow is not None and (arrow == ">") != action_kind.is_send:
        want = ">" if action_kind.is_send else "<"
        raise ScheduleError(f"cannot parse action {text!r}: {kind} is written with '{want}peer'")
    return Action(
        stage=int(stage),
        kind=action_kind,
        microbatch=None if microbatch is None else int(microbatch),
        peer=None if peer is None else int(peer),
    )


@dataclass(frozen=True, slots=True)
class StageLayout:
    """Which pipeline rank holds each global stage.

    Looped placement puts stage ``s`` on rank ``s % p``; the V-shape puts it on
    ``min(s, 2p - 1 - s)``. A rank's chunks are its stages in increasing order, which is
    megatron-core's ``vp_stage`` numbering for both placements.
    """

    stage_to_rank: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.stage_to_rank:
            raise ScheduleError("a layout needs at least one stage")
        ranks = set(self.stage_to_rank)
        if min(ranks) < 0 or ranks != set(range(max(ranks) + 1)):
            raise ScheduleError(
                f"layout ranks must be 0..p-1 with every rank used, got {self.stage_to_rank}"
            )
        per_rank = [self.stage_to_rank.count(r) for r in range(max(ranks) + 1)]
        if len(set(per_rank)) != 1:
            raise ScheduleError(
                f"every rank must hold the same number of stages, got {per_rank} "
                f"for layout {self.stage_to_rank}"
            )

    @classmethod
    def looped(cls, num_ranks: int, num_chunks: int = 1) -> StageLayout:
        _check_positive(num_ranks=num_ranks, num_chunks=num_chunks)
        return cls(tuple(s % num_ranks for s in range(num_ranks * num_chunks)))

    @classmethod
    def v_shape(cls, num_ranks: int) -> StageLayout:
        _check_positive(num_ranks=num_ranks)
        return cls(tuple(min(s, 2 * num_ranks - 1 - s) for s in range(2 * num_ranks)))

    @property
    def num_ranks(self) -> int:
        return max(self.stage_to_rank) + 1

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def num_chunks(self) -> int:
        return self.num_stages // self.num_ranks

    @property
    def stage_fraction(self) -> float:
        """Share of a full 1F1B stage (num_layers / pp layers) that one stage holds."""
        return self.num_ranks / self.num_stages

    @property
    def kind(self) -> str:
        if self == StageLayout.looped(self.num_ranks, self.num_chunks):
            return "looped"
        if self.num_chunks == 2 and self == StageLayout.v_shape(self.num_ranks):
            return "v-shape"
        return "custom"

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def chunk_of(self, stage: int) -> int:
        return self.stages_of(self.stage_to_rank[stage]).index(stage)

    def stage_of(self, rank: int, chunk: int) -> int:
        return self.stages_of(rank)[chunk]

    def is_last(self, stage: int) -> bool:
        return stage == self.num_stages - 1


@dataclass(frozen=True, slots=True)
class Schedule:
    """Program order for every pipeline rank; timing is the simulator's output, not stored here."""

    layout: StageLayout
    num_microbatches: int
    per_rank: tuple[tuple[Action, ...], ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ScheduleError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if len(self.per_rank) != self.layout.num_ranks:
            raise ScheduleError(
                f"schedule has {len(self.per_rank)} rank programs but the layout has "
                f"{self.layout.num_ranks} ranks"
            )

    @property
    def num_ranks(self) -> int:
        return self.layout.num_ranks

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def num_chunks(self) -> int:
        return self.layout.num_chunks

    @property
    def num_actions(self) -> int:
        return sum(len(actions) for actions in self.per_rank)

    def with_programs(self, per_rank: Iterable[Iterable[Action]]) -> Schedule:
        """Same layout and name, new programs: how passes return their result."""
        return Schedule(
            layout=self.layout,
            num_microbatches=self.num_microbatches,
            per_rank=tuple(tuple(actions) for actions in per_rank),
            name=self.name,
        )

    def compute_only(self) -> Schedule:
        return self.with_programs(
            [a for a in actions if a.kind.is_compute] for actions in self.per_rank
        )

    def stored_activations(self, rank: int) -> tuple[float, ...]:
        """Activations held on ``rank`` after each of its actions, in full-stage micro-batches.

        One unit is one micro-batch through one full 1F1B stage (num_layers / pp layers), so a
        stage of a looped or V layout counts ``stage_fraction``. A forward stores its
        activations until its backward (B, or W for split backward) frees them; BPipe's EV/RS
        hand them to the partner and AC/LD take them in. Program order, not time: this is what
        the runtime holds between two actions, transfers in flight included.
        """
        fraction = self.layout.stage_fraction
        # Integer counts, scaled once: no rounding drift.
        held = accumulate(map(_FULL_MEMORY_DELTA.__getitem__, map(_kind_of, self.per_rank[rank])))
        return tuple(count * fraction for count in held)

    def resident_parameters(self, rank: int) -> tuple[float, ...]:
        """Gathered (full) parameters held on ``rank`` after each of its actions, in full-stage
        units (the parameters of ``num_layers / pp`` layers), program order.

        Without sharded parameters (no RL on the rank) every chunk stays gathered. With them
        (``add_grad_sync(..., sharding="optim_grads_params")``) a chunk's parameters exist from
        its PS, which allocates the buffer the all-gather fills, to its RL. The local shard (1/d
        of the rank's parameters) is left out: it does not depend on the schedule.
        """
        program = self.per_rank[rank]
        fraction = self.layout.stage_fraction
        if ActionKind.RELEASE not in map(_kind_of, program):
            return (len(self.layout.stages_of(rank)) * fraction,) * len(program)
        step = {ActionKind.PARAM_SYNC: 1, ActionKind.RELEASE: -1}
        held = accumulate(step.get(kind, 0) for kind in map(_kind_of, program))
        return tuple(count * fraction for count in held)

    def peak_parameters(self) -> tuple[float, ...]:
        """Per-rank peak of ``resident_parameters``."""
        return tuple(max(self.resident_parameters(r), default=0.0) for r in range(self.num_ranks))

    def peak_activations(self) -> tuple[float, ...]:
        """Per-rank peak of ``stored_activations``: 1F1B's rank r reads p - r."""
        return tuple(max(self.stored_activations(r), default=0.0) for r in range(self.num_ranks))

    def iter_actions(self) -> Iterator[tuple[int, int, Action]]:
        """(rank, position, action) for every action."""
        for rank, actions in enumerate(self.per_rank):
            for position, action in enumerate(actions):
                yield rank, position, action


# Stored activations an action adds (+1) or frees (-1), in units of its stage's share.
MEMORY_DELTA: dict[ActionKind, int] = {
    ActionKind.FORWARD: 1,
    ActionKind.BACKWARD: -1,
    ActionKind.BACKWARD_WEIGHT: -1,
    ActionKind.EVICT: -1,
    ActionKind.LOAD: 1,
    ActionKind.ACCEPT: 1,
    ActionKind.RESTORE: -1,
}
_FULL_MEMORY_DELTA = {kind: MEMORY_DELTA.get(kind, 0) for kind in ActionKind}
_kind_of = attrgetter("kind")


def format_schedule(schedule: Schedule, *, marks: dict[tuple[int, int], str] | None = None) -> str:
    """The per-rank grid, one row per rank; ``marks`` flags (rank, position) cells for errors."""
    marks = marks or {}
    cells = [[str(a) for a in actions] for actions in schedule.per_rank]
    width = max((len(c) for row in cells for c in row), default=2)
    lines = []
    for rank, row in enumerate(cells):
        text = " ".join(c.ljust(width) for c in row)
        lines.append(f"rank {rank:>2}: {text}".rstrip())
        for (mark_rank, position), note in sorted(marks.items()):
            if mark_rank == rank:
                column = len(f"rank {rank:>2}: ") + position * (width + 1)
                lines.append(" " * column + "^" * width + f" <-- {note}")
    return "\n".join(lines)


def parse_schedule(
    rows: Sequence[str], *, layout: StageLayout, num_microbatches: int, name: str = "custom"
) -> Schedule:
    """Literal schedules for tests and docs: one whitespace-separated string per rank."""
    return Schedule(
        layout=layout,
        num_microbatches=num_microbatches,
        per_rank=tuple(tuple(parse_action(t) for t in row.split()) for row in rows),
        name=name,
    )


# --- CSV ------------------------------------------------------------------------------------
# Our format: a "layout" row (the rank of each stage), a "microbatches" row, an optional "name"
# row, then one row per rank: the rank number followed by its actions. torch.distributed
# .pipelining's ``_dump_csv`` writes one row per rank of action strings with empty cells for idle
# steps and no header; ``load_csv`` reads both, inferring the layout from torch's rows.

_TORCH_KINDS = {"F": "F", "B": "B", "I": "I", "W": "W"}
_TORCH_RE = re.compile(r"^(\d+)([A-Z_]+?)(\d+)$")


def dump_csv_text(schedule: Schedule) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["layout", *schedule.layout.stage_to_rank])
    writer.writerow(["microbatches", schedule.num_microbatches])
    writer.writerow(["name", schedule.name])
    for rank, actions in enumerate(schedule.per_rank):
        writer.writerow([rank, *(str(a) for a in actions)])
    return buffer.getvalue()


def dump_csv(schedule: Schedule, path: str | Path) -> None:
    Path(path).write_text(dump_csv_text(schedule))


def load_csv(path: str | Path) -> Schedule:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ScheduleError(f"cannot read schedule CSV {path}: {error.strerror}") from error
    return load_csv_text(text, source=str(path))


def load_csv_text(text: str, *, source: str = "<csv>") -> Schedule:
    rows = [row for row in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in row)]
    if not rows:
        raise ScheduleError(f"{source}: empty schedule CSV")
    if rows[0][0].strip() == "layout":
        return _load_ours(rows, source)
    return _load_torch(rows, source)


def _load_ours(rows: list[list[str]], source: str) -> Schedule:
    header: dict[str, list[str]] = {}
    programs: list[tuple[Action, ...]] = []
    for number, row in enumerate(rows, start=1):
        key = row[0].strip()
        if key in ("layout", "microbatches", "name"):
            header[key] = [c.strip() for c in row[1:] if c.strip()]
            continue
        if not key.isdigit() or int(key) != len(programs):
            raise ScheduleError(
                f"{source}: row {number}: expected rank {len(programs)} in the first cell, "
                f"got {key!r}"
            )
        programs.append(_parse_cells(row[1:], source, number))
    try:
        layout = StageLayout(tuple(int(c) for c in header["layout"]))
        num_microbatches = int(header["microbatches"][0])
    except (KeyError, IndexError) as error:
        raise ScheduleError(f"{source}: missing 'layout' or 'microbatches' row") from error
    except ValueError as error:
        raise ScheduleError(f"{source}: 'layout'/'microbatches' rows need integers") from error
    name = header.get("name", ["custom"])[0] if header.get("name") else "custom"
    return Schedule(layout, num_microbatches, tuple(programs), name=name)


def _parse_cells(cells: Sequence[str], source: str, number: int) -> tuple[Action, ...]:
    actions = []
    for column, cell in enumerate(cells, start=2):
        if not cell.strip():
            continue
        try:
            actions.append(parse_action(cell))
        except ScheduleError as error:
            raise ScheduleError(f"{source}: row {number}, column {column}: {error}") from None
    return tuple(actions)


def _load_torch(rows: list[list[str]], source: str) -> Schedule:
    programs: list[list[Action]] = []
    stage_rank: dict[int, int] = {}
    max_microbatch = -1
    for rank, row in enumerate(rows):
        program: list[Action] = []
        for column, cell in enumerate(row, start=1):
            cell = cell.strip()
            if not cell:
                continue
            match = _TORCH_RE.match(cell)
            if match is None or match.group(2) not in _TORCH_KINDS:
                raise ScheduleError(
                    f"{source}: row {rank + 1}, column {column}: {cell!r} is not a compute "
                    "action (F, B, I or W); only torch's compute-only CSV can be loaded"
                )
            stage, kind, microbatch = int(match.group(1)), match.group(2), int(match.group(3))
            if stage_rank.setdefault(stage, rank) != rank:
                raise ScheduleError(
                    f"{source}: row {rank + 1}, column {column}: stage {stage} also appears on "
                    f"rank {stage_rank[stage]}; a stage must live on one rank"
                )
            program.append(Action(stage, ActionKind(_TORCH_KINDS[kind]), microbatch))
            max_microbatch = max(max_microbatch, microbatch)
        programs.append(program)
    if max_microbatch < 0:
        raise ScheduleError(f"{source}: no actions found")
    num_stages = max(stage_rank) + 1
    missing = sorted(set(range(num_stages)) - set(stage_rank))
    if missing:
        raise ScheduleError(f"{source}: stages {missing} never appear, cannot infer the layout")
    layout = StageLayout(tuple(stage_rank[s] for s in range(num_stages)))
    if layout.num_ranks != len(programs):
        raise ScheduleError(
            f"{source}: {len(programs)} rows but stages only use {layout.num_ranks} ranks"
        )
    return Schedule(layout, max_microbatch + 1, tuple(tuple(p) for p in programs), name="torch-csv")


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if value < 1:
            raise ScheduleError(f"{key} must be >= 1, got {value}")
