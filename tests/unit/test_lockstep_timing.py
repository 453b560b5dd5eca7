"""The lock-step timing model (``nccl.time_posting``, ``simulate``'s default) against gloo's
rules, on schedules small enough to work out by hand, and over the catalogue.

Every case below is GPipe on 2 ranks with 2 micro-batches (F = 1, B = 2) and a message time of
3, where gloo's rules give 18 (tests/unit/test_sim.py works that out). The posting is written
out per rank: an int is a program position (a compute), a list one batch of positions.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pytest

from megatron_bfpp.ir import ActionKind, Schedule, ScheduleError, StageLayout, parse_schedule
from megatron_bfpp.nccl import (
    Batch,
    Item,
    Posting,
    check_posting,
    lockstep_posting,
    time_posting,
    written_posting,
)
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.schedules.registry import build_schedule, forward_only_schedule
from megatron_bfpp.semantics import Timing
from megatron_bfpp.sim import CostModel, simulate
from tests.unit.test_nccl import _build, _catalogue

LOOPED2 = StageLayout.looped(2)
# positions:    0   1      2   3      4      5   6      7
GPIPE = parse_schedule(
    [
        "0F0 0SA0>1 0F1 0SA1>1 0RG0<1 0B0 0RG1<1 0B1",
        "1RA0<0 1F0 1RA1<0 1F1 1B0 1SG0>0 1B1 1SG1>0",
    ],
    layout=LOOPED2,
    num_microbatches=2,
)
SLOW_LINK = Timing(forward=1, backward=2, p2p=3)
RUNTIME_ROWS = [[0, [1], 2, [3], [4], 5, [6], 7], [[0], 1, [2], 3, 4, [5], 6, [7]]]


def _posting(
    rows: list[list[Any]],
    blocking: Collection[tuple[int, int]] = (),
    pairwise: Collection[tuple[int, int]] = (),
) -> Posting:
    """A literal posting; ``blocking`` / ``pairwise``: the first positions of the batches
    that are so."""
    return Posting(
        "by hand",
        tuple(
            tuple(
                Batch(
                    -1,
                    tuple(Item(p) for p in step),
                    blocking=(rank, step[0]) in blocking,
                    pairwise=(rank, step[0]) in pairwise,
                )
                if isinstance(step, list)
                else step
                for step in row
            )
            for rank, row in enumerate(rows)
        ),
    )


def _computes(events: Any, rank: int) -> list[tuple[str, float, float]]:
    return [(e.label, e.start, e.end) for e in events if e.rank == rank and e.lane == "compute"]


def test_the_runtime_posting_of_gpipe_is_the_one_worked_out_below() -> None:
    posting = lockstep_posting(GPIPE)
    shape = [
        [s if isinstance(s, int) else [i.position for i in s.items] for s in row]
        for row in posting.per_rank
    ]
    assert shape == RUNTIME_ROWS


def test_a_late_peer_and_a_send_held_behind_its_ranks_earlier_batch() -> None:
    """By hand (message time 3):
    rank 0: F0 [0,1]; its act-0 batch meets rank 1's receive (posted at 0) at 1: done 4.
    rank 0: F1 [1,2]; its act-1 batch queues behind act 0 (4). Rank 1 posts that receive after
      its F0 [4,5], at 5: *a batch waiting for a late peer*, act 1 arrives 8 (gloo: 7).
    rank 1: F1 [8,9], B0 [9,11], posts grad 0 at 11; rank 0's receive (queued behind act 1,
      started 8) meets it at 11: done 14.
    rank 1: B1 [11,13] posts grad 1 at 13, *held behind its grad-0 batch* until 14; rank 0 posts
      that receive after B0 [14,16], at 16: done 19; B1 [19,21]. Step 21 against gloo's 18."""
    run = time_posting(GPIPE, lockstep_posting(GPIPE), SLOW_LINK)
    events = run.events()
    assert _computes(events, 1) == [("1F0", 4, 5), ("1F1", 8, 9), ("1B0", 9, 11), ("1B1", 11, 13)]
    assert _computes(events, 0) == [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 14, 16), ("0B1", 19, 21)]
    assert run.clock == [21, 19]  # rank 1 ends when its last batch (grad 1) is done
    batches = sorted((e.rank, e.label, e.start, e.end) for e in events if e.lane == "p2p")
    assert (1, "1SG1>0", 16, 19) in batches  # both halves started at 16 (not 13, nor 14)
    costs = CostModel(t_p2p=3.0)
    assert simulate(GPIPE, costs).step_time == 21
    assert simulate(GPIPE, costs, p2p="gloo").step_time == 18
    assert simulate(GPIPE, costs).p2p_model == "lockstep"
    assert simulate(GPIPE, costs).to_dict()["p2p_model"] == "lockstep"


