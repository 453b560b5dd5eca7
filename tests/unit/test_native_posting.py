"""megatron-core's own posting of its 1F1B and interleaved schedules (``native_posting``) on
cases worked out by hand from megatron-core's schedules.py and p2p_communication.py, its
refusals, and the NCCL model's reading of ``blocking``, ``pairwise`` and ``Wait``.

Notation of the expected rows: a compute or GS / PS as the action; ``[...]`` one
``batch_isend_irecv``, ``P[...]`` non-batched isend / irecv in posting order, ``!`` waited right
away, ``w(...)`` a deferred wait."""

from __future__ import annotations

import re

import pytest

from megatron_bfpp.ir import Schedule, ScheduleError, StageLayout, parse_schedule
from megatron_bfpp.native_posting import (
    MEGATRON_CORE_DDP_DEFAULTS,
    MEGATRON_CORE_DEFAULTS,
    GradSyncOptions,
    P2POptions,
    megatron_lm_grad_sync,
    megatron_lm_options,
    megatron_posting,
)
from megatron_bfpp.nccl import Batch, Item, Posting, Wait, check_posting
from megatron_bfpp.schedules.registry import build_schedule

PAIRWISE = P2POptions(batch_p2p=False)
OVERLAP = P2POptions(overlap_p2p=True, batch_p2p=False)


def _rows(schedule: Schedule, posting: Posting) -> list[str]:
    rows = []
    for rank, steps in enumerate(posting.per_rank):
        actions = schedule.per_rank[rank]
        words = []
        for step in steps:
            if isinstance(step, int):
                words.append(str(actions[step]))
            elif isinstance(step, Wait):
                words.append(f"w({' '.join(str(actions[q]) for q in step.positions)})")
            else:
                ops = " ".join(str(actions[item.position]) for item in step.items)
                words.append(f"{'P' if step.pairwise else ''}[{ops}]{'!' if step.blocking else ''}")
        rows.append(" ".join(words))
    return rows


# --- 1F1B -----------------------------------------------------------------------------------
def test_1f1b_batched_pairs_a_forward_send_with_the_next_backward_receive() -> None:
    # pp 2, m 3: rank 0 warms up with one forward (p - r - 1), rank 1 with none. Steady state:
    # send_forward_recv_backward after a forward, send_backward_recv_forward after a backward
    # (send_backward alone after the last); rank 0's cool-down: recv_backward, B. Batched ops
    # go send-previous, receive-previous, send-next, receive-next; every call is waited.
    # Without overlap_grad_reduce the reduction starts in finalize_model_grads, at the end.
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    posting = megatron_posting(schedule)
    assert _rows(schedule, posting) == [
        "0PS 0F0 [0SA0>1]! 0F1 [0SA1>1 0RG0<1]! 0B0 0F2 [0SA2>1 0RG1<1]! 0B1 [0RG2<1]! 0B2 0GS",
        "[1RA0<0]! 1PS 1F0 1B0 [1SG0>0 1RA1<0]! 1F1 1B1 [1SG1>0 1RA2<0]! 1F2 1B2 [1SG2>0]! 1GS",
    ]
    check_posting(schedule, posting)


def test_1f1b_non_batched_posts_an_odd_ranks_receive_first() -> None:
    # _p2p_ops: an even rank sends next before it receives; an odd rank receives previous
    # before it sends previous, so the pair's one stream meets head to head.
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    rows = _rows(schedule, megatron_posting(schedule, PAIRWISE))
    assert rows[0].split()[4] == "P[0SA1>1" and rows[0].split()[5] == "0RG0<1]!"
    assert rows[1].split()[4:6] == ["P[1RA1<0", "1SG0>0]!"]


