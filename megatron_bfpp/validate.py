"""Prove a schedule complete, correctly paired and free of deadlock before anything runs it.

Execution semantics (shared with the simulator and the runtime):

* A send (SA, SG, EV, RS) is posted without waiting; its data leaves whenever the link allows.
* A receive (RA, RG, AC, LD) is posted at its position; the rank waits for the data only at the
  action that consumes it (F/B/I for RA/RG/LD, RS for AC), so receives can be posted ahead.
* Between one ordered pair of ranks, the k-th receive posted matches the k-th send posted, as
  NCCL and gloo match point-to-point messages by posting order, not by meaning. With pp=2 and
  looping an activation and a gradient of the same shape travel between the same two ranks, so a
  swapped order would silently mix them up; ``validate_message_order`` rejects it.

Errors are ``ScheduleError`` whose message carries the per-rank grid with the failing step marked.
"""

from __future__ import annotations

from collections import defaultdict, deque

from megatron_bfpp.ir import (
    COMPUTE_KINDS,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    format_schedule,
)
from megatron_bfpp.messages import Message, has_communication, message_of

__all__ = [
    "Message",
    "consumed_messages",
    "has_communication",
    "message_of",
    "validate_completeness",
    "validate_deadlock_free",
    "validate_message_order",
    "validate_placement",
    "validate_schedule",
]

K = ActionKind


def consumed_messages(action: Action, schedule: Schedule, rank: int) -> list[Message]:
    """Messages an action waits for when they come from another rank."""
    layout = schedule.layout
    mb = action.microbatch
    if mb is None:
        return []
    stage = action.stage
    needed: list[Message] = []
    if action.kind == K.FORWARD and stage > 0 and layout.rank_of(stage - 1) != rank:
        needed.append(Message("act", stage - 1, mb))
    elif action.kind in (K.BACKWARD, K.BACKWARD_INPUT):
        if not layout.is_last(stage) and layout.rank_of(stage + 1) != rank:
            needed.append(Message("grad", stage + 1, mb))
    elif action.kind in (K.ACCEPT, K.RESTORE):
        # The runtime reads an eviction's size header before any later receive from the
        # evictor: modelled (conservatively) as AC waiting for the evict itself.
        needed.append(Message("evict", stage, mb))
    return needed


def validate_schedule(
    schedule: Schedule, *, require_communication: bool = True, require_backward: bool = True
) -> None:
    """Every check in order; a compute-only schedule may skip the communication ones.

    A compute-only schedule (no SA/RA/SG/RG yet) is checked as if each compute action sent its
    result the moment it finished, which proves the order itself can run. With
    ``require_backward=False`` (a forward-only schedule, e.g. evaluation) a (stage, micro-batch)
    may have no backward at all; one that has any must still have a complete one.

    All checks run on every schedule, first in one fused pass over flat integer keys (linear in
    the number of actions); only if that pass finds a problem do the checks run one by one,
    to name the first problem and draw the grid.
    """
    if _passes_all_checks(
        schedule, require_communication=require_communication, require_backward=require_backward
    ):
        return
    validate_placement(schedule)
    validate_completeness(schedule, require_backward=require_backward)
    if require_communication or has_communication(schedule):
        validate_message_order(schedule)
    validate_deadlock_free(schedule)


def _fail(schedule: Schedule, message: str, marks: dict[tuple[int, int], str]) -> ScheduleError:
    grid = format_schedule(schedule, marks=marks)
    return ScheduleError(f"{message}\n{grid}")


def validate_placement(schedule: Schedule) -> None:
    """Each action runs on the rank that owns its stage and names an existing micro-batch."""
    stage_to_rank = schedule.layout.stage_to_rank
    num_stages, num_microbatches = len(stage_to_rank), schedule.num_microbatches
    compute = COMPUTE_KINDS
    for rank, actions in enumerate(schedule.per_rank):
        for position, action in enumerate(actions):
            stage, mb = action.stage, action.microbatch
            if (
                action.kind in compute
                and stage < num_stages
                and stage_to_rank[stage] == rank
                and mb is not None
                and mb < num_microbatches
            ):
                continue  # the common case, checked inline
            problem = _placement_problem(action, rank, schedule)
            if problem:
                raise _fail(
                    schedule,
                    f"rank {rank}, step {position}: {action}: {problem}",
                    {(rank, position): "ERROR HERE"},
                )


