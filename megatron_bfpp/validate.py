"""Prove a schedule complete, correctly paired and free of deadlock before anything runs it: one
pass (``_scan``) checks each rank and records its waits and sends under ``semantics.Rules``, then
``semantics.run_recorded`` runs them (docs/architecture.md, "Execution semantics"). A failure is a
``ScheduleError`` naming rank, step and reason above the per-rank grid; of several problems, the
first (rank order) of the first kind: 1 placement, 2 completeness (one F and one B, or I and W,
per stage and micro-batch), 3 local order, 4 message order (NCCL and gloo match by posting
order), 5 deadlock, 6 NCCL (``nccl.validate_nccl``: the lock-step posting under NCCL's rules;
``build_schedule`` leaves it to whoever posts), 7 data-parallel sync (one GS per chunk after its
last backward, at most one PS before its first compute), 8 data order (each stage's forwards in
micro-batch order, as the runtime reads the data iterators; one line, no grid)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator

from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    format_schedule,
    parts,
    primitives,
)
from megatron_bfpp.messages import ACT, EVICT, GRAD, RESTORE, Message, has_communication, message_of
from megatron_bfpp.nccl import validate_nccl
from megatron_bfpp.semantics import Recorded, Rules, describe_waits, match_channels, run_recorded

__all__ = [
    "Message",
    "has_communication",
    "message_of",
    "validate_completeness",
    "validate_data_order",
    "validate_deadlock_free",
    "validate_grad_sync",
    "validate_message_order",
    "validate_placement",
    "validate_schedule",
]

K = ActionKind


def validate_schedule(
    schedule: Schedule,
    *,
    require_communication: bool = True,
    require_backward: bool = True,
    nccl: bool = True,
    require_grad_sync: bool = False,
) -> None:
    """Every check in one pass (the module docstring's kinds; compute-only schedules under the
    compute-only rule). ``require_backward=False`` (forward-only): a (stage, micro-batch) may lack a
    backward, not have half of one. ``nccl``: check 6. ``require_grad_sync``: check 7 even without
    GS / PS / RL (the runtime, a CSV: else nothing is reduced in the step)."""
    scan = _scan(schedule)
    _raise(  # the first problem in the order of the module docstring
        scan.complete(require_backward)
        or (scan.mismatched_channel() if require_communication or scan.with_comm else None)
        or scan.deadlock()
        or _grad_sync_problem(scan, require_grad_sync)
        or _first(scan.data_order)
    )
    if nccl and has_communication(schedule):
        validate_nccl(schedule)


def validate_data_order(schedule: Schedule) -> None:
    """Each stage's forwards take micro-batches in increasing order (check 8)."""
    scan = _scan(schedule)
    _raise(_first(scan.placement) or _first(scan.data_order))


def validate_placement(schedule: Schedule) -> None:
    """Each action runs on the rank that owns its stage and names an existing micro-batch."""
    _raise(_first(_scan(schedule).placement))


def validate_completeness(schedule: Schedule, *, require_backward: bool = True) -> None:
    """Exactly one F and one B (or one I and one W) per (stage, micro-batch), in local order.
    ``require_backward=False`` accepts a (stage, micro-batch) with no backward at all."""
    _raise(_scan(schedule).complete(require_backward))


def validate_grad_sync(schedule: Schedule, *, required: bool = False) -> None:
    """Each chunk's GS once, after its last backward, and its PS before its first use (rule 7
    of the module docstring); ``required`` checks a schedule without any GS / PS / RL too."""
    scan = _scan(schedule)
    residency = (
        _residency_problem(schedule, rank)
        for rank, actions in enumerate(schedule.per_rank)
        if any(action.kind is _RL for action in actions)  # fully sharded: a GS per run
    )
    _raise(
        _first(scan.placement)
        or next((problem for problem in residency if problem is not None), None)
        or _grad_sync_problem(scan, required)
    )


def validate_message_order(schedule: Schedule) -> None:
    """Sends and receives pair up one to one, posted in the same order on both sides."""
    scan = _scan(schedule)
    _raise(_first(scan.placement) or scan.mismatched_channel())


def validate_deadlock_free(schedule: Schedule) -> None:
    """Every program runs to its end under the execution rules (``semantics``)."""
    scan = _scan(schedule)
    _raise(_first(scan.placement) or scan.deadlock())


