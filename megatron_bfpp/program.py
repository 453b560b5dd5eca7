"""A schedule compiled once into the integer form that the loops running it read.

Every loop over a schedule's actions asks the same questions of each one: which message a
point-to-point action sends or receives, and which message a compute waits for.
``compile_program`` answers them once per schedule from ``Rules``' tables, as dense integers:

* a message is ``(what * stage_span + stage + 1) * microbatches + microbatch`` (``Program.id``):
  sender and receiver compute the same number for the same ``Message``, and the numbers sort as
  the (kind code, stage, micro-batch) triples do, which is the canonical order of a batch's ops;
* ``message[rank][position]``: a point-to-point action's message, -1 for the others;
* ``wait[rank][position]``: the message a compute waits for from another rank (its input
  activation or its output gradient, ``Rules.waits_for``), -1 for none or a non-compute;
* ``restore[rank]``: position -> the restore a B / I also waits for because an LD earlier in
  its rank's program brought its activations back (``Rules.transfers``' ``loads``, as
  ``semantics.Wires.restore`` applies it: each LD serves the first such backward), empty but
  for BPipe.
* a composite waits for what its parts wait for (the composite rule): -1 in ``wait``, its parts'
  by ``wait_of``, its backward's restore under its position in ``restore``.

``compiled`` keeps the programs of the last schedules it compiled, by identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from megatron_bfpp.ir import COMPUTE_KINDS, Action, ActionKind, Schedule, parts
from megatron_bfpp.messages import RESTORE, WHAT, WHAT_CODE, Message
from megatron_bfpp.semantics import Rules

__all__ = ["Program", "compiled"]

K = ActionKind
# kind -> (what travels, stage offset from the action's stage to the message's): message_of's
_MESSAGE = {
    K.SEND_ACT: (WHAT_CODE["act"], 0),
    K.RECV_ACT: (WHAT_CODE["act"], -1),
    K.SEND_GRAD: (WHAT_CODE["grad"], 0),
    K.RECV_GRAD: (WHAT_CODE["grad"], 1),
    K.EVICT: (WHAT_CODE["evict"], 0),
    K.ACCEPT: (WHAT_CODE["evict"], 0),
    K.RESTORE: (RESTORE, 0),
    K.LOAD: (RESTORE, 0),
}
_kind_of, _stage_of = attrgetter("kind"), attrgetter("stage")
_microbatch_of = attrgetter("microbatch")


@dataclass(frozen=True, slots=True, eq=False)
class Program:
    """``schedule`` compiled (module docstring); ``rules`` are its ``Rules`` as lowered."""

    schedule: Schedule
    rules: Rules
    stage_span: int  # message stages run from -1 to num_stages: num_stages + 2 of them
    microbatches: int  # one more than the largest micro-batch any action names
    message: tuple[list[int], ...]
    wait: tuple[list[int], ...]
    restore: tuple[dict[int, int], ...]
    wait_base: dict[ActionKind, list[int]]  # per compute kind and stage: ``wait``'s, of mb 0

    @property
    def num_messages(self) -> int:
        return (len(WHAT) * self.stage_span) * self.microbatches

    def id(self, what: int, stage: int, microbatch: int) -> int:
        return (what * self.stage_span + stage + 1) * self.microbatches + microbatch

    def id_of(self, message: Message) -> int:
        return self.id(WHAT_CODE[message.what], message.stage, message.microbatch)

    def wait_of(self, action: Action) -> int:
        """What a plain compute action (a composite's part) waits for: ``wait``'s entry."""
        base = self.wait_base[action.kind][action.stage]
        return -1 if base < 0 else base + (action.microbatch or 0)

    def message_of(self, message_id: int) -> Message:
        """The inverse of ``id``."""
        rest, microbatch = divmod(message_id, self.microbatches)
        what, stage = divmod(rest, self.stage_span)
        return Message(WHAT[what], stage - 1, microbatch)


def compile_program(schedule: Schedule) -> Program:
    """``schedule`` in the integer form (module docstring), lowered or not."""
    rules = Rules(schedule, implicit=False)
    per_rank = schedule.per_rank
    biggest = max((max(map(_mb_or_zero, actions), default=0) for actions in per_rank), default=0)
    span, microbatches = schedule.num_stages + 2, max(biggest, schedule.num_microbatches - 1) + 1
    # per kind: (what, offset) of its message, or per stage the base id of the message a compute
    # waits for (add the micro-batch), -1 for none
    waits: dict[ActionKind, list[int]] = {}
    for kind in COMPUTE_KINDS:
        slots = rules.waits_for[kind]
        waits[kind] = [_wait_base(rules, slot, span, microbatches) for slot in slots]
    messages, wait, restore = [], [], []
    for actions in per_rank:
        kinds = list(map(_kind_of, actions))
        stages = list(map(_stage_of, actions))
        mbs = list(map(_mb_or_zero, actions))
        message_row, wait_row = [-1] * len(actions), [-1] * len(actions)
        for position, kind in enumerate(kinds):
            entry = _MESSAGE.get(kind)
            if entry is not None:
                what, offset = entry
                stage = stages[position] + offset
                message_row[position] = (what * span + stage + 1) * microbatches + mbs[position]
            elif (bases := waits.get(kind)) is not None and (base := bases[stages[position]]) >= 0:
                wait_row[position] = base + mbs[position]
        messages.append(message_row)
        wait.append(wait_row)
        restore.append(_restores(rules, actions, kinds, span, microbatches))
    return Program(
        schedule, rules, span, microbatches, tuple(messages), tuple(wait), tuple(restore), waits
    )


def _restores(
    rules: Rules, actions: Sequence[Action], kinds: list[ActionKind], span: int, microbatches: int
) -> dict[int, int]:
    """``Program.restore`` of one rank (module docstring)."""
    if not any(kind in rules.transfers for kind in set(kinds)):
        return {}
    restore, loaded = {}, set()
    for position, (kind, action) in enumerate(zip(kinds, actions, strict=True)):
        if kind is K.OVERLAP_F_B:  # an overlapped pair: its backward's, at its position
            action = parts(action)[-1]
            kind = action.kind
        mb = action.microbatch or 0
        if (rule := rules.transfers.get(kind)) is not None:
            if rule.loads[action.stage] >= 0:
                loaded.add((RESTORE * span + action.stage + 1) * microbatches + mb)
        elif (
            kind in _RESTORED
            and (key := (RESTORE * span + action.stage + 1) * microbatches + mb) in loaded
        ):
            loaded.discard(key)
            restore[position] = key
    return restore


_RESTORED = frozenset({K.BACKWARD, K.BACKWARD_INPUT})  # what an LD's activations serve


def _mb_or_zero(action: object) -> int:
    return _microbatch_of(action) or 0


def _wait_base(rules: Rules, slot: int, span: int, microbatches: int) -> int:
    """A ``Rules.waits_for`` slot (micro-batch 0) as a message id of micro-batch 0."""
    if slot < 0:
        return -1
    message = rules.keys.message(slot)[0]
    return (WHAT_CODE[message.what] * span + message.stage + 1) * microbatches


_KEPT: list[Program] = []
_KEEP = 4


def compiled(schedule: Schedule) -> Program:
    """The program of ``schedule``, compiled at most once while it is among the last few."""
    for program in _KEPT:
        if program.schedule is schedule:
            return program
    program = compile_program(schedule)
    _KEPT.insert(0, program)
    del _KEPT[_KEEP:]
    return program
