"""The schedule as data: actions, stage layouts and per-rank programs.

A pipeline schedule is, for each pipeline rank, the ordered list of actions it performs in one
training step; passes, validation, simulation and the runtime all read this one representation.

Text form of one action: ``{stage}{kind}{microbatch}`` with an optional peer, written ``>peer`` for
actions that ship data away and ``<peer`` for actions that receive it: ``3F5``, ``0SA5>1``,
``1RA5<0``, ``2GS`` (per-chunk actions carry no micro-batch); a ``Composite`` is its parts joined
by ``&``: ``3F5&1B2``. ``parse_action`` is the inverse of ``str``."""

from __future__ import annotations

import csv
import gc
import io
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from itertools import accumulate, groupby
from operator import attrgetter
from pathlib import Path
from typing import NamedTuple

from megatron_bfpp.files import write_output

__all__ = [
    "COMPUTE_KINDS",
    "MAX_ACTIONS",
    "MAX_CSV_BYTES",
    "MAX_CSV_ROWS",
    "MEMORY_DELTA",
    "Action",
    "ActionKind",
    "Composite",
    "Placement",
    "Schedule",
    "ScheduleError",
    "StageLayout",
    "check_positive",
    "dump_csv",
    "dump_csv_text",
    "first_line",
    "format_schedule",
    "load_csv",
    "load_csv_text",
    "parse_action",
    "parse_schedule",
    "parts",
    "paused_gc",
    "primitives",
    "stored_counts",
    "unchecked_action",
]


class ScheduleError(ValueError):
    """Any invalid schedule, layout or generator input; the message says what would work."""


def first_line(error: BaseException | str) -> str:
    """An error's first line (schedule errors carry a grid after it), or its type's name."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class Placement(StrEnum):
    """How a schedule's stages sit on the pipeline ranks (a string enum: it prints as its name):
    what a front end's virtual-pipeline flag may say and how model chunks are built."""

    SINGLE = "single"  # one stage per rank: stage s on rank s
    LOOPED = "looped"  # num_chunks >= 2 stages per rank: stage s on rank s % p
    V_SHAPE = "v-shape"  # two stages per rank: rank r holds stages r and 2p-1-r


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
    # an F and another micro-batch's B as one (torch's OVERLAP_F_B): a ``Composite``, ``3F5&1B2``
    OVERLAP_F_B = "F&B"

    @property
    def is_compute(self) -> bool:
        """F, B, I, W (``COMPUTE_KINDS``) and their composite: what runs on the compute lane."""
        return self in _COMPUTE_LANE

    @property
    def is_send(self) -> bool:
        return self in _SENDS

    @property
    def is_recv(self) -> bool:
        return self in _RECVS

    @property
    def is_p2p(self) -> bool:
        return self in _SENDS or self in _RECVS


K = ActionKind
COMPUTE_KINDS = frozenset({K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT})
_COMPUTE_LANE = COMPUTE_KINDS | {K.OVERLAP_F_B}
_SENDS = frozenset({K.SEND_ACT, K.SEND_GRAD, K.EVICT, K.RESTORE})
_RECVS = frozenset({K.RECV_ACT, K.RECV_GRAD, K.ACCEPT, K.LOAD})
_CHUNK_LEVEL = frozenset({K.GRAD_SYNC, K.PARAM_SYNC, K.RELEASE})

# Longest kinds first so "SA" is not read as "S" + "A". A composite is written by its parts.
_KIND_PATTERN = "|".join(
    sorted((k.value for k in ActionKind if k is not ActionKind.OVERLAP_F_B), key=len, reverse=True)
)
# ASCII digits only: str.isdigit and \d also take digits int() rejects or misreads ("²", "３").
_ACTION_RE = re.compile(rf"(\d+)({_KIND_PATTERN})(\d+)?(?:([<>])(\d+))?", re.ASCII)
# indices stop at nine digits: no real schedule comes near, and int() of 100,000 digits is slow
_MAX_INDEX = 999_999_999


@dataclass(frozen=True, slots=True, order=True, init=False)
class Action:
    """One step of one rank's program: ``stage`` is the global virtual stage it belongs to (a
    message's: the local stage that sends or receives it; BPipe's transfers: the evictor's),
    ``peer`` the other rank of a point-to-point action. The constructor checks the fields."""

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
        return f"{type(self).__name__}({self})"


_set_stage: Callable[[Action, int], None] = Action.__dict__["stage"].__set__
_set_kind: Callable[[Action, ActionKind], None] = Action.__dict__["kind"].__set__
_set_microbatch: Callable[[Action, int | None], None] = Action.__dict__["microbatch"].__set__
_set_peer: Callable[[Action, int | None], None] = Action.__dict__["peer"].__set__