def _first(problems: dict[int, ScheduleError]) -> ScheduleError | None:
    """The problem of the lowest rank (each rank keeps its first)."""
    return problems[min(problems)] if problems else None


def _raise(problem: ScheduleError | None) -> None:
    if problem is not None:
        raise problem


def _fail(schedule: Schedule, message: str, marks: dict[tuple[int, int], str]) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_schedule(schedule, marks=marks)}")


def _at(
    schedule: Schedule, rank: int, position: int, problem: str, part: Action | None = None
) -> ScheduleError:
    """The problem of the action at (rank, position), or of ``part`` of the composite there."""
    message = f"rank {rank}, step {position}: {_label(schedule, rank, position, part)}: {problem}"
    return _fail(schedule, message, {(rank, position): "ERROR HERE"})


def _label(schedule: Schedule, rank: int, position: int, part: Action | None = None) -> str:
    action = schedule.per_rank[rank][position]
    return str(action) if part is None or part is action else f"{part} of {action}"


class _Scan:
    """What the pass found: each rank's first problem per kind, flags per (stage, micro-batch) (at
    ``stage * num_microbatches + mb``), channels' messages in order, where stuck ranks wait. A
    rank's pass stops at its first misplaced action: each flag is its own rank's, in range."""

    def __init__(self, schedule: Schedule, *, composites: bool = False) -> None:
        stage_to_rank = schedule.layout.stage_to_rank
        num_stages, num_ranks = len(stage_to_rank), len(schedule.per_rank)
        self.schedule, self.stage_to_rank = schedule, stage_to_rank
        self.num_mb = schedule.num_microbatches
        self.rules = Rules(schedule)
        self.with_comm = not self.rules.implicit
        # per stage: the previous / next stage's rank if another (RA, SG / SA, RG's peer), else -1
        self.remote_in, self.remote_out = self.rules.output_rank[_B], self.rules.output_rank[_F]
        same = [s > 0 and stage_to_rank[s - 1] == stage_to_rank[s] for s in range(num_stages)]
        self.local_in, self.local_out = same, [*same[1:], False]
        # F, B, I, W done; RA, RG posted; EV, LD done (each on the stage's own rank).
        self.flags = tuple(bytearray(num_stages * schedule.num_microbatches) for _ in range(8))
        self.mixed = False  # some (stage, micro-batch) has B and also I or W
        self.accepted: list[set[int]] = [set() for _ in range(num_ranks)]  # keys of ACs
        self.chunk_level: list[list[int]] = [[] for _ in range(num_ranks)]  # GS/PS/RL positions
        self.channels: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        self.placement: dict[int, ScheduleError] = {}
        self.duplicate: dict[int, ScheduleError] = {}
        self.order: dict[int, ScheduleError] = {}
        self.data_order: dict[int, ScheduleError] = {}
        self.forwarded = [-1] * num_stages  # per stage: the latest micro-batch forwarded
        self.last_backward = [-1] * num_stages  # per stage: the position of its last B / I / W
        self.stuck: dict[int, tuple[int, Message]] = {}
        self.part: Action | None = None  # the part of a composite being checked (``_parts``)
        self.composites = composites  # whether composites are checked as parts (``_scan``)

    def channel(self, src: int, dst: int) -> tuple[list[int], list[int]]:
        """(messages sent, messages received) on the link src -> dst, in posting order."""
        return self.channels.setdefault((src, dst), ([], []))

    def acting(self, rank: int, position: int) -> Action:
        """The action checked at (rank, position): while checking a composite, the part."""
        action = self.schedule.per_rank[rank][position]
        return self.part if action.kind is K.OVERLAP_F_B and self.part is not None else action

    def misplaced(self, rank: int, position: int) -> None:
        """Note the rank's first placement problem; its pass ends here."""
        action = self.acting(rank, position)
        problem = _placement_problem(action, rank, self.schedule)
        self.placement[rank] = _at(self.schedule, rank, position, problem or "misplaced", action)

    def repeated(self, rank: int, position: int) -> None:
        """Note the rank's first action seen twice (flags of F, B, I, W, EV and LD)."""
        if rank in self.duplicate:
            return
        action = self.acting(rank, position)
        same = (action.kind, action.stage, action.microbatch)
        actions = primitives(self.schedule.per_rank[rank])
        first = next(p for p, a in actions if (a.kind, a.stage, a.microbatch) == same)
        marks = {(rank, first): "first", (rank, position): "again"}
        self.duplicate[rank] = _fail(self.schedule, f"{action} appears twice", marks)

    def note_backward(self, rank: int, position: int, key: int) -> None:
        """A B, I or W whose key already has one: a repeat, or B mixed with I / W (``complete``)."""
        kind = self.acting(rank, position).kind  # flags 1, 2, 3: B, I, W done
        if self.flags[(_B, _I, _W).index(kind) + 1][key]:
            self.repeated(rank, position)
        else:
            self.mixed = True

    def out_of_order(self, rank: int, position: int) -> None:
        """Note the rank's first forward of a micro-batch after a later one of its stage."""
        if rank not in self.data_order:
            action = self.acting(rank, position)
            label = _label(self.schedule, rank, position, action)
            self.data_order[rank] = ScheduleError(
                f"{self.schedule.name}: rank {rank}, step {position}: {label} runs stage "
                f"{action.stage}'s micro-batch {action.microbatch} after its micro-batch "
                f"{self.forwarded[action.stage]}; data iterators are read in order, so order "
                "each stage's forwards by micro-batch"
            )

    def disorder(self, rank: int, position: int, rule: str) -> None:
        """Note the rank's first action that breaks the local order; ``rule`` keys ``_ORDER``."""
        if rank not in self.order:
            stage, mb = (a := self.acting(rank, position)).stage, a.microbatch
            problem = _ORDER[rule].format(stage=stage, mb=mb, prev=stage - 1, next=stage + 1)
            self.order[rank] = _at(self.schedule, rank, position, problem, a)

    def complete(self, require_backward: bool) -> ScheduleError | None:
        """Checks 1 to 3. Counting flags proves each (stage, micro-batch) complete when all else
        is right (keys in range, no B with I / W, each W after its I); else ``_missing_action``."""
        if problem := _first(self.placement) or _first(self.duplicate):
            return problem
        size = len(self.flags[0])
        count_f, count_b, count_i, count_w = (flags.count(1) for flags in self.flags[:4])
        trusted = not (self.mixed or self.order)
        backward_ok = count_i == count_w and (count_b + count_i == size or not require_backward)
        if not (trusted and count_f == size and backward_ok):
            problem = _missing_action(self.schedule, self.flags, require_backward)
        return problem or _first(self.order)

    def mismatched_channel(self) -> ScheduleError | None:
        """The first channel (in rank order) whose two sides differ, at the first difference."""
        bad = sorted(c for c, (sent, received) in self.channels.items() if sent != received)
        return _channel_problem(self.schedule, *bad[0]) if bad else None

    def deadlock(self) -> ScheduleError | None:
        if not self.stuck:
            return None
        message = "deadlock: every remaining rank waits for a message that is never sent first"
        return _fail(self.schedule, message, describe_waits(self.stuck))


