"""The one layout check of every training front end (schedules/fit.py): each question in the
front end's words, cheapest first, and what a layout that fits gives the generator."""

from __future__ import annotations

from typing import Any

import pytest

from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.schedules.fit import Fit, check_fit, num_microbatches, parse_batch_schedule
from megatron_bfpp.schedules.registry import check_sharding_data_parallel

BASE: dict[str, Any] = {
    "pp": 4,
    "vp": 2,
    "dp": 2,
    "micro_batch_size": 1,
    "global_batch_size": 16,
    "vp_flag": "--my-vp",
}


def test_a_layout_that_fits_gives_chunks_stages_and_micro_batches() -> None:
    assert check_fit("breadth-first", **BASE) == Fit(2, 2, 8)
    assert check_fit("v-half", **BASE) == Fit(None, 2, 8)  # the V places its own two
    assert check_fit("1f1b", **{**BASE, "vp": None}) == Fit(None, 1, 8)


@pytest.mark.parametrize(
    ("name", "changes", "expected"),
    [
        ("breadth-first", {"vp": None}, "breadth-first needs virtual pipeline stages: set --my-vp"),
        ("1f1b", {}, "1f1b runs one stage per rank; drop --my-vp or set it to 1 (got 2)"),
        (
            "breadth-first",
            {"num_layers": 12},
            "--num-layers 12 is not divisible by pipeline x virtual stages (4 x 2 = 8)",
        ),
        (
            "breadth-first",
            {"global_batch_size": 15},
            "--global-batch-size 15 is not a multiple of micro-batch size x data-parallel size "
            "(1 x 2)",
        ),
        ("interleaved", {"sharding": "optim_grads_params"}, "needs breadth-first"),
        (
            "breadth-first",
            {"sharding": "optim_grads_params", "dp": 1},
            "needs data parallelism (data-parallel size is 1: there is nothing to shard over)",
        ),
        (
            "bpipe",
            {"vp": None, "options": {"max_stored": 1}},
            "--pipeline-schedule bpipe cannot run 8 micro-batches on pp=4: --bpipe-max-stored 1 "
            "leaves no room",
        ),
        (
            "interleaved",
            {"global_batch_size": 6, "dp": 1},
            "--pipeline-schedule interleaved cannot run 6 micro-batches on pp=4, vp=2: ",
        ),
    ],
    ids=["vp-missing", "vp-extra", "layers", "batch", "sharding", "sharding-dp1", "option", "m"],
)
def test_each_refusal_is_one_line_in_the_front_ends_words(
    name: str, changes: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ScheduleError) as error:
        check_fit(name, **{**BASE, **changes})
    assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_micro_batches_per_step() -> None:
    assert num_microbatches(global_batch_size=32, micro_batch_size=2, data_parallel_size=4) == 4
    with pytest.raises(ScheduleError, match=r"\(2 x 4\)$"):
        num_microbatches(global_batch_size=12, micro_batch_size=2, data_parallel_size=4)


def test_sharding_over_one_data_parallel_rank_is_refused_only_when_sharded() -> None:
    check_sharding_data_parallel("optim", 1)
    check_sharding_data_parallel("optim_grads_params", 2)
    with pytest.raises(ScheduleError, match="nothing to shard over"):
        check_sharding_data_parallel("optim_grads_params", 1)


def test_a_batch_size_schedule_must_run_every_step() -> None:
    """The global batch of each step replaces --global-batch-size; the last step's micro-batches
    are returned (the steady state), each step's are checked."""
    ramp = {**BASE, "dp": 1, "global_batch_size": 1}
    assert check_fit("interleaved", **ramp, batch_schedule=(4, 8)).num_microbatches == 8
    with pytest.raises(ScheduleError, match="cannot run 6 micro-batches on pp=4, vp=2 \\(a step"):
        check_fit("interleaved", **ramp, batch_schedule=(4, 6, 8))
    with pytest.raises(ScheduleError, match="schedule's batch size 5 is not a multiple"):
        check_fit("1f1b", **{**ramp, "vp": None, "dp": 2}, batch_schedule=(4, 5))


def test_batch_size_schedule_is_read_as_megatron_core_reads_it() -> None:
    """Commas or spaces, K/M/B/T suffixes, sorted by threshold, thresholds in tokens when the
    sequence length is given (megatron-core's StepBatchsizeNumMicroBatchesCalculator)."""
    assert parse_batch_schedule("512:8,0:4", seq_length=None) == ((0, 4), (512, 8))
    assert parse_batch_schedule("0:768 250B:1.5K", seq_length=2048) == (
        (0, 768),
        (250_000_000_000 // 2048, 1500),
    )
    with pytest.raises(ScheduleError, match="thresholds must increase"):
        parse_batch_schedule("0:4 100:8 200:16", seq_length=128)  # 100 and 200 tokens: sample 0