@dataclass(frozen=True, slots=True, order=True, init=False, repr=False)  # Action's __repr__
class Composite(Action):
    """A forward and a backward (B, or I) of another micro-batch run as one (torch's
    ``OVERLAP_F_B``), ``parts`` in that order, possibly on two stages: it waits, sends, lasts and
    holds as its parts do (``semantics.Rules``); its ``stage`` and ``microbatch``: its forward's."""

    parts: tuple[Action, ...] = ()  # a default only because Action's fields have one

    def __init__(self, forward: Action, backward: Action) -> None:
        plain = type(forward) is Action and type(backward) is Action
        if not (plain and forward.kind is ActionKind.FORWARD and backward.kind in _PAIRED):
            raise ScheduleError(
                "an overlapped pair is a forward and then a backward (B, or I), e.g. '3F5&1B2'; "
                f"got {_shown(f'{forward}&{backward}')}"
            )
        if forward.microbatch == backward.microbatch:
            raise ScheduleError(
                f"{forward}&{backward}: an overlapped pair joins a forward and a backward of "
                "different micro-batches (a micro-batch's backward needs its own forward first)"
            )
        _set_stage(self, forward.stage)
        _set_kind(self, ActionKind.OVERLAP_F_B)
        _set_microbatch(self, forward.microbatch)
        _set_peer(self, None)
        _set_parts(self, (forward, backward))

    def __str__(self) -> str:
        return "&".join(map(str, self.parts))


_set_parts: Callable[[Composite, tuple[Action, ...]], None] = Composite.__dict__["parts"].__set__
_PAIRED = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT})  # a pair's backward


def parts(action: Action) -> tuple[Action, ...]:
    """The plain actions ``action`` runs, in order: a composite's parts, else the action."""
    return action.parts if action.kind is ActionKind.OVERLAP_F_B else (action,)  # type: ignore[attr-defined]


def primitives(actions: Sequence[Action]) -> Iterable[tuple[int, Action]]:
    """(position, action) over a program, each composite as its parts at its own position, for
    walkers that ask which forwards and backwards run where (``enumerate`` without composites)."""
    if ActionKind.OVERLAP_F_B not in map(_kind_of, actions):
        return enumerate(actions)
    return ((position, part) for position, action in enumerate(actions) for part in parts(action))


class _ActionFields:
    """``Action``'s slots without its frozen ``__setattr__``: ``unchecked_action`` fills one by
    plain stores (descriptors cost a call each), then assigns ``__class__`` (same layout)."""

    __slots__ = Action.__slots__
    stage: int
    kind: ActionKind
    microbatch: int | None
    peer: int | None


def unchecked_action(
    stage: int, kind: ActionKind, microbatch: int | None = None, peer: int | None = None
) -> Action:
    """``Action(stage, kind, microbatch, peer)``, an ordinary one, without the field checks (a
    quarter of the cost): for generators and passes, whose actions are right by construction."""
    fields = _ActionFields()
    fields.stage = stage
    fields.kind = kind
    fields.microbatch = microbatch
    fields.peer = peer
    fields.__class__ = Action  # type: ignore[assignment]  # same layout: see _ActionFields
    return fields  # type: ignore[return-value]  # an Action now


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for a bulk build, check or simulation of a schedule,
    whose millions of objects form no cycles (rescanning them costs as much as the work); nests."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _check_action(stage: int, kind: ActionKind, microbatch: int | None, peer: int | None) -> None:
    """The constructor's checks, with the message for the first field that is wrong."""
    if kind is ActionKind.OVERLAP_F_B:
        raise ScheduleError(
            "an overlapped pair is made of its parts: Composite(forward, backward), or "
            "parse_action('3F5&1B2')"
        )
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
    match, where = _ACTION_RE.fullmatch(text.strip()), f"cannot parse action {_shown(text)}"
    if match is None:
        if "&" in text:  # an overlapped pair: a forward and a backward joined by "&"
            pieces = text.strip().split("&")
            if len(pieces) != 2 or not all(pieces):
                raise ScheduleError(
                    f"{where}: an overlapped pair is two actions joined by '&', e.g. '3F5&1B2'"
                )
            forward, backward = (parse_action(piece) for piece in pieces)
            return Composite(forward, backward)
        raise ScheduleError(f"{where}: expected e.g. '3F5', '0SA5>1', '1RA5<0' or '2GS'")
    stage, kind, microbatch, arrow, peer = match.groups()
    action_kind = ActionKind(kind)
    if arrow is not None and (arrow == ">") != action_kind.is_send:
        want = ">" if action_kind.is_send else "<"
        raise ScheduleError(f"{where}: {kind} is written with '{want}peer'")
    return Action(
        stage=_index(stage, "stage", where),
        kind=action_kind,
        microbatch=None if microbatch is None else _index(microbatch, "micro-batch", where),
        peer=None if peer is None else _index(peer, "peer rank", where),
    )