def _scan(schedule: Schedule) -> _Scan:
    """Check every rank's actions, recording waits and sends; then run them (module docstring)."""
    scan = _Scan(schedule)
    programs = [_scan_rank(scan, rank) for rank in range(len(schedule.per_rank))]
    if scan.composites:  # a rank met one: all again, each composite as its parts (_parts)
        scan = _Scan(schedule, composites=True)
        programs = [_scan_rank(scan, rank) for rank in range(len(schedule.per_rank))]
    scan.stuck = run_recorded(scan.rules, programs)
    return scan


_F, _B, _I, _W = K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT
_SA, _RA, _SG, _RG = K.SEND_ACT, K.RECV_ACT, K.SEND_GRAD, K.RECV_GRAD
_EV, _AC, _RS, _LD, _GS, _PS = K.EVICT, K.ACCEPT, K.RESTORE, K.LOAD, K.GRAD_SYNC, K.PARAM_SYNC
_RL, _FB = K.RELEASE, K.OVERLAP_F_B


def _parts(
    scan: _Scan, actions: tuple[Action, ...], recorded: Recorded
) -> Iterator[tuple[int, Action]]:
    """(position, action) of a program, each composite as its parts at its position (``scan.part``:
    the one under check), so each part is checked as that action alone; the composite rule
    (``semantics``: every part's waits before any part's sends) puts its recorded waits first."""
    ops = recorded.ops
    for position, action in enumerate(actions):
        if action.kind is not _FB:
            yield position, action
            continue
        start = len(ops)
        for part in parts(action):
            scan.part = part
            yield position, part
        scan.part = None
        ops[start:] = [op for op in ops[start:] if op < 0] + [op for op in ops[start:] if op >= 0]