def test_a_blocking_batch_holds_the_cpu_until_it_completes() -> None:
    """Rank 0's act-0 batch blocking: its CPU waits for it (done 4) before F1, so F1 runs
    [4,5] instead of [1,2]; act 1 is then posted at 5, when rank 1 posts its receive too (done
    8, as before), and the rest of the step is unchanged: 21."""
    blocking = _posting(RUNTIME_ROWS, blocking={(0, 1)})
    run = time_posting(GPIPE, blocking, SLOW_LINK)
    assert _computes(run.events(), 0)[:2] == [("0F0", 0, 1), ("0F1", 4, 5)]
    assert max(run.clock) == 21
    plain = time_posting(GPIPE, _posting(RUNTIME_ROWS), SLOW_LINK)
    assert _computes(plain.events(), 0)[:2] == [("0F0", 0, 1), ("0F1", 1, 2)]


def test_pairwise_ops_overtake_a_group_stream_batch() -> None:
    """Both ranks post act 1 early; rank 0's act-0 batch holds its stream over [1,4].
    Grouped, act 1 queues behind act 0 on both ranks: done 7, rank 1's F1 [7,8], B0 [8,10],
    grad 0 posted 10 meets rank 0's receive (behind act 1 until 7) at 10: done 13; B1 [10,12],
    grad 1 behind grad 0 until 13; rank 0's B0 [13,15], its grad-1 receive at 15: done 18; B1
    [18,20]. Pairwise (isend / irecv on each pair's stream), act 1 starts at 2 on rank 0 (posted
    after F1) and at 0 on rank 1: done 5; F1 [5,6], B0 [6,8], grad 0 done 11, B1 [8,10], grad 1
    from 11 until rank 0 posts its receive after B0 [11,13]: done 16; B1 [16,18]."""
    rows = [[0, [1], 2, [3], [4], 5, [6], 7], [[0], [2], 1, 3, 4, [5], 6, [7]]]
    grouped = time_posting(GPIPE, _posting(rows), SLOW_LINK)
    assert _computes(grouped.events(), 1)[1] == ("1F1", 7, 8)
    assert max(grouped.clock) == 20
    pairwise = time_posting(GPIPE, _posting(rows, pairwise={(0, 3), (1, 2)}), SLOW_LINK)
    assert _computes(pairwise.events(), 1)[1] == ("1F1", 5, 6)
    assert _computes(pairwise.events(), 0)[2:] == [("0B0", 11, 13), ("0B1", 16, 18)]
    assert max(pairwise.clock) == 18


def test_a_blocking_batch_can_deadlock_a_posting_that_is_safe_without_it() -> None:
    """Rank 0 posts its grad-0 receive before its act-1 send, which is pairwise (its own
    stream), so act 1 still reaches rank 1 and rank 1 gets to its grad-0 send. Make the grad-0
    receive blocking and rank 0's CPU waits for a send that rank 1 makes only after act 1,
    which rank 0 posts after the wait."""
    rows = [[0, [1], 2, [4], [3], 5, [6], 7], RUNTIME_ROWS[1]]
    check_posting(GPIPE, _posting(rows, pairwise={(0, 3)}))
    time_posting(GPIPE, _posting(rows, pairwise={(0, 3)}), SLOW_LINK)
    with pytest.raises(ScheduleError, match=r"rank 0 waits .* for its batch #1 .*R grad1\.0<1"):
        check_posting(GPIPE, _posting(rows, pairwise={(0, 3)}, blocking={(0, 4)}))
    with pytest.raises(ScheduleError, match="deadlocks on NCCL"):
        time_posting(GPIPE, _posting(rows, pairwise={(0, 3)}, blocking={(0, 4)}))
    with pytest.raises(ScheduleError, match="is queued behind"):  # grouped: FIFO on the rank
        check_posting(GPIPE, _posting(rows))


