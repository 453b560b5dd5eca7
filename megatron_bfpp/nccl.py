"""Point-to-point messages under NCCL's rules: how the runtime posts them (``lockstep_posting``: one
batch per rank and tick, every op's partner in the peer's batch of the same tick) and the model
(``check_posting``, with clocks ``posting_timer``) that proves a posting deadlock-free on NCCL
before any message is sent, reading it as integers (``_Lowered``). The rules and why they hold:
docs/design-notes.md, "NCCL-safe posting", and docs/architecture.md."""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, chain, count, groupby, repeat
from operator import attrgetter, rshift, sub
from typing import NamedTuple, cast

from megatron_bfpp.ir import (
    COMPUTE_KINDS,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    format_schedule,
    parts,
    paused_gc,
)
from megatron_bfpp.messages import ACT, WHAT_CODE, What
from megatron_bfpp.program import compiled
from megatron_bfpp.semantics import (
    TIMING_SCALARS,
    Event,
    Lane,
    Timing,
    Wires,
    action_duration,
    compute_durations,
    lockstep_replay,
    match_channels,
    stage_durations,
    transfer_durations,
)

__all__ = [
    "TICKS",
    "Batch",
    "Item",
    "Posting",
    "PostingRun",
    "Wait",
    "check_posting",
    "lockstep_posting",
    "nccl_report",
    "posting_timer",
    "release_models",
    "time_posting",
    "validate_nccl",
    "written_posting",
]

K = ActionKind
_FREES = frozenset({K.BACKWARD, K.BACKWARD_INPUT})  # the backward that frees the output
_UNIT = Timing()
_SIDE = -2  # the peer of a rank's side stream in ``_Model.streams`` (-1: its group's)
# the lock-step replay's timing: semantics.Timing's defaults in integer ticks (composites: summed)
_TICKED = Timing(**{name: int(getattr(_UNIT, name)) for name in TIMING_SCALARS})  # type: ignore[arg-type]
TICKS = {kind: int(time) for kind, time in compute_durations(_TICKED).items()}
_FB = K.OVERLAP_F_B


class Item(NamedTuple):
    """One action's ops in a batch: its message (for EV / AC the size header), or with
    ``rest`` an eviction's payload (received after the acceptor read the header)."""

    position: int
    rest: bool = False


class Batch(NamedTuple):
    """One ``batch_isend_irecv`` of one rank; ``tick`` is -1 outside lock-step postings.
    ``blocking``: the CPU waits for it before its next step (megatron-core's ``batch_p2p_sync``);
    ``pairwise``: separate ``isend`` / ``irecv`` calls, each FIFO on its (rank, peer) pair's stream
    (megatron-core's non-batched path); ``side``: on the rank's second stream (BPipe's payloads)."""

    tick: int
    items: tuple[Item, ...]
    blocking: bool = False
    pairwise: bool = False
    side: bool = False


@dataclass(frozen=True, slots=True)
class Wait:
    """The CPU waits here for the ops of the p2p actions at these program positions, posted
    earlier in a batch that is not ``blocking`` (megatron-core's deferred ``req.wait()``)."""

    positions: tuple[int, ...]


# A program position (compute, GS, PS, RL), a batch of p2p actions, or a deferred wait.
Step = int | Batch | Wait


@dataclass(frozen=True, slots=True, eq=False)
class Posting:
    """Per rank, the order in which the CPU runs the non-p2p actions and posts the batches.
    Immutable; validation and the simulator read only its integers (``lowered``). Either form
    may be None (not both): the other is made from it when first read."""

    name: str
    _per_rank: tuple[tuple[Step, ...], ...] | None
    _lowered: _Lowered | None = None

    @property
    def per_rank(self) -> tuple[tuple[Step, ...], ...]:
        per_rank = self._per_rank
        if per_rank is None:
            with paused_gc():  # a tuple per batch and item, none freed: see paused_gc
                per_rank = _raised(self.lowered)
            _set(self, "_per_rank", per_rank)
        return per_rank

    @property
    def lowered(self) -> _Lowered:
        lowered = self._lowered
        if lowered is None:
            lowered = _lower(self.per_rank)
            _set(self, "_lowered", lowered)
        return lowered

    def batches(self, rank: int) -> list[Batch]:
        return [step for step in self.per_rank[rank] if isinstance(step, Batch)]

    @property
    def has_side(self) -> bool:
        """Whether any rank posts a ``side`` batch (the runtime then makes the pair groups)."""
        return any(flags & _SIDE_BATCH for flags in self.lowered.batch_flags)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Posting):
            return NotImplemented
        return self is other or (self.name == other.name and self.per_rank == other.per_rank)

    def __hash__(self) -> int:
        return hash((self.name, self.per_rank))

    def __repr__(self) -> str:
        return f"Posting(name={self.name!r}, per_rank={self.per_rank!r})"


_set = object.__setattr__  # Posting's own fields, set once (the lazy ones when first read)
_BLOCKING, _PAIRWISE, _SIDE_BATCH = _FLAG_BITS = (1, 2, 4)  # ``_Lowered.batch_flags``


@dataclass(frozen=True, slots=True, eq=False)
class _Lowered:
    """A posting as integers, what ``_Model`` reads: per rank its steps ``value * 4 + code``
    (``_RUN`` a program position, ``_POST`` a batch, ``_WAIT`` a ``Wait``: indices into the
    columns below, all ranks' together); a batch's items are ``position * 2 + rest`` and its
    flags ``_BLOCKING | _PAIRWISE | _SIDE_BATCH``. Batches are numbered in the order the ranks'
    steps post them, rank by rank (``_Model`` numbers its batches and ops so)."""

    steps: list[list[int]]
    batch_items: list[list[int]]
    batch_tick: list[int]
    batch_flags: list[int]
    waits: list[tuple[int, ...]]