def _index(digits: str, what: str, where: str) -> int:
    """An index from digits, refused past ``_MAX_INDEX`` before int(); ``where`` heads errors."""
    if len(digits.lstrip("0")) > len(str(_MAX_INDEX)):
        raise ScheduleError(
            f"{where}: {what} {_shown(digits, 12)} is out of range (at most {_MAX_INDEX})"
        )
    return int(digits)


def _shown(text: str, limit: int = 40) -> str:
    """``repr`` of user text cut to ``limit`` characters: a message stays one short line even for
    a cell of 100,000 characters (repr also escapes newlines and NULs)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _shown_sequence(values: Sequence[int]) -> str:
    """A sequence for a one-line message: in full when short, else its start and its length."""
    if len(values) <= 16:
        return str(tuple(values))
    return f"({', '.join(map(str, values[:16]))}, ... {len(values):,} in all)"


@dataclass(frozen=True, slots=True)
class StageLayout:
    """Which pipeline rank holds each global stage (looped: ``s % p``; V: ``min(s, 2p - 1 - s)``).
    A rank's chunks are its stages in increasing order: megatron-core's ``vp_stage`` numbering."""

    stage_to_rank: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.stage_to_rank:
            raise ScheduleError("a layout needs at least one stage")
        ranks = set(self.stage_to_rank)
        # distinct ranks >= 0 are 0..max iff max + 1 of them (range(max + 1) hangs on a huge one)
        if min(ranks) < 0 or len(ranks) != max(ranks) + 1:
            raise ScheduleError(
                "layout ranks must be 0..p-1 with every rank used, got "
                f"{_shown_sequence(self.stage_to_rank)}"
            )
        counts = Counter(self.stage_to_rank)  # one pass: not a count per rank
        per_rank = [counts[r] for r in range(max(ranks) + 1)]
        if len(set(per_rank)) != 1:
            raise ScheduleError(
                f"every rank must hold the same number of stages, got {_shown_sequence(per_rank)} "
                f"for layout {_shown_sequence(self.stage_to_rank)}"
            )

    @classmethod
    def looped(cls, num_ranks: int, num_chunks: int = 1) -> StageLayout:
        check_positive({"num_ranks": num_ranks, "num_chunks": num_chunks})
        return cls(tuple(s % num_ranks for s in range(num_ranks * num_chunks)))

    @classmethod
    def v_shape(cls, num_ranks: int) -> StageLayout:
        check_positive({"num_ranks": num_ranks})
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
    def exact_stage_fraction(self) -> Fraction:
        """``stage_fraction`` as an exact fraction (1/3, not 0.333...), for exact timing."""
        return Fraction(self.num_ranks, self.num_stages)

    @property
    def kind(self) -> str:
        """The placement this layout follows (looped with one chunk included), or "custom"."""
        if self == StageLayout.looped(self.num_ranks, self.num_chunks):
            return Placement.LOOPED
        if self.num_chunks == 2 and self == StageLayout.v_shape(self.num_ranks):
            return Placement.V_SHAPE
        return "custom"

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def chunk_of(self, stage: int) -> int:
        return self.stages_of(self.stage_to_rank[stage]).index(stage)

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
        return Schedule(self.layout, self.num_microbatches, tuple(map(tuple, per_rank)), self.name)

    def compute_only(self) -> Schedule:
        return self.with_programs(
            [a for a in actions if a.kind.is_compute] for actions in self.per_rank
        )

    def stored_activations(self, rank: int) -> tuple[float, ...]:
        """Activations ``rank`` holds after each of its actions, in full-stage micro-batches: what
        the runtime holds between two actions, transfers in flight included (``MEMORY_DELTA``)."""
        fraction = self.layout.stage_fraction
        # Integer counts, scaled once: no rounding drift.
        return tuple(count * fraction for count in stored_counts(self.per_rank[rank]))

    def resident_parameters(self, rank: int) -> tuple[float, ...]:
        """Gathered (full) parameters ``rank`` holds after each action, in full-stage units: all
        chunks' with no RL on the rank, else a chunk's from PS to RL (local shard excluded)."""
        program, fraction = self.per_rank[rank], self.layout.stage_fraction
        if ActionKind.RELEASE not in map(_kind_of, program):
            return self._all_chunks(rank)
        step = {ActionKind.PARAM_SYNC: 1, ActionKind.RELEASE: -1}
        held = accumulate(step.get(kind, 0) for kind in map(_kind_of, program))
        return tuple(count * fraction for count in held)

    def resident_gradients(self, rank: int) -> tuple[float, ...]:
        """Full gradient buffers held on ``rank`` after each of its actions, in full-stage units:
        every chunk's with no RL on the rank, else per ``held_gradient_chunks`` (not the shards)."""
        if ActionKind.RELEASE not in map(_kind_of, self.per_rank[rank]):
            return self._all_chunks(rank)
        fraction = self.layout.stage_fraction
        return tuple(len(held) * fraction for held in self.held_gradient_chunks(rank))

    def _all_chunks(self, rank: int) -> tuple[float, ...]:
        """Every chunk of ``rank`` after each of its actions, in full-stage units."""
        chunks = len(self.layout.stages_of(rank)) * self.layout.stage_fraction
        return (chunks,) * len(self.per_rank[rank])

    def held_gradient_chunks(self, rank: int) -> Iterator[set[int]]:
        """Stages whose full gradient buffers a fully sharded ``rank`` holds after each action, from
        a backward until its reduction lands (next GS or backward); one set, updated in place."""
        held: set[int] = set()
        synced: list[int] = []  # GS'd stages whose reduction has not landed yet
        for action in self.per_rank[rank]:
            for part in parts(action):  # a composite's backward allocates too
                kind, stage = part.kind, part.stage
                if kind in _BACKWARD_KINDS:
                    if stage in synced:  # its reduction lands first, then the buffer is new
                        synced.remove(stage)
                    held.add(stage)
                elif kind is ActionKind.GRAD_SYNC:
                    held.difference_update(synced)
                    synced = [stage]
            yield held

    def held_parameter_chunks(self, rank: int) -> Iterator[set[int]]:
        """Stages ``rank`` holds gathered after each action (PS to RL); one set updated in place."""
        held: set[int] = set()
        for action in self.per_rank[rank]:
            if action.kind is ActionKind.PARAM_SYNC:
                held.add(action.stage)
            elif action.kind is ActionKind.RELEASE:
                held.discard(action.stage)
            yield held

    def peak_gradients(self) -> tuple[float, ...]:
        return tuple(max(self.resident_gradients(r), default=0.0) for r in range(self.num_ranks))

    def peak_parameters(self) -> tuple[float, ...]:
        return tuple(max(self.resident_parameters(r), default=0.0) for r in range(self.num_ranks))

    def peak_activations(self) -> tuple[float, ...]:
        """Per-rank peak of ``stored_activations``: 1F1B's rank r reads p - r."""
        return tuple(max(self.stored_activations(r), default=0.0) for r in range(self.num_ranks))

    def iter_actions(self) -> Iterator[tuple[int, int, Action]]:
        for rank, actions in enumerate(self.per_rank):
            for position, action in enumerate(actions):
                yield rank, position, action


