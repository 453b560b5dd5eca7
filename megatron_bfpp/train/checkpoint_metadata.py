"""What a ``bfpp-train`` checkpoint says about itself (``bfpp_checkpoint.json``: its flags and every
file's size, rank files' SHA-256) and whether a run may resume from it; torch-free, so the command
line refuses an impossible resume before any rank starts (docs/design-notes.md, "Checkpoints")."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from megatron_bfpp.config.run_config import UNEVEN_FLAGS, LRSchedule, RunConfig, flag_name
from megatron_bfpp.train.checkpoint_files import (
    METADATA_FILE,
    TRACKER,
    CheckpointError,
    checkpoint_dir,
    complete_checkpoint,
    read_bounded,
    read_tracker,
    regular_file_problem,
)
from megatron_bfpp.train.data_source import DEFAULT_SPLIT

# bfpp_checkpoint.json: flags and ~150 bytes per file; 64 MiB is 400,000 files, far above any job.
METADATA_LIMIT = 64 << 20

__all__ = [
    "CKPT_FORMATS",
    "FORMAT_VERSION",
    "CheckpointMetadata",
    "FileRecord",
    "SchedulerPolicy",
    "check_resume",
    "metadata_from_json",
    "metadata_to_json",
    "read_checkpoint",
    "resume_warnings",
    "save_problem",
    "scheduler_policy",
]

FORMAT_VERSION = 1
CKPT_FORMATS = ("torch", "torch_dist")
SchedulerPolicy = Literal["check", "override", "checkpoint"]
_OVERRIDE_FLAGS = (
    "add --override-opt_param-scheduler to use this run's values or "
    "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
)


@dataclasses.dataclass(frozen=True, slots=True)
class FileRecord:
    """One file of a checkpoint, relative to its directory. ``sha256`` is recorded for the
    per-rank files (each rank hashes its own); megatron-core's ``torch_dist`` files get sizes."""

    name: str
    size: int
    sha256: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """``bfpp_checkpoint.json``. ``opt_param_scheduler`` is the scheduler as saved (it can differ
    from what ``run``'s flags imply when that run overrode or kept an older schedule)."""

    format_version: int
    ckpt_format: str
    iteration: int
    consumed_samples: int
    run: RunConfig
    opt_param_scheduler: LRSchedule
    megatron_core: str
    files: tuple[FileRecord, ...]


def metadata_to_json(metadata: CheckpointMetadata) -> str:
    return json.dumps(dataclasses.asdict(metadata), indent=1, sort_keys=True) + "\n"


def metadata_from_json(text: str, *, source: str) -> CheckpointMetadata:
    """Parse and type-check every field; a file that does not fit is one error naming it."""
    try:
        data = json.loads(text)
    except ValueError as error:
        raise CheckpointError(f"{source}: not valid JSON ({error})") from None
    except RecursionError:
        raise CheckpointError(
            f"{source}: nested too deeply to be bfpp-train's metadata (a few levels)"
        ) from None
    if isinstance(data, dict) and data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{source}: format_version {data.get('format_version')!r}; this bfpp-train reads "
            f"version {FORMAT_VERSION}"
        )
    metadata: CheckpointMetadata = _build(CheckpointMetadata, data, source=source, where="")
    return metadata


def _build(kind: Any, value: Any, *, source: str, where: str) -> Any:
    """``value`` (parsed JSON) as type ``kind``: dataclasses field by field, exact key sets."""

    def bad(expected: str) -> CheckpointError:
        return CheckpointError(
            f"{source}: {where or 'the file'} should be {expected}, got {value!r:.60}"
        )

    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        hints, fields = typing.get_type_hints(kind), dataclasses.fields(kind)
        names = [field.name for field in fields]
        # fields added later, with a default, may be absent (checkpoints written before them)
        required = {field.name for field in fields if field.default is dataclasses.MISSING}
        if not isinstance(value, dict) or not required <= set(value) <= set(names):
            raise bad(f"an object with keys {', '.join(names)}")
        return kind(
            **{
                name: _build(hints[name], value[name], source=source, where=f"{where}.{name}")
                for name in names
                if name in value
            }
        )
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _build(inner, value, source=source, where=where)
    if isinstance(kind, type) and issubclass(kind, enum.StrEnum):
        names = [member.value for member in kind]
        if not isinstance(value, str) or value not in names:
            raise bad(f"one of {', '.join(map(repr, names))}")
        return kind(value)
    if origin is tuple:
        if not isinstance(value, list):
            raise bad("a list")
        return tuple(
            _build(args[0], item, source=source, where=f"{where}[{index}]")
            for index, item in enumerate(value)
        )
    checks: dict[Any, tuple[str, Callable[[Any], bool]]] = {
        int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
        float: ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
        str: ("a string", lambda v: isinstance(v, str)),
        bool: ("true or false", lambda v: isinstance(v, bool)),
    }
    if kind not in checks:
        raise TypeError(f"no JSON reader for {kind!r}")  # a field type this module forgot
    expected, check = checks[kind]
    if not check(value):
        raise bad(expected)
    return float(value) if kind is float else value