# why an action breaks the local order, per rule (formatted with stage, mb, prev and next)
_ORDER = {
    "local input": "runs before its local producer {prev}F{mb}",
    "remote input": "consumes act of stage {prev} that no earlier receive posts",
    "forward": "backward before its forward",
    "evicted": "the activations were evicted and not loaded back ({stage}LD{mb} missing)",
    "local gradient": "runs before its local producer of the output gradient (stage {next})",
    "remote gradient": "consumes grad of stage {next} that no earlier receive posts",
    "input gradient": "W before its I",
    "activation": "sends an activation before computing it",
    "gradient": "sends a gradient before computing it",
    "window": "evicts outside the window between its forward and its backward",
    "never evicted": "loads activations that were never evicted",
    "never accepted": "returns activations it never accepted",
}


def _scan_rank(scan: _Scan, rank: int) -> Recorded:
    """``rank``'s actions checked (placement, flags, local order, channels), their waits and sends
    recorded (for ``run_recorded``); then, unless one was misplaced, the whole rank's checks."""
    recorded = Recorded([], array("q"))
    if (unloaded := _scan_actions(scan, rank, recorded)) is not None and rank not in scan.order:
        schedule, actions = scan.schedule, scan.schedule.per_rank[rank]
        problem = _unpaired(schedule, rank) if unloaded else None
        if problem is None and any(actions[p].kind is _RL for p in scan.chunk_level[rank]):
            problem = _residency_problem(schedule, rank)  # sharded parameters
        if problem is not None:
            scan.order[rank] = problem
    return recorded


_Row = tuple[int, int, Callable[[int], None]]  # peer, id of micro-batch 0, channel's append


def _p2p_rows(
    scan: _Scan, rank: int
) -> dict[ActionKind, tuple[list[_Row], bytearray, bytearray | None]]:
    """SA / RA / SG / RG: per stage, the peer each must name (-1: none may, as on other ranks'
    stages), its message's id of micro-batch 0 and the append of ``rank``'s side of its channel;
    and the flags a send reads (either: computed) or a receive sets (then None)."""
    unused: list[int] = []
    rows: dict[ActionKind, list[_Row]] = {
        kind: [(-1, 0, unused.append)] * len(scan.remote_in) for kind in (_SA, _RA, _SG, _RG)
    }
    act, grad = scan.rules.base[ACT], scan.rules.base[GRAD]
    for stage, owner in enumerate(scan.stage_to_rank):
        if owner == rank and (peer := scan.remote_in[stage]) >= 0:
            rows[_RA][stage] = (peer, act[stage - 1], scan.channel(peer, rank)[1].append)
            rows[_SG][stage] = (peer, grad[stage], scan.channel(rank, peer)[0].append)
        if owner == rank and (peer := scan.remote_out[stage]) >= 0:
            rows[_SA][stage] = (peer, act[stage], scan.channel(rank, peer)[0].append)
            rows[_RG][stage] = (peer, grad[stage + 1], scan.channel(peer, rank)[1].append)
    f_done, b_done, i_done, _, ra_done, rg_done = scan.flags[:6]
    return {
        _SA: (rows[_SA], f_done, f_done),
        _RA: (rows[_RA], ra_done, None),
        _SG: (rows[_SG], b_done, i_done),
        _RG: (rows[_RG], rg_done, None),
    }