# stored activations an action adds (+1) or frees (-1), in stage shares (a composite: its parts')
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
_BACKWARD_KINDS = frozenset({K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT})


def stored_counts(program: Sequence[Action], weights: Sequence[float] = ()) -> Iterable[float]:
    """Stored activations after each action of ``program``, in its stages' units: a running sum
    of ``MEMORY_DELTA``, a composite's parts in order and shown at their peak; ``weights``: one
    per global stage (uneven stages: its layers against an even stage's), else 1 (integers)."""
    kinds = list(map(_kind_of, program))
    if ActionKind.OVERLAP_F_B not in kinds and not weights:
        return accumulate(map(_FULL_MEMORY_DELTA.__getitem__, kinds))
    counts: list[float] = []
    count: float = 0
    for action in program:
        during = []
        for part in parts(action):
            delta = _FULL_MEMORY_DELTA[part.kind]
            count += delta * weights[part.stage] if weights and delta else delta
            during.append(count)
        counts.append(max(during))
    return counts


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
    programs = tuple(tuple(map(parse_action, row.split())) for row in rows)
    return Schedule(layout, num_microbatches, programs, name)


# Ours: "layout", "microbatches" and optional "name" rows, then per rank its number and actions;
# torch's ``_dump_csv``: one row per rank, no header (docs/architecture.md, "torch's CSV formats").

_HEADER_KEYS = ("layout", "microbatches", "name")
# What bfpp-sim checks and simulates in about a minute (schedules.registry refuses generated
# schedules past it too); a CSV past a limit is refused at the row that passes it.
MAX_ACTIONS = 4_000_000
MAX_CSV_ROWS = 100_000
MAX_CSV_BYTES = 64 << 20
_TORCH_RE = re.compile(
    r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)", re.ASCII
)
_TORCH_GROUP_RE = re.compile(r"\((.*)\)([A-Z_]+)", re.ASCII | re.DOTALL)
_TORCH_COMPUTE = {kind.value: kind for kind in COMPUTE_KINDS}  # torch's letters are ours
_TORCH_CHUNK = {"UNSHARD": K.PARAM_SYNC, "RESHARD": K.RELEASE, "REDUCE_GRAD": K.GRAD_SYNC}
# torch's message kinds: ours, and where the peer stage is (+1 the next stage, -1 the previous).
_TORCH_P2P = {
    "SEND_F": (ActionKind.SEND_ACT, 1),
    "RECV_F": (ActionKind.RECV_ACT, -1),
    "SEND_B": (ActionKind.SEND_GRAD, -1),
    "RECV_B": (ActionKind.RECV_GRAD, 1),
}
_TORCH_LOWERING = frozenset({"UNSHARD", "RESHARD", *_TORCH_P2P})