def _placement_problem(action: Action, rank: int, schedule: Schedule) -> str | None:
    layout = schedule.layout
    stage = action.stage
    if stage >= layout.num_stages:
        return f"stage {stage} does not exist (the layout has {layout.num_stages})"
    mb = action.microbatch
    if mb is not None and mb >= schedule.num_microbatches:
        return f"micro-batch {mb} does not exist (num_microbatches={schedule.num_microbatches})"
    owner = layout.rank_of(stage)
    if action.kind in (K.ACCEPT, K.RESTORE):
        if owner == rank or action.peer != owner:
            return f"the acceptor must receive from the evictor rank {owner} (stage {stage})"
        return None
    if owner != rank:
        return f"stage {stage} lives on rank {owner}"
    expected_peer = {
        K.SEND_ACT: stage + 1,
        K.RECV_ACT: stage - 1,
        K.SEND_GRAD: stage - 1,
        K.RECV_GRAD: stage + 1,
    }.get(action.kind)
    if expected_peer is not None:
        if not 0 <= expected_peer < layout.num_stages:
            return f"stage {stage} has no neighbour stage {expected_peer}"
        peer_rank = layout.rank_of(expected_peer)
        if peer_rank == rank:
            return f"stages {stage} and {expected_peer} share rank {rank}: no message is needed"
        if action.peer != peer_rank:
            return f"the neighbour stage {expected_peer} lives on rank {peer_rank}"
    if action.kind in (K.EVICT, K.LOAD) and action.peer == rank:
        return "an evictor cannot evict to itself"
    return None


def validate_completeness(schedule: Schedule, *, require_backward: bool = True) -> None:
    """Exactly one F and one B (or one I and one W) per (stage, micro-batch), in local order.

    ``require_backward=False`` accepts a (stage, micro-batch) with no backward at all.
    """
    counts: dict[tuple[ActionKind, int, int], int] = {}
    tracked = _TRACKED
    for actions in schedule.per_rank:
        for action in actions:
            if action.kind in tracked:
                key = (action.kind, action.stage, action.microbatch or 0)
                counts[key] = counts.get(key, 0) + 1
    if counts and max(counts.values()) > 1:
        _raise_duplicate(schedule, {k for k, n in counts.items() if n > 1})
    forward, full = K.FORWARD, K.BACKWARD
    split_i, split_w = K.BACKWARD_INPUT, K.BACKWARD_WEIGHT
    for stage in range(schedule.num_stages):
        for mb in range(schedule.num_microbatches):
            if (forward, stage, mb) not in counts:
                rank = schedule.layout.rank_of(stage)
                raise _fail(
                    schedule, f"stage {stage} micro-batch {mb} has no forward on rank {rank}", {}
                )
            has_b = (full, stage, mb) in counts
            has_i, has_w = (split_i, stage, mb) in counts, (split_w, stage, mb) in counts
            if has_b and (has_i or has_w):
                raise _fail(schedule, f"stage {stage} micro-batch {mb} has both B and I/W", {})
            if not has_b and not (has_i and has_w) and (require_backward or has_i or has_w):
                raise _fail(
                    schedule,
                    f"stage {stage} micro-batch {mb} has no complete backward (B, or I and W)",
                    {},
                )
    _validate_local_order(schedule)


_TRACKED = frozenset({K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT, K.EVICT, K.LOAD})


def _raise_duplicate(schedule: Schedule, duplicated: set[tuple[ActionKind, int, int]]) -> None:
    """Slow path, only on failure: find the first two places of the first duplicated action."""
    seen: dict[tuple[ActionKind, int, int], tuple[int, int]] = {}
    for rank, position, action in schedule.iter_actions():
        key = (action.kind, action.stage, action.microbatch or 0)
        if key in duplicated:
            if key in seen:
                raise _fail(
                    schedule,
                    f"{action} appears twice",
                    {seen[key]: "first", (rank, position): "again"},
                )
            seen[key] = (rank, position)