def _scan_actions(scan: _Scan, rank: int, recorded: Recorded) -> int | None:
    """``_scan_rank``'s pass over the actions: the rank's EVs minus LDs, None when it ended at a
    misplaced one. One branch per kind, the most common first, tables in locals: it runs once
    per action of every schedule built (BPipe's few transfers: ``_scan_transfer``)."""
    schedule, rules, disorder = scan.schedule, scan.rules, scan.disorder
    actions, s2r, num_mb = schedule.per_rank[rank], scan.stage_to_rank, schedule.num_microbatches
    remote_in, remote_out = scan.remote_in, scan.remote_out
    local_in, local_out, with_comm = scan.local_in, scan.local_out, scan.with_comm
    f_done, b_done, i_done, w_done, ra_done, rg_done, ev_done, ld_done = scan.flags
    forwarded, last_backward, p2p = scan.forwarded, scan.last_backward, _p2p_rows(scan, rank).get
    # What F and B / I wait for and send (compute-only), as ids of micro-batch 0 (0: nothing).
    act_wait, grad_wait = rules.waits_for[_F], rules.waits_for[_B]
    act_send, grad_send = rules.sends_for[_F], rules.sends_for[_B]
    op, wait_at = recorded.ops.append, recorded.wait_at.append
    awaiting: list[int] = []  # acknowledgements the next compute waits for (Wires.awaiting)
    restores: dict[int, int] = {}  # position -> the restore a backward there waits for
    unloaded = 0  # this rank's EVs minus LDs
    chunk_level = scan.chunk_level[rank]  # positions of its GS / PS / RL
    steps, position = _parts(scan, actions, recorded) if scan.composites else enumerate(actions), 0
    try:  # a stage past the layout raises IndexError at a per-stage table, before any change
        for position, action in steps:
            kind, stage = action.kind, action.stage
            mb: int = action.microbatch  # type: ignore[assignment]  # None only for GS / PS
            if awaiting and (kind is _F or kind is _B or kind is _I or kind is _W):
                for need in awaiting:  # Wires.unacknowledged: BPipe's acknowledgements first
                    op(~need)
                    wait_at(position)
                awaiting.clear()
            if (row := p2p(kind)) is not None:  # SA, RA, SG, RG: one table (_p2p_rows)
                table, done, also = row
                peer, message, post = table[stage]
                if action.peer != peer or mb >= num_mb:
                    scan.misplaced(rank, position)
                    return None
                post(message := message + mb)
                if also is None:  # a receive, posted
                    done[stage * num_mb + mb] = 1
                else:  # a send, after what it sends
                    if not (done[key := stage * num_mb + mb] or also[key]):
                        disorder(rank, position, "activation" if kind is _SA else "gradient")
                    op(message)
            elif kind is _F:
                if s2r[stage] != rank or mb >= num_mb:
                    scan.misplaced(rank, position)
                    return None
                if need := act_wait[stage]:
                    op(~(need + mb))
                    wait_at(position)
                if sent := act_send[stage]:
                    op(sent + mb)
                key = stage * num_mb + mb
                if f_done[key]:
                    scan.repeated(rank, position)
                f_done[key] = 1
                if mb < forwarded[stage]:  # the rank's first such F is reported
                    scan.out_of_order(rank, position)
                forwarded[stage] = mb
                if local_in[stage]:
                    if not f_done[key - num_mb]:
                        disorder(rank, position, "local input")
                elif with_comm and remote_in[stage] >= 0 and not ra_done[key]:
                    disorder(rank, position, "remote input")
            elif kind is _B or kind is _I:
                if s2r[stage] != rank or mb >= num_mb:
                    scan.misplaced(rank, position)
                    return None
                if need := grad_wait[stage]:
                    op(~(need + mb))
                    wait_at(position)
                if restores and (need := restores.get(position, -1)) >= 0:
                    op(~need)  # the restore of the activations an LD brought back
                    wait_at(position)
                if sent := grad_send[stage]:
                    op(sent + mb)
                key = stage * num_mb + mb
                if b_done[key] or i_done[key]:
                    scan.note_backward(rank, position, key)  # a repeat, or B with I
                (b_done if kind is _B else i_done)[key] = 1
                last_backward[stage] = position
                if not f_done[key]:
                    disorder(rank, position, "forward")
                elif ev_done[key] and not ld_done[key]:
                    disorder(rank, position, "evicted")
                elif local_out[stage]:
                    if not (b_done[key + num_mb] or i_done[key + num_mb]):
                        disorder(rank, position, "local gradient")
                elif with_comm and remote_out[stage] >= 0 and not rg_done[key]:
                    disorder(rank, position, "remote gradient")
            elif kind is _W:  # waits for nothing but its own rank's I
                if s2r[stage] != rank or mb >= num_mb:
                    scan.misplaced(rank, position)
                    return None
                key = stage * num_mb + mb
                if w_done[key] or b_done[key]:
                    scan.note_backward(rank, position, key)  # a repeat, or W with B
                w_done[key] = 1
                last_backward[stage] = position
                if not i_done[key]:
                    disorder(rank, position, "input gradient")
            elif kind is _GS or kind is _PS or kind is _RL:
                if s2r[stage] != rank:
                    scan.misplaced(rank, position)
                    return None
                chunk_level.append(position)  # checked by _grad_sync_problem
            else:  # BPipe's EV / AC / RS / LD, a few per rank (or a composite: _scan_transfer)
                moved = _scan_transfer(scan, rank, position, recorded, awaiting, restores)
                if moved is None:
                    return None
                unloaded += moved
    except IndexError:
        if _placement_problem(scan.acting(rank, position), rank, schedule) is None:
            raise  # not a stage past the layout: a bug, not a schedule problem
        scan.misplaced(rank, position)
        return None
    return unloaded