class _Row(NamedTuple):
    """A non-blank CSV record and the file row it starts on (blank rows count: an editor's line)."""

    number: int
    cells: tuple[str, ...]


class _TorchCell(NamedTuple):
    """One of torch's actions: a cell, or one action of a composite OVERLAP_F_B cell."""

    column: int
    text: str
    stage: int
    kind: str
    microbatch: int | None
    grouped: str = ""  # the OVERLAP_F_B cell's text it is part of


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
    """``dump_csv_text(schedule)`` written as :func:`megatron_bfpp.files.write_output` writes."""
    write_output(path, dump_csv_text(schedule).encode())


def load_csv(path: str | Path) -> Schedule:
    """Our CSV or torch's ``_dump_csv`` output; each problem one line naming the file and row."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CSV_BYTES + 1)
    except OSError as error:
        raise ScheduleError(f"cannot read schedule CSV {path}: {error.strerror}") from error
    if len(data) > MAX_CSV_BYTES:
        raise ScheduleError(
            f"{path}: more than {MAX_CSV_BYTES >> 20} MiB, more than a schedule of "
            f"{MAX_ACTIONS:,} actions takes; is this the right file?"
        )
    try:  # UTF-8, a byte-order mark dropped (spreadsheets write one); say which byte is not
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        row = data.count(b"\n", 0, error.start) + 1
        raise ScheduleError(
            f"{path}: row {row}: byte 0x{data[error.start]:02x} (offset {error.start}) is not "
            "UTF-8 text; a schedule CSV is UTF-8 text, is this the right file?"
        ) from None
    return load_csv_text(text, source=str(path))


def load_csv_text(text: str, *, source: str = "<csv>") -> Schedule:
    rows = _read_rows(text.removeprefix("\ufeff"), source)
    if not rows:
        raise ScheduleError(f"{source}: empty schedule CSV")
    if rows[0].cells[0].strip() in _HEADER_KEYS:
        return _load_ours(rows, source)
    return _load_torch(rows, source)


def _read_rows(text: str, source: str) -> list[_Row]:
    """The non-blank records; csv errors and NULs (binary, UTF-16): one line naming the row."""
    if (nul := text.find("\0")) >= 0:
        row = text.count("\n", 0, nul) + 1
        raise ScheduleError(
            f"{source}: row {row}: contains a NUL character, so this is not a text CSV (binary, "
            "or UTF-16?); save the schedule as UTF-8 text"
        )
    # newline="": csv sees "\r\n" and "\r" line ends itself, as the csv module asks.
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[_Row] = []
    actions = 0
    while True:
        start = reader.line_num + 1
        try:
            cells = next(reader)
        except StopIteration:
            return rows
        except csv.Error as error:
            problem = f"not readable as CSV ({error})"
            if "field limit" in str(error):
                problem = (
                    f"a cell is longer than {csv.field_size_limit()} characters (csv's field "
                    "size limit); schedule cells are short actions such as '3F5', is this the "
                    "right file?"
                )
            raise ScheduleError(f"{source}: row {start}: {problem}") from None
        if any(cell.strip() for cell in cells):
            rows.append(_Row(start, tuple(cells)))
            actions += len(cells)
            if len(rows) > MAX_CSV_ROWS + len(_HEADER_KEYS) or actions > MAX_ACTIONS + len(rows):
                raise ScheduleError(
                    f"{source}: row {start}: more rows or cells than a schedule holds (at most "
                    f"{MAX_CSV_ROWS:,} ranks and {MAX_ACTIONS:,} actions); is this the right file?"
                )


# One rank row's actions, each with the column it came from (for messages naming the cell).
_Program = tuple[tuple[int, Action], ...]


def _load_ours(rows: list[_Row], source: str) -> Schedule:
    header: dict[str, _Row] = {}
    rank_rows: list[_Row] = []
    programs: list[_Program] = []
    for row in rows:
        key = row.cells[0].strip()
        if key in _HEADER_KEYS:
            if key in header:
                raise ScheduleError(
                    f"{source}: row {row.number}: a second {key!r} row (the first is row "
                    f"{header[key].number}); keep one"
                )
            header[key] = row
            continue
        if key != str(len(programs)):
            raise ScheduleError(
                f"{source}: row {row.number}: expected rank {len(programs)} in the first cell, "
                f"got {_shown(key)}"
            )
        rank_rows.append(row)
        actions, where = [], f"{source}: row {row.number}"
        for column, cell in enumerate(row.cells[1:], start=2):
            if not cell.strip():
                continue
            try:
                actions.append((column, parse_action(cell)))
            except ScheduleError as error:
                raise ScheduleError(f"{where}, column {column}: {error}") from None
        programs.append(tuple(actions))
    if "layout" not in header or "microbatches" not in header:
        raise ScheduleError(f"{source}: missing 'layout' or 'microbatches' row")
    layout, counted = _header_layout(header["layout"], source), header["microbatches"]
    values = [c.strip() for c in counted.cells[1:] if c.strip()]
    if (
        len(values) != 1
        or not (values[0].isascii() and values[0].isdigit())
        or len(values[0].lstrip("0")) > len(str(_MAX_INDEX))
        or int(values[0]) < 1
    ):
        got = ", ".join(_shown(v, 12) for v in values[:3]) or "nothing"
        raise ScheduleError(
            f"{source}: row {counted.number}: the 'microbatches' row needs one integer from 1 "
            f"to {_MAX_INDEX}, got {got}"
        )
    m = int(values[0])
    if len(programs) != layout.num_ranks:
        raise ScheduleError(
            f"{source}: {len(programs)} rank rows, but the 'layout' row (row "
            f"{header['layout'].number}) places stages on {layout.num_ranks} ranks"
        )
    for rank, (row, program) in enumerate(zip(rank_rows, programs, strict=True)):
        for column, action in program:
            for part in parts(action):
                if (problem := _cell_problem(part, rank, layout, rank_rows)) is not None:
                    raise ScheduleError(
                        f"{source}: row {row.number}, column {column}: {str(action)!r}: {problem}"
                    )
    name_row = header.get("name")
    names = [c.strip() for c in name_row.cells[1:] if c.strip()] if name_row else []
    counted_by = f"the 'microbatches' row (row {counted.number}) says {m}"
    name = names[0] if names else "custom"
    return _checked_schedule(layout, m, rank_rows, programs, name, source, counted=counted_by)


def _header_layout(row: _Row, source: str) -> StageLayout:
    ranks = []
    for column, cell in enumerate(row.cells[1:], start=2):
        text = cell.strip()
        if not text:
            continue
        if not (text.isascii() and text.isdigit()):
            raise ScheduleError(
                f"{source}: row {row.number}, column {column}: the 'layout' row lists the rank of "
                f"each stage (integers >= 0), got {_shown(text)}"
            )
        # ranks < stages <= the row's length; digits checked first: no int() of 100,000 digits
        if len(text.lstrip("0")) > len(str(len(row.cells))) or int(text) >= len(row.cells) - 1:
            raise ScheduleError(
                f"{source}: row {row.number}, column {column}: rank {_shown(text, 12)} is out of "
                "range: every rank holds stages, so ranks run 0..(number of stages - 1) at most"
            )
        ranks.append(int(text))
    if not ranks:
        raise ScheduleError(f"{source}: row {row.number}: the 'layout' row lists no stages")
    try:
        return StageLayout(tuple(ranks))
    except ScheduleError as error:
        raise ScheduleError(f"{source}: row {row.number}: {error}") from None


def _cell_problem(
    action: Action, rank: int, layout: StageLayout, rank_rows: Sequence[_Row]
) -> str | None:
    """Indices past the header's bounds, or an action on another rank's row, named by cell before
    the forwards' check or the validator names them (BPipe's AC / RS: the acceptor's row)."""
    if action.stage >= layout.num_stages:
        return f"stage {action.stage} does not exist (the layout has {layout.num_stages})"
    if action.peer is not None and action.peer >= layout.num_ranks:
        return f"peer rank {action.peer} does not exist (the layout has {layout.num_ranks})"
    owner = layout.rank_of(action.stage)
    if action.kind in (ActionKind.ACCEPT, ActionKind.RESTORE):
        if owner == rank:
            return f"stage {action.stage}'s own rank {rank} cannot accept its evicted activations"
        return None
    if owner != rank:
        return (
            f"stage {action.stage} lives on rank {owner} (row {rank_rows[owner].number}), not on "
            f"this row's rank {rank}; move it to that row"
        )
    return None


