"""``install()`` / ``uninstall()`` against megatron-core alone, plus a tiny fake Megatron-LM.

megatron-core 0.16.1 on PyPI ships no ``megatron.training``; the argument and ``validate_args``
wrapping is exercised against a fake ``megatron.training`` package written to a temporary
directory (``megatron`` is a namespace package, so a second portion on ``sys.path`` adds it)
with Megatron-LM's function names and signatures. The real Megatron-LM is covered by
``test_megatron_lm.py`` (needs ``MEGATRON_LM_PATH``).
"""

from __future__ import annotations

import importlib
import re
import shlex
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_bfpp import flags
from megatron_bfpp.ir import ScheduleError

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
pipeline_parallel = importlib.import_module("megatron.core.pipeline_parallel")
from megatron_bfpp.megatron import plugin  # noqa: E402
from megatron_bfpp.megatron.arguments import check_schedule_args  # noqa: E402

pytestmark = pytest.mark.megatron

ORIGINAL = schedules.get_forward_backward_func

FAKE_TRAINING = {
    "__init__.py": "from megatron.training.global_vars import get_args\n",
    "global_vars.py": """
        _GLOBAL_ARGS = None

        def get_args():
            return _GLOBAL_ARGS

        def set_args(args):
            global _GLOBAL_ARGS
            _GLOBAL_ARGS = args
        """,
    "arguments.py": """
        import argparse

        def add_megatron_arguments(parser: argparse.ArgumentParser):
            group = parser.add_argument_group(title='distributed')
            group.add_argument('--pipeline-model-parallel-size', type=int, default=1)
            group.add_argument('--num-layers-per-virtual-pipeline-stage', type=int, default=None)
            group.add_argument('--num-virtual-stages-per-pipeline-rank', type=int, default=None)
            group.add_argument('--num-layers', type=int, default=8)
            group.add_argument('--micro-batch-size', type=int, default=1)
            group.add_argument('--global-batch-size', type=int, default=None)
            group.add_argument('--microbatch-group-size-per-virtual-pipeline-stage', type=int,
                               dest='microbatch_group_size_per_vp_stage', default=None)
            group.add_argument('--world-size', type=int, default=None)
            return parser

        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            parser = argparse.ArgumentParser(description='Megatron-LM Arguments',
                                             allow_abbrev=False)
            parser = add_megatron_arguments(parser)
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return parser.parse_args()

        def validate_args(args, defaults={}):
            pp = args.pipeline_model_parallel_size
            args.world_size = args.world_size or pp
            args.data_parallel_size = args.world_size // pp
            if args.global_batch_size is None:
                args.global_batch_size = args.micro_batch_size * args.data_parallel_size
            vp = args.num_virtual_stages_per_pipeline_rank
            if args.num_layers_per_virtual_pipeline_stage is not None:
                vp = args.num_layers // pp // args.num_layers_per_virtual_pipeline_stage
            args.virtual_pipeline_model_parallel_size = None if vp in (None, 1) else vp
            args.rampup_batch_size = None
            return args
        """,
    "initialize.py": """
        from megatron.training.arguments import parse_args, validate_args
        from megatron.training.global_vars import set_args

        def initialize_megatron(extra_args_provider=None, args_defaults={},
                                ignore_unknown_args=False, allow_no_cuda=False):
            args = parse_args(extra_args_provider, ignore_unknown_args)
            validate_args(args, args_defaults)
            set_args(args)
        """,
    "training.py": """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def train_step():
            return get_forward_backward_func()
        """,
}


def _clear_fake_modules() -> None:
    for name in [
        m for m in sys.modules if m == "megatron.training" or m.startswith("megatron.training.")
    ]:
        del sys.modules[name]
    megatron = sys.modules["megatron"]
    if "training" in vars(megatron):
        delattr(megatron, "training")


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    plugin.uninstall()
    plugin.set_schedule("default")
    yield
    plugin.uninstall()
    plugin.set_schedule("default")
    assert schedules.get_forward_backward_func is ORIGINAL
    assert pipeline_parallel.get_forward_backward_func is ORIGINAL