def test_1f1b_with_all_micro_batches_in_warm_up_posts_no_steady_pair() -> None:
    # pp 4, m 2, rank 1: warm-up min(2, 2) = 2 leaves no steady state: send_forward, then
    # recv_backward, never send_forward_recv_backward; rank 2 (warm-up 1) pairs once.
    schedule = build_schedule("1f1b", num_ranks=4, num_microbatches=2)
    rows = _rows(schedule, megatron_posting(schedule))
    assert rows[1] == (
        "[1RA0<0]! 1PS 1F0 [1SA0>2]! [1RA1<0]! 1F1 [1SA1>2]! [1RG0<2]! 1B0 [1SG0>0]! "
        "[1RG1<2]! 1B1 [1SG1>0]! 1GS"
    )
    assert rows[2] == (
        "[2RA0<1]! 2PS 2F0 [2SA0>3]! [2RA1<1]! 2F1 [2SA1>3 2RG0<3]! 2B0 [2SG0>1]! "
        "[2RG1<3]! 2B1 [2SG1>1]! 2GS"
    )


# --- interleaved ----------------------------------------------------------------------------
def test_interleaved_overlap_defers_waits_as_megatron_core_does() -> None:
    # pp 2, vp 2, m 2. Rank 0: warm-up min(2 + 2, 4) = all four forwards; as the leading rank it
    # receives at step k what rank 1 sent at step k - 1 (none at step 0, none for chunk 1's
    # last); then recv_backward and a blocking cool-down. Rank 1: warm-up 2 (blocking
    # send_forward_recv_forward), then the steady state overlapped: the input of 3F1 received
    # after 3F0 and waited just before 3F1, 3SG0 waited after 3SG1 is posted, 1RG0 (rank 1
    # leads the backward: nothing at step 0) waited before 1B0, 3SG1 after the cool-down.
    # The reductions start in finalize_model_grads, in chunk order.
    schedule = build_schedule("interleaved", num_ranks=2, num_chunks=2, num_microbatches=2)
    posting = megatron_posting(schedule, OVERLAP)
    assert _rows(schedule, posting) == [
        "0PS 2PS 0F0 P[0SA0>1]! 0F1 P[0SA1>1 2RA0<1]! 2F0 P[2SA0>1 2RA1<1]! 2F1 P[2SA1>1]! "
        "P[2RG0<1]! 2B0 P[2SG0>1 2RG1<1]! 2B1 P[2SG1>1 0RG0<1]! 0B0 P[0RG1<1]! 0B1 0GS 2GS",
        "P[1RA0<0]! 1PS 3PS 1F0 P[1RA1<0 1SA0>0]! 1F1 P[3RA0<0 1SA1>0]! 3F0 P[3RA1<0] 3B0 "
        "P[3SG0>0] w(3RA1<0) 3F1 3B1 P[1RG0<0 3SG1>0] w(3SG0>0) w(1RG0<0) 1B0 "
        "P[1RG1<0 1SG0>0]! 1B1 P[1SG1>0]! w(3SG1>0) 1GS 3GS",
    ]
    check_posting(schedule, posting)


def test_interleaved_freed_outputs_wait_each_forward_send_at_once() -> None:
    # pp 4, vp 2, m 8, rank 2: warm-up (4 - 2 - 1) * 2 + 4 = 6, then ten steady steps. Without
    # freed outputs the send of 6F2's output is waited after the next forward send is posted;
    # megatron-core 0.18+ with deallocate_pipeline_outputs waits for it right after posting.
    schedule = build_schedule("interleaved", num_ranks=4, num_chunks=2, num_microbatches=8)
    late = _rows(schedule, megatron_posting(schedule, OVERLAP))[2]
    early = _rows(schedule, megatron_posting(schedule, P2POptions(True, False, True)))[2]
    assert "6F2 P[6SA2>3 6RA3<1] w(6RG0<3) 6B0" in late
    assert "6F3 P[6SA3>3 2RA4<1] w(6SA2>3) w(6RG1<3) 6B1" in late
    assert "6F2 P[6SA2>3 6RA3<1] w(6SA2>3) w(6RG0<3) 6B0" in early
    assert "6F3 P[6SA3>3 2RA4<1] w(6SA3>3) w(6RG1<3) 6B1" in early