def _checked_schedule(
    layout: StageLayout,
    m: int,
    rank_rows: Sequence[_Row],
    programs: Sequence[_Program],
    name: str,
    source: str,
    *,
    counted: str,
) -> Schedule:
    """The schedule, once each stage's forwards run micro-batches 0..m-1 once and nothing names one
    past m - 1, before anything allocates per micro-batch; ``counted``: where m comes from."""
    schedule = Schedule(
        layout, m, tuple(tuple(action for _, action in p) for p in programs), name=name
    )
    forwards: list[list[int]] = [[] for _ in range(layout.num_stages)]
    for actions in schedule.per_rank:
        for _, action in primitives(actions):
            if action.kind is ActionKind.FORWARD and action.microbatch is not None:
                forwards[action.stage].append(action.microbatch)
    problems = []
    for stage, microbatches in enumerate(forwards):
        if (problem := _microbatch_problem(microbatches, m)) is not None:
            row_number = rank_rows[layout.rank_of(stage)].number
            problems.append(f"stage {stage} (row {row_number}) {problem}")
    if problems:
        shown = "; ".join(problems[:3])
        if len(problems) > 3:
            shown += f"; {len(problems) - 3} more stages too"
        raise ScheduleError(
            f"{source}: {counted}, so every stage needs forwards for micro-batches 0..{m - 1}, "
            f"each once: {shown}"
        )
    for row, program in zip(rank_rows, programs, strict=True):
        for column, action in program:
            # Forwards passed the check above, so only other kinds can be out of range here.
            for part in parts(action):
                if part.microbatch is not None and part.microbatch >= m:
                    raise ScheduleError(
                        f"{source}: row {row.number}, column {column}: {str(action)!r}: "
                        f"micro-batch {part.microbatch} does not exist ({counted})"
                    )
    return schedule


