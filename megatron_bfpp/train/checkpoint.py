"""``bfpp-train`` checkpoints (``--ckpt-format``): ``torch``, one ``torch.save`` file per rank, or
``torch_dist``, megatron-core's ``dist_checkpointing``; loading never runs code from a file, and a
failed collective step is one line, from the lowest failing rank (docs/design-notes.md)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import random
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_bfpp.compat import (
    main_weight_shards,
    megatron_core_version,
    model_params_from_main_params,
    restore_torch_adam_steps,
    torch_adam_state_for_load,
)
from megatron_bfpp.config.run_config import LRSchedule, RunConfig
from megatron_bfpp.ir import first_line
from megatron_bfpp.train.checkpoint_files import (
    METADATA_FILE,
    CheckpointError,
    checkpoint_dir,
    clean_stale,
    fsync_dir,
    fsync_file,
    make_temp_dir,
    publish,
    remove_old,
    write_tracker,
)
from megatron_bfpp.train.checkpoint_metadata import (
    FORMAT_VERSION,
    CheckpointMetadata,
    FileRecord,
    SchedulerPolicy,
    check_resume,
    metadata_to_json,
    read_checkpoint,
)
from megatron_bfpp.train.presets import unwrap

__all__ = ["OtherRankFailed", "load_checkpoint", "read_rank_file", "save_checkpoint"]

# Test hook "<point>:<rank>": SIGKILL that rank at "rank-file" (before writing its files) or
# "publish" (rank 0, between moving an existing same-iteration checkpoint aside and renaming in).
_KILL_DURING_SAVE_ENV = "BFPP_TEST_KILL_DURING_SAVE"
# Test hook: a file name; rank 0 creates it before writing its files and waits there (up to 10
# minutes) for the test to signal the job, as SLURM does when it preempts a job mid-save.
_PAUSE_DURING_SAVE_ENV = "BFPP_TEST_PAUSE_DURING_SAVE"
_PAUSE_S = 600.0
# Megatron-LM's default format for the distributed optimizer (megatron-core 0.16 rejects the
# older "fully_sharded_model_space": flattened ShardedTensors are no longer supported).
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}

# A model chunk's index -> a context in which its (sharded) parameters are whole.
GatherChunk = Callable[[int], contextlib.AbstractContextManager[Any]]
_WEIGHTS_ONLY_VARIABLES = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_SCHEDULER_GROUP_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")


class OtherRankFailed(Exception):
    """Another rank failed and reports it (one line in all); this rank exits quietly."""


def _agree(error: CheckpointError | None) -> None:
    """Every rank learns whether any failed, so none waits forever; the lowest failing rank raises
    its error (the one line users see), the others :class:`OtherRankFailed`."""
    world, nccl = dist.get_world_size(), dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    first = torch.tensor(
        [dist.get_rank() if error is not None else world], dtype=torch.int64, device=device
    )
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    failed = int(first.item())
    if failed == world:
        return
    if error is not None and failed == dist.get_rank():
        raise error
    raise OtherRankFailed(f"rank {failed} failed")


def _kill_point(point: str) -> None:
    if os.environ.get(_KILL_DURING_SAVE_ENV) == f"{point}:{dist.get_rank()}":
        os.kill(os.getpid(), signal.SIGKILL)
    marker = os.environ.get(_PAUSE_DURING_SAVE_ENV)
    if marker and point == "rank-file" and dist.get_rank() == 0:
        Path(marker).write_text(f"{os.getpid()}\n")
        time.sleep(_PAUSE_S)


def _gpt(chunk: Any) -> Any:
    """The ``GPTModel`` whose state a checkpoint holds (inside DDP, and ``Float16Module`` in bf16,
    which returns no ``load_state_dict`` result)."""
    return unwrap(chunk)


def _parameter_keys(module: Any) -> set[str]:
    """State-dict keys of the module's parameters (not TE's ``_extra_state``: not optimizer's)."""
    return {name for name, _ in module.named_parameters()}


