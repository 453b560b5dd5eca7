"""What travels between pipeline ranks, and the one integer form every hot loop keys it by.

A point-to-point action (SA, RA, SG, RG; BPipe's EV, AC, RS, LD) sends or receives one
``Message`` (``message_of``), the same for passes, validator, simulator and runtime. Hot loops
key messages by an integer (``MessageKeys``), several times cheaper to hash than a tuple.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    "RESTORE",
    "RESTORE_POSTED",
    "WHAT",
    "WHAT_CODE",
    "Message",
    "MessageKeys",
    "What",
    "has_communication",
    "message_of",
]

K = ActionKind


class What(StrEnum):
    """What a message carries: the one list of message kinds (a ``str``: prints as its value).

    ``EVICT_POSTED`` / ``RESTORE_POSTED`` are BPipe's data-less acknowledgements that the partner
    posted the receive (AC / LD), so the sender may release the payload's buffer. ``EVICT_SIZE``
    is the runtime's 8-byte header of an eviction, sent in the tick's batch before the payload
    (``runtime.p2p``): the acceptor posts it as the ``EVICT`` message's header.
    """

    ACT = "act"
    GRAD = "grad"
    EVICT = "evict"
    RESTORE = "restore"
    EVICT_POSTED = "evict-posted"
    RESTORE_POSTED = "restore-posted"
    EVICT_SIZE = "evict-size"


# Each kind as the small integer inside a message key (``MessageKeys``), and back; the names
# below in What's order.
WHAT: tuple[What, ...] = tuple(What)
WHAT_CODE: dict[str, int] = {what: code for code, what in enumerate(WHAT)}
ACT, GRAD, EVICT, RESTORE, EVICT_POSTED, RESTORE_POSTED, EVICT_SIZE = range(len(WHAT))
_WHAT_SLOTS = 8  # room for every kind; a power of two keeps the key arithmetic exact
if len(WHAT) > _WHAT_SLOTS:
    raise RuntimeError(f"{len(WHAT)} message kinds do not fit MessageKeys' {_WHAT_SLOTS} slots")


class Message(NamedTuple):
    """What travels: a :class:`What` of (stage, microbatch).

    ``act`` is stage ``stage``'s output, ``grad`` the gradient of stage ``stage``'s input, and
    ``evict``/``restore`` the stored activations of the evictor's stage ``stage``.
    """

    what: What
    stage: int
    microbatch: int


def message_of(action: Action) -> Message:
    """The message a point-to-point action sends or receives."""
    entry = _MESSAGE_TABLE.get(action.kind)
    mb = action.microbatch
    if entry is None or mb is None:
        raise ScheduleError(f"{action} is not a point-to-point action")
    return Message(WHAT[entry[0]], action.stage + entry[1], mb)


# kind -> (what travels, stage offset from the action's stage to the message's stage)
_MESSAGE_TABLE = {
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


@dataclass(frozen=True, slots=True)
class MessageKeys:
    """The integer of a message addressed to a rank, for one layout.

    ``key = microbatch * per_microbatch + slot(what, stage, rank)`` with
    ``slot = (stage * 8 + what) * num_ranks + rank``: distinct for every (what, stage,
    micro-batch, rank) with ``stage < num_stages`` and ``rank < num_ranks``, and split so that a
    loop can precompute the slot per stage and add ``microbatch * per_microbatch``. Without the
    rank (``rank=0, num_ranks=1``, ``MessageKeys(num_stages, 1)``) it keys a message alone.
    """

    num_stages: int
    num_ranks: int

    @property
    def per_microbatch(self) -> int:
        # One more than the slots: an odd stride spreads micro-batches over the low bits, all a
        # hash table of ints looks at (an even one piles one stage's keys into a few buckets).
        return self.num_stages * _WHAT_SLOTS * self.num_ranks + 1

    def slot(self, what: int, stage: int, rank: int = 0) -> int:
        return (stage * _WHAT_SLOTS + what) * self.num_ranks + rank

    def key(self, message: Message, rank: int = 0) -> int:
        slot = self.slot(WHAT_CODE[message.what], message.stage, rank)
        return message.microbatch * self.per_microbatch + slot

    def message(self, key: int) -> tuple[Message, int]:
        """The inverse of ``key``: (message, rank it is addressed to)."""
        microbatch, slot = divmod(key, self.per_microbatch)
        rest, rank = divmod(slot, self.num_ranks)
        stage, what = divmod(rest, _WHAT_SLOTS)
        return Message(WHAT[what], stage, microbatch), rank