def test_pairwise_ops_are_first_in_first_out_per_pair() -> None:
    """1F1B posted crossing (rank 0: act 1 then grad 0; rank 1: grad 0 then act 1) deadlocks
    as batches, and pairwise too: both messages go between the same two ranks, so each waits
    on its pair's stream behind the other rank's send. Rank 0 receiving grad 0 first runs."""
    schedule = parse_schedule(
        [
            "0F0 0SA0>1 0F1 0SA1>1 0RG0<1 0B0 0RG1<1 0B1",
            "1RA0<0 1F0 1B0 1SG0>0 1RA1<0 1F1 1B1 1SG1>0",
        ],
        layout=LOOPED2,
        num_microbatches=2,
    )
    crossing = [[0, [1], 2, [3], [4], 5, [6], 7], [[0], 1, 2, [3], [4], 5, 6, [7]]]
    every = {(r, s[0]) for r, row in enumerate(crossing) for s in row if isinstance(s, list)}
    with pytest.raises(ScheduleError, match="deadlocks on NCCL"):
        check_posting(schedule, _posting(crossing, pairwise=every))
    ordered = [[0, [1], 2, [4], [3], 5, [6], 7], crossing[1]]
    check_posting(schedule, _posting(ordered, pairwise=every))


# --- the catalogue ------------------------------------------------------------------------------
COSTS = (CostModel(), CostModel(t_p2p=0.1, t_evict=0.3, t_grad_reduce=0.5, t_param_gather=0.2))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_catalogue_schedule_times_under_lockstep_no_faster_than_gloo(p: int) -> None:
    """Every schedule the catalogue builds (training and forward-only) times without deadlock
    under its lock-step posting, and never faster than under gloo's rules (measured over the
    whole catalogue at pp 2-8 and three cost models before this was asserted: lock-step only
    adds waits there; with free messages it is often equal)."""
    timed = slower = 0
    for case in _catalogue():
        if case[1] != p:
            continue
        schedule = _build(*case)
        if schedule is None:
            continue
        for planned in (schedule, forward_only_schedule(schedule)):
            for costs in COSTS:
                lock = simulate(planned, costs)
                gloo = simulate(planned, costs, p2p="gloo")
                assert lock.step_time >= gloo.step_time - 1e-9, (case, costs)
                slower += lock.step_time > gloo.step_time + 1e-9
                timed += 1
    assert timed > 100
    assert slower > 0  # the models differ somewhere: the property is not vacuous


@pytest.mark.parametrize(
    ("name", "p", "m", "vp", "bound"),
    [
        ("bpipe", 4, 16, None, 1.0),
        ("bpipe", 8, 32, None, 1.04),
        ("interleaved", 8, 32, 2, 1.0),
    ],
)
def test_partners_in_one_tick_do_not_wait_for_each_other(
    name: str, p: int, m: int, vp: int | None, bound: float
) -> None:
    """With free messages the lock-step posting costs BPipe and interleaved (almost) nothing
    over gloo's rules. With every compute one tick it did: BPipe's acceptor waited for its
    partner's evictions in a tick its backward-heavy steady state reached later (63 against
    57 at pp 4 m 16, 140 against 117 at pp 8 m 32, +20%), and interleaved lost 2.5 of 109 at
    pp 8 m 32; in nominal time 57, 121 (+3.4%) and 106.5."""
    schedule = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=vp)
    lock = simulate(schedule).step_time
    gloo = simulate(schedule, p2p="gloo").step_time
    assert gloo <= lock <= bound * gloo