@pytest.fixture
def no_megatron_lm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``megatron.training`` unimportable even where a checkout happens to be on the path,
    or an earlier test of the session imported it (its submodules would still be found in
    ``sys.modules``)."""
    for name in [n for n in sys.modules if n.startswith("megatron.training.")]:
        monkeypatch.setitem(sys.modules, name, None)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "megatron.training", None)  # type: ignore[arg-type]


@pytest.fixture
def fake_megatron_lm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    package = tmp_path / "megatron" / "training"
    package.mkdir(parents=True)
    for name, source in FAKE_TRAINING.items():
        (package / name).write_text(textwrap.dedent(source))
    _clear_fake_modules()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    plugin.uninstall()
    _clear_fake_modules()


def _pp_pair_state() -> tuple[object, object]:
    return schedules.get_forward_backward_func, pipeline_parallel.get_forward_backward_func


# --- megatron-core alone -------------------------------------------------------------------


def test_install_patches_and_uninstall_restores_core_sites(no_megatron_lm: None) -> None:
    assert not plugin.is_installed()
    plugin.install()
    assert plugin.is_installed()
    assert _pp_pair_state() == (plugin.get_forward_backward_func,) * 2
    plugin.uninstall()
    assert not plugin.is_installed()
    assert _pp_pair_state() == (ORIGINAL, ORIGINAL)


def test_the_launchers_dataset_helpers_patch_is_registered(no_megatron_lm: None) -> None:
    """The wheel's prebuilt helpers_cpp: compile_helpers does nothing while installed, and
    uninstall puts Megatron's own back (the launcher's patch goes through the registry)."""
    pytest.importorskip("megatron.core.datasets.helpers_cpp")
    dataset_utils = importlib.import_module("megatron.core.datasets.utils")
    original = dataset_utils.compile_helpers
    with pytest.raises(ScheduleError, match="install"):
        plugin.keep_prebuilt_dataset_helpers()
    plugin.install()
    plugin.keep_prebuilt_dataset_helpers()
    assert dataset_utils.compile_helpers is not original
    assert dataset_utils.compile_helpers() is None
    plugin.uninstall()
    assert dataset_utils.compile_helpers is original


def test_install_is_idempotent(no_megatron_lm: None) -> None:
    plugin.install()
    plugin.install()
    plugin.uninstall()
    assert _pp_pair_state() == (ORIGINAL, ORIGINAL)
    plugin.uninstall()  # uninstalling twice is harmless too
    assert _pp_pair_state() == (ORIGINAL, ORIGINAL)


def test_core_only_install_is_logged(
    no_megatron_lm: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger=plugin.__name__):
        plugin.install()
    assert any("megatron.training is not importable" in r.getMessage() for r in caplog.records)


def test_default_returns_megatrons_own_function(no_megatron_lm: None) -> None:
    plugin.install()
    get = pipeline_parallel.get_forward_backward_func
    assert get(pp_size=4, vp_size=None) is ORIGINAL(pp_size=4, vp_size=None)
    assert get(pp_size=4, vp_size=2) is ORIGINAL(pp_size=4, vp_size=2)
    assert get(pp_size=1, vp_size=None) is ORIGINAL(pp_size=1, vp_size=None)


def test_set_schedule_dispatches_to_ours(no_megatron_lm: None) -> None:
    plugin.install()
    plugin.set_schedule("breadth-first", group_size=2)
    assert plugin.current_schedule() == ("breadth-first", {"group_size": 2})
    func = pipeline_parallel.get_forward_backward_func(pp_size=2, vp_size=2)
    assert func.schedule == "breadth-first"
    assert func is schedules.get_forward_backward_func(pp_size=2, vp_size=2)  # cached
    # No pipeline: megatron's own no-pipelining function.
    assert schedules.get_forward_backward_func(pp_size=1) is ORIGINAL(pp_size=1)
    plugin.set_schedule("1f1b")
    assert pipeline_parallel.get_forward_backward_func(pp_size=4).schedule == "1f1b"


def test_set_schedule_rejects_bad_choices() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule"):
        plugin.set_schedule("zigzag")
    with pytest.raises(ScheduleError, match="does not take"):
        plugin.set_schedule("1f1b", group_size=2)
    with pytest.raises(ScheduleError, match="takes no options"):
        plugin.set_schedule("default", group_size=2)
    assert plugin.current_schedule() == ("default", {})


# --- with a (fake) Megatron-LM -------------------------------------------------------------


@pytest.mark.parametrize("imported_first", [True, False], ids=["imported-first", "not-imported"])
def test_megatron_lm_sites_patched_and_restored(
    fake_megatron_lm: Path, imported_first: bool
) -> None:
    if imported_first:
        importlib.import_module("megatron.training.training")
        importlib.import_module("megatron.training.initialize")
    plugin.install()
    arguments = sys.modules["megatron.training.arguments"]
    initialize = sys.modules["megatron.training.initialize"]
    training = sys.modules["megatron.training.training"]
    originals = {
        "add": arguments.add_megatron_arguments.__wrapped__,
        "validate": arguments.validate_args.__wrapped__,
    }
    assert training.get_forward_backward_func is plugin.get_forward_backward_func
    assert initialize.validate_args.megatron_bfpp_wrapped
    assert initialize.validate_args.__wrapped__ is originals["validate"]
    plugin.install()  # idempotent: nothing wrapped twice
    assert arguments.add_megatron_arguments.__wrapped__ is originals["add"]
    plugin.uninstall()
    assert training.get_forward_backward_func is ORIGINAL
    assert arguments.add_megatron_arguments is originals["add"]
    assert arguments.validate_args is originals["validate"]
    assert initialize.validate_args is originals["validate"]


def _initialize(monkeypatch: pytest.MonkeyPatch, *argv: str) -> SimpleNamespace:
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    initialize = importlib.import_module("megatron.training.initialize")
    initialize.initialize_megatron(allow_no_cuda=True)
    args: SimpleNamespace = importlib.import_module("megatron.training").get_args()
    return args


def test_flag_parsed_validated_and_dispatched(
    fake_megatron_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin.install()
    args = _initialize(
        monkeypatch,
        *shlex.split("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2"),
        *shlex.split("--global-batch-size 4 --pipeline-schedule breadth-first"),
        *shlex.split("--breadth-first-group-size 2"),
    )
    assert args.pipeline_schedule == "breadth-first"
    assert plugin.current_schedule() == ("breadth-first", {"group_size": 2})
    training = sys.modules["megatron.training.training"]
    assert training.get_forward_backward_func(pp_size=2, vp_size=2).schedule == "breadth-first"


def test_default_flag_keeps_megatron_behaviour(
    fake_megatron_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin.install()
    args = _initialize(monkeypatch, "--pipeline-model-parallel-size", "4")
    assert args.pipeline_schedule == "default"
    training = sys.modules["megatron.training.training"]
    assert training.get_forward_backward_func(pp_size=4) is ORIGINAL(pp_size=4)
    # Megatron-LM's args take precedence over set_schedule() once they exist.
    plugin.set_schedule("1f1b")
    assert plugin.current_schedule() == ("default", {})


def test_interleaved_reads_megatrons_group_size_flag(
    fake_megatron_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin.install()
    _initialize(
        monkeypatch,
        *shlex.split("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2"),
        *shlex.split("--global-batch-size 4 --pipeline-schedule interleaved"),
        *shlex.split("--microbatch-group-size-per-virtual-pipeline-stage 4"),
    )
    assert plugin.current_schedule() == ("interleaved", {"microbatch_group_size": 4})


@pytest.mark.parametrize(
    ("argv", "vp"),
    [
        ("--pipeline-schedule breadth-first", 2),
        ("--pipeline-schedule interleaved", 2),
        ("--pipeline-schedule breadth-first --num-virtual-stages-per-pipeline-rank 4", 4),
        ("--pipeline-schedule interleaved --num-layers-per-virtual-pipeline-stage 1", 4),
        ("--pipeline-schedule 1f1b", None),
        ("--pipeline-schedule default", None),
        ("--pipeline-schedule v-half", 2),
        ("--pipeline-schedule v-min --num-virtual-stages-per-pipeline-rank 2", 2),
    ],
)
def test_virtual_stages_default_per_schedule(
    fake_megatron_lm: Path, monkeypatch: pytest.MonkeyPatch, argv: str, vp: int | None
) -> None:
    """A looped schedule without any virtual-stage flag gets 2 per rank before Megatron's own
    validation derives the rest (as bfpp-train does); a flag the user gave is kept, and
    single-stage schedules keep Megatron's default (None: one stage per rank)."""
    plugin.install()
    args = _initialize(
        monkeypatch, *shlex.split(f"--pipeline-model-parallel-size 2 --global-batch-size 8 {argv}")
    )
    assert args.virtual_pipeline_model_parallel_size == vp


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
            "--pipeline-schedule 1f1b",
            "one stage per rank",
        ),
        (
            "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
            "--pipeline-schedule gpipe",
            "one stage per rank",
        ),
        (
            "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
            "--pipeline-schedule bpipe",
            "one stage per rank",
        ),
        (
            "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 4 "
            "--pipeline-schedule v-zb",
            "v-zb places exactly 2 stages per rank",
        ),
        ("--pipeline-model-parallel-size 1 --pipeline-schedule 1f1b", "needs --pipeline-model"),
        (
            "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
            "--global-batch-size 6 --pipeline-schedule interleaved",
            "cannot run 6 micro-batches",
        ),
        (
            "--pipeline-model-parallel-size 4 --world-size 8 --global-batch-size 3 "
            "--pipeline-schedule 1f1b",
            "not a multiple",
        ),
        (
            "--pipeline-model-parallel-size 4 --breadth-first-group-size 2",
            "applies to --pipeline-sch",
        ),
        (
            "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
            "--pipeline-schedule breadth-first --breadth-first-group-size 0",
            "must be >= 1",
        ),
        (  # before auto decides: its choice is never printed
            "--pipeline-model-parallel-size 2 --pipeline-schedule auto --combined-1f1b",
            "--combined-1f1b needs --pipeline-schedule interleaved, not auto",
        ),
    ],
)
def test_bad_combinations_exit_with_one_line(
    fake_megatron_lm: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: str,
    message: str,
) -> None:
    """Exit code 2 and one line on stderr, printed by local rank 0 only (every rank checks the
    same arguments: under torchrun each printing it made one mistake many lines)."""
    plugin.install()
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        _initialize(monkeypatch, *argv.split())
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron_bfpp: error: "), lines
    assert message in lines[0]
    monkeypatch.setenv("LOCAL_RANK", "1")
    # In-process there is no torchrun to outwait: the quiet rank's grace would only add 10 s.
    monkeypatch.setattr(flags, "QUIET_RANK_GRACE_S", 0.0)
    with pytest.raises(SystemExit) as exit_info:
        _initialize(monkeypatch, *argv.split())
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""