def read_checkpoint(root: str | Path) -> tuple[Path, CheckpointMetadata]:
    """The complete checkpoint ``root``'s tracker names and its metadata, every listed file checked
    present at its recorded size (a truncated or missing file named before anything loads)."""
    iteration = read_tracker(root)
    path = complete_checkpoint(root, iteration)
    if path is None:
        name = checkpoint_dir(root, iteration).name
        raise CheckpointError(
            f"--load {root}: {name} is missing or incomplete (no {METADATA_FILE}); it was not "
            "written by this bfpp-train or its save was interrupted"
        )
    source = f"--load {root}: {path.name}/{METADATA_FILE}"
    if os.path.islink(path):
        raise CheckpointError(
            f"--load {root}: {path.name} is a symbolic link (a checkpoint holds only its own "
            "directories and files)"
        )
    try:
        text = read_bounded(path / METADATA_FILE, METADATA_LIMIT, label=source).decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{source}: cannot read it ({error})") from None
    metadata = metadata_from_json(text, source=source)
    if metadata.ckpt_format not in CKPT_FORMATS:
        raise CheckpointError(
            f"{source}: unknown ckpt_format {metadata.ckpt_format!r} (known: "
            f"{', '.join(CKPT_FORMATS)})"
        )
    if metadata.iteration != iteration:
        raise CheckpointError(
            f"{source}: records iteration {metadata.iteration}, the tracker {iteration}"
        )
    for record in metadata.files:
        _check_file(root, path, record)
    return path, metadata


def _check_file(root: str | Path, path: Path, record: FileRecord) -> None:
    file, where = path / record.name, f"--load {root}: {path.name}/{record.name}"
    if Path(record.name).is_absolute() or ".." in Path(record.name).parts:
        raise CheckpointError(
            f"--load {root}: {METADATA_FILE} lists {record.name!r}, outside the checkpoint"
        )
    if (problem := regular_file_problem(file)) is not None:
        raise CheckpointError(f"{where} {problem}")
    try:
        size = file.stat().st_size
    except OSError as error:
        raise CheckpointError(f"{where} cannot be read ({error.strerror})") from None
    if size != record.size:
        raise CheckpointError(
            f"{where} has {size} bytes, the checkpoint recorded {record.size} (truncated or "
            "replaced); resume from another checkpoint"
        )


def _model_differences(saved: RunConfig, current: RunConfig) -> list[str]:
    """``--flag saved, this run has current`` per differing model flag (defaults filled in)."""
    model_saved, model_now = saved.model.effective_flags(), current.model.effective_flags()
    return [
        f"{flag_name(dest)} {value}, this run has {model_now[dest]}"
        for dest, value in model_saved.items()
        if model_now[dest] != value
    ]


def _layout_differences(saved: RunConfig, current: RunConfig) -> list[str]:
    """``--flag saved, this run has current`` for each model or layout difference."""
    differences = _model_differences(saved, current)
    a, b = saved.layout, current.layout
    for dest in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "num_virtual_stages_per_pipeline_rank",
        *UNEVEN_FLAGS,
        "expert_model_parallel_size",  # a rank's file holds its own experts
    ):
        if getattr(a, dest) != getattr(b, dest):
            differences.append(
                f"{flag_name(dest)} {getattr(a, dest)}, this run has {getattr(b, dest)}"
            )
    if a.placement != b.placement:
        differences.append(
            f"--pipeline-schedule {saved.pipeline_schedule} ({a.placement} placement), this run "
            f"has {current.pipeline_schedule} ({b.placement})"
        )
    if a.world_size != b.world_size:
        differences.append(
            f"{a.world_size} ranks (data-parallel size {a.data_parallel_size}), this run has "
            f"{b.world_size} ({b.data_parallel_size})"
        )
    precision = {True: "--bf16", False: "fp32"}  # bf16 keeps fp32 main weights beside the model's
    if (was := saved.training.bf16) != (now := current.training.bf16):
        differences.append(f"{precision[was]}, this run has {precision[now]}")
    return differences