def _scan_transfer(
    scan: _Scan,
    rank: int,
    position: int,
    recorded: Recorded,
    awaiting: list[int],
    restores: dict[int, int],
) -> int | None:
    """``_scan_rank``'s branch for BPipe's EV / AC / RS / LD (what ``Wires.transfer`` runs): the
    change in the rank's evicted-not-loaded count; None when misplaced or a composite."""
    action, rules, flags = scan.schedule.per_rank[rank][position], scan.rules, scan.flags
    if action.kind is _FB:  # a composite: _scan checks every rank again, with them as parts
        scan.composites = True
        return None
    kind, stage, s2r = action.kind, action.stage, scan.stage_to_rank
    mb: int = action.microbatch  # type: ignore[assignment]  # transfers name one
    peer: int = action.peer  # type: ignore[assignment]  # point-to-point: never None
    owner = s2r[stage] if stage < len(s2r) else -1
    if kind is _EV or kind is _LD:  # the evictor's side
        placed = owner == rank and peer != rank
    else:
        placed = owner not in (-1, rank) and peer == owner
    if not placed or mb >= scan.num_mb:
        scan.misplaced(rank, position)
        return None
    rule, num_ranks = rules.transfers[kind], rules.num_ranks
    key = stage * scan.num_mb + mb
    if (base := rule.waits[stage]) >= 0:
        recorded.ops.append(~((base + mb) * num_ranks + rank))
        recorded.wait_at.append(position)
    sent = (rule.sends[stage] + mb) * num_ranks + peer
    if peer < num_ranks:  # a rank outside the layout: the message reaches nobody
        recorded.ops.append(sent)
    if (base := rule.awaits[stage]) >= 0:
        awaiting.append((base + mb) * num_ranks + rank)
    if kind is _LD and (later := rules.restored(rank, position)) >= 0:  # as Wires.transfer
        restores[later] = (rules.base[RESTORE][stage] + mb) * num_ranks + rank
    f_done, b_done, i_done, _, _, _, ev_done, ld_done = flags
    if kind is _EV:
        scan.channel(rank, peer)[0].append(sent)
        if not f_done[key] or b_done[key] or i_done[key]:
            scan.disorder(rank, position, "window")
        if ev_done[key]:
            scan.repeated(rank, position)
            return 0
        ev_done[key] = 1
        return 1
    if kind is _AC:
        scan.channel(peer, rank)[1].append((rules.base[EVICT][stage] + mb) * num_ranks + rank)
        scan.accepted[rank].add(key)
        return 0
    if kind is _RS:
        scan.channel(rank, peer)[0].append(sent)
        if key not in scan.accepted[rank]:
            scan.disorder(rank, position, "never accepted")
        return 0
    scan.channel(peer, rank)[1].append((rules.base[RESTORE][stage] + mb) * num_ranks + rank)
    if not ev_done[key]:
        scan.disorder(rank, position, "never evicted")
    if ld_done[key]:
        scan.repeated(rank, position)
        return 0
    ld_done[key] = 1
    return -1


