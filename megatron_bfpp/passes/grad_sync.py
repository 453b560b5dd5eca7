"""Mark where each chunk's parameter gather (PS), gradient reduction (GS) and, sharded, release
(RL) go: docs/architecture.md, "Gradient sync and sharded parameters"."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Set
from itertools import chain, islice
from operator import attrgetter

from megatron_bfpp.ir import (
    _BACKWARD_KINDS,
    _CHUNK_LEVEL,
    COMPUTE_KINDS,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    parts,
    paused_gc,
    unchecked_action,
)

__all__ = ["SHARDING_STRATEGIES", "add_grad_sync"]

K = ActionKind


SHARDING_STRATEGIES = ("optim", "optim_grads_params")


@paused_gc()
def add_grad_sync(
    schedule: Schedule, *, sharding: str = "optim", max_resident: int = 2
) -> Schedule:
    """GS / PS per chunk; ``sharding="optim_grads_params"`` (Megatron's word) shards parameters
    and gradients too (RL), at most ``max_resident`` chunks of a rank gathered at once."""
    get_kind = attrgetter("kind")
    scans = []  # per rank: its stages' last B or W (-1: none; a pair's I needs its W), first F
    for rank, actions in enumerate(schedule.per_rank):
        stages = schedule.layout.stages_of(rank)
        backwards = zip(range(len(actions) - 1, -1, -1), reversed(actions), strict=True)
        last_grad = _find(backwards, stages, -1, {K.BACKWARD, K.BACKWARD_WEIGHT})
        first_forward = _find(enumerate(actions), stages, len(actions), {K.FORWARD})
        start = max(first_forward.values()) + 1  # _find refused GS/PS/RL where it looked
        if not _CHUNK_LEVEL.isdisjoint(map(get_kind, actions[start : min(last_grad.values())])):
            raise ScheduleError(_ALREADY_SYNCED)
        scans.append((actions, stages, last_grad, first_forward))
    if sharding not in SHARDING_STRATEGIES:
        raise ScheduleError(
            f"add_grad_sync: sharding={sharding!r} is not one of {', '.join(SHARDING_STRATEGIES)}"
        )
    if sharding == "optim_grads_params":
        if any(K.OVERLAP_F_B in map(get_kind, actions) for actions in schedule.per_rank):
            raise ScheduleError(
                "add_grad_sync: sharded parameters (optim_grads_params) gather and release per "
                "run of one chunk's computes, and an overlapped pair (F&B) may run two chunks "
                "at once; use sharding='optim' for schedules with overlapped pairs"
            )
        if isinstance(max_resident, bool) or not isinstance(max_resident, int) or max_resident < 1:
            raise ScheduleError(
                f"add_grad_sync: max_resident={max_resident!r} must be an integer >= 1 (chunks "
                "gathered at once; 2 lets the next chunk's gather overlap this one's compute)"
            )
    programs = []
    for actions, stages, last_grad, first_forward in scans:
        if sharding == "optim_grads_params":
            programs.append(_sharded_program(actions, stages, last_grad, max_resident))
            continue
        order = sorted(stages, key=first_forward.__getitem__)  # gathered in first-use order
        inserts = {0: [unchecked_action(stage, K.PARAM_SYNC) for stage in order]}
        for stage in stages:
            if last_grad[stage] >= 0:
                position = _past_sends(actions, last_grad[stage]) + 1
                inserts.setdefault(position, []).append(unchecked_action(stage, K.GRAD_SYNC))
        programs.append(_spliced(actions, inserts))
    return schedule.with_programs(programs)


def _spliced(actions: tuple[Action, ...], inserts: dict[int, list[Action]]) -> tuple[Action, ...]:
    """``actions`` with ``inserts[i]`` before action i (after the last: i = len): chained views
    over one iterator touch each action once (slices into a list, then a tuple: three times)."""
    rest, start = iter(actions), 0
    pieces: list[Iterable[Action]] = []
    for position in sorted(inserts):
        pieces += (islice(rest, position - start), inserts[position])
        start = position
    pieces.append(rest)
    return tuple(chain.from_iterable(pieces))


_ALREADY_SYNCED = "add_grad_sync: the schedule already has GS/PS/RL actions"


def _find(
    indexed: Iterable[tuple[int, Action]],
    stages: tuple[int, ...],
    default: int,
    kinds: Set[ActionKind],
) -> dict[int, int]:
    """Each stage's first position in ``indexed`` (``default`` if none) holding an action of
    ``kinds`` (a pair's F, or its B / I), scanning until every stage has one; refuses GS/PS/RL."""
    found, missing = dict.fromkeys(stages, default), set(stages)
    pair = K.OVERLAP_F_B
    noticed = kinds | _CHUNK_LEVEL | {pair}
    for position, action in indexed:
        kind = action.kind
        if kind not in noticed:
            continue
        if kind is pair:
            action = parts(action)[K.FORWARD not in kinds]  # its F, or its B / I
            kind = action.kind
        elif kind in _CHUNK_LEVEL:
            raise ScheduleError(_ALREADY_SYNCED)
        if kind in kinds and action.stage in missing:
            found[action.stage] = position
            missing.discard(action.stage)
            if not missing:
                break
    return found


def _past_sends(actions: tuple[Action, ...], position: int) -> int:
    """``position`` past later gradient sends, on upstream's critical path (a reduction is not)."""
    while position + 1 < len(actions) and actions[position + 1].kind is K.SEND_GRAD:
        position += 1
    return position


def _sharded_program(
    actions: tuple[Action, ...],
    stages: tuple[int, ...],
    last_grad: dict[int, int],
    max_resident: int,
) -> tuple[Action, ...]:
    """One rank's program with sharded parameters (see the module docstring's reference)."""
    # (stage, position of its first compute) of each maximal run of computes on one stage.
    segments: list[tuple[int, int]] = []
    uses: dict[int, list[int]] = {stage: [] for stage in stages}  # segment indices per stage
    last_use: dict[int, int] = {}  # each stage's last compute
    for position, action in enumerate(actions):
        if action.kind in COMPUTE_KINDS:
            if not segments or action.stage != segments[-1][0]:
                uses[action.stage].append(len(segments))
                segments.append((action.stage, position))
            last_use[action.stage] = position
    inserts: dict[int, list[Action]] = {}  # before each position; a chunk's GS / RL first
    marks: list[tuple[int, list[Action]]] = [
        (position, [unchecked_action(stage, K.GRAD_SYNC)])
        for stage, position in _run_ends(actions)
        if position != last_grad[stage]
    ]
    for stage in stages:  # GS and RL after the last backward (and its gradient send)
        done = [unchecked_action(stage, K.GRAD_SYNC), unchecked_action(stage, K.RELEASE)]
        position = last_grad[stage]
        if position < 0:  # no backward on this rank (forward only): release after its last use
            position, done = last_use.get(stage, -1), done[1:]
        if position >= 0:
            marks.append((position, done))
    for position, done in sorted(marks, key=lambda mark: mark[0]):
        inserts.setdefault(_past_sends(actions, position) + 1, []).extend(done)

    def next_use(stage: int, index: int) -> int:
        later = uses[stage]
        found = bisect_right(later, index)
        return later[found] if found < len(later) else len(segments)

    gathered: list[int] = []
    for index, (stage, start) in enumerate(segments):
        inserted = inserts.setdefault(start, [])
        # A chunk past its last use was released after its last backward (above).
        gathered = [s for s in gathered if uses[s][-1] >= index]
        wanted = [stage]
        if max_resident >= 2 and index + 1 < len(segments):
            wanted.append(segments[index + 1][0])  # prefetch: overlap this segment's compute
        for want in wanted:
            if want in gathered:
                continue
            keep = stage if want != stage else -1  # never release the chunk about to compute
            while len(gathered) >= max_resident:
                victim = max((s for s in gathered if s != keep), key=lambda s: next_use(s, index))
                gathered.remove(victim)
                inserted.append(unchecked_action(victim, K.RELEASE))
            gathered.append(want)
            inserted.append(unchecked_action(want, K.PARAM_SYNC))
    return _spliced(actions, inserts)


def _run_ends(actions: tuple[Action, ...]) -> list[tuple[int, int]]:
    """(stage, position) of the last B or W of each maximal run of one stage's backward work
    (B, I, W; other compute ends a run, messages do not): where that run's gradients are reduced."""
    ends: list[tuple[int, int]] = []
    stage, last = -1, -1  # the current run's stage, and its last B / W so far (-1: none)
    for position, action in enumerate(actions):
        kind = action.kind
        if kind not in COMPUTE_KINDS:
            continue
        backward = kind in _BACKWARD_KINDS
        if not backward or action.stage != stage:  # this compute ends the run under way
            if last >= 0:
                ends.append((stage, last))
            stage, last = action.stage if backward else -1, -1
        if backward and kind is not K.BACKWARD_INPUT:
            last = position
    if last >= 0:
        ends.append((stage, last))
    return ends
