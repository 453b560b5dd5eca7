"""Reading checkpoint files in one process (plain torch): a file is data, never code; a damaged
file is one error naming it; what bfpp-train saves loads with ``weights_only``; the data position
is the consumed-sample count."""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from megatron_bfpp.train.checkpoint import check_dcp_metadata, read_rank_file  # noqa: E402
from megatron_bfpp.train.checkpoint_files import CheckpointError  # noqa: E402
from megatron_bfpp.train.checkpoint_metadata import FileRecord  # noqa: E402
from megatron_bfpp.train.data import TrainingData  # noqa: E402


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _record(path: Path) -> FileRecord:
    data = path.read_bytes()
    return FileRecord(path.name, len(data), hashlib.sha256(data).hexdigest())


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch, on the raw pickle
@pytest.mark.parametrize("writer", ["torch.save", "raw pickle"])
def test_code_in_a_rank_file_is_refused_not_run(tmp_path: Path, writer: str) -> None:
    marker = tmp_path / "pwned"
    file = tmp_path / "iter_0000003" / "rank_00000.pt"
    file.parent.mkdir()
    state = {"iteration": 3, "model": _Payload(marker)}
    if writer == "torch.save":
        torch.save(state, file)
    else:
        file.write_bytes(pickle.dumps(state))
    with pytest.raises(CheckpointError) as caught:
        read_rank_file(file, record=_record(file), label="--load D: ")
    message = str(caught.value)
    assert message.startswith("--load D: iter_0000003/rank_00000.pt refused: it "), message
    if writer == "torch.save":
        assert "refused: it would call posix.system; " in message
    else:  # pickle protocol 4 frames: torch's unpickler stops at the first frame
        assert "refused: it is more than tensors and plain values (Unsupported operand" in message
    assert "\n" not in str(caught.value)
    assert not marker.exists()


def test_truncated_rank_file_is_named(tmp_path: Path) -> None:
    file = tmp_path / "rank_00001.pt"
    torch.save({"w": torch.zeros(10_000)}, file)
    file.write_bytes(file.read_bytes()[:2_000])
    with pytest.raises(
        CheckpointError, match=r"rank_00001\.pt is unreadable \(truncated or corrupt"
    ):
        read_rank_file(file)


def test_rank_file_must_match_its_digest(tmp_path: Path) -> None:
    file = tmp_path / "rank_00000.pt"
    torch.save({"w": torch.zeros(100)}, file)
    record = _record(file)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 1
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match the SHA-256"):
        read_rank_file(file, record=record)


def test_what_bfpp_train_saves_loads_weights_only(tmp_path: Path) -> None:
    """RNG states (``random``'s tuple, byte tensors), Adam's state and param groups, the
    scheduler's numbers and strings: no type needs allowing, and they round-trip exactly."""
    model = torch.nn.Linear(4, 3)
    adam = torch.optim.Adam(model.parameters(), betas=(0.9, 0.95))
    model(torch.ones(2, 4)).sum().backward()
    adam.step()
    state = {
        "iteration": 3,
        "consumed_samples": 24,
        "model": [model.state_dict()],
        "optimizer": [adam.state_dict()],
        "opt_param_scheduler": {"max_lr": 3e-3, "lr_decay_style": "cosine", "num_steps": 24},
        "rng_state": {"random": random.getstate(), "torch": torch.get_rng_state(), "cuda": None},
    }
    file = tmp_path / "rank_00000.pt"
    torch.save(state, file)
    loaded = read_rank_file(file, record=_record(file))
    assert loaded["rng_state"]["random"] == random.getstate()
    assert torch.equal(loaded["rng_state"]["torch"], state["rng_state"]["torch"])
    assert loaded["optimizer"][0]["param_groups"] == adam.state_dict()["param_groups"]
    assert loaded["opt_param_scheduler"] == state["opt_param_scheduler"]


def test_distributed_checkpoint_metadata_is_checked_before_torch_unpickles_it(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    genuine = tmp_path / "iter_0000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(
            {"w": torch.ones(3, 2), "step": torch.tensor(4)}, checkpoint_id=genuine, no_dist=True
        )
    check_dcp_metadata(genuine)

    marker = tmp_path / "pwned"
    crafted = tmp_path / "iter_0000002"
    crafted.mkdir()
    (crafted / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(
        CheckpointError,
        match=r"^--load D: iter_0000002/\.metadata refused: it would call posix\.system",
    ):
        check_dcp_metadata(crafted, label="--load D: ")
    assert not marker.exists()


def _dotted_global_pickle(module: str, name: str, argument: str) -> bytes:
    """Protocol 4: ``STACK_GLOBAL`` module + dotted name, called with one string."""

    def text(value: str) -> bytes:
        data = value.encode()
        return b"\x8c" + bytes([len(data)]) + data

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(argument) + b"\x85R."


def test_a_dotted_name_through_an_allowed_module_is_refused(tmp_path: Path) -> None:
    """pickle resolves dotted names: ``torch.distributed.checkpoint.filesystem`` + ``os.system``
    is ``os.system``. Allowing whole modules let a crafted ``.metadata`` run a shell command."""
    marker = tmp_path / "pwned"
    crafted = tmp_path / "iter_0000002"
    crafted.mkdir()
    (crafted / ".metadata").write_bytes(
        _dotted_global_pickle(
            "torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}"
        )
    )
    with pytest.raises(CheckpointError, match=r"\.metadata refused: it would call torch\."):
        check_dcp_metadata(crafted)
    assert not marker.exists()


def test_the_plan_megatron_core_keeps_in_metadata_is_accepted(tmp_path: Path) -> None:
    """megatron-core 0.16 and 0.19 keep torch's save plan (``SavePlan``, ``WriteItem``, ...) in
    the ``.metadata`` they write: data classes, accepted."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    item = WriteItem(
        index=MetadataIndex("w", torch.Size([0])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size([0]), torch.Size([2])),
            properties=None,  # type: ignore[arg-type]
            size=torch.Size([2]),
        ),
    )
    directory = tmp_path / "iter_0000001"
    directory.mkdir()
    (directory / ".metadata").write_bytes(pickle.dumps({"plan": SavePlan([item])}))
    check_dcp_metadata(directory)


def test_microbatches_start_at_the_consumed_sample_count() -> None:
    """A global batch of 16 after 24 consumed samples holds samples 24..39, split over
    data-parallel ranks in order: exactly the next two batches of 8."""
    data = TrainingData(seq_length=8, vocab_size=256, seed=1)

    def rows(first: int, gbs: int, dp: int) -> list[Any]:
        out = []
        for rank in range(dp):
            for batch in data.microbatches(
                first_sample=first,
                global_batch_size=gbs,
                micro_batch_size=2,
                dp_rank=rank,
                dp_size=dp,
            ):
                out.extend(batch["tokens"])
        return out

    big = rows(24, 16, 2)
    small = rows(24, 8, 1) + rows(32, 8, 1)
    assert len(big) == 16
    assert all(torch.equal(a, b) for a, b in zip(big, small, strict=True))
    assert torch.equal(big[0], data.sample(24)[:-1])
