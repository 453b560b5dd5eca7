"""BPipe eviction pass: memory caps, pairing, placement, and that the lowered result still runs."""

from __future__ import annotations

from collections import Counter

import pytest

from megatron_bfpp.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    StageLayout,
    parse_schedule,
)
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.eviction import add_eviction, bpipe_max_stored
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.schedules.registry import build_schedule
from megatron_bfpp.validate import validate_schedule
from tests.growth import growth, python_lines

K = ActionKind
TRANSFERS = (K.EVICT, K.ACCEPT, K.RESTORE, K.LOAD)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Compute-only 1F1B: rank r warms up with min(p - r - 1, m) forwards, alternates F and B,
    then drains the remaining backwards."""
    programs = []
    for rank in range(num_ranks):
        warmup = min(num_ranks - rank - 1, num_microbatches)
        program = [Action(rank, K.FORWARD, mb) for mb in range(warmup)]
        for mb in range(num_microbatches - warmup):
            program += [Action(rank, K.FORWARD, warmup + mb), Action(rank, K.BACKWARD, mb)]
        program += [
            Action(rank, K.BACKWARD, mb)
            for mb in range(num_microbatches - warmup, num_microbatches)
        ]
        programs.append(program)
    return Schedule(StageLayout.looped(num_ranks, 1), num_microbatches, tuple(map(tuple, programs)))


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    programs = [
        [Action(r, K.FORWARD, mb) for mb in range(num_microbatches)]
        + [Action(r, K.BACKWARD, mb) for mb in range(num_microbatches)]
        for r in range(num_ranks)
    ]
    return Schedule(StageLayout.looped(num_ranks, 1), num_microbatches, tuple(map(tuple, programs)))


def lowered_and_validated(schedule: Schedule) -> Schedule:
    lowered = add_communication(schedule)
    validate_schedule(lowered)
    return lowered


def without_transfers(actions: tuple[Action, ...]) -> tuple[Action, ...]:
    return tuple(a for a in actions if a.kind not in TRANSFERS)


def microbatch_counts(p: int) -> list[int]:
    return sorted({m for m in (1, 2, 3, p - 1, p, p + 1, 2 * p + 1, 37, 64) if m >= 1})


CASES = [(p, m) for p in range(2, 17) for m in microbatch_counts(p)]


# --- the literal case --------------------------------------------------------------------------

P4_M6 = [
    "0F0 0F1 0F2 0EV2>3 0F3 0B0 0F4 0B1 0EV4>3 0LD2<3 0F5 0B2 0LD4<3 0B3 0B4 0B5",
    "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5",
    "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5",
    "0AC2<0 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 0RS2>0 0AC4<0 3F4 3B4 0RS4>0 3F5 3B5",
]


def test_p4_m6_exact_placement() -> None:
    """Rank 0 (cap 3) evicts 2 before F3 would make it 4, then evicts 4 (backward latest) to
    load 2 ahead of F5, and loads 4 ahead of B3 once B2 frees a slot. Rank 3 accepts at the
    time each evict is sent and restores when rank 0 posts the load, RS before AC on a tie."""
    expected = parse_schedule(P4_M6, layout=StageLayout.looped(4, 1), num_microbatches=6)
    result = add_eviction(one_f_one_b(4, 6))
    assert [" ".join(map(str, row)) for row in result.per_rank] == P4_M6
    assert result == expected
    assert result.peak_activations() == (3.0, 3.0, 2.0, 2.0)
    assert result.stored_activations(0) == (1, 2, 3, 2, 3, 2, 3, 2, 1, 2, 3, 2, 3, 2, 1, 0)
    lowered_and_validated(result)


# --- memory bounds -----------------------------------------------------------------------------


def test_builder_is_1f1b() -> None:
    for p in range(1, 17):
        for m in (1, p, 3 * p):
            base = one_f_one_b(p, m)
            validate_schedule(base, require_communication=False)
            assert base.peak_activations() == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize("p", range(2, 17))
def test_every_rank_within_bpipe_cap_for_all_microbatch_counts(p: int) -> None:
    """The acceptor bound, exhaustively: own + accepted never exceeds ceil((p + 2) / 2)."""
    cap = bpipe_max_stored(p)
    assert cap == -(-(p + 2) // 2)
    for m in range(1, 65):
        result = add_eviction(one_f_one_b(p, m))
        peaks = result.peak_activations()
        assert max(peaks) <= cap, (p, m, peaks)
        assert peaks[0] == min(p, m, cap)


@pytest.mark.parametrize(("p", "m"), CASES)
def test_bpipe_pairs_and_lowering(p: int, m: int) -> None:
    base = one_f_one_b(p, m)
    result = add_eviction(base)
    cap = bpipe_max_stored(p)
    evictors = range(p // 2)
    # Compute order untouched everywhere; non-evictor ranks gain only AC/RS.
    for rank in range(p):
        assert without_transfers(result.per_rank[rank]) == base.per_rank[rank]
        kinds = {a.kind for a in result.per_rank[rank] if a.kind in TRANSFERS}
        if rank in evictors:
            assert kinds <= {K.EVICT, K.LOAD}
        else:
            assert kinds <= {K.ACCEPT, K.RESTORE}
    # Every EV(x, mb) on rank x goes to rank p-1-x and comes back exactly once.
    seen: Counter[tuple[ActionKind, int, int, int, int]] = Counter()
    for rank, _, action in result.iter_actions():
        if action.kind in TRANSFERS:
            assert action.microbatch is not None and action.peer is not None
            seen[(action.kind, rank, action.peer, action.stage, action.microbatch)] += 1
    evicts = [key for key in seen if key[0] == K.EVICT]
    for _, rank, peer, stage, mb in evicts:
        assert rank == stage < p // 2 and peer == p - 1 - rank
        assert seen[(K.LOAD, rank, peer, stage, mb)] == 1
        assert seen[(K.ACCEPT, peer, rank, stage, mb)] == 1
        assert seen[(K.RESTORE, peer, rank, stage, mb)] == 1
    assert sum(seen.values()) == 4 * len(evicts)
    assert all(count == 1 for count in seen.values())
    # Memory: every rank within the cap; evictions happen exactly where 1F1B exceeded it.
    for rank, (before, after) in enumerate(
        zip(base.peak_activations(), result.peak_activations(), strict=True)
    ):
        assert after <= cap
        if rank in evictors:
            assert (before > cap) == any(k[0] == K.EVICT and k[1] == rank for k in evicts)
    if max(base.peak_activations()) <= cap:
        assert result is base
    # Lowering keeps the transfers where they are (no receive hoisted past them) and runs.
    lowered = lowered_and_validated(result)
    for rank in range(p):
        assert max(lowered.stored_activations(rank)) == result.peak_activations()[rank]
        assert [a for a in lowered.per_rank[rank] if a.kind in TRANSFERS] == [
            a for a in result.per_rank[rank] if a.kind in TRANSFERS
        ]
    validate_schedule(add_grad_sync(lowered))


@pytest.mark.parametrize(("p", "m"), [(4, 6), (5, 20), (8, 32), (16, 64), (13, 40)])
def test_belady_victims_and_early_loads(p: int, m: int) -> None:
    """EV takes the resident micro-batch whose backward is last; an LD sits one compute action
    ahead of its backward unless that slot would break the cap."""
    cap = bpipe_max_stored(p)
    result = add_eviction(one_f_one_b(p, m))
    for rank in range(p // 2):
        program = result.per_rank[rank]
        stored = result.stored_activations(rank)
        backward_at = {a.microbatch: i for i, a in enumerate(program) if a.kind == K.BACKWARD}
        resident: set[int | None] = set()
        for position, action in enumerate(program):
            if action.kind == K.EVICT:
                assert backward_at[action.microbatch] == max(backward_at[r] for r in resident)
                nxt = next(a for a in program[position:] if a.kind.is_compute)
                assert stored[position - 1] == cap or nxt.kind == K.FORWARD
            if action.kind == K.LOAD:
                backward = backward_at[action.microbatch]
                between = [a for a in program[position:backward] if a.kind.is_compute]
                assert len(between) <= 1
                if not between:
                    # Not early: the slot before the previous compute action was full.
                    previous = max(i for i in range(position) if program[i].kind.is_compute)
                    assert program[previous].kind == K.BACKWARD
                    assert stored[previous - 1] == cap
            if action.kind in (K.FORWARD, K.LOAD):
                resident.add(action.microbatch)
            elif action.kind in (K.BACKWARD, K.EVICT):
                resident.discard(action.microbatch)


def unit_time_compute_ends(schedule: Schedule) -> list[list[int]]:
    """F = 1, B = 2, transfers free; RS waits for its EV, B for its RS when it was evicted."""
    done: dict[tuple[ActionKind, int, int], int] = {}
    ends: list[list[int]] = [[] for _ in schedule.per_rank]
    clock = [0] * schedule.num_ranks
    last = schedule.num_stages - 1
    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(schedule.per_rank):
            while len(ends[rank]) < len(program):
                action = program[len(ends[rank])]
                stage, mb = action.stage, action.microbatch
                assert mb is not None
                needs = []
                if action.kind == K.FORWARD and stage > 0:
                    needs.append((K.FORWARD, stage - 1, mb))
                if action.kind == K.BACKWARD and stage < last:
                    needs.append((K.BACKWARD, stage + 1, mb))
                if action.kind == K.BACKWARD and (K.LOAD, stage, mb) in done:
                    needs.append((K.RESTORE, stage, mb))
                if action.kind == K.RESTORE:
                    needs.append((K.EVICT, stage, mb))
                if any(need not in done for need in needs):
                    break
                start = max([clock[rank], *(done[need] for need in needs)])
                clock[rank] = start + {K.FORWARD: 1, K.BACKWARD: 2}.get(action.kind, 0)
                done[(action.kind, stage, mb)] = clock[rank]
                ends[rank].append(clock[rank])
                progress = True
    return [
        [end for action, end in zip(program, ends[rank], strict=True) if action.kind.is_compute]
        for rank, program in enumerate(schedule.per_rank)
    ]


@pytest.mark.parametrize(("p", "m"), [(4, 6), (4, 64), (7, 3), (8, 32), (11, 23), (16, 64)])
def test_acceptor_never_stalls_in_unit_time(p: int, m: int) -> None:
    """With instant transfers every compute action ends exactly when it did without BPipe: no
    RS waits for an evict that is not yet sent, no backward for a load not yet restored."""
    base = one_f_one_b(p, m)
    assert unit_time_compute_ends(add_eviction(base)) == unit_time_compute_ends(base)


# --- trivial cases and custom caps -------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), [(1, 1), (1, 8), (2, 64), (3, 64), (4, 2), (8, 5), (16, 9)])
def test_nothing_to_evict_returns_input(p: int, m: int) -> None:
    base = one_f_one_b(p, m)
    assert add_eviction(base) is base


@pytest.mark.parametrize("m", [7, 8, 16, 64])
def test_custom_cap_two_for_p8(m: int) -> None:
    """Evictors keep at most 2; the acceptors take the rest, never more than 1F1B's rank 0."""
    base = one_f_one_b(8, m)
    result = add_eviction(base, max_stored=2)
    peaks = result.peak_activations()
    assert peaks[:4] == (2.0, 2.0, 2.0, 2.0)
    assert max(peaks[4:]) <= min(8, m)
    assert all(
        without_transfers(r) == b for r, b in zip(result.per_rank, base.per_rank, strict=True)
    )
    # Ranks 3 and 4 are neighbours: evicts share the channel with activations and gradients.
    assert any(a.kind == K.EVICT and a.peer == 4 for a in result.per_rank[3])
    lowered = lowered_and_validated(result)
    assert lowered.peak_activations() == peaks


