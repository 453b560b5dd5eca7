"""What travels between pipeline ranks: the one ``Message`` a point-to-point action (SA, RA, SG,
RG; BPipe's EV, AC, RS, LD) sends or receives, alike for passes, validator, simulator and runtime;
hot loops key it by an integer (``semantics.Rules.id``), several times cheaper to hash."""

from __future__ import annotations

from enum import StrEnum
from operator import attrgetter
from typing import NamedTuple

from megatron_bfpp.ir import Action, ActionKind, Schedule, ScheduleError

__all__ = [
    "ACT",
    "EVICT",
    "EVICT_POSTED",
    "EVICT_SIZE",
    "GRAD",
    "MESSAGE_TABLE",
    "RESTORE",
    "RESTORE_POSTED",
    "WHAT",
    "WHAT_CODE",
    "Message",
    "What",
    "has_communication",
    "message_of",
]

K = ActionKind


class What(StrEnum):
    """What a message carries, the one list of kinds. ``EVICT_POSTED`` / ``RESTORE_POSTED``: BPipe's
    data-less acknowledgements that the partner posted the receive (AC / LD), so the sender may free
    the payload; ``EVICT_SIZE``: the runtime's 8-byte eviction header (``runtime.p2p``)."""

    ACT = "act"
    GRAD = "grad"
    EVICT = "evict"
    RESTORE = "restore"
    EVICT_POSTED = "evict-posted"
    RESTORE_POSTED = "restore-posted"
    EVICT_SIZE = "evict-size"


# Each kind as the small integer in a message id (``semantics.Rules.id``) and back, in What's order.
WHAT: tuple[What, ...] = tuple(What)
WHAT_CODE: dict[str, int] = {what: code for code, what in enumerate(WHAT)}
ACT, GRAD, EVICT, RESTORE, EVICT_POSTED, RESTORE_POSTED, EVICT_SIZE = range(len(WHAT))


class Message(NamedTuple):
    """What travels: a :class:`What` of (stage, microbatch): ``act`` is stage ``stage``'s output,
    ``grad`` the gradient of its input, ``evict``/``restore`` the evictor's stored activations."""

    what: What
    stage: int
    microbatch: int


def message_of(action: Action) -> Message:
    """The message a point-to-point action sends or receives."""
    entry, mb = MESSAGE_TABLE.get(action.kind), action.microbatch
    if entry is None or mb is None:
        raise ScheduleError(f"{action} is not a point-to-point action")
    return Message(WHAT[entry[0]], action.stage + entry[1], mb)


# kind -> (what travels, stage offset from the action's stage to the message's stage)
MESSAGE_TABLE = {
    K.SEND_ACT: (ACT, 0),
    K.RECV_ACT: (ACT, -1),
    K.SEND_GRAD: (GRAD, 0),
    K.RECV_GRAD: (GRAD, 1),
    K.EVICT: (EVICT, 0),
    K.ACCEPT: (EVICT, 0),
    K.RESTORE: (RESTORE, 0),
    K.LOAD: (RESTORE, 0),
}


def has_communication(schedule: Schedule) -> bool:
    """A schedule without activation/gradient messages is compute-only (not yet lowered)."""
    return any(
        not _LOWERED_KINDS.isdisjoint(map(_get_kind, actions)) for actions in schedule.per_rank
    )


_get_kind = attrgetter("kind")
_LOWERED_KINDS = frozenset({K.SEND_ACT, K.RECV_ACT, K.SEND_GRAD, K.RECV_GRAD})