def _validate_local_order(schedule: Schedule) -> None:
    """Within a rank: F before its backward, I before W, evict after F and load before backward,
    local producers before local consumers, sends after what they send and receives before what
    consumes them."""
    with_comm = has_communication(schedule)
    for rank, actions in enumerate(schedule.per_rank):
        done: set[tuple[ActionKind, int, int]] = set()
        posted: set[Message] = set()
        for position, action in enumerate(actions):
            mb = action.microbatch
            if mb is None:
                continue
            problem = _local_order_problem(action, rank, done, posted, schedule, with_comm)
            if problem:
                raise _fail(
                    schedule,
                    f"rank {rank}, step {position}: {action}: {problem}",
                    {(rank, position): "ERROR HERE"},
                )
            done.add((action.kind, action.stage, mb))
            if action.kind in _RECV_KINDS:
                posted.add(message_of(action))
        evicted = {(s, m) for (k, s, m) in done if k is K.EVICT}
        loaded = {(s, m) for (k, s, m) in done if k is K.LOAD}
        if evicted != loaded:
            missing = sorted(evicted ^ loaded)
            raise _fail(schedule, f"rank {rank}: evictions and loads do not pair up: {missing}", {})


_RECV_KINDS = frozenset({K.RECV_ACT, K.RECV_GRAD, K.ACCEPT, K.LOAD})
_SEND_KINDS = frozenset({K.SEND_ACT, K.SEND_GRAD, K.EVICT, K.RESTORE})


def _local_order_problem(
    action: Action,
    rank: int,
    done: set[tuple[ActionKind, int, int]],
    posted: set[Message],
    schedule: Schedule,
    with_comm: bool,
) -> str | None:
    """The first local-order rule the action breaks, or None. Written as flat lookups: it runs
    once per action of every schedule built."""
    mb = action.microbatch
    if mb is None:
        return None
    kind, stage = action.kind, action.stage
    stage_to_rank = schedule.layout.stage_to_rank
    if kind is K.FORWARD:
        if stage > 0:
            if stage_to_rank[stage - 1] == rank:
                if (K.FORWARD, stage - 1, mb) not in done:
                    return f"runs before its local producer {stage - 1}F{mb}"
            elif with_comm and Message("act", stage - 1, mb) not in posted:
                return f"consumes act of stage {stage - 1} that no earlier receive posts"
        return None
    if kind is K.BACKWARD or kind is K.BACKWARD_INPUT:
        if (K.FORWARD, stage, mb) not in done:
            return "backward before its forward"
        if (K.EVICT, stage, mb) in done and (K.LOAD, stage, mb) not in done:
            return f"the activations were evicted and not loaded back ({stage}LD{mb} missing)"
        nxt = stage + 1
        if nxt < len(stage_to_rank):
            if stage_to_rank[nxt] == rank:
                if (K.BACKWARD, nxt, mb) not in done and (K.BACKWARD_INPUT, nxt, mb) not in done:
                    return f"runs before its local producer of the output gradient (stage {nxt})"
            elif with_comm and Message("grad", nxt, mb) not in posted:
                return f"consumes grad of stage {nxt} that no earlier receive posts"
        return None
    backward_done = (K.BACKWARD, stage, mb) in done or (K.BACKWARD_INPUT, stage, mb) in done
    if kind is K.BACKWARD_WEIGHT and (K.BACKWARD_INPUT, stage, mb) not in done:
        return "W before its I"
    if kind is K.SEND_ACT and (K.FORWARD, stage, mb) not in done:
        return "sends an activation before computing it"
    if kind is K.SEND_GRAD and not backward_done:
        return "sends a gradient before computing it"
    if kind is K.EVICT and ((K.FORWARD, stage, mb) not in done or backward_done):
        return "evicts outside the window between its forward and its backward"
    if kind is K.LOAD and (K.EVICT, stage, mb) not in done:
        return "loads activations that were never evicted"
    if kind is K.RESTORE:
        if (K.ACCEPT, stage, mb) not in done:
            return "returns activations it never accepted"
        if Message("evict", stage, mb) not in posted:
            return f"consumes evict of stage {stage} that no earlier receive posts"
    return None


# (source rank, destination rank) -> [(position on the posting rank, message), ...]
_Channels = dict[tuple[int, int], list[tuple[int, Message]]]


def _channels(schedule: Schedule) -> tuple[_Channels, _Channels]:
    sends: _Channels = defaultdict(list)
    recvs: _Channels = defaultdict(list)
    for rank, position, action in schedule.iter_actions():
        if action.kind.is_send:
            assert action.peer is not None
            sends[(rank, action.peer)].append((position, message_of(action)))
        elif action.kind.is_recv:
            assert action.peer is not None
            recvs[(action.peer, rank)].append((position, message_of(action)))
    return sends, recvs