def test_unknown_schedule_is_an_argparse_error(
    fake_megatron_lm: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plugin.install()
    with pytest.raises(SystemExit) as exit_info:
        _initialize(monkeypatch, "--pipeline-schedule", "zigzag")
    assert exit_info.value.code == 2
    assert "invalid choice: 'zigzag'" in capsys.readouterr().err


def test_check_schedule_args_is_pure() -> None:
    args = SimpleNamespace(
        pipeline_schedule="breadth-first",
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        micro_batch_size=1,
        global_batch_size=8,
        data_parallel_size=1,
        breadth_first_group_size=None,
        bpipe_max_stored=None,
    )
    check_schedule_args(args)
    args.virtual_pipeline_model_parallel_size = None
    with pytest.raises(ScheduleError, match="needs virtual pipeline stages"):
        check_schedule_args(args)


def test_check_schedule_args_runs_every_step_of_a_batch_size_schedule() -> None:
    """Megatron-LM's validate_args leaves global_batch_size at micro-batch x data-parallel size
    (1 here) with --step-batch-size-schedule; the plugin refused interleaved on pp 4 as "cannot
    run 1 micro-batches", though Megatron runs 4 and then 8 per step."""
    args = SimpleNamespace(
        pipeline_schedule="interleaved",
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        micro_batch_size=1,
        global_batch_size=1,
        data_parallel_size=1,
        step_batch_size_schedule="0:4,512:8",
        seq_length=128,
        microbatch_group_size_per_vp_stage=None,
    )
    check_schedule_args(args)
    args.step_batch_size_schedule = "0:4 2M:6"  # 2M tokens / 128: a step of 6 from sample 15625
    with pytest.raises(ScheduleError, match=r"cannot run 6 micro-batches on pp=4, vp=2 \(a step"):
        check_schedule_args(args)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({}, None),
        ({"bfpp_data_parallel_sharding_strategy": "optim"}, None),
        ({"bfpp_data_parallel_sharding_strategy": "no_shard"}, "is Megatron-FSDP's"),
        (
            {"pipeline_schedule": "1f1b", "virtual_pipeline_model_parallel_size": None},
            "needs breadth-first",
        ),
        ({"pipeline_schedule": "interleaved"}, "needs breadth-first"),
        ({"use_precision_aware_optimizer": True}, "--use-precision-aware-optimizer is not"),
        ({"data_parallel_size": 1, "global_batch_size": 4}, "needs data parallelism"),
        ({"use_distributed_optimizer": False}, "add --use-distributed-optimizer"),
        ({"overlap_param_gather": True}, "drop --overlap-param-gather"),
        ({"log_params_norm": True}, "--log-params-norm reads every parameter"),
    ],
    ids=[
        "sharded",
        "optim",
        "fsdp-value",
        "single-chunk",
        "interleaved",
        "precision-aware",
        "dp1",
        "no-distopt",
        "overlap-gather",
        "params-norm",
    ],
)
def test_sharding_flags_are_checked_in_one_line(
    changes: dict[str, object], expected: str | None
) -> None:
    args = SimpleNamespace(
        pipeline_schedule="breadth-first",
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=4,
        micro_batch_size=1,
        global_batch_size=8,
        data_parallel_size=2,
        breadth_first_group_size=None,
        bpipe_max_stored=None,
        use_distributed_optimizer=True,
        overlap_param_gather=False,
        bfpp_data_parallel_sharding_strategy="optim_grads_params",
    )
    for name, value in changes.items():
        setattr(args, name, value)
    if expected is None:
        check_schedule_args(args)
        return
    with pytest.raises(ScheduleError, match=re.escape(expected)) as error:
        check_schedule_args(args)
    assert "\n" not in str(error.value)