def _sharded_state(
    model: Sequence[Any], optimizer: Any, *, is_loading: bool, rng: Any, parameters: bool = True
) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state: dict[str, Any] = {}
    for index, chunk in enumerate(model):
        # without parameters: only metadata is read from released (sharded) ones, never their data
        dropped = set() if parameters else _parameter_keys(_gpt(chunk))
        items = _gpt(chunk).sharded_state_dict().items()
        state[f"model{index}"] = {k: v for k, v in items if k not in dropped}
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata=_OPTIMIZER_METADATA
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    state["rng_state"] = ShardedObject("rng_state", rng, (world,), (rank,), replica_id=0)
    return state


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers (Adam) inside megatron-core's (chained) distributed optimizer."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _refusal(error: BaseException) -> str:
    """Why a restricted unpickler refused a file, in a few words: the callable it would have
    called, else torch's one-line reason (its message is a paragraph of advice around it)."""
    text = str(error)
    if found := _GLOBAL.search(text):
        return f"it would call {found.group(1)}"
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = next((line for line in lines if not line.startswith(advice)), "not plain data")
    return f"it is more than tensors and plain values ({reason})"


def save_checkpoint(
    root: str | Path,
    *,
    ckpt_format: str = "torch",
    iteration: int,
    consumed_samples: int,
    model: Sequence[Any],
    optimizer: Any,
    scheduler: Any,
    run: RunConfig,
    gather_chunk: GatherChunk | None = None,
    sharded: bool = False,
) -> Path:
    """Every rank saves one checkpoint (collective), atomically (:mod:`.checkpoint_files`); fully
    sharded, ``gather_chunk(i)`` (torch) gathers chunk ``i`` to copy it."""
    root = Path(root)
    temp = _shared_temp_dir(root, iteration)
    records: list[FileRecord] = []
    error = None
    try:
        _kill_point("rank-file")
        state = _rank_state(scheduler, iteration, consumed_samples)
        if ckpt_format == "torch":
            records = [_save_torch(temp, model, optimizer, state, gather_chunk)]
        else:
            _save_torch_dist(temp, model, optimizer, state, parameters=not sharded)
    except Exception as failure:  # torch re-raises ENOSPC as RuntimeError, megatron-core's
        # writer as CheckpointException: any failure to write is the same one line
        error = CheckpointError(
            f"--save {root}: rank {dist.get_rank()} could not write iteration {iteration} "
            f"({_write_failure(failure, root)}); the last complete checkpoint is untouched and "
            "this save's files were removed"
        )
    _agree_or_clear(error, temp)
    gathered: list[list[FileRecord] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    final, error = checkpoint_dir(root, iteration), None
    if dist.get_rank() == 0:
        files = [record for rank_records in gathered for record in rank_records or []]
        if ckpt_format != "torch":  # megatron-core's files: sizes only
            files = [
                FileRecord(name=str(path.relative_to(temp)), size=path.stat().st_size, sha256=None)
                for path in sorted(temp.rglob("*"))
                if path.is_file()
            ]
        saved = scheduler.state_dict()
        schedule = LRSchedule(**{k: saved[k] for k in LRSchedule.__dataclass_fields__})
        metadata = CheckpointMetadata(
            format_version=FORMAT_VERSION,
            ckpt_format=ckpt_format,
            iteration=iteration,
            consumed_samples=consumed_samples,
            run=run,
            opt_param_scheduler=schedule,
            megatron_core=".".join(map(str, megatron_core_version())),
            files=tuple(sorted(files, key=lambda r: r.name)),
        )
        try:
            _publish(root, temp, final, metadata)
        except OSError as failure:
            error = CheckpointError(
                f"--save {root}: could not publish {final.name} "
                f"({_write_failure(failure, root)}); the tracker still names the last complete "
                "checkpoint and this save's files were removed"
            )
    _agree_or_clear(error, temp)
    return final


def _agree_or_clear(error: CheckpointError | None, temp: Path) -> None:
    """:func:`_agree`; when any rank failed, rank 0 removes the save's temporary directory
    (every rank has stopped writing into it by then) before the error goes up."""
    try:
        _agree(error)
    except (CheckpointError, OtherRankFailed):
        if dist.get_rank() == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise


def _write_failure(failure: BaseException, root: Path) -> str:
    """What failed, in one line, with the space left where it matters (a full disk shows as
    torch's ``[enforce fail at inline_container.cc]`` or megatron-core's CheckpointException)."""
    cause: BaseException | None = failure
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    text = (cause.strerror if isinstance(cause, OSError) else None) or first_line(failure)
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return text
    return f"{text}; {free:,} bytes free there"


def _shared_temp_dir(root: Path, iteration: int) -> Path:
    """Rank 0 clears interrupted saves' leftovers and makes the temporary directory for all."""
    names: list[str | None] = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            clean_stale(root)
            names[0] = make_temp_dir(root, iteration).name
        except OSError as failure:
            error = CheckpointError(f"--save {root}: cannot create a checkpoint there: {failure}")
    _agree(error)  # past it, rank 0 has named the directory
    dist.broadcast_object_list(names, src=0)
    return root / str(names[0])


def _publish(root: Path, temp: Path, final: Path, metadata: CheckpointMetadata) -> None:
    """Metadata last (it marks the directory complete), everything fsynced, then the rename and
    the tracker; an older copy of the same iteration is deleted only after both."""
    for path in sorted(temp.rglob("*")):
        if path.is_file():
            fsync_file(path)
        elif path.is_dir():
            fsync_dir(path)
    (temp / METADATA_FILE).write_text(metadata_to_json(metadata))
    fsync_file(temp / METADATA_FILE)
    fsync_dir(temp)
    old = publish(temp, final, between=lambda: _kill_point("publish"))
    write_tracker(root, metadata.iteration)
    remove_old(old)


def _rank_state(scheduler: Any, iteration: int, consumed_samples: int) -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "format": "torch",
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "opt_param_scheduler": scheduler.state_dict(),
        # byte tensors and random's tuple of ints: loadable with weights_only=True
        "rng_state": {
            "random": random.getstate(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": get_cuda_rng_tracker().get_states(),
        },
    }


def _save_torch(
    temp: Path,
    model: Sequence[Any],
    optimizer: Any,
    state: dict[str, Any],
    gather_chunk: GatherChunk | None,
) -> FileRecord:
    """Per-rank format: ``state`` (scheduler, RNG, iteration), chunks' ``state_dict``, this rank's
    Adam shard (inner torch optimizers' ``state_dict``) and, in bf16, its fp32 main weights (in
    fp32 they view the model's)."""
    state["model"] = [_chunk_state(index, chunk, gather_chunk) for index, chunk in enumerate(model)]
    state["optimizer"] = [o.state_dict() for o in _inner_optimizers(optimizer)]
    state["main_weights"] = [
        shard.detach().to("cpu", copy=True) for shard in main_weight_shards(optimizer)
    ]
    path = temp / _rank_file_name(dist.get_rank())
    with open(path, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    return FileRecord(name=path.name, size=path.stat().st_size, sha256=_sha256(path))


def _chunk_state(index: int, chunk: Any, gather_chunk: GatherChunk | None) -> dict[str, Any]:
    """A chunk's ``state_dict``; with ``gather_chunk``, read while the chunk is gathered and
    copied to host memory (its buffers are released when the context ends)."""
    if gather_chunk is None:
        return dict(_gpt(chunk).state_dict())
    with gather_chunk(index):
        return {
            key: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
            for key, value in _gpt(chunk).state_dict().items()
        }


def _save_torch_dist(
    temp: Path, model: Sequence[Any], optimizer: Any, state: dict[str, Any], *, parameters: bool
) -> None:
    from megatron.core import dist_checkpointing

    sharded = _sharded_state(
        model, optimizer, is_loading=False, rng=state["rng_state"], parameters=parameters
    )
    sharded.update(
        {k: v for k, v in state.items() if k not in ("rank", "rng_state")}, format="torch_dist"
    )
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dist_checkpointing.save(sharded, str(temp))
    except CheckpointException as failure:  # a BaseException: turned into an ordinary error
        ranks = ", ".join(str(rank) for rank in sorted(failure.failures))
        raise RuntimeError(f"megatron-core's checkpoint writer failed on rank(s) {ranks}") from None


def load_checkpoint(
    root: str | Path,
    *,
    model: Sequence[Any],
    optimizer: Any,
    scheduler: Any,
    run: RunConfig,
    scheduler_policy: SchedulerPolicy = "check",
) -> tuple[int, int]:
    """Restore model, optimizer, scheduler and RNG from ``root``'s latest complete checkpoint
    (collective, metadata re-checked); returns ``(iteration, consumed_samples)``."""
    error = None
    try:
        path, metadata = read_checkpoint(root)
        check_resume(metadata, run, root=root, scheduler=scheduler_policy)
    except CheckpointError as failure:
        error = failure
    _agree(error)  # past it, every rank has read its metadata
    try:
        own_groups = _scheduler_group_values(optimizer) if scheduler_policy == "override" else None
        if metadata.ckpt_format == "torch":
            _load_torch(root, path, metadata, model, optimizer, scheduler, own_groups)
        else:
            _load_torch_dist(root, path, model, optimizer, scheduler, own_groups)
    except CheckpointError as failure:
        error = failure
    _agree(error)
    return metadata.iteration, metadata.consumed_samples


def read_rank_file(file: Path, *, record: FileRecord | None = None, label: str = "") -> Any:
    """A rank file checked against its SHA-256, read by ``torch.load(weights_only=True)``."""
    name = f"{label}{file.parent.name}/{file.name}"
    if record is not None and _sha256(file) != record.sha256:
        raise CheckpointError(
            f"{name} does not match the SHA-256 its checkpoint recorded (corrupt or replaced); "
            "resume from another checkpoint"
        )
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{name} refused: {_refusal(error)}; a checkpoint may hold only tensors and plain "
            "values (read with torch.load(weights_only=True)), never code"
        ) from None
    except Exception as error:  # a file users hand us: any failure to parse it is a bad file
        raise CheckpointError(
            f"{name} is unreadable (truncated or corrupt: {first_line(error)}); resume from "
            "another checkpoint"
        ) from None


def _scheduler_group_values(optimizer: Any) -> list[list[dict[str, Any]]]:
    """What megatron-core's scheduler prefers in each parameter group to its own values, which
    loading the optimizer replaces by the checkpoint's (an override would not change the rate)."""
    return [
        [{key: group[key] for key in _SCHEDULER_GROUP_KEYS if key in group} for group in groups]
        for groups in (inner.param_groups for inner in _inner_optimizers(optimizer))
    ]


def _load_scheduler_and_rng(
    state: dict[str, Any],
    optimizer: Any,
    scheduler: Any,
    own_groups: list[list[dict[str, Any]]] | None,
) -> None:
    """After the optimizer: this run's parameter-group values under
    ``--override-opt_param-scheduler`` (else the checkpoint's stay), the scheduler, the RNGs."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    if own_groups is not None:
        _set_group_values(optimizer, own_groups)
    scheduler.load_state_dict(state["opt_param_scheduler"])
    rng = state["rng_state"]
    version, internal, gauss = rng["random"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(rng["tracker"])


def _load_torch(
    root: str | Path,
    path: Path,
    metadata: CheckpointMetadata,
    model: Sequence[Any],
    optimizer: Any,
    scheduler: Any,
    own_groups: list[list[dict[str, Any]]] | None,
) -> None:
    rank = dist.get_rank()
    name, records = _rank_file_name(rank), {record.name: record for record in metadata.files}
    if name not in records:
        raise CheckpointError(f"--load {root}: {path.name}/{METADATA_FILE} lists no {name}")
    label = f"--load {root}: "
    state = read_rank_file(path / name, record=records[name], label=label)
    where = f"{label}{path.name}/{name}"
    try:
        if (state["iteration"], state["rank"]) != (metadata.iteration, rank):
            raise ValueError(
                f"holds rank {state['rank']} of iteration {state['iteration']}, not rank {rank} "
                f"of iteration {metadata.iteration}"
            )
        for chunk, chunk_state in zip(model, state["model"], strict=True):
            _gpt(chunk).load_state_dict(chunk_state)
        for opt, opt_state in zip(_inner_optimizers(optimizer), state["optimizer"], strict=True):
            opt.load_state_dict(opt_state)
        with torch.no_grad():  # older (fp32) files have none, as an fp32 run
            for shard, saved in zip(
                main_weight_shards(optimizer), state.get("main_weights", []), strict=True
            ):
                shard.copy_(saved)
        _load_scheduler_and_rng(state, optimizer, scheduler, own_groups)
    except (AssertionError, KeyError, IndexError, RuntimeError, TypeError, ValueError) as error:
        raise CheckpointError(f"{where} does not fit this run: {first_line(error)}") from None


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    """megatron-core calls ``torch.load`` without ``weights_only``; this variable forces it."""
    saved = {key: os.environ.pop(key, None) for key in _WEIGHTS_ONLY_VARIABLES}
    os.environ[_WEIGHTS_ONLY_VARIABLES[0]] = "1"
    try:
        yield
    finally:
        for key in saved:
            os.environ.pop(key, None)
        os.environ.update({key: value for key, value in saved.items() if value is not None})


_DCP = "torch.distributed.checkpoint"
# Module -> exactly the names torch's distributed-checkpoint ``.metadata`` holds from it as written
# by megatron-core 0.16 and 0.19 (torch's dataclasses and enums: building them runs no code of the
# file's choosing), plus megatron-core's empty stand-ins kept so older checkpoints unpickle.
_DCP_METADATA_GLOBALS: dict[str, tuple[str, ...]] = {
    f"{_DCP}.metadata": (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    ),
    f"{_DCP}.filesystem": ("_StorageInfo",),
    f"{_DCP}.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    "torch": ("Size",),
    "torch.serialization": ("_get_layout",),
    "pathlib": ("PosixPath", "WindowsPath"),
    "collections": ("OrderedDict",),
    "megatron.core.dist_checkpointing.strategies.torch": ("MCoreMetadata", "MCoreSavePlan"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Knows only the types torch's distributed-checkpoint ``.metadata`` holds (and torch's dtypes,
    layouts, memory formats), never a whole module: pickle resolves dotted names, so any module
    importing ``os`` would hand out ``os.system``."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _DCP_METADATA_GLOBALS.get(module, ())
        if module == "torch" and name.isidentifier():
            allowed |= isinstance(
                getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format
            )
        if not allowed:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not checkpoint metadata")
        return super().find_class(module, name)


def check_dcp_metadata(path: Path, *, label: str = "") -> None:
    """Refuse a torch ``.metadata`` file that would run code when torch unpickles it."""
    file = path / ".metadata"
    try:
        with open(file, "rb") as stream:
            _MetadataUnpickler(stream).load()
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{label}{path.name}/.metadata refused: {_refusal(error)}; a checkpoint is data, "
            "never code"
        ) from None
    except Exception as error:  # a file users hand us
        raise CheckpointError(
            f"{label}{path.name}/.metadata is unreadable ({first_line(error)})"
        ) from None


def _saved_param_groups(state: Any) -> list[list[dict[str, Any]]]:
    """A loaded optimizer state's groups, a list per inner optimizer, in megatron-core's order."""
    if isinstance(state, dict) and isinstance(state.get("param_groups"), list):
        return [state["param_groups"]]
    values = state.values() if isinstance(state, dict) else state if isinstance(state, list) else ()
    return [groups for value in values for groups in _saved_param_groups(value)]


def _set_group_values(optimizer: Any, values: list[list[dict[str, Any]]]) -> None:
    """Each parameter group takes its scheduler values from ``values`` (by position: one order)."""
    for inner, groups in zip(_inner_optimizers(optimizer), values, strict=True):
        for group, own in zip(inner.param_groups, groups, strict=True):
            group.update({key: own[key] for key in _SCHEDULER_GROUP_KEYS if key in own})


def _take_saved_group_values(optimizer: Any, saved: list[list[dict[str, Any]]]) -> None:
    """megatron-core 0.19 pairs a checkpoint's parameter groups with the optimizer's by their
    values (``max_lr`` among them), so before loading each takes the checkpoint's."""
    inner = _inner_optimizers(optimizer)
    if [len(groups) for groups in saved] == [len(opt.param_groups) for opt in inner]:
        _set_group_values(optimizer, saved)  # else megatron-core's own error says why


def _load_model_entries(module: Any, entries: dict[str, Any]) -> None:
    """Load a chunk's non-parameter entries; a key missing on either side is an error."""
    result = module.load_state_dict(entries, strict=False)
    if (missing := set(result.missing_keys) - _parameter_keys(module)) or result.unexpected_keys:
        raise ValueError(
            f"model entries missing: {sorted(missing)}, unexpected: {result.unexpected_keys}"
        )


def _load_torch_dist(
    root: str | Path,
    path: Path,
    model: Sequence[Any],
    optimizer: Any,
    scheduler: Any,
    own_groups: list[list[dict[str, Any]]] | None,
) -> None:
    from megatron.core import dist_checkpointing

    label = f"--load {root}: "
    check_dcp_metadata(path, label=label)
    torch_adam_state_for_load(optimizer)
    # The parameters come from the optimizer's main parameters (the one copy every torch_dist
    # checkpoint has: fully sharded saves store no other), the model part gives the rest.
    template = _sharded_state(model, optimizer, is_loading=True, rng=None, parameters=False)
    try:
        with _weights_only_loads():
            state = dist_checkpointing.load(template, str(path))
        for index, chunk in enumerate(model):
            _load_model_entries(_gpt(chunk), state[f"model{index}"])
        _take_saved_group_values(optimizer, _saved_param_groups(state["optimizer"]))
        with torch.no_grad():  # fp32 main parameters are views of the model's (leaf) weights
            optimizer.load_state_dict(state["optimizer"])
            model_params_from_main_params(optimizer, model)
        restore_torch_adam_steps(optimizer)
        _load_scheduler_and_rng(state, optimizer, scheduler, own_groups)
    except Exception as error:  # megatron-core's reader: its errors name no flag we could
        raise CheckpointError(
            f"{label}{path.name} could not be loaded: {first_line(error)}"
        ) from None