def test_interleaved_without_overlap_pairs_all_four_ops_in_one_batch() -> None:
    # Same layout, batched: the last warm-up step (6F1) sends its output and receives both the
    # next forward's input and the first backward's gradient; each steady step runs F and B,
    # then one batch of all four ops in megatron-core's order.
    schedule = build_schedule("interleaved", num_ranks=4, num_chunks=2, num_microbatches=8)
    posting = megatron_posting(schedule)
    rows = _rows(schedule, posting)
    assert "6F1 [6RA2<1 6SA1>3 6RG0<3]! 6F2 6B0 [6SG0>1 6RA3<1 6SA2>3 6RG1<3]! 6F3" in rows[2]
    check_posting(schedule, posting)


# --- where megatron-core DDP starts each chunk's gradient reduction ------------------------
HOOKS = GradSyncOptions(overlap_grad_reduce=True)  # --no-align-grad-reduce: DDP's hooks alone
ALIGNED = megatron_lm_grad_sync(overlap_grad_reduce=True)  # Megatron-LM's --overlap-grad-reduce


def _grad_syncs(schedule: Schedule, posting: Posting) -> list[list[tuple[str, str]]]:
    """Per rank, in posting order, each GS with the compute right before it (other GSs
    skipped), or "end" where that is the rank's last p2p call or wait."""
    result = []
    for row in _rows(schedule, posting):
        last, found = "", []
        for word in row.split():
            if word.endswith("GS"):
                found.append((word, last if re.fullmatch(r"\d+[FB]\d+", last) else "end"))
            else:
                last = word
        result.append(found)
    return result


def test_1f1b_grad_sync_points_follow_megatron_cores_no_sync_and_grad_sync_func() -> None:
    # pp 4, m 6: rank r's last backward is rB5 (warm-up 3 - r), after which rank r > 0 posts
    # send_backward [rSG5>r-1]! and nothing else. Without overlap_grad_reduce DDP's hooks start
    # nothing; finalize_model_grads reduces after the schedule: every GS at the end. With
    # overlap_grad_reduce and no grad_sync_func, enable_grad_sync before the last backward on
    # every rank: its hooks start the reduction in rB5, before the send. With grad_sync_func
    # (Megatron-LM), only the first pipeline rank lifts no_sync; the others call
    # grad_sync_func after the cool-down. Rank 0 sends nothing after its last backward.
    schedule = build_schedule("1f1b", num_ranks=4, num_microbatches=6)
    at_end = [[("0GS", "0B5")]] + [[(f"{r}GS", "end")] for r in (1, 2, 3)]
    after_backward = [[(f"{r}GS", f"{r}B5")] for r in range(4)]
    for grad_sync, want in (
        (MEGATRON_CORE_DDP_DEFAULTS, at_end),
        (HOOKS, after_backward),
        (ALIGNED, at_end),
    ):
        posting = megatron_posting(schedule, grad_sync=grad_sync)
        assert _grad_syncs(schedule, posting) == want, grad_sync
        check_posting(schedule, posting)
    rows = _rows(schedule, megatron_posting(schedule, grad_sync=ALIGNED))
    assert rows[2].endswith("2B5 [2SG5>1]! 2GS")
    assert _rows(schedule, megatron_posting(schedule, grad_sync=HOOKS))[2].endswith(
        "2B5 2GS [2SG5>1]!"
    )