def validate_message_order(schedule: Schedule) -> None:
    """Sends and receives pair up one to one, posted in the same order on both sides."""
    sends, recvs = _channels(schedule)
    for channel in sorted(set(sends) | set(recvs)):
        src, dst = channel
        out, into = sends.get(channel, []), recvs.get(channel, [])
        for index in range(max(len(out), len(into))):
            if index >= len(out):
                position, message = into[index]
                raise _fail(
                    schedule,
                    f"rank {dst} receives {message} from rank {src}, which never sends it",
                    {(dst, position): "ERROR HERE"},
                )
            if index >= len(into):
                position, message = out[index]
                raise _fail(
                    schedule,
                    f"rank {src} sends {message} to rank {dst}, which never receives it",
                    {(src, position): "ERROR HERE"},
                )
            if out[index][1] != into[index][1]:
                raise _fail(
                    schedule,
                    f"message order differs between ranks {src} -> {dst}: send #{index} is "
                    f"{out[index][1]} but receive #{index} is {into[index][1]}; point-to-point "
                    "messages match by posting order, so these would be swapped",
                    {(src, out[index][0]): "sent here", (dst, into[index][0]): "received here"},
                )


def validate_deadlock_free(schedule: Schedule) -> None:
    """Run every program under the semantics above with unit time; all must reach the end."""
    blocked = run_programs(schedule)
    if blocked:
        marks = {
            (rank, position): f"waits for {message.what} {message.stage}/{message.microbatch}"
            for rank, (position, message) in blocked.items()
        }
        raise _fail(
            schedule,
            "deadlock: every remaining rank waits for a message that is never sent first",
            marks,
        )


def run_programs(schedule: Schedule) -> dict[int, tuple[int, Message]]:
    """Advance all ranks as far as the messages allow; return where unfinished ranks are stuck.

    Received messages are tracked per rank so that a consumer waits for the send that matches its
    own receive, which is how the runtime behaves.
    """
    programs = schedule.per_rank
    implicit = not has_communication(schedule)
    cursor = [0] * len(programs)
    sent: set[tuple[int, Message]] = set()  # (destination rank, message)
    waiting: dict[tuple[int, Message], int] = {}
    ready: deque[int] = deque(range(len(programs)))
    blocked_on: dict[int, tuple[int, Message]] = {}
    waits_for = _WAITS_FOR
    # BPipe: a backward also waits for the activations its LOAD brings back.
    loads = [{(a.stage, a.microbatch) for a in p if a.kind is K.LOAD} for p in programs]
    # BPipe: the compute after an EV (RS) waits until the partner has posted the AC (LD), so
    # that the payload's buffer can be released (gloo sends are only known done once waited).
    unacknowledged: list[list[Message]] = [[] for _ in programs]
    while ready:
        rank = ready.popleft()
        program = programs[rank]
        position = cursor[rank]
        blocked_on.pop(rank, None)
        while position < len(program):
            action = program[position]
            if action.kind.is_compute and unacknowledged[rank]:
                missing = [m for m in unacknowledged[rank] if (rank, m) not in sent]
                if missing:
                    waiting[(rank, missing[0])] = rank
                    blocked_on[rank] = (position, missing[0])
                    break
                unacknowledged[rank].clear()
            if action.kind in (K.EVICT, K.RESTORE):
                unacknowledged[rank].append(_acknowledgement(action))
            if action.kind in waits_for:
                needed = consumed_messages(action, schedule, rank)
                if (action.stage, action.microbatch) in loads[rank] and action.kind in (
                    K.BACKWARD,
                    K.BACKWARD_INPUT,
                ):
                    needed.append(Message("restore", action.stage, action.microbatch or 0))
                missing = [m for m in needed if (rank, m) not in sent]
                if missing:
                    waiting[(rank, missing[0])] = rank
                    blocked_on[rank] = (position, missing[0])
                    break
            if action.kind in (K.ACCEPT, K.LOAD) and action.peer is not None:
                acknowledged = (action.peer, _acknowledgement(action))
                sent.add(acknowledged)
                woken = waiting.pop(acknowledged, None)
                if woken is not None:
                    ready.append(woken)
            if action.kind in _SEND_KINDS or implicit:
                for key in _posted_by(action, schedule, rank, implicit):
                    sent.add(key)
                    woken = waiting.pop(key, None)
                    if woken is not None:
                        ready.append(woken)
            position += 1
        cursor[rank] = position
    return blocked_on