def _scheduler_differences(saved: CheckpointMetadata, current: RunConfig) -> list[str]:
    """The flags that make this run's learning-rate schedule differ from the checkpoint's as
    megatron-core compares them (steps count samples: ``--global-batch-size`` alone moves them)."""
    was, now = saved.opt_param_scheduler, current.training.lr_schedule()
    training, old_gbs = current.training, saved.run.training.global_batch_size
    # this run's iteration counts at the checkpoint's batch size: what the iteration flags changed
    same_batch = dataclasses.replace(training, global_batch_size=old_gbs).lr_schedule()
    differences = []
    if old_gbs != training.global_batch_size and _steps(was) != _steps(now):
        differences.append(
            f"--global-batch-size {training.global_batch_size} (checkpoint: {old_gbs}; warm-up "
            "and decay count samples)"
        )
    for flag, old, new in (("--lr", was.max_lr, now.max_lr), ("--min-lr", was.min_lr, now.min_lr)):
        if old != new:
            differences.append(f"{flag} {new!r} (checkpoint: {old!r})")
    if was.lr_warmup_steps != same_batch.lr_warmup_steps:
        differences.append(
            f"--lr-warmup-iters {training.lr_warmup_iters} (warm-up over "
            f"{same_batch.lr_warmup_steps // old_gbs} iterations, checkpoint: "
            f"{was.lr_warmup_steps / old_gbs:g})"
        )
    if _steps(was)[1:] != _steps(same_batch)[1:]:  # the decay and weight-decay spans
        flag = (
            f"--lr-decay-iters {training.lr_decay_iters}"
            if training.lr_decay_iters is not None
            else f"--train-iters {training.train_iters}"
        )
        differences.append(
            f"{flag} (decay over {training.decay_iters} iterations, checkpoint: "
            f"{was.lr_decay_steps / old_gbs:g})"
        )
    if (was.start_wd, was.end_wd) != (now.start_wd, now.end_wd):
        differences.append(f"--weight-decay {now.start_wd!r} (checkpoint: {was.start_wd!r})")
    for name in ("lr_decay_style", "wd_incr_style"):
        if getattr(was, name) != getattr(now, name):
            differences.append(
                f"{name.replace('_', ' ')} {getattr(now, name)} (checkpoint: {getattr(was, name)})"
            )
    return differences


def _steps(schedule: LRSchedule) -> tuple[int, int, int]:
    return schedule.lr_warmup_steps, schedule.lr_decay_steps, schedule.wd_incr_steps


def check_resume(
    metadata: CheckpointMetadata,
    current: RunConfig,
    *,
    root: str | Path,
    scheduler: SchedulerPolicy = "check",
) -> None:
    """Raise one line naming every difference that stops ``current`` from resuming."""
    if layout := _layout_differences(metadata.run, current):
        raise CheckpointError(
            f"--load {root}: checkpoint was saved with {'; '.join(layout)}; a checkpoint resumes "
            "only on the same model and parallel layout (the schedule, --micro-batch-size and "
            "--global-batch-size may change)"
        )
    differences = _scheduler_differences(metadata, current) if scheduler == "check" else []
    if not differences:
        return
    hint = ""
    gbs, decay = current.training.global_batch_size, metadata.opt_param_scheduler.lr_decay_steps
    decay_changed = any(d.startswith(("--train-iters", "--lr-decay-iters")) for d in differences)
    if decay_changed and decay % gbs == 0:
        hint = f"; to train further on the checkpoint's schedule: --lr-decay-iters {decay // gbs}"
    raise CheckpointError(
        f"--load {root}: this run's learning-rate schedule differs from the checkpoint's: "
        f"{', '.join(differences)}; {_OVERRIDE_FLAGS}{hint}"
    )


def save_problem(root: str | Path, current: RunConfig) -> str | None:
    """Why ``--save root`` (not resumed from) would overwrite another model's checkpoint, or holds
    a tracker that is no regular file; an unreadable checkpoint is left to the save."""
    problem = regular_file_problem(Path(root) / TRACKER)
    if problem == "is missing":
        return None
    if problem is not None:
        return f"--save {root}: {TRACKER} {problem}; remove it or choose another --save directory"
    try:
        _, metadata = read_checkpoint(root)
    except CheckpointError:
        return None
    if not (differences := _model_differences(metadata.run, current)):
        return None
    return (
        f"--save {root}: holds a checkpoint of another model (iteration {metadata.iteration}, "
        f"saved with {'; '.join(differences)}); this run's saves would overwrite it: choose "
        "another --save directory"
    )


def resume_warnings(
    metadata: CheckpointMetadata, current: RunConfig, *, root: str | Path
) -> list[str]:
    """One line per ``--seed``, ``--data-path`` or ``--split`` that differs: accepted as
    Megatron-LM accepts it, though the samples from ``consumed_samples`` on change."""
    saved, now = metadata.run.training, current.training
    after = (
        f"the samples from {metadata.consumed_samples:,} on come from another stream; "
        "accepted, as Megatron-LM accepts it"
    )
    warnings = []
    for flag, was, will in (
        ("--seed", saved.seed, now.seed),
        ("--data-path", saved.data_path, now.data_path),
        ("--split", saved.split or DEFAULT_SPLIT, now.split or DEFAULT_SPLIT),
    ):
        if was != will and not (flag == "--split" and saved.data_path != now.data_path):
            warnings.append(
                f"--load {root}: checkpoint was saved with {flag} {_shown(was)}, this run has "
                f"{_shown(will)}: {after}"
            )
    return warnings


def _shown(value: object) -> str:
    return "none (synthetic data)" if value is None else str(value)


def scheduler_policy(args: Any) -> SchedulerPolicy:
    """Megatron-LM's two flags as one value (the command line refuses both at once)."""
    if getattr(args, "override_opt_param_scheduler", False):
        return "override"
    return "checkpoint" if getattr(args, "use_checkpoint_opt_param_scheduler", False) else "check"
