"""V-shape schedules with controllable activation memory (Qi et al., NeurIPS 2024): rank r holds
stages r and 2p-1-r, one early and one late in a micro-batch's life, so memory balances across
ranks, and the order of its split backwards (I, W) sets the peak. Compute-only (F, I, W); the
constructions and bounds: docs/architecture.md, "Generator bounds and measured figures"."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from megatron_bfpp.ir import ActionKind, Schedule, StageLayout, paused_gc, unchecked_action
from megatron_bfpp.schedules.common import check_counts, make_schedule

__all__ = ["build_v_half", "build_v_min", "build_v_zb"]

# Compact action tuples while planning: (kind, stage, micro-batch); Actions are built once, last.
_F, _I, _W = 0, 1, 2
_KINDS = (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
_Step = tuple[int, int, int]

# Slots per micro-batch in a building block: each rank runs 2 F, 2 I and 2 W per micro-batch.
_PERIOD = 6


@paused_gc()
def build_v_min(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Min: about a third of 1F1B's activation memory (floor((p + 4) / 3) units on the busiest
    rank for m >= p), paid for with more bubble than v-half; ``_block_programs``."""
    check_counts("v-min", num_ranks=num_ranks, num_microbatches=num_microbatches)
    return _make("v-min", num_ranks, num_microbatches, _block_programs(num_ranks, num_microbatches))


