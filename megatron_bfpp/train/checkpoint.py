"""``bfpp-train`` checkpoints, in one of two formats (``--ckpt-format``):

* ``torch`` (default): one ``torch.save`` file per rank (``rank_00000.pt`` ...) with the rank's
  model chunks, its shard of the distributed optimizer's Adam state, scheduler, RNG, iteration,
  consumed samples and model flags. Resumes exactly, on the same layout and world size only.
  It is the default because megatron-core 0.16's ``torch_dist`` writer forks writer processes
  that hang inside gloo CPU ranks (measured here: ``write_preloaded_data_multiproc`` waits
  forever), so the distributed format cannot be the CPU main job's default.
* ``torch_dist``: megatron-core distributed checkpointing, described below (meant for GPUs;
  not verified on a GPU yet).

Layout of ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt     the last complete checkpoint's iteration
    DIR/iter_0000020/                          one ``megatron.core.dist_checkpointing`` checkpoint

A ``torch_dist`` checkpoint holds the model chunks' ``sharded_state_dict()`` (keys by global
layer number, so the files do not depend on how layers are split), the distributed optimizer's
``sharded_state_dict`` (format ``dp_reshardable``), the scheduler, the iteration, the consumed
samples (the data position: samples are a pure function of their index, see
:mod:`megatron_bfpp.train.data`), the model flags, and every rank's RNG states (one
``ShardedObject`` per global rank).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "FORMATS",
    "TRACKER",
    "checkpoint_dir",
    "latest_iteration",
    "load_checkpoint",
    "save_checkpoint",
]

FORMATS = ("torch", "torch_dist")

TRACKER = "latest_checkpointed_iteration.txt"
# Megatron-LM's default format for the distributed optimizer (megatron-core 0.16 rejects the
# older "fully_sharded_model_space": flattened ShardedTensors are no longer supported).
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def checkpoint_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | Path) -> int:
    """The iteration recorded in ``root``'s tracker file (raises ``FileNotFoundError``)."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise FileNotFoundError(f"--load {root}: no {TRACKER} (not a bfpp-train checkpoint)")
    return int(tracker.read_text().strip())


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "random": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(
    model: Sequence[Any], optimizer: Any, *, is_loading: bool, rng: Any
) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state: dict[str, Any] = {
        f"model{index}": chunk.sharded_state_dict() for index, chunk in enumerate(model)
    }
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata=_OPTIMIZER_METADATA
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    state["rng_state"] = ShardedObject("rng_state", rng, (world,), (rank,), replica_id=0)
    return state


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers (Adam) inside megatron-core's (chained) distributed optimizer."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _rank_file(path: Path) -> Path:
    return path / f"rank_{dist.get_rank():05d}.pt"


def _save_torch(path: Path, model: Sequence[Any], optimizer: Any, extra: dict[str, Any]) -> None:
    """Per-rank format: this rank's chunks (``state_dict`` of each GPTModel), its shard of the
    Adam state (the inner torch optimizers' ``state_dict``: with fp32 parameters the distributed
    optimizer's main parameters are views of the model's), the scheduler, RNG, iteration."""
    state = dict(extra)
    state["model"] = [chunk.module.state_dict() for chunk in model]
    state["optimizer"] = [o.state_dict() for o in _inner_optimizers(optimizer)]
    state["rng_state"] = _rng_state()
    state["world_size"] = dist.get_world_size()
    torch.save(state, _rank_file(path))


def _load_torch(path: Path, model: Sequence[Any], optimizer: Any) -> dict[str, Any]:
    file = _rank_file(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file} missing: resume needs the same number of ranks")
    state = torch.load(file, map_location="cpu", weights_only=False)
    if state["world_size"] != dist.get_world_size() or len(state["model"]) != len(model):
        raise ValueError(
            f"{path} was saved by {state['world_size']} ranks with {len(state['model'])} chunks "
            "per rank; the torch format resumes only on the same layout"
        )
    for chunk, chunk_state in zip(model, state["model"], strict=True):
        chunk.module.load_state_dict(chunk_state)
    inner = _inner_optimizers(optimizer)
    for opt, opt_state in zip(inner, state["optimizer"], strict=True):
        opt.load_state_dict(opt_state)
    loaded: dict[str, Any] = state
    return loaded


def save_checkpoint(
    root: str | Path,
    *,
    ckpt_format: str = "torch",
    iteration: int,
    consumed_samples: int,
    model: Sequence[Any],
    optimizer: Any,
    scheduler: Any,
    flags: dict[str, Any],
) -> Path:
    """Save one checkpoint on every rank (collective), then point the tracker at it."""
    from megatron.core import dist_checkpointing

    path = checkpoint_dir(root, iteration)
    if dist.get_rank() == 0:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    dist.barrier()
    extra = dict(
        iteration=iteration,
        consumed_samples=consumed_samples,
        opt_param_scheduler=scheduler.state_dict(),
        flags=flags,
        format=ckpt_format,
    )
    if ckpt_format == "torch":
        _save_torch(path, model, optimizer, extra)
    else:
        state = _sharded_state(model, optimizer, is_loading=False, rng=_rng_state())
        state.update(extra)
        dist_checkpointing.save(state, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(root) / TRACKER).write_text(f"{iteration}\n")
    dist.barrier()
    return path


def load_checkpoint(
    root: str | Path,
    *,
    model: Sequence[Any],
    optimizer: Any,
    scheduler: Any,
    flags: dict[str, Any],
) -> tuple[int, int]:
    """Restore model, optimizer, scheduler and RNG from ``root``'s latest checkpoint; returns
    ``(iteration, consumed_samples)``. Model flags must match the saved ones."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    path = checkpoint_dir(root, iteration)
    if _rank_file(path).is_file() or not (path / "common.pt").is_file():
        state = _load_torch(path, model, optimizer)
        _check_flags(root, state.get("flags", {}), flags)
        scheduler.load_state_dict(state["opt_param_scheduler"])
        _set_rng_state(state["rng_state"])
        return int(state["iteration"]), int(state["consumed_samples"])
    common = dist_checkpointing.load_common_state_dict(str(path))
    _check_flags(root, common.get("flags", {}), flags)
    template = _sharded_state(model, optimizer, is_loading=True, rng=None)
    state = dist_checkpointing.load(template, str(path))
    for index, chunk in enumerate(model):
        chunk.load_state_dict(state[f"model{index}"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    _set_rng_state(state["rng_state"])
    return int(state["iteration"]), int(state["consumed_samples"])


def _check_flags(root: str | Path, saved_flags: dict[str, Any], flags: dict[str, Any]) -> None:
    different = sorted(k for k in flags if k in saved_flags and saved_flags[k] != flags[k])
    if different:
        detail = ", ".join(f"{k}: saved {saved_flags[k]!r}, now {flags[k]!r}" for k in different)
        raise ValueError(f"--load {root}: checkpoint was saved with other model flags ({detail})")