def _residency_problem(schedule: Schedule, rank: int) -> ScheduleError | None:
    """Rule 7 with sharded parameters (the rank has an RL): each chunk released at both ends of
    the step, gathered (PS) only while released, released (RL) and computing only while
    gathered, and a GS after each run of its backwards, reducing them into its shard."""
    gathered: set[int] = set()
    unreduced: dict[int, int] = {}  # stage -> its first backward since its last GS
    reduces: dict[int, int] = {}  # stage -> its latest GS
    for position, action in primitives(schedule.per_rank[rank]):
        kind, stage = action.kind, action.stage
        if kind is _GS:
            if stage in reduces and stage not in unreduced:
                return _at(schedule, rank, position, f"reduces stage {stage}'s gradients a second "
                           f"time with no backward since its last GS (step {reduces[stage]}): "
                           "fully sharded, keep one GS per run of its backwards")  # fmt: skip
            reduces[stage] = position
            unreduced.pop(stage, None)
        elif kind.is_compute and kind is not _F:
            unreduced.setdefault(stage, position)
        if kind is _PS:
            if stage in gathered:
                return _at(schedule, rank, position, "gathers parameters already gathered: "
                           f"release them (RL {stage}) first, or drop this PS")  # fmt: skip
            gathered.add(stage)
        elif kind is _RL:
            if stage not in gathered:
                return _at(schedule, rank, position, "releases parameters that are not gathered")
            gathered.discard(stage)
        elif kind.is_compute and stage not in gathered:
            return _at(schedule, rank, position, f"runs with stage {stage}'s parameters released "
                       f"(sharded): gather them ({stage}PS) before it")  # fmt: skip
    if late := sorted(position for stage, position in unreduced.items() if stage in reduces):
        stage = schedule.per_rank[rank][late[0]].stage
        return _at(schedule, rank, late[0], f"computes a backward of stage {stage} after "
                   f"its last gradient reduction ({stage}GS): fully sharded, its gradients "
                   "are only a shard from there; add a GS after its last backward")  # fmt: skip
    if gathered:
        return _fail(
            schedule,
            f"rank {rank}: stage(s) {sorted(gathered)} end the step with their sharded parameters "
            "gathered; release them (RL) after their last use",
            {},
        )
    return None


def _grad_sync_problem(scan: _Scan, required: bool) -> ScheduleError | None:
    """Rule 7, rank by rank, from the positions of each rank's GS / PS / RL and each stage's last
    backward that the pass noted (the rest is read only before the PSs, which come first)."""
    if not required and not any(scan.chunk_level):
        return None  # not lowered for data parallelism (compute-only, or messages only)
    problems = (_rank_grad_sync_problem(scan, r) for r in range(len(scan.chunk_level)))
    return next((problem for problem in problems if problem is not None), None)


def _rank_grad_sync_problem(scan: _Scan, rank: int) -> ScheduleError | None:
    schedule, positions, last_backward = scan.schedule, scan.chunk_level[rank], scan.last_backward
    actions, stages = schedule.per_rank[rank], schedule.layout.stages_of(rank)
    sharded = any(actions[p].kind is _RL for p in positions)  # PS / RL: _residency_problem
    synced: dict[int, int] = {}
    gathered: dict[int, int] = {}
    for position in positions:
        action = actions[position]
        kind, stage = action.kind, action.stage
        if kind is _GS:
            last = last_backward[stage]
            if stage in synced and not sharded:  # fully sharded: one GS per run of backwards
                return _at(schedule, rank, position, f"reduces stage {stage}'s gradients a second "
                           f"time (first {stage}GS at step {synced[stage]}); keep one GS per "
                           "chunk, after its last backward")  # fmt: skip
            if last < 0:
                return _at(schedule, rank, position, f"no backward of stage {stage} runs on rank "
                           f"{rank}, so it has no gradients to reduce; drop this GS")  # fmt: skip
            if position < last and not sharded:  # sharded: _residency_problem's reduction runs
                return _at(schedule, rank, position, f"starts stage {stage}'s gradient reduction "
                           f"before its last backward ({actions[last]} at step {last}), whose "
                           "gradients would stay unreduced across data-parallel replicas; move "
                           "the GS after it")  # fmt: skip
            synced[stage] = position
        elif kind is _PS and not sharded:
            if stage in gathered:
                return _at(schedule, rank, position, f"gathers stage {stage}'s parameters a "
                           f"second time (first {stage}PS at step {gathered[stage]}); keep one "
                           "PS per chunk, before its first use")  # fmt: skip
            uses = primitives(actions[:position])  # an overlapped pair: both parts' stages
            first = next((p for p, a in uses if a.kind.is_compute and a.stage == stage), position)
            if position > first:
                return _at(schedule, rank, position, f"gathers stage {stage}'s parameters after "
                           f"their first use ({actions[first]} at step {first}); move the PS "
                           "before it")  # fmt: skip
            gathered[stage] = position
    for stage in stages:
        if (last := last_backward[stage]) >= 0 and stage not in synced:
            return _at(schedule, rank, last, f"the last backward of stage {stage} is followed by "
                       f"no GS, so its gradients are never reduced across data-parallel "
                       f"replicas; add {stage}GS after it")  # fmt: skip
    return None