def _microbatch_problem(microbatches: list[int], m: int) -> str | None:
    """What keeps ``microbatches`` from being 0..m-1, or None; no range(m): m may be huge."""
    unique = sorted(set(microbatches))
    if len(unique) == len(microbatches) == m and unique[0] == 0 and unique[-1] == m - 1:
        return None
    repeated = sorted(mb for mb, count in Counter(microbatches).items() if count > 1)
    found = (
        ("misses", _gaps([mb for mb in unique if mb < m], m)),
        ("has extra", _listed([mb for mb in unique if mb >= m])),
        ("repeats", _listed(repeated)),
    )
    return " and ".join(f"{verb} {listed}" for verb, listed in found if listed)


def _gaps(present: list[int], m: int) -> str:
    """The numbers of 0..m-1 not in sorted, distinct ``present``, as spans ("1, 3..5")."""
    spans = []
    expected = 0
    for value in [*present, m]:
        if value > expected:
            spans.append(str(expected) if value == expected + 1 else f"{expected}..{value - 1}")
        expected = value + 1
    return _listed(spans)


def _listed(items: Sequence[object]) -> str:
    text = ", ".join(str(item) for item in items[:4])
    return text + (f" and {len(items) - 4} more" if len(items) > 4 else "")


def _load_torch(rows: list[_Row], source: str) -> Schedule:
    cells = [_torch_row(row, source) for row in rows]
    layout = _torch_layout(rows, cells, source)
    m, counted = _torch_microbatches(cells, layout, source)
    lowered = any(cell.kind in _TORCH_LOWERING for row_cells in cells for cell in row_cells)
    programs = [
        _torch_program(row_cells, rank, layout, f"{source}: row {row.number}", lowered)
        for rank, (row, row_cells) in enumerate(zip(rows, cells, strict=True))
    ]
    return _checked_schedule(layout, m, rows, programs, "torch-csv", source, counted=counted)


def _torch_program(
    cells: list[_TorchCell], rank: int, layout: StageLayout, row: str, lowered: bool
) -> tuple[tuple[int, Action], ...]:
    """One row's actions by column (REDUCE_GRAD only when ``lowered``); an OVERLAP_F_B cell's two
    actions become our pair (``Composite``: it waits, lasts and sends as torch's group does)."""
    kept = [cell for cell in cells if lowered or cell.kind != "REDUCE_GRAD"]
    program: list[tuple[int, Action]] = []
    for column, group in groupby(kept, key=attrgetter("column", "grouped")):
        actions = [_torch_action(cell, rank, layout, row) for cell in group]
        if not column[1]:
            program += [(column[0], action) for action in actions]
            continue
        if len(actions) != 2:
            raise ScheduleError(
                f"{row}, column {column[0]}: {_shown(column[1])}: an OVERLAP_F_B group runs one "
                f"forward and one backward, got {len(actions)} action(s)"
            )
        try:
            program.append((column[0], Composite(*actions)))
        except ScheduleError as error:
            raise ScheduleError(f"{row}, column {column[0]}: {error}") from None
    return tuple(program)


def _torch_microbatches(
    cells: list[list[_TorchCell]], layout: StageLayout, source: str
) -> tuple[int, str]:
    """torch's CSV does not say m: take the count most stages run forwards for (the larger on a
    tie), so a stage skipping or renumbering one (torch 2.13's Schedule1F1B) is its own problem."""
    forwards: list[set[int]] = [set() for _ in range(layout.num_stages)]
    for row_cells in cells:
        for cell in row_cells:
            if cell.kind == "F" and cell.microbatch is not None:
                forwards[cell.stage].add(cell.microbatch)
    counts = Counter(len(found) for found in forwards if found)
    if not counts:
        raise ScheduleError(f"{source}: no forward actions (F) found")
    m, stages = max(counts.items(), key=lambda item: (item[1], item[0]))
    return m, f"{stages} of {layout.num_stages} stages run forwards for {m} micro-batches"