def _lower(per_rank: tuple[tuple[Step, ...], ...]) -> _Lowered:
    lowered = _Lowered([], [], [], [], [])
    for steps in per_rank:
        row: list[int] = []
        for step in steps:
            if isinstance(step, int):
                row.append(step * 4 + _RUN)
            elif isinstance(step, Wait):
                row.append(len(lowered.waits) * 4 + _WAIT)
                lowered.waits.append(step.positions)
            else:
                row.append(len(lowered.batch_items) * 4 + _POST)
                lowered.batch_items.append([p * 2 + rest for p, rest in step.items])
                lowered.batch_tick.append(step.tick)
                bits = zip(_FLAG_BITS, step[2:], strict=True)  # blocking, pairwise, side
                lowered.batch_flags.append(sum(bit * flag for bit, flag in bits))
        lowered.steps.append(row)
    return lowered


def _raised(lowered: _Lowered) -> tuple[tuple[Step, ...], ...]:
    """The inverse of ``_lower``: ``Posting.per_rank`` of integers."""
    items, ticks, flags = lowered.batch_items, lowered.batch_tick, lowered.batch_flags
    per_rank = []
    for row in lowered.steps:
        steps: list[Step] = []
        for step in row:
            code, value = step & 3, step >> 2
            if code == _RUN:
                steps.append(value)
            elif code == _WAIT:
                steps.append(Wait(lowered.waits[value]))
            else:
                batch_items = tuple([Item(i >> 1, i & 1 == 1) for i in items[value]])
                bits = (flags[value] & bit != 0 for bit in _FLAG_BITS)  # blocking, pairwise, side
                steps.append(Batch(ticks[value], batch_items, *bits))
        per_rank.append(tuple(steps))
    return tuple(per_rank)


def lockstep_posting(schedule: Schedule) -> Posting:
    """The runtime's posting (module docstring), kept for the last few schedules posted."""
    for kept, posting in _POSTINGS:
        if kept is schedule:
            return posting
    program = compiled(schedule)
    lowered = _Lowered([], [], [], [], [])
    with paused_gc():  # a list per batch, none freed: see paused_gc
        run = lockstep_replay(program.rules, _TICKED)
        if pending := run.unfinished():
            raise ScheduleError(
                f"{schedule.name}: no lock-step posting exists (ranks {pending} "
                "wait for messages nobody sends); validate the schedule first"
            )
        for rank, actions in enumerate(schedule.per_rank):
            _lockstep_steps(lowered, actions, rank, run, program.message[rank])
    posting = Posting("lock-step", None, lowered)
    _POSTINGS.insert(0, (schedule, posting))
    del _POSTINGS[_KEEP:]
    return posting


_POSTINGS: list[tuple[Schedule, Posting]] = []
_KEEP = 4


def _lockstep_steps(
    lowered: _Lowered, actions: tuple[Action, ...], rank: int, run: Wires, message: list[int]
) -> None:
    """One rank's steps of the lock-step posting, from its actions' ticks in ``run``
    (``lockstep_replay``: a compute's start, a message's send), added to ``lowered``. Sort keys
    are ``(tick * 4 + phase) * wide + step``: at a tick, its batch (phase 0), its payload batch
    (1), the GS / PS / RL that follow the compute ending there (2: after its messages, the
    pipeline's critical path goes first), then the compute starting there (3); ``step`` is the
    position's ``_RUN`` step, 0 for a batch (numbered in tick order). A batch's items are
    ``position * 2 + rest``, appended in program order and sorted by message: canonical order."""
    wide = 4 * len(actions) + 4  # above every ``_RUN`` step
    batches: defaultdict[int, list[int]] = defaultdict(list)  # tick * 2 + payload -> items
    keys: list[int] = []
    add_key, p2p, compute, ticks_of, lanes = keys.append, _P2P, _COMPUTE, TICKS, _LANES
    # its computes' and GS / PS's starts in program order, and the messages' sends: integers
    starts = iter(cast("list[int]", run.starts[rank]))
    flow, arrivals = cast("list[int | None]", run.flow), cast("dict[int, int]", run.arrivals)
    num_ranks, limit = run.rules.num_ranks, len(flow)
    end = 0  # the end of the latest compute: an SA / SG goes then
    tick: int | None
    for position, action in enumerate(actions):
        if (kind := action.kind) in p2p:
            sent = message[position]
            if kind in _SENT_AT_END:
                tick = end
            elif (tick := flow[sent] if sent < limit else arrivals.get(sent * num_ranks)) is None:
                raise ScheduleError(f"rank {rank}, step {position}: {action} is never sent")
            if sent < limit:  # an activation or gradient
                batches[tick * 2].append(position * 2)
                continue
            batches[tick * 2 + (kind in _PAYLOADS)].append(position * 2)  # RS / LD: the pair's
            if kind in _HEADERS:  # EV / AC: the size header, then the payload
                batches[tick * 2 + 1].append(position * 2 + 1)
        elif kind in compute:
            tick = next(starts)
            add_key((tick * 4 + 3) * wide + position * 4 + _RUN)
            # a composite's ticks: its parts' (``TICKS`` has none)
            end = tick + (ticks_of.get(kind) or sum(ticks_of[p.kind] for p in parts(action)))
        else:
            if kind in lanes:
                next(starts)
            add_key((end * 4 + 2) * wide + position * 4 + _RUN)
    ordered = sorted(batches)  # by tick, then payload
    keys += [(key + (key & ~1)) * wide for key in ordered]
    keys.sort()
    numbers = count(len(lowered.batch_items) * 4 + _POST, 4)
    lowered.steps.append([key % wide or next(numbers) for key in keys])
    by_item = [0] * 2 * len(actions)  # an item's message
    by_item[::2] = by_item[1::2] = message
    for items in batches.values():
        if len(items) > 1:
            items.sort(key=by_item.__getitem__)  # stable: a message's items by position
    lowered.batch_items.extend(map(batches.__getitem__, ordered))
    lowered.batch_tick.extend([key >> 1 for key in ordered])
    lowered.batch_flags.extend([_SIDE_BATCH * (key & 1) for key in ordered])