@pytest.mark.parametrize(("p", "slower_before"), [(4, 76), (8, 185)])
def test_a_costly_eviction_holds_no_tick_batch(p: int, slower_before: float) -> None:
    """BPipe's payloads run on the partners' own stream (``Batch.side``), so a transfer of two
    forwards' time delays neither rank's next activations and gradients: with m = 4p and free
    messages otherwise, pp 4 takes 62 (gloo's rules 60) and pp 8 134 (123); on the rank's one
    stream they took ``slower_before``."""
    schedule = build_schedule("bpipe", num_ranks=p, num_microbatches=4 * p)
    costs = CostModel(t_evict=2.0)
    lock = simulate(schedule, costs).step_time
    gloo = simulate(schedule, costs, p2p="gloo").step_time
    assert gloo <= lock <= 1.1 * gloo < slower_before
    posting = lockstep_posting(schedule)
    payloads = {ActionKind.RESTORE, ActionKind.LOAD}
    for rank, program in enumerate(schedule.per_rank):
        for batch in posting.batches(rank):
            kinds = {program[item.position].kind for item in batch.items}
            if batch.side:  # eviction payloads (rest items), restores and their receives
                assert all(i.rest or program[i.position].kind in payloads for i in batch.items)
            else:
                assert not kinds & payloads and not any(i.rest for i in batch.items)


def test_compute_only_schedules_are_timed_as_their_lowered_form() -> None:
    schedule = build_schedule(
        "interleaved", num_ranks=2, num_microbatches=4, num_chunks=2, lower=False
    )
    costs = CostModel(t_p2p=0.2)
    lowered = build_schedule("interleaved", num_ranks=2, num_microbatches=4, num_chunks=2)
    assert simulate(schedule, costs).step_time == simulate(lowered, costs).step_time


def test_an_unknown_model_is_refused_in_one_line() -> None:
    with pytest.raises(ScheduleError, match="unknown p2p timing model 'nccl'; choose one of"):
        simulate(GPIPE, p2p="nccl")


def test_written_postings_time_too() -> None:
    """Any posting of the schedule can be timed (what another executor posts): GPipe as written
    is the runtime's lock-step posting here, so the two agree."""
    schedule: Schedule = GPIPE
    assert time_posting(schedule, written_posting(schedule), SLOW_LINK).clock == [21, 19]


def test_bfpp_sim_says_which_model_produced_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from megatron_bfpp.cli.sim import main

    flags = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--t-p2p", "3"]
    assert main([*flags, "--json"]) == 0
    lockstep = json.loads(capsys.readouterr().out)
    assert main([*flags, "--json", "--p2p-model", "gloo"]) == 0
    gloo = json.loads(capsys.readouterr().out)
    assert (lockstep["p2p_model"], gloo["p2p_model"]) == ("lockstep", "gloo")
    assert lockstep["step_time"] > gloo["step_time"]
    assert main([*flags, "--grid", "none"]) == 0
    assert (
        "p2p timing model: lockstep (the runtime's lock-step NCCL posting"
        in capsys.readouterr().out
    )


def test_megatron_times_megatron_cores_own_posting_of_its_schedules() -> None:
    """``megatron`` times the calls megatron-core posts (native_posting, Megatron-LM's
    settings); it takes only Megatron's own 1f1b / interleaved orders."""
    costs = CostModel(t_p2p=0.5)
    one_f_one_b = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    result = simulate(one_f_one_b, costs, p2p="megatron")
    assert result.p2p_model == "megatron"
    assert result.step_time >= simulate(one_f_one_b, costs, p2p="gloo").step_time
    interleaved = build_schedule("interleaved", num_ranks=4, num_microbatches=8, num_chunks=2)
    # overlapped non-batched p2p: each pair's stream, not the rank's one, so it beats lock-step
    assert (
        simulate(interleaved, costs, p2p="megatron").step_time
        < simulate(interleaved, costs).step_time
    )
    breadth = build_schedule("breadth-first", num_ranks=4, num_microbatches=8, num_chunks=2)
    with pytest.raises(ScheduleError, match="cannot simulate 'breadth-first' under megatron"):
        simulate(breadth, costs, p2p="megatron")