_WAITS_FOR = frozenset({K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.ACCEPT, K.RESTORE})


def _acknowledgement(action: Action) -> Message:
    """The signal an AC (LD) gives its EV (RS): the partner's receive is posted."""
    what = "evict-posted" if action.kind in (K.EVICT, K.ACCEPT) else "restore-posted"
    return Message(what, action.stage, action.microbatch or 0)


def _posted_by(
    action: Action, schedule: Schedule, rank: int, implicit: bool
) -> list[tuple[int, Message]]:
    """(destination rank, message) pairs an action makes available to other ranks."""
    if action.kind.is_send:
        assert action.peer is not None
        return [(action.peer, message_of(action))]
    if not implicit or action.microbatch is None:
        return []
    layout, stage, mb = schedule.layout, action.stage, action.microbatch
    if action.kind == K.FORWARD and not layout.is_last(stage):
        return [(layout.rank_of(stage + 1), Message("act", stage, mb))]
    if action.kind in (K.BACKWARD, K.BACKWARD_INPUT) and stage > 0:
        return [(layout.rank_of(stage - 1), Message("grad", stage, mb))]
    return []


# --- the fused check --------------------------------------------------------------------------
# validate_schedule's fast path: every rule of the checks above, in one pass per rank over flat
# integer keys, then the channel comparison and the deadlock run on integer messages. It only
# answers "all pass"; on any doubt it says no and the checks above run one by one to explain.
#
# Keys: (stage, micro-batch) is stage * num_microbatches + microbatch; a message is
# key * 4 + what (what: act, grad, evict, restore) and, addressed to a rank, message * P + rank.
_ACT, _GRAD, _EVICT, _RESTORE = 0, 1, 2, 3


def _passes_all_checks(
    schedule: Schedule, *, require_communication: bool, require_backward: bool
) -> bool:
    try:
        return _fused_checks(schedule, require_communication, require_backward)
    except (TypeError, IndexError):  # a field out of range or None where a number belongs
        return False