def _torch_row(row: _Row, source: str) -> list[_TorchCell]:
    found = []
    for column, cell in enumerate(row.cells, start=1):
        if text := cell.strip():
            found.extend(_torch_cell(text, column, f"{source}: row {row.number}, column {column}"))
    return found


def _torch_cell(text: str, column: int, where: str) -> list[_TorchCell]:
    group = _TORCH_GROUP_RE.fullmatch(text)
    if group is None:
        return [_torch_single(text, column, where)]
    parts, kind = group.groups()
    if kind != "OVERLAP_F_B":
        raise ScheduleError(f"{where}: {_shown(text)}: only OVERLAP_F_B groups actions, not {kind}")
    inner = [
        _torch_single(part.strip(), column, where)._replace(grouped=text)
        for part in parts.split(";")
    ]
    for cell in inner:
        if cell.kind not in _TORCH_COMPUTE:
            raise ScheduleError(
                f"{where}: {_shown(text)}: an OVERLAP_F_B group holds compute actions (F, B, I, "
                f"W), not {cell.kind}"
            )
    return inner


def _torch_single(text: str, column: int, where: str) -> _TorchCell:
    match = _TORCH_RE.fullmatch(text)
    if match is None:
        raise ScheduleError(
            f"{where}: {_shown(text)} is not one of torch's actions: a stage, then F, B, I, W, "
            "UNSHARD, RESHARD, REDUCE_GRAD, SEND_F, RECV_F, SEND_B or RECV_B, then the "
            "micro-batch (e.g. '3F5', '0SEND_F5', '2UNSHARD')"
        )
    stage, kind, microbatch = match.groups()
    if kind in _TORCH_CHUNK and microbatch:
        raise ScheduleError(f"{where}: {_shown(text)}: {kind} is per stage, without a micro-batch")
    if kind not in _TORCH_CHUNK and not microbatch:
        raise ScheduleError(f"{where}: {_shown(text)}: {kind} needs a micro-batch, e.g. '0{kind}3'")
    where = f"{where}: {_shown(text)}"
    index = _index(stage, "stage", where)
    mb = _index(microbatch, "micro-batch", where) if microbatch else None
    return _TorchCell(column, text, index, kind, mb)


def _torch_layout(rows: list[_Row], cells: list[list[_TorchCell]], source: str) -> StageLayout:
    """Stage -> rank from the rows: each torch action (messages too) names a stage of its rank."""
    first: dict[int, tuple[int, _Row, _TorchCell]] = {}
    for rank, (row, row_cells) in enumerate(zip(rows, cells, strict=True)):
        for cell in row_cells:
            owner, owner_row, _ = first.setdefault(cell.stage, (rank, row, cell))
            if owner != rank:
                raise ScheduleError(
                    f"{source}: row {row.number}, column {cell.column}: stage {cell.stage} also "
                    f"appears on rank {owner} (row {owner_row.number}); a stage must live on one "
                    "rank"
                )
    largest = max(first)
    if len(first) != largest + 1:
        _, row, cell = first[largest]
        raise ScheduleError(
            f"{source}: no action names stage(s) {_gaps(sorted(first), largest + 1)}, yet row "
            f"{row.number}, column {cell.column} names stage {largest}: cannot infer the layout"
        )
    try:
        layout = StageLayout(tuple(first[stage][0] for stage in range(largest + 1)))
    except ScheduleError as error:
        raise ScheduleError(f"{source}: {error}") from None
    if layout.num_ranks != len(rows):
        raise ScheduleError(
            f"{source}: {len(rows)} rows but stages only use {layout.num_ranks} ranks"
        )
    return layout


def _torch_action(cell: _TorchCell, rank: int, layout: StageLayout, row: str) -> Action:
    if (local := _TORCH_COMPUTE.get(cell.kind) or _TORCH_CHUNK.get(cell.kind)) is not None:
        return Action(cell.stage, local, cell.microbatch)  # a chunk's has no micro-batch
    where = f"{row}, column {cell.column}"
    kind, step = _TORCH_P2P[cell.kind]
    neighbour = cell.stage + step
    if not 0 <= neighbour < layout.num_stages:
        side = "next" if step > 0 else "previous"
        raise ScheduleError(
            f"{where}: {_shown(cell.text)}: stage {cell.stage} has no {side} stage to exchange "
            "messages with"
        )
    peer = layout.rank_of(neighbour)
    if peer == rank:
        raise ScheduleError(
            f"{where}: {_shown(cell.text)}: stages {cell.stage} and {neighbour} are both on rank "
            f"{rank}, so no message passes between them"
        )
    return Action(cell.stage, kind, cell.microbatch, peer)


def check_positive(values: Mapping[str, object], *, prefix: str = "") -> None:
    """The first of ``values`` (by the name a user wrote) that is not a positive integer (a bool
    is not one), in one line: the shared check of every count a user hands us."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{prefix}{name} must be a positive integer, got {value!r}")