@paused_gc()
def build_v_half(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Half: half of 1F1B's activation memory and about half its bubble: greedy under p + 2 held
    activations per rank (2 for p = 1: never more than 1F1B), rank r keeping at most p - r + 1
    micro-batches between its chunks (in flight down the V and back: more starves chunk 1)."""
    check_counts("v-half", num_ranks=num_ranks, num_microbatches=num_microbatches)
    p = num_ranks
    programs = _greedy_programs(p, num_microbatches, memory_limit=min(p + 2, 2 * p))
    return _make("v-half", num_ranks, num_microbatches, programs)


@paused_gc()
def build_v_zb(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """V-ZB: zero bubble at 1F1B's activation memory (2p held activations = p units): the ZB-V
    order, replayed by ``_input_gradients_first`` below m = (3p - 1) / 2 to reach the
    pipeline-fill floor; the greedy for m < p, where the limit never binds and it is shorter."""
    check_counts("v-zb", num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m_count = num_ranks, num_microbatches
    if m_count < p:
        programs = _greedy_programs(p, m_count, memory_limit=2 * p)
    elif 2 * m_count < 3 * p - 1:
        programs = _input_gradients_first(p, _zb_programs(p, m_count))
    else:
        programs = _zb_programs(p, m_count)
    return _make("v-zb", p, m_count, programs)


def _make(
    name: str, num_ranks: int, num_microbatches: int, programs: list[list[_Step]]
) -> Schedule:
    actions = (
        [unchecked_action(stage, _KINDS[kind], mb) for kind, stage, mb in program]
        for program in programs
    )
    return make_schedule(name, StageLayout.v_shape(num_ranks), num_microbatches, actions)


def _block_programs(num_ranks: int, num_microbatches: int) -> list[list[_Step]]:
    """Program order of the repeated V-Min building block: micro-batch k's F and I at slot 6k + an
    offset (every dependency earlier: no deadlock), each W in the next free slot after its I."""
    p, m_count = num_ranks, num_microbatches
    last_stage = 2 * p - 1
    d = 0 if p % 3 else 2
    programs: list[list[_Step]] = []
    for r in range(p):
        chunk0, chunk1 = r, last_stage - r
        offsets = (
            (r, _F, chunk0),
            (2 * p - 1 - r, _F, chunk1),
            (2 * p + d + r, _I, chunk1),
            (4 * p + d - 1 - r, _I, chunk0),
        )
        horizon = _PERIOD * (m_count - 1) + max(o for o, _, _ in offsets) + 1
        slots: list[_Step | None] = [None] * horizon
        for offset, kind, stage in offsets:  # distinct residues mod 6 (d): no slot taken twice
            end = offset + _PERIOD * m_count
            slots[offset:end:_PERIOD] = [(kind, stage, mb) for mb in range(m_count)]
        program: list[_Step] = []
        waiting: deque[tuple[int, int]] = deque()  # input gradients done, weight gradient not
        for step in slots:
            if step is not None:
                program.append(step)
                if step[0] == _I:
                    waiting.append((step[1], step[2]))
            elif waiting:
                stage, mb = waiting.popleft()
                program.append((_W, stage, mb))
        program.extend((_W, stage, mb) for stage, mb in waiting)
        programs.append(program)
    return programs


def _zb_programs(num_ranks: int, num_microbatches: int) -> list[list[_Step]]:
    """Every rank's ZB-V order (Qi et al., ICLR 2024, section 6), phase by phase, for 2p - 1 or more
    micro-batches; fewer are skipped (no dependency crosses micro-batches)."""
    p, m_count = num_ranks, num_microbatches
    n = max(m_count, 2 * p - 1)
    fa, fb, ia, ib, wa, wb = range(6)  # 2 * kind + chunk
    programs: list[list[_Step]] = []
    for r in range(p):
        phases = (
            ((fa,), 2 * (p - r) - 1),
            ((fb, fa), r),
            ((fb, ib, wb), p - r),
            ((fa, ia, wa, fb, ib, wb), n - (2 * p - 1 - r)),
            ((ia, wa, fb, ib, wb), p - 1 - r),
            ((ia, ib), r),
            ((ia, wa), p - r),
            ((wb,), r),
            ((wa,), r),
        )
        stage_of = (r, 2 * p - 1 - r)
        step_of = [(token >> 1, stage_of[token & 1]) for token in range(6)]
        next_mb = [0] * 6
        program: list[_Step] = []
        for group, times in phases:
            useful = max(0, min(times, max(m_count - next_mb[token] for token in group)))
            for _ in range(useful):
                for token in group:
                    mb = next_mb[token]
                    next_mb[token] = mb + 1
                    if mb < m_count:
                        kind, stage = step_of[token]
                        program.append((kind, stage, mb))
            for token in group:
                next_mb[token] += times - useful
        programs.append(program)
    return programs


def _input_gradients_first(num_ranks: int, programs: list[list[_Step]]) -> list[list[_Step]]:
    """Replay ``programs`` in unit time steps, every F in its place, between two F's the first ready
    I before any ready W: an input gradient (critical path) never waits behind a weight gradient."""
    p, last = num_ranks, 2 * num_ranks - 1
    m_count = 1 + max((mb for program in programs for _, _, mb in program), default=0)
    never = 1 << 62
    f_time = [never] * (2 * p * m_count)  # step an F ran, at index stage * m_count + mb
    i_time = [never] * (2 * p * m_count)
    replayed: list[list[_Step]] = [[] for _ in range(p)]
    # Per rank: its I's and W's listed before its next F and not run yet, in listed order.
    window: list[list[_Step]] = [[] for _ in range(p)]
    # Each program's first action neither run nor in the window (an F).
    position = [_fill_window(programs[r], 0, window[r]) for r in range(p)]
    remaining, step = sum(len(program) for program in programs), 0

    def ready(action: _Step) -> bool:  # an I or W of a window, at this step
        kind, stage, mb = action
        if kind == _I:
            return stage == last or i_time[(stage + 1) * m_count + mb] < step
        return i_time[stage * m_count + mb] < step

    while remaining:
        acted = False
        for r in range(p):
            pending = window[r]
            if pending:
                pick = _first_ready(pending, ready)
                if pick < 0:
                    continue
                action = pending.pop(pick)
                if action[0] == _I:
                    i_time[action[1] * m_count + action[2]] = step
            else:
                program, at = programs[r], position[r]
                if at == len(program):
                    continue
                action = program[at]  # an F
                stage, mb = action[1], action[2]
                if stage and f_time[(stage - 1) * m_count + mb] >= step:
                    continue
                f_time[stage * m_count + mb] = step
                position[r] = _fill_window(program, at + 1, pending)
            replayed[r].append(action)
            remaining -= 1
            acted = True
        if not acted:  # pragma: no cover - deadlock-free programs (docs/architecture.md)
            raise RuntimeError("v-shape replay made no progress: the program order deadlocks")
        step += 1
    return replayed


def _first_ready(window: list[_Step], ready: Callable[[_Step], bool]) -> int:
    """Index of the first ready I in ``window``, else of the first ready W, or -1."""
    for kind in (_I, _W):
        for index, action in enumerate(window):
            if action[0] == kind and ready(action):
                return index
    return -1


def _fill_window(program: list[_Step], start: int, window: list[_Step]) -> int:
    """Append ``program``'s I / W from ``start`` until its next F to ``window``: that F's index."""
    at = start
    while at < len(program) and program[at][0] != _F:
        window.append(program[at])
        at += 1
    return at


def _greedy_programs(
    num_ranks: int, num_microbatches: int, *, memory_limit: int, open_limits: Sequence[int] = ()
) -> list[list[_Step]]:
    """List-schedule F, I and W in unit time steps under ``memory_limit`` held activations per
    rank and ``open_limits[r]`` (default p - r + 1) micro-batches between rank r's chunks: each
    step a ready I (it unblocks upstream), else a ready F that fits, else the oldest pending W."""
    p, m_count = num_ranks, num_microbatches
    open_limits = open_limits or [p - r + 1 for r in range(p)]
    num_stages = 2 * p
    last, never = num_stages - 1, 1 << 62
    f_time = [never] * (num_stages * m_count)  # step F ran, at index stage * m_count + mb
    i_time = [never] * (num_stages * m_count)
    next_f, next_i = [0] * num_stages, [0] * num_stages
    held = [0] * p
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
    programs: list[list[_Step]] = [[] for _ in range(p)]
    remaining, step = 3 * num_stages * m_count, 0
    while remaining:
        acted = False
        for r in range(p):
            chunk0, chunk1 = r, last - r
            # 1. input gradients, chunk 0's first: it is always the older micro-batch, since
            # I(chunk0, m) needs I(chunk1, m) first; 2. forwards, chunk 1's first (the older).
            if (mb := next_i[chunk0]) < next_f[chunk0] and (
                i_time[(chunk0 + 1) * m_count + mb] < step
            ):
                kind, stage = _I, chunk0
            elif (mb := next_i[chunk1]) < next_f[chunk1] and (
                chunk1 == last or i_time[(chunk1 + 1) * m_count + mb] < step
            ):
                kind, stage = _I, chunk1
            elif (
                (mb := next_f[chunk1]) < m_count
                and held[r] + 1 <= memory_limit
                and f_time[(chunk1 - 1) * m_count + mb] < step
            ):
                kind, stage = _F, chunk1
            elif (
                (mb := next_f[chunk0]) < m_count
                and held[r] + 2 <= memory_limit
                and mb - next_f[chunk1] < open_limits[r]
                and (chunk0 == 0 or f_time[(chunk0 - 1) * m_count + mb] < step)
            ):
                kind, stage = _F, chunk0
            elif pending_w[r]:  # 3. weight gradients
                kind, (stage, mb) = _W, pending_w[r].popleft()
                held[r] -= 1
            else:
                continue
            if kind == _I:
                i_time[stage * m_count + mb] = step
                next_i[stage] = mb + 1
                pending_w[r].append((stage, mb))
            elif kind == _F:
                f_time[stage * m_count + mb] = step
                next_f[stage] = mb + 1
                held[r] += 1
            programs[r].append((kind, stage, mb))
            remaining -= 1
            acted = True
        if not acted and remaining:  # a limit below one micro-batch's need
            mb, stage, r = _oldest_ready_forward(p, m_count, step, f_time, next_f)
            f_time[stage * m_count + mb] = step
            next_f[stage] = mb + 1
            held[r] += 1
            programs[r].append((_F, stage, mb))
            remaining -= 1
        step += 1
    return programs


def _oldest_ready_forward(
    p: int, m_count: int, step: int, f_time: list[int], next_f: list[int]
) -> tuple[int, int, int]:
    """(micro-batch, stage, rank) of the oldest micro-batch's ready F, run over the memory limit."""
    ready = [
        (mb, stage, r)
        for r in range(p)
        for stage in (2 * p - 1 - r, r)
        if (mb := next_f[stage]) < m_count
        and (stage == 0 or f_time[(stage - 1) * m_count + mb] < step)
    ]
    if not ready:  # pragma: no cover - the oldest micro-batch always has a ready F here
        raise RuntimeError("v-shape greedy scheduler made no progress")
    return min(ready)