def test_interleaved_grad_sync_func_starts_chunk_c_p_rank_backwards_late() -> None:
    # pp 4, vp 2, m 8, group 4: the schedule table runs micro-batches 0-3 on chunk 0, 0-3 on
    # chunk 1, 4-7 on chunk 0, 4-7 on chunk 1 (virtual micro-batches 0..15); backward k runs
    # the mirrored chunk, so chunk 1's last backward is k = 11 (micro-batch 7 of table chunk
    # 0) and chunk 0's is k = 15. Stage of chunk c on rank r: 4c + r.
    schedule = build_schedule("interleaved", num_ranks=4, num_chunks=2, num_microbatches=8)
    # Without overlap_grad_reduce: finalize_model_grads, after everything, in chunk order
    # (rank 0's last step is 0B7: stage 0 sends nothing back).
    want_off = [[("0GS", "0B7"), ("4GS", "0B7")]]
    want_off += [[(f"{r}GS", "end"), (f"{4 + r}GS", "end")] for r in (1, 2, 3)]
    # DDP's hooks alone: no_sync lifted for each chunk's last backward (preprocess), so the
    # reduction starts in that backward, on every rank alike.
    want_hooks = [[(f"{4 + r}GS", f"{4 + r}B7"), (f"{r}GS", f"{r}B7")] for r in range(4)]
    # grad_sync_func: after backward k, chunk of backward k - r if that is its chunk's last
    # micro-batch. Chunk 1: k = 11 + r, i.e. rank 0 after 4B7 (k 11), rank 1 after backward
    # 12 (table (4, chunk 1) -> chunk 0: 1B4), rank 2 after 13 (2B5), rank 3 after 14 (3B6).
    # Chunk 0: k = 15 + r < 16 only on rank 0 (after 0B7); the others after the cool-down.
    want_aligned = [
        [("4GS", "4B7"), ("0GS", "0B7")],
        [("5GS", "1B4"), ("1GS", "end")],
        [("6GS", "2B5"), ("2GS", "end")],
        [("7GS", "3B6"), ("3GS", "end")],
    ]
    for options in (OVERLAP, MEGATRON_CORE_DEFAULTS):
        for grad_sync, want in (
            (MEGATRON_CORE_DDP_DEFAULTS, want_off),
            (HOOKS, want_hooks),
            (ALIGNED, want_aligned),
        ):
            posting = megatron_posting(schedule, options, grad_sync)
            assert _grad_syncs(schedule, posting) == want, (options, grad_sync)
            check_posting(schedule, posting)


def test_megatron_lm_sets_grad_sync_func_only_with_overlap_grad_reduce() -> None:
    assert megatron_lm_grad_sync(overlap_grad_reduce=False) == MEGATRON_CORE_DDP_DEFAULTS
    assert megatron_lm_grad_sync(overlap_grad_reduce=True) == GradSyncOptions(True, True)
    assert megatron_lm_grad_sync(overlap_grad_reduce=True, align=False) == HOOKS
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="grad_sync_func without overlap_grad_reduce"):
        megatron_posting(schedule, grad_sync=GradSyncOptions(grad_sync_func=True))


# --- Megatron-LM's settings and refusals ------------------------------------------------------
def test_megatron_lm_overlaps_only_the_interleaved_schedule() -> None:
    one = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    inter = build_schedule("interleaved", num_ranks=4, num_chunks=2, num_microbatches=4)
    assert megatron_lm_options(one, core_version=(0, 19)) == MEGATRON_CORE_DEFAULTS
    assert megatron_lm_options(inter, core_version=(0, 17)) == P2POptions(True, False, False)
    assert megatron_lm_options(inter, core_version=(0, 18)) == P2POptions(True, False, True)


@pytest.mark.parametrize(
    ("name", "chunks", "options", "says"),
    [
        ("1f1b", None, P2POptions(overlap_p2p=True, batch_p2p=False), "only in the interleaved"),
        ("interleaved", 2, P2POptions(True, True), "cannot overlap batched"),
        ("gpipe", None, MEGATRON_CORE_DEFAULTS, "rank 1: its compute #3 is 1F3 where megatron"),
        ("breadth-first", 2, MEGATRON_CORE_DEFAULTS, "one forward one backward, cool-down"),
        ("bpipe", None, MEGATRON_CORE_DEFAULTS, "0EV2>3, which megatron-core never runs"),
        ("v-half", None, MEGATRON_CORE_DEFAULTS, "looped placement"),
    ],
)
def test_what_megatron_core_does_not_run_is_refused(
    name: str, chunks: int | None, options: P2POptions, says: str
) -> None:
    schedule = build_schedule(name, num_ranks=4, num_microbatches=4, num_chunks=chunks)
    with pytest.raises(ScheduleError, match=says) as error:
        megatron_posting(schedule, options)
    assert "\n" not in str(error.value)


# --- the model's reading of the new fields ----------------------------------------------------
ONE_F_ONE_B = parse_schedule(
    [
        "0F0 0SA0>1 0F1 0SA1>1 0RG0<1 0B0 0RG1<1 0B1",
        "1RA0<0 1F0 1B0 1SG0>0 1RA1<0 1F1 1B1 1SG1>0",
    ],
    layout=StageLayout.looped(2),
    num_microbatches=2,
)


