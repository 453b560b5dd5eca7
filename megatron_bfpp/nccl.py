"""Point-to-point messages under NCCL's rules: how the runtime posts them (lock-step batches)
and the model that proves a posting deadlock-free on NCCL before any message is sent.

NCCL (torch's ProcessGroupNCCL) is stricter than gloo in three ways that matter to a pipeline:

1. ``batch_isend_irecv`` runs its ops as one group and returns one Work for the whole batch;
2. all batches of one process group share one communicator and one stream: a rank's batch k+1
   starts only after its batch k has completed;
3. a batch completes only when every op in it has been matched, and a send waits until the
   receiver has *started* the batch holding its receive (rendezvous; NCCL buffers small sends,
   the model assumes it buffers none).

So two ranks that each post "send" then "receive" as two batches deadlock on NCCL, though gloo
(whose sends never wait) runs them; the execution rules the validator and simulator share
(``semantics``) are gloo's, and accept such orders.

**Lock-step posting** (``lockstep_posting``, what the runtime does: megatron-core's one batch per
pipeline tick, generalised to any schedule). A unit-time as-soon-as-possible replay numbers the
compute actions: each lasts one tick, a message takes none. A message goes in the batch of the
tick at which its sender posts it: SA / SG at the end of the compute before them, EV and RS
there too but no earlier than the partner reaches its AC / LD (and RS a tick after the eviction
it returns), so a payload arrives where the program order says it is received. Each rank
posts one batch per tick it sends or receives at, holding its sends of that tick and the
receives of everything sent to it at that tick, in one canonical order both sides compute
alike, and posts it after its computes that end by that tick and before those that start at it
or later. Every op's partner is then in the peer's batch of the same tick, and by induction on
the tick every batch completes: the batches of tick t are all posted once every compute that
ends by t has run, those computes consume only batches of ticks up to their start (< t), and
the batches of a rank complete in tick order.

BPipe's payload size is known only to the evictor, so an eviction travels in two batches of the
same tick: its size header in the tick's batch, then the payload in a second batch that only the
evictor and the acceptor post, right after it (the *rest* items below). The acceptor reads the
header, blocking its CPU, between the two, so it can post a receive of the right size; both
batches come before the computes that start at the tick. Neither blocks anyone else: the tick's
batch completes as before, and the payload batch needs only the two ranks that posted it.

**The model** (``check_posting``) runs any posting under rules 1-3 with a strict CPU per rank:
each rank executes its steps in order, waits at a compute for the batches holding what it
consumes (and the send of its output before the backward that frees it, and BPipe's transfers
after the next compute, as the runtime does on gloo), at a BPipe RS for the eviction it returns,
before a payload batch for the eviction's header; a batch starts when posted and its predecessor
on the rank has completed. Postings of other executors say more (``native_posting``:
megatron-core's own): a ``blocking`` batch is waited right after it is posted, a ``pairwise``
batch's ops (non-batched ``isend`` / ``irecv``) each run on the stream of their (rank, peer) pair,
FIFO per pair, instead of the rank's one stream, and a ``Wait`` step waits for the ops it
names. A CPU that waits is stricter than a GPU (whose CPU only enqueues stream waits), so what
the model proves holds on both. A posting that cannot finish is reported with
the cycle of waits and the per-rank grid.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import NamedTuple

from megatron_bfpp.ir import Action, ActionKind, Schedule, ScheduleError, format_schedule
from megatron_bfpp.messages import WHAT, Message, message_of

__all__ = [
    "Batch",
    "Item",
    "Posting",
    "Wait",
    "check_posting",
    "lockstep_posting",
    "nccl_report",
    "validate_nccl",
    "written_posting",
]

K = ActionKind
_WHAT_CODE = {name: code for code, name in enumerate(WHAT)}
RS_DELAY = 1  # ticks from an eviction to its return: the payload is in by the end of its tick


class Item(NamedTuple):
    """One action's ops in a batch: its message (for EV / AC the size header), or with
    ``rest`` an eviction's payload (the evictor sends it; the acceptor first reads the header,
    then receives it)."""

    position: int
    rest: bool = False


@dataclass(frozen=True, slots=True)
class Batch:
    """One ``batch_isend_irecv`` of one rank; ``tick`` is -1 outside lock-step postings.

    ``blocking``: the posting rank waits for the batch to complete before its next step
    (megatron-core's ``req.wait()`` right after posting). ``pairwise``: the ops are non-batched
    ``isend`` / ``irecv``, each on the stream of its (rank, peer) pair, FIFO per pair, instead
    of one batch on the rank's one stream."""

    tick: int
    items: tuple[Item, ...]
    blocking: bool = False
    pairwise: bool = False


@dataclass(frozen=True, slots=True)
class Wait:
    """The CPU waits here for the ops of the p2p actions at these program positions, posted
    earlier in a batch that is not ``blocking`` (megatron-core's deferred ``req.wait()``)."""

    positions: tuple[int, ...]


# A program position (compute, GS, PS, RL), a batch of p2p actions, or a deferred wait.
Step = int | Batch | Wait


@dataclass(frozen=True, slots=True)
class Posting:
    """Per rank, the order in which the CPU runs the non-p2p actions and posts the batches."""

    name: str
    per_rank: tuple[tuple[Step, ...], ...]

    def batches(self, rank: int) -> list[Batch]:
        return [step for step in self.per_rank[rank] if isinstance(step, Batch)]


# --- lock-step posting --------------------------------------------------------------------------
def lockstep_posting(schedule: Schedule) -> Posting:
    """The runtime's posting: one batch per tick, partners in the same tick (module docstring)."""
    ticks = _unit_ticks(schedule)
    per_rank = []
    for rank, actions in enumerate(schedule.per_rank):
        tick_of = ticks[rank]
        by_tick: dict[tuple[int, int], list[Item]] = defaultdict(list)  # (tick, payload?)
        # Sort keys (tick, phase, order): at a tick, its batch, its payload batch, the GS / PS /
        # RL that follow the compute ending there (after its messages: the pipeline's critical
        # path goes first), then the compute starting there.
        steps: list[tuple[tuple[int, int, int], Step]] = []
        end = 0  # the end of the latest compute
        for position, action in enumerate(actions):
            kind = action.kind
            if kind.is_p2p:
                by_tick[(tick_of[position], 0)].append(Item(position))
                if kind is K.EVICT or kind is K.ACCEPT:
                    by_tick[(tick_of[position], 1)].append(Item(position, rest=True))
            elif kind.is_compute:
                steps.append(((tick_of[position], 3, position), position))
                end = tick_of[position] + 1
            else:
                steps.append(((end, 2, position), position))
        for (tick, payload), items in by_tick.items():
            items.sort(key=lambda item: _canonical(actions[item.position]))
            steps.append(((tick, payload, 0), Batch(tick, tuple(items))))
        steps.sort(key=lambda entry: entry[0])
        per_rank.append(tuple(step for _, step in steps))
    return Posting("lock-step", tuple(per_rank))


def _canonical(action: Action) -> tuple[int, int, int]:
    """The order of a batch's ops, from the message alone so that both ends agree."""
    message = message_of(action)
    return (_WHAT_CODE[message.what], message.stage, message.microbatch)


def _unit_ticks(schedule: Schedule) -> list[list[int]]:
    """Per rank and position: a compute's start tick, a p2p action's batch tick, else -1."""
    replay = _TickReplay(schedule)
    replay.run()
    return replay.ticks


class _TickReplay:
    """An as-soon-as-possible replay with unit computes and instant messages.

    Each rank advances until it needs a message not yet sent. BPipe's EV (RS) goes out no
    earlier than the tick at which the partner reaches its AC (LD) in program order, and the
    evictor's (acceptor's) next compute waits for that, as the gloo rules have it: a payload
    then arrives where the schedule's program order (which the memory model and the eviction
    pass reason about) says it is received, not earlier."""

    def __init__(self, schedule: Schedule) -> None:
        programs = schedule.per_rank
        self.schedule = schedule
        self.ticks = [[-1] * len(actions) for actions in programs]
        self.sent: dict[Message, int] = {}
        self.posted: dict[Message, int] = {}  # AC / LD: the receiver's tick at that position
        self.loaded = [
            {(a.stage, a.microbatch or 0) for a in actions if a.kind is K.LOAD}
            for actions in programs
        ]
        self.at = [0] * len(programs)
        self.now = [0] * len(programs)  # the end of each rank's latest compute
        # EV / RS waiting for the partner's AC / LD: (position, message, earliest tick).
        self.deferred: list[list[tuple[int, Message, int]]] = [[] for _ in programs]

    def run(self) -> None:
        programs = self.schedule.per_rank
        pending = list(range(len(programs)))
        progressed = True
        while pending and progressed:  # rounds over the ranks still running, while any moves
            progressed, still = False, []
            for rank in pending:
                position = self._advance(rank, self.at[rank])
                progressed |= position != self.at[rank]
                self.at[rank] = position
                if position < len(programs[rank]) or self.deferred[rank]:
                    still.append(rank)
            pending = still
        if pending:
            raise ScheduleError(
                f"{self.schedule.name}: no lock-step posting exists (ranks {sorted(pending)} "
                "wait for messages nobody sends); validate the schedule first"
            )
        for rank, actions in enumerate(programs):
            for position, action in enumerate(actions):
                if action.kind.is_recv:
                    message = message_of(action)
                    if message not in self.sent:
                        raise ScheduleError(f"rank {rank}, step {position}: {action} is never sent")
                    self.ticks[rank][position] = self.sent[message]

    def _resolved(self, rank: int) -> int | None:
        """Settle the deferred transfers whose partner has posted; the latest tick among them,
        or None while one still waits."""
        latest, still = 0, []
        for position, message, earliest in self.deferred[rank]:
            if message not in self.posted:  # AC / LD name the same message as EV / RS
                still.append((position, message, earliest))
                continue
            tick = max(earliest, self.posted[message])
            self.ticks[rank][position] = self.sent[message] = tick
            latest = max(latest, tick)
        self.deferred[rank] = still
        return None if still else latest

    def _advance(self, rank: int, position: int) -> int:
        """Number ``rank``'s actions from ``position``; return where it stopped."""
        layout, actions, t = self.schedule.layout, self.schedule.per_rank[rank], self.now[rank]
        sent, ticks = self.sent, self.ticks[rank]
        while True:
            if position == len(actions):
                self._resolved(rank)
                break
            action = actions[position]
            kind, stage, mb = action.kind, action.stage, action.microbatch or 0
            needs: list[Message] = []
            if kind is K.FORWARD:
                if stage > 0 and layout.rank_of(stage - 1) != rank:
                    needs.append(Message("act", stage - 1, mb))
            elif kind is K.BACKWARD or kind is K.BACKWARD_INPUT:
                if not layout.is_last(stage) and layout.rank_of(stage + 1) != rank:
                    needs.append(Message("grad", stage + 1, mb))
                if (stage, mb) in self.loaded[rank]:
                    needs.append(Message("restore", stage, mb))
            elif kind is K.RESTORE:
                needs.append(Message("evict", stage, mb))
            if any(need not in sent for need in needs):
                break
            ready = max((sent[need] for need in needs), default=0)
            if kind.is_compute:
                transfers = self._resolved(rank)
                if transfers is None:
                    break
                ticks[position] = max(t, ready, transfers)
                t = ticks[position] + 1
            elif kind is K.SEND_ACT or kind is K.SEND_GRAD:
                ticks[position] = sent[message_of(action)] = t
            elif kind is K.EVICT:
                self.deferred[rank].append((position, message_of(action), t))
            elif kind is K.RESTORE:
                self.deferred[rank].append((position, message_of(action), max(t, ready + RS_DELAY)))
            elif kind is K.ACCEPT or kind is K.LOAD:
                self.posted[message_of(action)] = t
            position += 1
        self.now[rank] = t
        return position


# --- as written -------------------------------------------------------------------------------
def written_posting(schedule: Schedule) -> Posting:
    """Each run of p2p actions between two computes posted as one batch, in program order: how
    the runtime posted before lock-step, and the order a schedule file states."""
    per_rank = []
    for actions in schedule.per_rank:
        steps: list[Step] = []
        window: list[Item] = []
        for position, action in enumerate(actions):
            if action.kind.is_p2p:
                window.append(Item(position))
                continue
            if window:
                steps.append(Batch(-1, tuple(window)))
                window = []
            steps.append(position)
        if window:
            steps.append(Batch(-1, tuple(window)))
        per_rank.append(tuple(steps))
    return Posting("as written", tuple(per_rank))


# --- the model --------------------------------------------------------------------------------
def validate_nccl(schedule: Schedule) -> Posting:
    """The lock-step posting of ``schedule``, proven under NCCL's rules (raises otherwise)."""
    posting = lockstep_posting(schedule)
    check_posting(schedule, posting)
    return posting


def nccl_report(schedule: Schedule) -> dict[str, dict[str, object]]:
    """Whether ``schedule`` is NCCL-safe as written (one batch per run of messages between two
    computes: what a file states, and what torch's runtime or ours before lock-step would post)
    and as the runtime posts it (lock-step); a failure's reason without the grid."""
    report: dict[str, dict[str, object]] = {}
    for key, make in (("as_written", written_posting), ("lock_step", lockstep_posting)):
        try:
            check_posting(schedule, make(schedule))
        except ScheduleError as error:
            report[key] = {"safe": False, "problem": str(error).split("\nrank ")[0]}
        else:
            report[key] = {"safe": True, "problem": None}
    return report


class _Op(NamedTuple):
    rank: int
    batch: int  # global batch id
    send: bool
    peer: int
    what: tuple[str, int, int, bool]  # the message, and whether it is an eviction's payload
    position: int


def check_posting(schedule: Schedule, posting: Posting) -> None:
    """Run ``posting`` under NCCL's rules (module docstring); raise a ScheduleError naming the
    cycle of waits, above the grid, if it cannot finish."""
    _Model(schedule, posting).run()


class _Model:
    def __init__(self, schedule: Schedule, posting: Posting) -> None:
        self.schedule, self.posting = schedule, posting
        num_ranks = schedule.num_ranks
        self.ops: list[_Op] = []
        self.batch_ops: list[list[int]] = []
        self.batch_rank: list[int] = []
        self.batch_index: list[int] = []  # the batch's number on its rank
        self.batch_tick: list[int] = []
        # The stream each batch runs on: a rank's batches share one, and a pairwise batch's ops
        # run one per (rank, peer) pair, each op then a batch of its own here.
        self.batch_stream: list[int] = []
        self.stream_ids: dict[tuple[int, int], int] = {}  # (rank, peer or -1) -> stream
        # Per rank: ("post", batch) / ("wait", batch) / ("run", position) in CPU order.
        self.steps: list[list[tuple[str, int]]] = [
            self._rank_steps(rank) for rank in range(num_ranks)
        ]
        self.partner = self._match()

    # building
    def _rank_steps(self, rank: int) -> list[tuple[str, int]]:
        actions = self.schedule.per_rank[rank]
        layout = self.schedule.layout
        holder: dict[tuple[bool, str, int, int, bool], int] = {}  # (send, message, rest) -> batch
        steps: list[tuple[str, int]] = []
        unsettled: list[int] = []

        def wait(send: bool, message: Message, rest: bool = False) -> None:
            batch = holder.get((send, *message, rest))
            if batch is not None:
                steps.append(("wait", batch))

        index = 0  # the rank's batches, numbered from 0
        unit_of: dict[int, int] = {}  # program position -> the batch holding its op
        for step in self.posting.per_rank[rank]:
            if isinstance(step, Wait):
                for position in step.positions:
                    if position not in unit_of:
                        raise self._error(
                            f"rank {rank} waits for step {position}, which no earlier batch posts",
                            {(rank, position): "ERROR HERE"},
                        )
                    steps.append(("wait", unit_of[position]))
                continue
            if isinstance(step, int):
                action = actions[step]
                kind, stage, mb = action.kind, action.stage, action.microbatch or 0
                if kind is K.FORWARD and stage > 0:
                    wait(False, Message("act", stage - 1, mb))
                elif kind is K.BACKWARD or kind is K.BACKWARD_INPUT:
                    if not layout.is_last(stage):
                        wait(False, Message("grad", stage + 1, mb))
                        wait(True, Message("act", stage, mb))  # the output it frees
                    wait(False, Message("restore", stage, mb))
                steps.append(("run", step))
                if kind.is_compute:  # gloo: BPipe's sends are settled after the next compute
                    steps.extend(("wait", batch) for batch in unsettled)
                    unsettled = []
                continue
            transfers = False
            units: list[int] = []
            for item in step.items:
                action = actions[item.position]
                message = message_of(action)
                if item.rest and action.kind is K.ACCEPT:
                    wait(False, message)  # the header, read before the payload is posted
                if action.kind is K.RESTORE:
                    wait(False, message._replace(what="evict"))
                    wait(False, message._replace(what="evict"), rest=True)
                if not units or step.pairwise:
                    peer = (action.peer or 0) if step.pairwise else -1
                    units.append(self._new_batch(rank, index, step.tick, peer))
                    index += 1
                batch = units[-1]
                send = action.kind.is_send
                holder[(send, *message, item.rest)] = batch
                unit_of[item.position] = batch
                op = _Op(rank, batch, send, action.peer or 0, (*message, item.rest), item.position)
                self.batch_ops[batch].append(len(self.ops))
                self.ops.append(op)
                transfers |= send and action.kind in (K.EVICT, K.RESTORE)
            steps.extend(("post", batch) for batch in units)
            if step.blocking:
                steps.extend(("wait", batch) for batch in units)
            if transfers:
                unsettled.extend(units)
        steps.extend(("wait", batch) for batch in sorted(set(holder.values())))
        return steps

    def _new_batch(self, rank: int, index: int, tick: int, peer: int) -> int:
        """A batch of ``rank`` on its stream (``peer`` -1) or on its pair's with ``peer``."""
        batch = len(self.batch_ops)
        self.batch_ops.append([])
        self.batch_rank.append(rank)
        self.batch_index.append(index)
        self.batch_tick.append(tick)
        stream = self.stream_ids.setdefault((rank, peer), len(self.stream_ids))
        self.batch_stream.append(stream)
        return batch

    def _match(self) -> list[int]:
        """The k-th send from a to b matches the k-th receive at b from a (posting order)."""
        channels: dict[tuple[int, int, bool], list[int]] = defaultdict(list)
        for rank in range(self.schedule.num_ranks):
            for kind, batch in self.steps[rank]:
                if kind == "post":
                    for op_id in self.batch_ops[batch]:
                        op = self.ops[op_id]
                        src, dst = (rank, op.peer) if op.send else (op.peer, rank)
                        channels[(src, dst, op.send)].append(op_id)
        partner = [-1] * len(self.ops)
        for (src, dst, send), op_ids in channels.items():
            if not send:
                continue
            receives = channels.get((src, dst, False), [])
            for k, op_id in enumerate(op_ids):
                op = self.ops[op_id]
                other = self.ops[receives[k]] if k < len(receives) else None
                if other is None or other.what != op.what:
                    got = "nothing" if other is None else _what_text(other.what)
                    raise self._error(
                        f"send #{k} from rank {src} to rank {dst} is {_what_text(op.what)} but "
                        f"rank {dst}'s receive #{k} from rank {src} is {got}",
                        {(src, op.position): "ERROR HERE"},
                    )
                partner[op_id], partner[receives[k]] = receives[k], op_id
        for op_id, op in enumerate(self.ops):
            if partner[op_id] < 0:
                raise self._error(
                    f"rank {op.rank} receives {_what_text(op.what)} from rank {op.peer}, "
                    "which never sends it",
                    {(op.rank, op.position): "ERROR HERE"},
                )
        return partner

    # running
    def run(self) -> None:
        num_ranks = self.schedule.num_ranks
        nbatches = len(self.batch_ops)
        self.started = bytearray(nbatches)
        self.done = bytearray(nbatches)
        self.posted = bytearray(nbatches)
        self.left = [len(ops) for ops in self.batch_ops]
        self.queues: list[deque[int]] = [deque() for _ in range(len(self.stream_ids))]
        self.pc = [0] * num_ranks
        self.waiter: dict[int, int] = {}  # batch -> rank whose CPU waits for it
        self.ready: deque[int] = deque(range(num_ranks))
        while self.ready:
            self._advance(self.ready.popleft())
        if any(self.pc[r] < len(self.steps[r]) for r in range(num_ranks)) or any(self.queues):
            raise self._deadlock()

    def _advance(self, rank: int) -> None:
        steps, pc = self.steps[rank], self.pc[rank]
        while pc < len(steps):
            kind, batch = steps[pc]
            if kind == "post":
                self.posted[batch] = 1
                queue = self.queues[self.batch_stream[batch]]
                queue.append(batch)
                if len(queue) == 1:
                    self._start(batch)
            elif kind == "wait" and not self.done[batch]:
                self.waiter[batch] = rank
                break
            pc += 1
        self.pc[rank] = pc

    def _start(self, first: int) -> None:
        """Start a batch; completing batches start their successors (no recursion)."""
        starting = [first]
        while starting:
            batch = starting.pop()
            self.started[batch] = 1
            finished = [] if self.left[batch] else [batch]
            for op_id in self.batch_ops[batch]:
                other = self.ops[self.partner[op_id]].batch
                if self.started[other] and other != batch:
                    for b in (batch, other):
                        self.left[b] -= 1
                        if not self.left[b]:
                            finished.append(b)
                elif other == batch:  # a rank messaging itself: never in a valid schedule
                    self.left[batch] -= 1
                    if not self.left[batch]:
                        finished.append(batch)
            for b in finished:
                self.done[b] = 1
                queue = self.queues[self.batch_stream[b]]
                queue.popleft()
                if queue:
                    starting.append(queue[0])
                woken = self.waiter.pop(b, None)
                if woken is not None:
                    self.ready.append(woken)

    # reporting
    def _deadlock(self) -> ScheduleError:
        """Follow the waits from a stuck rank until one repeats: that is the cycle."""
        stuck = [r for r in range(self.schedule.num_ranks) if self.pc[r] < len(self.steps[r])]
        node: tuple[str, int] = ("cpu", stuck[0]) if stuck else ("batch", self._any_queued())
        seen: dict[tuple[str, int], int] = {}
        chain: list[tuple[tuple[str, int], str, tuple[int, int]]] = []
        while node not in seen:
            seen[node] = len(chain)
            text, mark, node_next = self._explain(node)
            chain.append((node, text, mark))
            node = node_next
        cycle = chain[seen[node] :]
        lines = [f"  {text}" for _, text, _ in cycle]
        marks = {mark: "NCCL: stuck" for _, _, mark in cycle if mark[1] >= 0}
        return self._error(
            f"{self.schedule.name} deadlocks on NCCL when posted {self.posting.name}; the "
            "cycle of waits:\n" + "\n".join(lines),
            marks,
        )

    def _any_queued(self) -> int:
        return next(queue[0] for queue in self.queues if queue)

    def _explain(self, node: tuple[str, int]) -> tuple[str, tuple[int, int], tuple[str, int]]:
        kind, value = node
        if kind == "cpu":
            rank = value
            _, batch = self.steps[rank][self.pc[rank]]
            position = self._last_position(rank)
            return (
                f"rank {rank} waits (after step {position}) for its {self._name(batch)}",
                (rank, position),
                ("batch", batch),
            )
        batch, rank = value, self.batch_rank[value]
        mark = (rank, self.ops[self.batch_ops[batch][0]].position)
        if not self.started[batch]:
            head = self.queues[self.batch_stream[batch]][0]
            return (
                f"rank {rank}'s {self._name(batch)} is queued behind its {self._name(head)}",
                mark,
                ("batch", head),
            )
        for op_id in self.batch_ops[batch]:
            other = self.ops[self.partner[op_id]]
            if not self.started[other.batch]:
                op = self.ops[op_id]
                verb = "sends" if op.send else "receives"
                where = (
                    f"rank {other.rank}'s {self._name(other.batch)}, not posted yet"
                    if not self.posted[other.batch]
                    else f"rank {other.rank}'s {self._name(other.batch)}, not started"
                )
                nxt = ("batch", other.batch) if self.posted[other.batch] else ("cpu", other.rank)
                return (
                    f"rank {rank}'s {self._name(batch)} {verb} {_what_text(op.what)}: its "
                    f"partner is in {where}",
                    mark,
                    nxt,
                )
        raise AssertionError("a started batch with every partner started completes")

    def _last_position(self, rank: int) -> int:
        for kind, value in reversed(self.steps[rank][: self.pc[rank]]):
            if kind == "run":
                return value
            if kind == "post":
                return self.ops[self.batch_ops[value][-1]].position
        return -1

    def _name(self, batch: int) -> str:
        ops = [self.ops[op_id] for op_id in self.batch_ops[batch]]
        text = " ".join(
            f"{'S' if op.send else 'R'} {_what_text(op.what)}{'>' if op.send else '<'}{op.peer}"
            for op in ops
        )
        tick = self.batch_tick[batch]
        when = f" (tick {tick})" if tick >= 0 else ""
        return f"batch #{self.batch_index[batch]}{when} [{text}]"

    def _error(self, message: str, marks: dict[tuple[int, int], str]) -> ScheduleError:
        grid = format_schedule(self.schedule, marks=marks)
        return ScheduleError(f"{message}\n{grid}")


def _what_text(what: tuple[str, int, int, bool]) -> str:
    name, stage, mb, rest = what
    return f"{name}{'-payload' if rest else ''}{stage}.{mb}"