def _v_half_args(**changes: object) -> object:
    import argparse

    fields = dict(
        pipeline_schedule="v-half",
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        micro_batch_size=1,
        data_parallel_size=1,
        global_batch_size=8,
    )
    return argparse.Namespace(**{**fields, **changes})


@pytest.mark.parametrize(
    "dest, value",
    [
        ("pipeline_model_parallel_layout", "Et|t|t|t|t|t|t|tL"),
        ("decoder_first_pipeline_num_layers", 1),
        ("account_for_loss_in_pipeline_split", True),
    ],
)
def test_v_shape_takes_uneven_layout_flags(dest: str, value: object) -> None:
    """Megatron's stages in model order, stage s on rank s or 2p-1-s (tests/megatron/
    test_megatron_lm.py trains each kind against 1F1B)."""
    from megatron_bfpp.megatron.arguments import check_schedule_args

    check_schedule_args(_v_half_args(**{dest: value}))


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"mtp_num_layers": 1}, "does not support --mtp-num-layers yet"),
        (  # Megatron-LM derived vp 3 from a 12-stage layout on 4 ranks
            {"pipeline_model_parallel_layout": "x", "virtual_pipeline_model_parallel_size": 3},
            "set it to 2, got 3",
        ),
    ],
)
def test_v_shape_refusals_name_the_flag(changes: dict[str, object], expected: str) -> None:
    from megatron_bfpp.megatron.arguments import check_schedule_args

    with pytest.raises(ScheduleError, match=re.escape(expected)) as error:
        check_schedule_args(_v_half_args(**changes))
    flag = "--pipeline-model-parallel-layout" if len(changes) > 1 else "--mtp-num-layers"
    assert flag in str(error.value) and "\n" not in str(error.value)


