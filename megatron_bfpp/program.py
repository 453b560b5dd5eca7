"""A schedule compiled once, from ``Rules``' tables, into the message ids (``Rules.id``) that
every loop over its actions would otherwise work out; ``compiled`` keeps the last few."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_bfpp.ir import COMPUTE_KINDS, Action, ActionKind, Schedule
from megatron_bfpp.messages import MESSAGE_TABLE, Message
from megatron_bfpp.semantics import Rules

__all__ = ["Program", "compiled"]


@dataclass(frozen=True, slots=True, eq=False)
class Program:
    """``schedule`` compiled, per rank and position; ``rules`` are its ``Rules`` as lowered."""

    schedule: Schedule
    rules: Rules
    message: tuple[list[int], ...]  # a point-to-point action's message, -1 for the others
    # the message a compute waits for from another rank, -1 none (a composite's: see ``wait_of``)
    wait: tuple[list[int], ...]
    # position -> the restore a B / I (a composite's backward) also waits for because an LD
    # brought its activations back (``Rules.restored``), empty but for BPipe
    restore: tuple[dict[int, int], ...]
    wait_base: dict[ActionKind, list[int]]  # per compute kind and stage: ``wait``'s, of mb 0

    def wait_of(self, action: Action) -> int:
        """What a plain compute action (a composite's part) waits for: ``wait``'s entry."""
        base = self.wait_base[action.kind][action.stage]
        return -1 if base < 0 else base + (action.microbatch or 0)

    def message_of(self, message_id: int) -> Message:
        """The inverse of ``id``."""
        return self.rules.message(message_id)


_KEPT: list[Program] = []
_KEEP = 4


def compiled(schedule: Schedule) -> Program:
    """``schedule`` in the integer form (module docstring), lowered or not, compiled at most once
    while it is among the last few."""
    for program in _KEPT:
        if program.schedule is schedule:
            return program
    rules = Rules(schedule, implicit=False, any_microbatch=True)
    # per compute kind and stage: the id it waits for at micro-batch 0 (add the micro-batch), -1
    waits = {kind: [base or -1 for base in rules.waits_for[kind]] for kind in COMPUTE_KINDS}
    # per p2p kind the id of its stage 0's message of micro-batch 0: ids are linear in the stage
    firsts = {kind: rules.id(what, offset, 0) for kind, (what, offset) in MESSAGE_TABLE.items()}
    # an LD's message is also the restore a later B / I waits for
    load = firsts.pop(ActionKind.LOAD)
    first_of, waits_of, per_stage = firsts.get, waits.get, rules.microbatches
    messages, wait, restore = [], [], []
    for rank, actions in enumerate(schedule.per_rank):
        message_row, wait_row = [-1] * len(actions), [-1] * len(actions)
        loads: dict[int, int] = {}  # position -> its LD's message
        for position, action in enumerate(actions):
            kind = action.kind  # p2p and compute actions name a micro-batch: not None
            if (first := first_of(kind)) is not None:
                message_row[position] = first + action.stage * per_stage + action.microbatch  # type: ignore[operator]
            elif (bases := waits_of(kind)) is not None and (base := bases[action.stage]) >= 0:
                wait_row[position] = base + action.microbatch  # type: ignore[operator]
            elif kind is ActionKind.LOAD:
                message = load + action.stage * per_stage + action.microbatch  # type: ignore[operator]
                loads[position] = message_row[position] = message
        messages.append(message_row)
        wait.append(wait_row)
        # each LD's restore where ``Rules.restored`` puts it
        waited = ((rules.restored(rank, p), message) for p, message in loads.items())
        restore.append({at: message for at, message in waited if at >= 0})
    program = Program(schedule, rules, tuple(messages), tuple(wait), tuple(restore), waits)
    _KEPT.insert(0, program)
    del _KEPT[_KEEP:]
    return program