def _fused_checks(schedule: Schedule, require_communication: bool, require_backward: bool) -> bool:
    """True when every check passes; see validate_schedule. Each branch below applies the
    placement, completeness and local-order rules of one kind and records what the message
    order and deadlock checks need; the invariants it relies on are noted where used."""
    stage_to_rank = schedule.layout.stage_to_rank
    num_stages, num_mb = len(stage_to_rank), schedule.num_microbatches
    num_ranks = len(schedule.per_rank)
    with_comm = has_communication(schedule)
    implicit = not with_comm
    # Per stage: the rank of the previous / next stage when it is another rank (the peer of
    # RA, SG / SA, RG), else -1; and whether that neighbour is on the same rank.
    remote_in, remote_out = [-1] * num_stages, [-1] * num_stages
    local_in, local_out = [False] * num_stages, [False] * num_stages
    for stage in range(1, num_stages):
        if stage_to_rank[stage - 1] == stage_to_rank[stage]:
            local_in[stage] = local_out[stage - 1] = True
        else:
            remote_in[stage] = stage_to_rank[stage - 1]
            remote_out[stage - 1] = stage_to_rank[stage]
    # Done flags per (stage, micro-batch). Every kind flagged here runs on its stage's rank
    # (placement, checked before any flag is set), so a flag is that rank's own history.
    size = num_stages * num_mb
    f_done, b_done, i_done, w_done = (bytearray(size) for _ in range(4))
    ra_done, rg_done, ev_done, ld_done = (bytearray(size) for _ in range(4))
    count_f = count_b = count_i = count_w = 0
    any_eviction = False
    # (source, destination) -> (messages sent, messages received), in posting order.
    channels: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    # Per rank, the deadlock run's program: m >= 0 posts message m, ~m waits for it.
    rank_ops: list[list[int]] = []
    F, B, I, W = K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT  # noqa: E741
    SA, RA, SG, RG = K.SEND_ACT, K.RECV_ACT, K.SEND_GRAD, K.RECV_GRAD
    GS, PS = K.GRAD_SYNC, K.PARAM_SYNC
    unused: list[int] = []
    # BPipe acknowledgements (see run_programs) get ids above every message id.
    ack_base = size * 4 * num_ranks
    for rank, actions in enumerate(schedule.per_rank):
        # This rank's channel ends per own stage, so the loop only appends.
        act_in, act_out = [unused] * num_stages, [unused] * num_stages
        grad_in, grad_out = [unused] * num_stages, [unused] * num_stages
        for stage in range(num_stages):
            if stage_to_rank[stage] == rank:
                if remote_in[stage] >= 0:
                    act_in[stage] = channels.setdefault((remote_in[stage], rank), ([], []))[1]
                    grad_out[stage] = channels.setdefault((rank, remote_in[stage]), ([], []))[0]
                if remote_out[stage] >= 0:
                    act_out[stage] = channels.setdefault((rank, remote_out[stage]), ([], []))[0]
                    grad_in[stage] = channels.setdefault((remote_out[stage], rank), ([], []))[1]
        ops: list[int] = []
        op = ops.append
        accepted: set[int] = set()  # AC keys on this rank (the acceptor is not the owner)
        evictions = loads = 0
        awaiting: list[int] = []  # acknowledgement ids the next compute action waits for
        for action in actions:
            kind = action.kind
            stage = action.stage
            mb: int = action.microbatch  # type: ignore[assignment]  # None only for GS / PS
            if awaiting and (kind is F or kind is B or kind is I or kind is W):
                for ack in awaiting:
                    op(~ack)
                awaiting.clear()
            if kind is F:
                if stage_to_rank[stage] != rank or mb >= num_mb:
                    return False
                key = stage * num_mb + mb
                if f_done[key]:
                    return False  # duplicate
                if local_in[stage]:
                    if not f_done[key - num_mb]:
                        return False  # before its local producer
                elif remote_in[stage] >= 0:
                    if with_comm and not ra_done[key]:
                        return False  # no earlier receive posts its input
                    op(~(((key - num_mb) * 4 + _ACT) * num_ranks + rank))
                f_done[key] = 1
                count_f += 1
                if implicit and stage + 1 < num_stages:
                    op((key * 4 + _ACT) * num_ranks + stage_to_rank[stage + 1])
            elif kind is B or kind is I:
                if stage_to_rank[stage] != rank or mb >= num_mb:
                    return False
                key = stage * num_mb + mb
                # A duplicate, or both B and I; W needs its I, so W never joins a B either.
                if b_done[key] or i_done[key] or not f_done[key]:
                    return False
                if any_eviction and ev_done[key] and not ld_done[key]:
                    return False  # evicted and not loaded back
                if local_out[stage]:
                    if not (b_done[key + num_mb] or i_done[key + num_mb]):
                        return False  # before its local producer of the output gradient
                elif remote_out[stage] >= 0:
                    if with_comm and not rg_done[key]:
                        return False
                    op(~(((key + num_mb) * 4 + _GRAD) * num_ranks + rank))
                # An LD of this key precedes it (EV precedes the backward and the check above
                # wants the LD done): it also waits for the activations the LD brings back.
                if any_eviction and ld_done[key]:
                    op(~((key * 4 + _RESTORE) * num_ranks + rank))
                if kind is B:
                    b_done[key] = 1
                    count_b += 1
                else:
                    i_done[key] = 1
                    count_i += 1
                if implicit and stage > 0:
                    op((key * 4 + _GRAD) * num_ranks + stage_to_rank[stage - 1])
            elif kind is SA:
                if stage_to_rank[stage] != rank or mb >= num_mb or action.peer != remote_out[stage]:
                    return False
                key = stage * num_mb + mb
                if not f_done[key]:
                    return False
                message = key * 4 + _ACT
                act_out[stage].append(message)
                op(message * num_ranks + remote_out[stage])
            elif kind is RA:
                if stage_to_rank[stage] != rank or mb >= num_mb or action.peer != remote_in[stage]:
                    return False
                key = stage * num_mb + mb
                ra_done[key] = 1
                act_in[stage].append((key - num_mb) * 4 + _ACT)
            elif kind is SG:
                if stage_to_rank[stage] != rank or mb >= num_mb or action.peer != remote_in[stage]:
                    return False
                key = stage * num_mb + mb
                if not (b_done[key] or i_done[key]):
                    return False
                message = key * 4 + _GRAD
                grad_out[stage].append(message)
                op(message * num_ranks + remote_in[stage])
            elif kind is RG:
                if stage_to_rank[stage] != rank or mb >= num_mb or action.peer != remote_out[stage]:
                    return False
                key = stage * num_mb + mb
                rg_done[key] = 1
                grad_in[stage].append((key + num_mb) * 4 + _GRAD)
            elif kind is W:
                if stage_to_rank[stage] != rank or mb >= num_mb:
                    return False
                key = stage * num_mb + mb
                if w_done[key] or not i_done[key]:
                    return False
                w_done[key] = 1
                count_w += 1
            elif kind is GS or kind is PS:
                if stage_to_rank[stage] != rank:
                    return False
            else:  # BPipe's transfers: rare, so written plainly
                owner = stage_to_rank[stage]
                peer: int = action.peer  # type: ignore[assignment]  # p2p: never None
                if mb >= num_mb or peer >= num_ranks:  # (a peer out of range breaks the keys)
                    return False
                key = stage * num_mb + mb
                if kind is K.EVICT:
                    if owner != rank or peer == rank or ev_done[key]:
                        return False
                    if not f_done[key] or b_done[key] or i_done[key]:
                        return False  # outside the window between forward and backward
                    ev_done[key] = 1
                    any_eviction = True
                    evictions += 1
                    message = key * 4 + _EVICT
                    channels.setdefault((rank, peer), ([], []))[0].append(message)
                    op(message * num_ranks + peer)
                    awaiting.append(ack_base + (key * 2) * num_ranks + rank)
                elif kind is K.LOAD:
                    if owner != rank or peer == rank or ld_done[key] or not ev_done[key]:
                        return False
                    ld_done[key] = 1
                    loads += 1
                    channels.setdefault((peer, rank), ([], []))[1].append(key * 4 + _RESTORE)
                    op(ack_base + (key * 2 + 1) * num_ranks + peer)
                elif kind is K.ACCEPT:
                    if owner == rank or peer != owner:
                        return False
                    accepted.add(key)
                    channels.setdefault((peer, rank), ([], []))[1].append(key * 4 + _EVICT)
                    op(~((key * 4 + _EVICT) * num_ranks + rank))  # reads the size header
                    op(ack_base + (key * 2) * num_ranks + peer)
                elif kind is K.RESTORE:
                    if owner == rank or peer != owner or key not in accepted:
                        return False
                    op(~((key * 4 + _EVICT) * num_ranks + rank))
                    message = key * 4 + _RESTORE
                    channels.setdefault((rank, peer), ([], []))[0].append(message)
                    op(message * num_ranks + peer)
                    awaiting.append(ack_base + (key * 2 + 1) * num_ranks + rank)
                else:
                    return False
        # Every LD needs its EV on this rank and neither repeats: equal counts, equal sets.
        if evictions != loads:
            return False
        rank_ops.append(ops)
    # Completeness: all keys are in range and none repeats, I and B never share a key and
    # every W follows its I, so counting suffices.
    if count_f != size or count_i != count_w:
        return False
    if require_backward and count_b + count_i != size:
        return False
    if (require_communication or with_comm) and any(
        sent != received for sent, received in channels.values()
    ):
        return False
    return _runs_to_the_end(rank_ops)


def _runs_to_the_end(rank_ops: list[list[int]]) -> bool:
    """run_programs on the fused check's integer programs: does every rank reach its end?"""
    sent: set[int] = set()
    waiting: dict[int, int] = {}
    cursor = [0] * len(rank_ops)
    ready = deque(range(len(rank_ops)))
    while ready:
        rank = ready.popleft()
        ops = rank_ops[rank]
        position, end = cursor[rank], len(ops)
        while position < end:
            op = ops[position]
            if op >= 0:
                sent.add(op)
                woken = waiting.pop(op, None)
                if woken is not None:
                    ready.append(woken)
            elif ~op not in sent:
                waiting[~op] = rank
                break
            position += 1
        cursor[rank] = position
    return all(position == len(ops) for position, ops in zip(cursor, rank_ops, strict=True))