def _pairwise(odd_receives_first: bool) -> Posting:
    def call(*positions: int) -> Batch:
        return Batch(-1, tuple(Item(q) for q in positions), blocking=True, pairwise=True)

    steady = call(4, 3) if odd_receives_first else call(3, 4)
    return Posting(
        "by hand",
        (
            (0, call(1), 2, call(3, 4), 5, call(6), 7),
            (call(0), 1, 2, steady, 5, 6, call(7)),
        ),
    )


def test_non_batched_ops_of_a_pair_run_in_order_on_its_one_stream() -> None:
    check_posting(ONE_F_ONE_B, _pairwise(odd_receives_first=True))
    with pytest.raises(ScheduleError, match="deadlocks on NCCL"):
        check_posting(ONE_F_ONE_B, _pairwise(odd_receives_first=False))
    # The same ops in one batch_isend_irecv complete together in either order.
    batched = Posting(
        "batched",
        tuple(
            tuple(
                Batch(-1, step.items, blocking=True) if isinstance(step, Batch) else step
                for step in row
            )
            for row in _pairwise(odd_receives_first=False).per_rank
        ),
    )
    check_posting(ONE_F_ONE_B, batched)


def test_a_wait_for_an_op_never_posted_is_refused() -> None:
    posting = _pairwise(odd_receives_first=True)
    early = Posting("by hand", ((Wait((1,)), *posting.per_rank[0]), posting.per_rank[1]))
    with pytest.raises(ScheduleError, match="no earlier batch posts"):
        check_posting(ONE_F_ONE_B, early)


def test_interleaved_at_pp_2_without_overlap_cross_matches_as_megatron_lm_warns() -> None:
    # Megatron-LM refuses the interleaved schedule at pp 2 without p2p overlap ("multiple p2p
    # sends and recvs between same 2 ranks per communication batch"): rank 0 sends a gradient
    # and an activation to rank 1 in one batch, which receives them in the other order.
    schedule = build_schedule("interleaved", num_ranks=2, num_chunks=2, num_microbatches=4)
    with pytest.raises(ScheduleError, match=r"send #\d+ from rank 0 to rank 1 is grad"):
        check_posting(schedule, megatron_posting(schedule))
    check_posting(schedule, megatron_posting(schedule, OVERLAP))


def _megatron_cases() -> list[tuple[Schedule, P2POptions]]:
    """1F1B at pp 2, 3, 4, 8 (m 1..3p+1) and interleaved at vp 2 and 4 (m p..3p+1, groups p and
    m), under every setting megatron-core accepts."""
    cases = []
    for p in (2, 3, 4, 8):
        for m in range(1, 3 * p + 2):
            one = build_schedule("1f1b", num_ranks=p, num_microbatches=m)
            cases += [(one, MEGATRON_CORE_DEFAULTS), (one, PAIRWISE)]
        for v, m in ((v, m) for v in (2, 4) for m in range(p, 3 * p + 2)):
            for group in sorted({p, m}):
                if 0 < m % group < p:  # megatron-core refuses this remainder
                    continue
                inter = build_schedule(
                    "interleaved",
                    num_ranks=p,
                    num_microbatches=m,
                    num_chunks=v,
                    microbatch_group_size=group,
                )
                for options in (MEGATRON_CORE_DEFAULTS, PAIRWISE, OVERLAP):
                    cases.append((inter, options))
                cases.append((inter, P2POptions(True, False, wait_forward_sends=True)))
    return cases


@pytest.mark.slow
def test_megatron_cores_postings_are_nccl_safe_but_for_interleaved_pp_2_batched() -> None:
    unsafe = []
    cases = _megatron_cases()
    for schedule, options in cases:
        try:
            check_posting(schedule, megatron_posting(schedule, options))
        except ScheduleError:
            unsafe.append((schedule.name, schedule.num_ranks, options))
    assert len(cases) == 510  # the figures in docs/design-notes.md
    assert len(unsafe) == 14
    assert set(unsafe) == {("interleaved", 2, MEGATRON_CORE_DEFAULTS)}