def _placement_problem(action: Action, rank: int, schedule: Schedule) -> str | None:
    layout, stage, kind = schedule.layout, action.stage, action.kind
    if stage >= layout.num_stages:
        return f"stage {stage} does not exist (the layout has {layout.num_stages})"
    if (mb := action.microbatch) is not None and mb >= schedule.num_microbatches:
        return f"micro-batch {mb} does not exist (num_microbatches={schedule.num_microbatches})"
    owner = layout.rank_of(stage)
    if kind in (K.ACCEPT, K.RESTORE):
        if owner == rank or action.peer != owner:
            return f"the acceptor must receive from the evictor rank {owner} (stage {stage})"
        return None
    if owner != rank:
        return f"stage {stage} lives on rank {owner}"
    expected_peer = {_SA: stage + 1, _RA: stage - 1, _SG: stage - 1, _RG: stage + 1}.get(kind)
    if expected_peer is not None:
        if not 0 <= expected_peer < layout.num_stages:
            return f"stage {stage} has no neighbour stage {expected_peer}"
        peer_rank = layout.rank_of(expected_peer)
        if peer_rank == rank:
            return f"stages {stage} and {expected_peer} share rank {rank}: no message is needed"
        if action.peer != peer_rank:
            return f"the neighbour stage {expected_peer} lives on rank {peer_rank}"
    if kind in (K.EVICT, K.LOAD) and action.peer == rank:
        return "an evictor cannot evict to itself"
    return None


def _missing_action(
    schedule: Schedule, flags: tuple[bytearray, ...], require_backward: bool
) -> ScheduleError | None:
    """``_Scan.complete``'s count, key by key, in (stage, micro-batch) order."""
    f_done, b_done, i_done, w_done = flags[:4]
    num_mb = schedule.num_microbatches
    for stage in range(schedule.num_stages):
        for mb in range(num_mb):
            key, where = stage * num_mb + mb, f"stage {stage} micro-batch {mb}"
            if not f_done[key]:
                rank = schedule.layout.rank_of(stage)
                return _fail(schedule, f"{where} has no forward on rank {rank}", {})
            has_b, has_i, has_w = b_done[key], i_done[key], w_done[key]
            if has_b and (has_i or has_w):
                return _fail(schedule, f"{where} has both B and I/W", {})
            if not has_b and not (has_i and has_w) and (require_backward or has_i or has_w):
                return _fail(schedule, f"{where} has no complete backward (B, or I and W)", {})
    return None


def _unpaired(schedule: Schedule, rank: int) -> ScheduleError | None:
    """Why ``rank``'s evictions and loads do not pair up, if they do not."""
    program = schedule.per_rank[rank]
    evicted = {(a.stage, a.microbatch) for a in program if a.kind is K.EVICT}
    loaded = {(a.stage, a.microbatch) for a in program if a.kind is K.LOAD}
    if evicted == loaded:
        return None
    missing = sorted(evicted ^ loaded)
    return _fail(schedule, f"rank {rank}: evictions and loads do not pair up: {missing}", {})


def _channel_problem(schedule: Schedule, src: int, dst: int) -> ScheduleError:
    """The first difference between what ``src`` sends ``dst`` and what ``dst`` receives."""
    out, into = (
        [
            (position, message_of(a))
            for position, a in enumerate(schedule.per_rank[rank])
            if (a.kind.is_send if sends else a.kind.is_recv) and a.peer == peer
        ]
        for rank, peer, sends in ((src, dst, True), (dst, src, False))
    )
    # The first send whose receive differs (semantics.match_channels pairs them).
    pairs = enumerate(match_channels(out, into))
    index = next((k for k, (sent, got) in pairs if got is None or sent[1] != got[1]), len(out))
    if index < len(out) and index < len(into):
        (sent_at, sent), (received_at, received) = out[index], into[index]
        return _fail(
            schedule,
            f"message order differs between ranks {src} -> {dst}: send #{index} is {sent} but "
            f"receive #{index} is {received}; point-to-point messages match by posting order, "
            "so these would be swapped",
            {(src, sent_at): "sent here", (dst, received_at): "received here"},
        )
    if index < len(into):
        position, message = into[index]
        text = f"rank {dst} receives {message} from rank {src}, which never sends it"
        return _fail(schedule, text, {(dst, position): "ERROR HERE"})
    position, message = out[index]
    text = f"rank {src} sends {message} to rank {dst}, which never receives it"
    return _fail(schedule, text, {(src, position): "ERROR HERE"})