_P2P = frozenset(kind for kind in K if kind.is_p2p)
_COMPUTE = frozenset(kind for kind in K if kind.is_compute)
_LANES = frozenset({K.GRAD_SYNC, K.PARAM_SYNC})  # what ``Wires.starts`` also holds
_SENT_AT_END = frozenset({K.SEND_ACT, K.SEND_GRAD})
_PAYLOADS, _HEADERS = frozenset({K.RESTORE, K.LOAD}), frozenset({K.EVICT, K.ACCEPT})


def check_side_pairs(schedule: Schedule, posting: Posting) -> None:
    """The runtime makes a group per BPipe pair (x, p-1-x) only (``runtime.p2p.pair_group``), so a
    payload batch between other ranks has none to run on: a ``ScheduleError`` names the first."""
    last, lowered = schedule.num_ranks - 1, posting.lowered
    for rank, steps in enumerate(lowered.steps):
        for step in steps:
            if step & 3 != _POST or not lowered.batch_flags[step >> 2] & _SIDE_BATCH:
                continue
            for item in lowered.batch_items[step >> 2]:
                position = item >> 1
                action = schedule.per_rank[rank][position]
                if action.peer != last - rank:
                    raise ScheduleError(
                        f"{action} at position {position} of pipeline rank {rank} moves "
                        f"activations between ranks {rank} and {action.peer}, but the runtime "
                        f"runs such transfers only between partners x and {last}-x (BPipe's "
                        f"pairs): give rank {rank} the partner {last - rank}"
                    )


def written_posting(schedule: Schedule) -> Posting:
    """Each run of p2p actions between two computes posted as one batch, in program order: how
    the runtime posted before lock-step, and the order a schedule file states."""
    per_rank = []
    for actions in schedule.per_rank:
        steps: list[Step] = []
        is_p2p = [action.kind.is_p2p for action in actions]
        for p2p, run in groupby(range(len(actions)), is_p2p.__getitem__):
            if p2p:
                steps.append(Batch(-1, tuple(map(Item, run))))
            else:
                steps += run
        per_rank.append(tuple(steps))
    return Posting("as written", tuple(per_rank))


def validate_nccl(schedule: Schedule) -> Posting:
    """``schedule``'s lock-step posting, NCCL-proven, payloads between partners only, or raises."""
    posting = lockstep_posting(schedule)
    check_posting(schedule, posting)
    check_side_pairs(schedule, posting)
    return posting


def nccl_report(schedule: Schedule) -> dict[str, dict[str, object]]:
    """Whether ``schedule`` is NCCL-safe as written (a batch per run of messages between computes,
    what a file states) and as the runtime posts it (lock-step): else why, without the grid."""
    report: dict[str, dict[str, object]] = {}
    for key, check in (
        ("as_written", lambda: check_posting(schedule, written_posting(schedule))),
        ("lock_step", lambda: validate_nccl(schedule)),  # the runtime's own check
    ):
        try:
            check()
        except ScheduleError as error:
            report[key] = {"safe": False, "problem": str(error).split("\nrank ")[0]}
        else:
            report[key] = {"safe": True, "problem": None}
    return report


class PostingRun(NamedTuple):
    """What ``time_posting`` found, per rank, in ``Timing``'s units (integers when its are)."""

    clock: list[float]  # when its CPU finished its last step
    dp_end: list[float]  # when its data-parallel lane is done
    busy: list[float]  # the sum of its compute durations
    gather_wait: list[float]  # the time its computes waited for their stage's PS
    # busy compute, batch, GS / PS intervals by rank and start; lazy: the planner never draws
    events: Callable[[], list[Event]]


def check_posting(schedule: Schedule, posting: Posting) -> None:
    """Run ``posting`` under NCCL's rules; a ScheduleError names a wait cycle, above the grid."""
    model = _model(schedule, posting, settle=True)
    with paused_gc():  # columns of a million ops: see paused_gc
        model.run(None)


def time_posting(schedule: Schedule, posting: Posting, timing: Timing = _UNIT) -> PostingRun:
    return posting_timer(schedule, posting)(timing)


def posting_timer(schedule: Schedule, posting: Posting) -> Callable[[Timing], PostingRun]:
    """``check_posting``'s model with clocks, built once per posting and run per ``Timing`` (the
    planner times one schedule under many costs). Its CPU does not settle BPipe's sends after
    the next compute: on NCCL the runtime polls them (``PipeComm.reap``)."""
    return _model(schedule, posting, settle=False).timed