def test_megatron_grad_reduce_moves_each_ranks_end_where_megatron_core_starts_it() -> None:
    """Interleaved pp 4, vp 2, m 8 under ``megatron``, with a data-parallel reduction (T = 50)
    far longer than what follows any chunk's last backward: each rank's two reductions run
    back to back on its lane from the first one's start, so rank r ends 2T after it. With
    Megatron-LM's --overlap-grad-reduce megatron-core starts rank r's chunk 1 after its
    backward 11 + r (chunk 1's last micro-batch is backward 11), so that every rank starts
    about when rank 0 does and the step still ends 2T after rank 0's backward 11; DDP's hooks
    alone start it after backward 11 on every rank (the ranks after 0 end earlier); without
    overlap_grad_reduce both start after the rank's last message and the step ends later."""
    from megatron_bfpp.native_posting import (
        GradSyncOptions,
        megatron_lm_options,
        megatron_posting,
    )

    reduce = 50.0
    costs = CostModel(t_forward=1, t_backward=2, t_p2p=0.25, t_grad_reduce=reduce)
    schedule = build_schedule("interleaved", num_ranks=4, num_microbatches=8, num_chunks=2)

    def backward_end(result: Any, rank: int, k: int) -> float:
        ends = sorted(e.end for e in result.events if e.rank == rank and e.kind.value == "B")
        return float(ends[k])

    aligned = simulate(schedule, costs, p2p="megatron")
    assert aligned.megatron_grad_reduce == "overlap"
    assert aligned.to_dict()["megatron_grad_reduce"] == "overlap"
    hooks = megatron_posting(
        schedule,
        megatron_lm_options(schedule, core_version=(0, 19)),
        GradSyncOptions(overlap_grad_reduce=True),
    )
    by_hooks = simulate(schedule, costs, p2p="megatron", posting=hooks)
    at_end = simulate(schedule, costs, p2p="megatron", megatron_grad_reduce="at-end")
    for r in range(4):
        assert aligned.per_rank[r].end_time == backward_end(aligned, r, 11 + r) + 2 * reduce
        assert by_hooks.per_rank[r].end_time == backward_end(by_hooks, r, 11) + 2 * reduce
        assert at_end.per_rank[r].end_time == at_end.per_rank[r].compute_end + 2 * reduce
        if r:
            assert by_hooks.per_rank[r].end_time < aligned.per_rank[r].end_time
    assert aligned.step_time == by_hooks.step_time == aligned.per_rank[0].end_time
    assert at_end.step_time > aligned.step_time + 1
    # Without reductions where they start takes no time: the same step.
    free = CostModel(t_forward=1, t_backward=2, t_p2p=0.25, t_grad_reduce=0)
    assert simulate(schedule, free, p2p="megatron").step_time == pytest.approx(
        simulate(schedule, free, p2p="megatron", megatron_grad_reduce="at-end").step_time
    )
    with pytest.raises(ScheduleError, match="applies to the megatron p2p models"):
        simulate(schedule, costs, megatron_grad_reduce="at-end")


def test_bfpp_sim_says_where_megatrons_reductions_start(capsys: Any) -> None:
    import json

    from megatron_bfpp.cli.sim import main

    flags = ["--schedule", "interleaved", "--pp", "4", "--vp", "2", "--microbatches", "8"]
    flags += ["--t-grad-reduce", "50", "--json", "--p2p-model", "megatron"]
    assert main(flags) == 0
    overlap = json.loads(capsys.readouterr().out)
    assert main([*flags, "--megatron-grad-reduce", "at-end"]) == 0
    at_end = json.loads(capsys.readouterr().out)
    assert (overlap["megatron_grad_reduce"], at_end["megatron_grad_reduce"]) == (
        "overlap",
        "at-end",
    )
    assert at_end["step_time"] > overlap["step_time"]
    assert main(["--schedule", "1f1b", "--pp", "2", "--megatron-grad-reduce", "at-end"]) == 2
    assert "applies to --p2p-model megatron" in capsys.readouterr().err


@pytest.mark.parametrize("p2p", ["gloo", "lockstep", "megatron"])
def test_host_time_on_1f1b_two_ranks_two_microbatches(p2p: str) -> None:
    """F 1 + 0.5, B 2 + 0.5, free messages. Rank 1: F0 [1.5, 3], B0 [3, 5.5], F1 [5.5, 7],
    B1 [7, 9.5]; rank 0: F0 [0, 1.5], F1 [1.5, 3], B0 [5.5, 8], B1 [9.5, 12]: 12 (9 without)."""
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    costs = CostModel(t_forward=1.0, t_backward=2.0, t_host=0.5)
    assert simulate(schedule, costs, p2p=p2p).step_time == 12
    assert simulate(schedule, CostModel(t_forward=1.0, t_backward=2.0), p2p=p2p).step_time == 9