def test_every_cap_from_two_up_runs_when_accepted() -> None:
    for p in (3, 4, 5, 8, 9):
        for m in (p, 2 * p + 3, 40):
            for cap in range(2, bpipe_max_stored(p) + 2):
                try:
                    result = add_eviction(one_f_one_b(p, m), max_stored=cap)
                except ScheduleError as error:
                    assert "max_stored" in str(error) and "works" in str(error)
                    continue
                assert max(result.peak_activations()[: p // 2]) <= cap
                lowered_and_validated(result)


# --- bad inputs --------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [1, 0, -3])
def test_cap_below_two_is_rejected(cap: int) -> None:
    with pytest.raises(ScheduleError, match=r"max_stored=2 or more .*default for p=4 is 3"):
        add_eviction(one_f_one_b(4, 8), max_stored=cap)


def test_cap_the_acceptor_cannot_absorb_is_rejected() -> None:
    with pytest.raises(ScheduleError, match=r"acceptor rank 4 .* max_stored=4 works"):
        add_eviction(one_f_one_b(8, 4), max_stored=2)
    # GPipe stores every micro-batch everywhere: no partner has room.
    with pytest.raises(ScheduleError, match=r"below what this schedule can balance"):
        add_eviction(gpipe(4, 8))


def test_multi_chunk_layouts_are_rejected() -> None:
    interleaved = Schedule(
        StageLayout.looped(2, 2),
        1,
        ((Action(0, K.FORWARD, 0), Action(2, K.FORWARD, 0)), (Action(1, K.FORWARD, 0),)),
    )
    with pytest.raises(ScheduleError, match=r"StageLayout.looped\(p, 1\).*2 chunks per rank"):
        add_eviction(interleaved)
    v_shape = Schedule(StageLayout.v_shape(2), 1, ((), ()))
    with pytest.raises(ScheduleError, match="v-shape layout"):
        add_eviction(v_shape)


def test_lowered_or_already_evicted_schedules_are_rejected() -> None:
    with pytest.raises(ScheduleError, match="before add_communication"):
        add_eviction(add_communication(one_f_one_b(4, 8)))
    with pytest.raises(ScheduleError, match="apply the pass once"):
        add_eviction(add_eviction(one_f_one_b(4, 8)))
    with pytest.raises(ScheduleError, match="after add_eviction"):
        add_eviction(add_grad_sync(one_f_one_b(4, 8)))
    split = one_f_one_b(2, 1).with_programs(
        [
            [
                Action(0, K.FORWARD, 0),
                Action(0, K.BACKWARD_INPUT, 0),
                Action(0, K.BACKWARD_WEIGHT, 0),
            ],
            [Action(1, K.FORWARD, 0), Action(1, K.BACKWARD, 0)],
        ]
    )
    with pytest.raises(ScheduleError, match=r"got I, W: use full backwards"):
        add_eviction(split)


def test_misplaced_or_stuck_programs_are_rejected() -> None:
    base = one_f_one_b(4, 6)
    swapped = base.with_programs([base.per_rank[1], base.per_rank[0], *base.per_rank[2:]])
    with pytest.raises(ScheduleError, match="validate_schedule"):
        add_eviction(swapped)
    backwards_first = base.with_programs([reversed(base.per_rank[0]), *base.per_rank[1:]])
    with pytest.raises(ScheduleError, match="validate_schedule"):
        add_eviction(backwards_first)


# --- speed -------------------------------------------------------------------------------------


def test_large_pipeline_is_linear_in_the_microbatches() -> None:
    """Doubling the micro-batches at most doubles the lines add_eviction runs (a scan of the
    stored micro-batches per action would be 4x); p=64, m=1024 keeps the cap."""
    bases = {m: one_f_one_b(16, m) for m in (64, 128)}
    assert growth(python_lines, lambda m: add_eviction(bases[m]), 64) < 2.3
    result = add_eviction(one_f_one_b(64, 1024))
    assert max(result.peak_activations()) == bpipe_max_stored(64)


# --- what the runtime needs from the order of transfers ----------------------------------------


def _move_accept_late(schedule: Schedule, acceptor: int) -> Schedule:
    """The acceptor's first AC moved to just before its matching RS."""
    program = list(schedule.per_rank[acceptor])
    index = next(i for i, a in enumerate(program) if a.kind is ActionKind.ACCEPT)
    accept = program.pop(index)
    restore = next(
        i
        for i, a in enumerate(program)
        if a.kind is ActionKind.RESTORE and a.microbatch == accept.microbatch
    )
    program.insert(restore, accept)
    programs = [list(p) for p in schedule.per_rank]
    programs[acceptor] = program
    return schedule.with_programs(programs)


def test_compute_after_an_evict_waits_for_the_partners_accept() -> None:
    """The runtime releases an evicted payload after the next compute, once the acceptor posted
    its receive (gloo sends are only known done once waited for): an AC placed after work that
    depends on the evictor's next forward deadlocks, and the validator must say so."""
    schedule = build_schedule("bpipe", num_ranks=4, num_microbatches=8)
    validate_schedule(schedule)
    late = _move_accept_late(schedule, acceptor=3)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(late)


def test_cap_errors_name_the_flag_that_set_the_cap() -> None:
    """What bfpp-train, Megatron-LM and bfpp-sim print: their own flag, not the pass's name."""
    from megatron_bfpp.schedules.registry import build_schedule, in_flag_terms

    with pytest.raises(ScheduleError) as info:
        build_schedule("bpipe", num_ranks=4, num_microbatches=8, max_stored=1)
    message = str(info.value).splitlines()[0]
    train = in_flag_terms(message, "bpipe")
    assert train.startswith("--bpipe-max-stored 1 leaves no room"), train
    assert "use --bpipe-max-stored 2 or more" in train and "add_eviction" not in train
    sim = in_flag_terms(message, "bpipe", sim=True)
    assert sim.startswith("--max-stored 1 leaves no room") and "--max-stored 2 or more" in sim
    assert in_flag_terms("rank 3: max_stored=1", "1f1b") == "rank 3: max_stored=1"