# megatron-core's conditions for its combined step, met
OVERLAP_MET = dict(
    overlap_moe_expert_parallel_comm=True,
    expert_model_parallel_size=2,
    bf16=True,
    fp16=False,
    moe_token_dispatcher_type="alltoall",
    recompute_granularity=None,
)


@pytest.mark.parametrize(
    ("unmet", "said"),
    [
        ({"expert_model_parallel_size": 1}, "--expert-model-parallel-size > 1"),
        ({"bf16": False}, "--bf16 or --fp16"),
        ({"moe_token_dispatcher_type": "allgather"}, "--moe-token-dispatcher-type alltoall or"),
        ({"recompute_granularity": "full"}, "no --recompute-granularity full"),
    ],
)
def test_moe_all_to_all_overlap_without_megatron_cores_conditions_is_one_line(
    unmet: dict[str, object], said: str
) -> None:
    """megatron-core asserts them in TransformerConfig, one traceback per rank after the
    arguments; refused where Megatron-LM's arguments are read, in one line."""
    args = SimpleNamespace(
        pipeline_schedule="dualpipe-v", pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2, micro_batch_size=1, global_batch_size=8,
        data_parallel_size=1, **(OVERLAP_MET | unmet),
    )  # fmt: skip
    with pytest.raises(ScheduleError) as error:
        check_schedule_args(args)
    message = str(error.value)
    assert message.startswith("--overlap-moe-expert-parallel-comm needs ") and said in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("schedule", "combined_1f1b", "refused"),
    [("dualpipe-v", False, False), ("interleaved", True, False), ("interleaved", False, True),
     ("breadth-first", False, True), ("v-zb", False, True)],
)  # fmt: skip
def test_moe_all_to_all_overlap_runs_only_with_overlapped_pairs(
    schedule: str, combined_1f1b: bool, refused: bool
) -> None:
    """--overlap-moe-expert-parallel-comm hides all-to-alls in the pairs that run as
    megatron-core's combined step; a schedule without them is refused in one line, before any
    work, where Megatron-LM's arguments are read."""
    args = SimpleNamespace(
        pipeline_schedule=schedule,
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        micro_batch_size=1,
        global_batch_size=8,
        data_parallel_size=1,
        breadth_first_group_size=None,
        bpipe_max_stored=None,
        combined_1f1b=True if combined_1f1b else None,
        **OVERLAP_MET,
    )
    if not refused:
        check_schedule_args(args)
        return
    with pytest.raises(ScheduleError) as error:
        check_schedule_args(args)
    assert str(error.value) == (
        "--overlap-moe-expert-parallel-comm hides expert all-to-alls in overlapped forward-"
        f"backward pairs, which {schedule} has none of here; use --pipeline-schedule dualpipe-v, "
        "or interleaved with --combined-1f1b, or drop the flag"
    )
    args.overlap_moe_expert_parallel_comm = False
    check_schedule_args(args)