def test_v_shape_step_ends_with_the_loss_delivery_to_the_last_rank() -> None:
    """The V's last stage is on rank 0, and the runtime sends the step's losses to the last rank
    after both programs (``deliver_to_last_rank``: two blocking messages). F 0.5, B 1 (half
    stages), messages 0.25: rank 0 0F0 [0, 0.5]; rank 1 1F0 [0.75, 1.25], 2F0 [1.25, 1.75];
    rank 0 3F0 [2, 2.5], 3B0 [2.5, 3.5]; rank 1 2B0 [3.75, 4.75], 1B0 [4.75, 5.75], its send
    done at 6; rank 0 0B0 [6, 7]. Then the two messages: both ranks end at 7 + 2 x 0.25."""
    schedule = parse_schedule(
        [
            "0F0 0SA0>1 3RA0<1 3F0 3B0 3SG0>1 0RG0<1 0B0",
            "1RA0<0 1F0 2F0 2SA0>0 2RG0<0 2B0 1B0 1SG0>0",
        ],
        layout=StageLayout.v_shape(2),
        num_microbatches=1,
    )
    result = simulate(schedule, CostModel(t_forward=1.0, t_backward=2.0, t_p2p=0.25))
    assert result.step_time == 7.5
    assert [rank.end_time for rank in result.per_rank] == [7.5, 7.5]
    # gloo's rules time the schedule alone: rank 0's last backward ends at 7
    assert (
        simulate(
            schedule, CostModel(t_forward=1.0, t_backward=2.0, t_p2p=0.25), p2p="gloo"
        ).step_time
        == 7
    )


def test_v_shape_loss_delivery_follows_the_data_parallel_reduction() -> None:
    """The runtime finalizes the gradients (waiting for the reductions) before it delivers the
    losses. With a reduction of 1 per chunk after its last backward: rank 0's lane runs 3GS
    [3.5, 4.5] and 0GS [7, 8], rank 1's 2GS [4.75, 5.75] and 1GS [5.75, 6.75] (the computes
    as in the test above): the delivery starts at 8 and both ranks end at 8.5."""
    schedule = parse_schedule(
        [
            "0F0 0SA0>1 3RA0<1 3F0 3B0 3SG0>1 0RG0<1 0B0",
            "1RA0<0 1F0 2F0 2SA0>0 2RG0<0 2B0 1B0 1SG0>0",
        ],
        layout=StageLayout.v_shape(2),
        num_microbatches=1,
    )
    costs = CostModel(t_forward=1.0, t_backward=2.0, t_p2p=0.25, t_grad_reduce=1.0)
    result = simulate(add_grad_sync(schedule), costs)
    assert result.step_time == 8.5
    assert [rank.end_time for rank in result.per_rank] == [8.5, 8.5]


@pytest.mark.parametrize("name", ["breadth-first", "bpipe", "v-zb"])
def test_a_proven_model_times_as_a_fresh_one(name: str) -> None:
    """The proof's model serves the timer (``nccl._model``): timed after an untimed run, and
    proven again after a timed one, a posting's timings are those of a model built afresh."""
    from megatron_bfpp import nccl

    chunks = {"num_chunks": 2} if name == "breadth-first" else {}
    schedule = build_schedule(name, num_ranks=4, num_microbatches=8, **chunks)
    posting = lockstep_posting(schedule)
    timing = Timing(forward=1, backward=2, p2p=0.5, transfer=1.5, grad_sync=3, param_sync=1)

    def figures() -> tuple[object, ...]:
        run = time_posting(schedule, posting, timing)
        return run.clock, run.dp_end, run.busy, run.gather_wait, run.events()

    nccl._MODELS.clear()
    fresh = figures()
    nccl._MODELS.clear()
    check_posting(schedule, posting)
    assert figures() == fresh
    check_posting(schedule, posting)
    assert figures() == fresh