def _model(schedule: Schedule, posting: Posting, *, settle: bool) -> _Model:
    """The model of ``posting``, built once while it is among the last two modelled: validation
    proves the posting that the simulator then times. The proof's model (``settle``) serves
    the timer too, and the other way round, where no BPipe send is settled after a compute
    (``_Model.settles``): the two then have the same steps, and ``run`` starts afresh."""
    for kept_schedule, kept_posting, model in _MODELS:
        same = kept_posting is posting and kept_schedule is schedule
        if same and (model.settle == settle or not model.settles):
            return model
    with paused_gc():  # columns of a million ops: see paused_gc
        model = _Model(schedule, posting, settle=settle)
    _MODELS.insert(0, (schedule, posting, model))
    del _MODELS[_MODELS_KEPT:]
    return model


# The last models built: two, each up to 0.4 GB (pp 64, vp 4, m 1,024).
_MODELS: list[tuple[Schedule, Posting, _Model]] = []
_MODELS_KEPT = 2


def release_models() -> None:
    """Drop the kept models: a training process proves its posting once and never times it."""
    _MODELS.clear()


class _Model:
    """NCCL's rules for one posting, optionally timed. A *unit* runs on a stream as one: a batch,
    or one op of a pairwise batch (on the stream of its (rank, peer); the others on the rank's
    group or side stream). Ops are numbered in posting order, as columns (``op_*``);
    an op's or a CPU wait's key is ``message * 4 + send * 2 + rest``; a rank's CPU steps are
    ``value * 4 + code`` (``_POST`` a batch, ``_WAIT`` for a unit, ``_RUN`` a position)."""

    def __init__(self, schedule: Schedule, posting: Posting, *, settle: bool = True) -> None:
        self.schedule, self.posting, self.settle = schedule, posting, settle
        self.program = compiled(schedule)
        self.rules = self.program.rules
        items = posting.lowered.batch_items
        # ops, numbered in posting order (rank by rank: ``_Lowered``), a batch's in a row
        self.op_start = [0, *accumulate(map(len, items))]  # per batch, its first op
        self.op_position: list[int] = list(map(rshift, chain.from_iterable(items), repeat(1)))
        self.op_key: list[int] = []  # message * 4 + send * 2 + rest (an eviction's payload)
        self.batch_tick = posting.lowered.batch_tick
        self.batch_rank: list[int] = []
        self.batch_index: list[int] = []  # the batch's number on its rank
        self.batch_first = [0]  # per batch, its first unit (one more: the end)
        self.unit_first = [0]  # per unit, its first op (one more: the end)
        self.unit_batch: list[int] = []
        self.unit_stream: list[int] = []
        self.streams: dict[tuple[int, int], int] = {}  # (rank, peer; -1 for the group) -> id
        self.rank_batches = [0]  # per rank, its first batch (one more: the end)
        self._units()
        sizes = list(map(sub, self.unit_first[1:], self.unit_first))  # per unit, its ops
        self.op_unit = list(chain.from_iterable(map(repeat, range(len(sizes)), sizes)))  # per op
        self.channels: dict[tuple[int, int, bool], list[int]] = {}  # (src, dst, send) -> ops
        self.settles = False  # whether a send is settled after a compute (``settle`` or not)
        self.steps: list[list[int]] = [self._rank_steps(rank) for rank in range(schedule.num_ranks)]
        self.partner = self._match()

    def _stream(self, rank: int, peer: int) -> int:
        return self.streams.setdefault((rank, peer), len(self.streams))

    def _units(self) -> None:
        """Per batch its rank, number there and units (``_Model``); a rank's batches are numbered
        in posting order (``_Lowered``), so ``batch_first`` and ``unit_first`` delimit them."""
        lowered, starts, positions = self.posting.lowered, self.op_start, self.op_position
        flags, programs = lowered.batch_flags, self.schedule.per_rank
        batch_first, unit_first = self.batch_first, self.unit_first
        for rank, row in enumerate(lowered.steps):
            group, low = self._stream(rank, -1), self.rank_batches[-1]  # its batches from ``low``
            posted = range(low, 1 + next((s >> 2 for s in row[::-1] if s & 3 == _POST), low - 1))
            self.rank_batches.append(posted.stop)
            self.batch_rank += [rank] * len(posted)
            self.batch_index += range(len(posted))
            kinds = set(mine := flags[low : posted.stop])  # the rank's batches' flags
            if not any(bits & _PAIRWISE for bits in kinds):  # a unit per batch, in order
                first = len(self.unit_batch)
                batch_first += range(first + 1, first + 1 + len(posted))
                unit_first += starts[low + 1 : posted.stop + 1]
                self.unit_batch += posted
                side = any(bits & _SIDE_BATCH for bits in kinds)
                streams = [group, self._stream(rank, _SIDE) if side else group]
                self.unit_stream += [streams[bits & _SIDE_BATCH != 0] for bits in mine]
                continue
            for batch in posted:
                bits = flags[batch]
                if bits & _PAIRWISE:
                    ops = range(starts[batch], starts[batch + 1])
                    unit_first += range(starts[batch] + 1, starts[batch + 1] + 1)
                    peers = [programs[rank][positions[op]].peer or 0 for op in ops]
                    streams = [self._stream(rank, peer) for peer in peers]
                else:
                    unit_first.append(starts[batch + 1])
                    streams = [self._stream(rank, _SIDE) if bits & _SIDE_BATCH else group]
                batch_first.append(batch_first[-1] + len(streams))
                self.unit_batch += [batch] * len(streams)
                self.unit_stream += streams

    def _rank_steps(self, rank: int) -> list[int]:
        """``rank``'s CPU steps: its posting, each step after the waits it needs. A compute waits
        for the batches holding what it consumes (``Program.wait`` / ``restore``) and for its
        output's send before the backward freeing it (``deallocate_pipeline_outputs``); a composite
        for its parts'. Fills ``op_key`` and ``channels`` with the rank's ops, in posting order."""
        lowered, program, actions = self.posting.lowered, self.program, self.schedule.per_rank[rank]
        wait, restores, compute, frees = program.wait[rank], program.restore[rank], _COMPUTE, _FREES
        last, mbs, messages = self.schedule.num_stages - 1, self.rules.microbatches, program.message
        act = ACT * self.rules.span  # an activation's id: (act + stage + 1) * mbs + mb
        starts, positions, op_unit, send = self.op_start, self.op_position, self.op_unit, _SEND_BIT
        batches = self.rank_batches[rank], self.rank_batches[rank + 1]
        first, end = starts[batches[0]], starts[batches[1]]
        keys = [  # its ops' keys: message * 4 + send * 2 + rest
            messages[rank][item >> 1] * 4 + send[actions[item >> 1].kind] + (item & 1)
            for batch in lowered.batch_items[slice(*batches)]
            for item in batch
        ]
        self.op_key += keys
        mine: defaultdict[int, list[int]] = defaultdict(list)  # peer * 2 + send -> its channel
        for op, position, key in zip(range(first, end), positions[first:end], keys, strict=True):
            mine[(actions[position].peer or 0) * 2 + (key >> 1 & 1)].append(op)
        for channel, members in mine.items():  # the channels, in order of their first op
            peer = channel >> 1
            self.channels[(rank, peer, True) if channel & 1 else (peer, rank, False)] = members
        # whether it posts BPipe's transfers: theirs are the only messages at or above ``limit``
        transfers, moves = self.rules.transfers, max(keys, default=0) >> 2 >= self.rules.limit
        # op key -> the unit running it; a CPU waits for units posted (``< posted``), so
        # ``holder`` is filled op by op for BPipe's transfers, waits by position, a key twice
        holder = dict(zip(keys, op_unit[first:end], strict=True))
        if in_order := moves or bool(lowered.waits) or len(holder) < len(keys):
            holder.clear()
        unit_at: dict[int, int] = {}  # position -> unit (``in_order``)
        steps: list[int] = []
        unsettled: list[int] = []  # BPipe's sends the next compute settles (``settle``)
        add_step, get, never = steps.append, holder.get, len(self.unit_batch)
        posted, batch_first = self.batch_first[batches[0]], self.batch_first
        for step in lowered.steps[rank]:
            code, value = step & 3, step >> 2
            if code == _POST:  # in order: an op may wait for a transfer before it
                for op in range(starts[value], starts[value + 1]) if in_order else ():
                    if moves and (action := actions[positions[op]]).kind in transfers:
                        self._transfer_waits(action, op, holder, steps, unsettled)
                    holder[keys[op - first]] = unit_at[positions[op]] = op_unit[op]
                posted = batch_first[value + 1]
                add_step(step)
                if lowered.batch_flags[value] & _BLOCKING:
                    steps.extend(unit * 4 + _WAIT for unit in range(batch_first[value], posted))
            elif code == _WAIT:  # for the units of these positions' ops, posted earlier
                for position in lowered.waits[value]:
                    if position not in unit_at:
                        raise self._error(
                            f"rank {rank} waits for step {position}, which no earlier batch posts",
                            {(rank, position): "ERROR HERE"},
                        )
                    add_step(unit_at[position] * 4 + _WAIT)
            elif (kind := actions[value].kind) not in compute:
                add_step(step)
            else:
                if (need := wait[value]) >= 0 and (unit := get(need * 4, never)) < posted:
                    add_step(unit * 4 + _WAIT)
                if restores and (unit := get(restores.get(value, -1) * 4, never)) < posted:
                    add_step(unit * 4 + _WAIT)  # the restore of an LD's activations
                if kind in frees and (action := actions[value]).stage != last:
                    need = (act + action.stage + 1) * mbs + (action.microbatch or 0)
                    if (unit := get(need * 4 + 2, never)) < posted:
                        add_step(unit * 4 + _WAIT)
                if kind is _FB:  # its parts' waits as above (a composite's restore is its own)
                    for part in parts(actions[value]):
                        needs = [program.wait_of(part) * 4]  # -4 for none
                        if part.kind in frees and part.stage != last:
                            sent = (act + part.stage + 1) * mbs + (part.microbatch or 0)
                            needs.append(sent * 4 + 2)
                        for key in needs:
                            if key >= 0 and (unit := get(key, never)) < posted:
                                add_step(unit * 4 + _WAIT)
                add_step(step)
                if unsettled:  # gloo: a transfer's send is settled after the next compute
                    self.settles = True
                    if self.settle:
                        steps.extend(unit * 4 + _WAIT for unit in unsettled)
                    unsettled.clear()
        # then for its units not waited for yet (a unit waited for once is passed at once)
        steps += sorted({unit * 4 + _WAIT for unit in set(holder.values())}.difference(steps))
        return steps

    def _transfer_waits(
        self, action: Action, op: int, holder: dict[int, int], steps: list[int], later: list[int]
    ) -> None:
        """A BPipe transfer's waits before posting (``Rules.transfer_waits``: RS the payload it
        returns, AC the payload's header); ``later`` gets a send the next compute settles."""
        rules = self.rules
        rule, waited = rules.transfers[action.kind], rules.transfer_waits(action)
        if waited is not None and (rule.carries_data or self.op_key[op] & 1):
            key = rules.id(WHAT_CODE[waited.what], waited.stage, waited.microbatch) * 4
            for wanted in (key, key + 1) if rule.carries_data else (key,):
                if (unit := holder.get(wanted)) is not None:
                    steps.append(unit * 4 + _WAIT)
        if action.kind in _SENDS and rules.awaits(action):
            later.append(self.op_unit[op])

    def _match(self) -> list[int]:
        """Pair each op with its partner by posting order (``semantics.match_channels``)."""
        op_key, channels = self.op_key, self.channels
        partner = [-1] * len(op_key)
        for (src, dst, send), op_ids in channels.items():
            if not send:  # receives: matched from their sends
                continue
            receives = channels.get((src, dst, False), [])
            for k, (op_id, other_id) in enumerate(match_channels(op_ids, receives)):
                if other_id is None or op_key[other_id] ^ 2 != op_key[op_id]:
                    got = "nothing" if other_id is None else self._what_text(other_id)
                    raise self._error(
                        f"send #{k} from rank {src} to rank {dst} is {self._what_text(op_id)} but "
                        f"rank {dst}'s receive #{k} from rank {src} is {got}",
                        {(src, self.op_position[op_id]): "ERROR HERE"},
                    )
                partner[op_id], partner[other_id] = other_id, op_id
        if -1 in partner:  # the first op unmatched
            op_id = partner.index(-1)
            raise self._error(
                f"rank {self._op_rank(op_id)} receives {self._what_text(op_id)} from rank "
                f"{self._op_peer(op_id)}, which never sends it",
                {(self._op_rank(op_id), self.op_position[op_id]): "ERROR HERE"},
            )
        return partner

    def run(self, timing: Timing | None) -> None:
        """One run, afresh: untimed (all clocks 0) or under ``timing``."""
        num_ranks = self.schedule.num_ranks
        nbatches, nunits = len(self.batch_first) - 1, len(self.unit_batch)
        self.started, self.unit_done = bytearray(nunits), bytearray(nunits)
        self.posted = bytearray(nbatches)
        self.left = list(map(sub, self.unit_first[1:], self.unit_first))
        self.queues: list[deque[int]] = [deque() for _ in self.streams]
        self.pc = [0] * num_ranks
        self.waiter: dict[int, int] = {}  # unit -> rank whose CPU waits for it
        self.ready: deque[int] = deque(range(num_ranks))
        zero: float = 0
        self.cpu, self.dp_free, self.busy, self.gather_wait = ([zero] * num_ranks for _ in "1234")
        self.ps_done: list[dict[int, float]] = [{} for _ in range(num_ranks)]
        self.post_time, self.done_time = [zero] * nbatches, [zero] * nbatches
        self.start_time, self.unit_end = [zero] * nunits, [zero] * nunits
        self.unit_active: list[float] = [math.inf] * nunits  # when its first op got going
        self.stream_free = [zero] * len(self.streams)
        stages = self.schedule.num_stages
        self.durations = {} if timing is None else stage_durations(timing, stages)
        p2p = 0 if timing is None else timing.p2p
        transfers = (0,) * stages if timing is None else transfer_durations(timing, stages)
        self.a2a = 0 if timing is None else timing.a2a
        if timing is not None:
            lanes = {K.GRAD_SYNC: timing.grad_sync, K.PARAM_SYNC: timing.param_sync}
            self.durations |= {kind: (d,) * stages for kind, d in lanes.items()}
        # per op once both halves started: its stage's transfer for stored activations, else p2p
        if all(t == p2p for t in transfers):
            self.op_time: list[float] = [p2p] * len(self.op_key)
        else:
            mbs, per_what = self.rules.microbatches, self.rules.span * self.rules.microbatches
            restore, evict = WHAT_CODE[What.RESTORE], WHAT_CODE[What.EVICT]
            self.op_time = [
                transfers[(key >> 2) % per_what // mbs - 1]
                if (what := (key >> 2) // per_what) == restore or (what == evict and key & 1)
                else p2p
                for key in self.op_key
            ]
        self.records: list[list[tuple[float, float, int]]] = [[] for _ in range(num_ranks)]
        self._advance()
        if any(self.pc[r] < len(self.steps[r]) for r in range(num_ranks)) or any(self.queues):
            raise self._deadlock()

    def timed(self, timing: Timing) -> PostingRun:
        """One run under ``timing``. Where the last stage is not on the last rank (V-shapes), its
        rank sends the step's losses there once both are done (data-parallel lanes too) in two
        blocking messages, ending both ranks' steps (``runtime.placement.deliver_to_last_rank``)."""
        with paused_gc():
            self.run(timing)
        layout, cpu, dp_end = self.schedule.layout, self.cpu, self.dp_free
        source, target = layout.rank_of(layout.num_stages - 1), layout.num_ranks - 1
        if source != target:
            ready = max(cpu[source], dp_end[source], cpu[target], dp_end[target])
            cpu[source] = cpu[target] = ready + 2 * timing.p2p
        events = partial(self._events, self.records, self.unit_active, self.done_time)
        return PostingRun(cpu, dp_end, self.busy, self.gather_wait, events)

    def _advance(self) -> None:
        """Run the ready CPUs until each waits or ends. A unit starts once posted and its stream
        is free, an op ends ``op_time`` after both halves started, a unit with its last op;
        completing units start their successors (no recursion) and wake the CPU waiting on them."""
        steps_of, pc_of, ready, waiter, cpu = self.steps, self.pc, self.ready, self.waiter, self.cpu
        run, posted, post_time = self._run, self.posted, self.post_time
        queues, stream_of, unit_batch = self.queues, self.unit_stream, self.unit_batch
        op_unit, op_time, partner, left = self.op_unit, self.op_time, self.partner, self.left
        started, start_time, unit_first = self.started, self.start_time, self.unit_first
        unit_done, unit_end, unit_active = self.unit_done, self.unit_end, self.unit_active
        stream_free, batch_first, done_time = self.stream_free, self.batch_first, self.done_time
        durations, ps_done, busy, records = self.durations, self.ps_done, self.busy, self.records
        programs, timed = self.schedule.per_rank, bool(self.durations)
        starting: list[int] = []  # units to start, then their successors
        finished: list[int] = []  # the units a start completes
        while ready:
            rank = ready.popleft()
            steps, pc = steps_of[rank], pc_of[rank]
            while pc < len(steps):
                step = steps[pc]
                code, value = step & 3, step >> 2
                if code == _WAIT:
                    if not unit_done[value]:
                        waiter[value] = rank
                        break
                    if unit_end[value] > cpu[rank]:
                        cpu[rank] = unit_end[value]
                elif code == _POST:
                    posted[value] = 1
                    post_time[value] = cpu[rank]
                    for unit in range(batch_first[value], batch_first[value + 1]):
                        queue = queues[stream_of[unit]]
                        queue.append(unit)
                        if len(queue) == 1:
                            starting.append(unit)
                    while starting:
                        unit = starting.pop()
                        started[unit] = 1
                        start = post_time[unit_batch[unit]]
                        if stream_free[stream_of[unit]] > start:
                            start = stream_free[stream_of[unit]]
                        start_time[unit] = start
                        last = start if start > unit_end[unit] else unit_end[unit]
                        active, waiting = unit_active[unit], left[unit]  # the unit's, kept here
                        for op in range(unit_first[unit], unit_first[unit + 1]):
                            other = op_unit[partner[op]]
                            if other == unit:  # a rank messaging itself: never in a valid schedule
                                waiting -= 1
                                continue
                            if not started[other]:
                                continue
                            begin = start if start > start_time[other] else start_time[other]
                            end = begin + op_time[op]
                            if end > last:
                                last = end
                            if begin < active:
                                active = begin
                            waiting -= 1
                            if end > unit_end[other]:
                                unit_end[other] = end
                            if begin < unit_active[other]:
                                unit_active[other] = begin
                            left[other] -= 1
                            if not left[other]:
                                finished.append(other)
                        unit_end[unit], unit_active[unit], left[unit] = last, active, waiting
                        if not waiting:
                            finished.append(unit)
                        for done in finished:
                            unit_done[done] = 1
                            stream_free[stream := stream_of[done]] = end = unit_end[done]
                            queue = queues[stream]
                            queue.popleft()
                            if queue:
                                starting.append(queue[0])
                            if end > done_time[batch := unit_batch[done]]:
                                done_time[batch] = end
                            if (woken := waiter.pop(done, None)) is not None:
                                ready.append(woken)
                        finished.clear()
                elif not timed:
                    pass
                elif (action := programs[rank][value]).kind in COMPUTE_KINDS and not ps_done[rank]:
                    now = cpu[rank]  # a plain compute, no gather pending: the rest in ``_run``
                    cpu[rank] = end = now + (duration := durations[action.kind][action.stage])
                    busy[rank] += duration
                    records[rank].append((now, end, value))
                else:
                    run(rank, value)
                pc += 1
            pc_of[rank] = pc

    def _run(self, rank: int, position: int) -> None:
        """A compute on the CPU, or a GS / PS on the data-parallel lane (timed only)."""
        action = self.schedule.per_rank[rank][position]
        kind = action.kind
        row = self.durations.get(kind)
        duration = None if row is None else row[action.stage]
        if duration is None and kind is _FB:  # the composite rule: its parts' durations
            duration = action_duration(
                self.durations, action, self.rules.hidden(rank, position, self.a2a)
            )
        if duration is None:  # RL: frees memory, takes no time
            return
        now = self.cpu[rank]
        if kind in _COMPUTE:
            start, gathered, ps_done = now, None, self.ps_done[rank]
            if ps_done and kind is _FB:  # the composite rule: both parts' stages gathered
                gathers = [ps_done.pop(part.stage, None) for part in parts(action)]
                gathered = max((g for g in gathers if g is not None), default=None)
            elif ps_done:  # a gather pending
                gathered = ps_done.pop(action.stage, None)
            if gathered is not None and gathered > start:
                self.gather_wait[rank] += gathered - start
                start = gathered
            self.cpu[rank] = start + duration
            self.busy[rank] += duration
        else:
            start = max(self.dp_free[rank], now)
            self.dp_free[rank] = start + duration
            if kind is K.PARAM_SYNC:
                self.ps_done[rank][action.stage] = start + duration
            if duration <= 0:
                return
        self.records[rank].append((start, start + duration, position))

    def _events(
        self,
        records: list[list[tuple[float, float, int]]],
        unit_active: list[float],
        done_time: list[float],
    ) -> list[Event]:
        """The events of one run (``PostingRun.events``): its computes and GS / PS, and each
        batch on its rank's p2p lane from when its first op had both halves started to its
        completion where that takes time (a batch waiting for its peer is not busy)."""
        programs = self.schedule.per_rank
        per_rank = [[self._event(rank, *row) for row in rows] for rank, rows in enumerate(records)]
        for batch in range(len(self.batch_first) - 1):
            units = range(self.batch_first[batch], self.batch_first[batch + 1])
            start = min(unit_active[unit] for unit in units)
            end = done_time[batch]
            if end <= start:
                continue
            rank = self.batch_rank[batch]
            ops = range(self.op_start[batch], self.op_start[batch + 1])
            label = " ".join(
                str(programs[rank][self.op_position[op]]) + "+" * (self.op_key[op] & 1)
                for op in ops
            )
            per_rank[rank].append(self._event(rank, start, end, self.op_position[ops[0]], label))
        for events in per_rank:
            events.sort(key=_start_of)
        return [event for events in per_rank for event in events]

    def _event(
        self, rank: int, start: float, end: float, position: int, label: str | None = None
    ) -> Event:
        """A compute or GS / PS at ``position``, or with ``label`` a batch led by it."""
        action = self.schedule.per_rank[rank][position]
        lane: Lane = "p2p" if label else "compute" if action.kind in _COMPUTE else "dp"
        text = label or str(action)
        return Event(rank, lane, text, action.stage, action.microbatch, action.kind, start, end)

    def _deadlock(self) -> ScheduleError:
        """Follow the waits from a stuck rank until one repeats: that is the cycle."""
        stuck = [r for r in range(self.schedule.num_ranks) if self.pc[r] < len(self.steps[r])]
        queued = next(queue[0] for queue in self.queues if queue) if not stuck else -1
        node: tuple[str, int] = ("cpu", stuck[0]) if stuck else ("unit", queued)
        seen: dict[tuple[str, int], int] = {}
        chain: list[tuple[str, tuple[int, int]]] = []
        while node not in seen:
            seen[node] = len(chain)
            text, mark, node = self._explain(node)
            chain.append((text, mark))
        cycle = chain[seen[node] :]
        return self._error(
            f"{self.schedule.name} deadlocks on NCCL when posted {self.posting.name}; the "
            "cycle of waits:\n" + "\n".join(f"  {text}" for text, _ in cycle),
            {mark: "NCCL: stuck" for _, mark in cycle if mark[1] >= 0},
        )

    def _explain(self, node: tuple[str, int]) -> tuple[str, tuple[int, int], tuple[str, int]]:
        """One link of the cycle: a CPU waits for a unit (a batch, or a pairwise op), which is
        queued behind another on its stream or waits for a partner not started."""
        kind, value = node
        if kind == "cpu":
            rank = value
            unit = self.steps[rank][self.pc[rank]] >> 2
            position = self._last_position(rank)
            return (
                f"rank {rank} waits (after step {position}) for its {self._name(unit)}",
                (rank, position),
                ("unit", unit),
            )
        unit = value
        rank = self.batch_rank[self.unit_batch[unit]]
        ops = range(self.unit_first[unit], self.unit_first[unit + 1])
        mark = (rank, self.op_position[ops[0]] if ops else -1)  # an empty batch marks nothing
        if not self.posted[self.unit_batch[unit]]:  # its CPU waits for it before posting it
            return (f"rank {rank}'s {self._name(unit)} is not posted yet", mark, ("cpu", rank))
        if not self.started[unit]:
            head = self.queues[self.unit_stream[unit]][0]
            return (
                f"rank {rank}'s {self._name(unit)} is queued behind its {self._name(head)}",
                mark,
                ("unit", head),
            )
        for op_id in ops:
            other = self.partner[op_id]
            other_unit, other_rank = self.op_unit[other], self._op_rank(other)
            if not self.started[other_unit]:
                verb = "sends" if self.op_key[op_id] & 2 else "receives"
                posted = self.posted[self.unit_batch[other_unit]]
                state = "not started" if posted else "not posted yet"
                nxt = ("unit", other_unit) if posted else ("cpu", other_rank)
                return (
                    f"rank {rank}'s {self._name(unit)} {verb} {self._what_text(op_id)}: its "
                    f"partner is in rank {other_rank}'s {self._name(other_unit)}, {state}",
                    mark,
                    nxt,
                )
        raise AssertionError("a started batch with every partner started completes")

    def _last_position(self, rank: int) -> int:
        for step in reversed(self.steps[rank][: self.pc[rank]]):
            code, value = step & 3, step >> 2
            if code == _RUN:
                return value
            if code == _POST and self.op_start[value + 1] > self.op_start[value]:
                return self.op_position[self.op_start[value + 1] - 1]
        return -1

    def _name(self, unit: int) -> str:
        """A unit as its batch: the rank's batch number, tick, ops (a pairwise op alone)."""
        batch = self.unit_batch[unit]
        text = " ".join(
            f"{'S' if self.op_key[op] & 2 else 'R'} {self._what_text(op)}"
            f"{'>' if self.op_key[op] & 2 else '<'}{self._op_peer(op)}"
            for op in range(self.unit_first[unit], self.unit_first[unit + 1])
        )
        tick = self.batch_tick[batch]
        when = f" (tick {tick})" if tick >= 0 else ""
        return f"batch #{self.batch_index[batch]}{when} [{text}]"

    def _op_rank(self, op_id: int) -> int:
        return self.batch_rank[self.unit_batch[self.op_unit[op_id]]]

    def _op_peer(self, op_id: int) -> int:
        return self.schedule.per_rank[self._op_rank(op_id)][self.op_position[op_id]].peer or 0

    def _what_text(self, op_id: int) -> str:
        key = self.op_key[op_id]
        message = self.program.message_of(key >> 2)
        payload = "-payload" if key & 1 else ""
        return f"{message.what}{payload}{message.stage}.{message.microbatch}"

    def _error(self, message: str, marks: dict[tuple[int, int], str]) -> ScheduleError:
        return ScheduleError(f"{message}\n{format_schedule(self.schedule, marks=marks)}")


_POST, _WAIT, _RUN = 0, 1, 2  # a CPU step's code (``_Model``)
_SENDS = frozenset(kind for kind in K if kind.is_send)
_SEND_BIT = {kind: 2 * kind.is_send for kind in K}  # an op key's send bit
_start_of = attrgetter("start")
