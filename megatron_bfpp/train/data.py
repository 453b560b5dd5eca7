"""``bfpp-train``'s data (synthetic progressions, byte-level windows of a text file, or Megatron's
indexed datasets): a sample is a pure function of ``(seed, global index)``, so a checkpoint's
consumed-sample count is the data position on any layout and any ``--global-batch-size``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from megatron_bfpp.train.data_source import IndexedSource, TextSource, data_source

__all__ = ["Batch", "IndexedTrainingData", "TrainingData", "training_data"]

_MAX_STEP = 4

Batch = dict[str, torch.Tensor]


class _Samples:
    """Samples by global index (``sample``); :meth:`microbatches` gives dp rank ``d`` micro-batches
    ``d*m .. d*m+m-1`` of an iteration's global batch, whatever the source."""

    def microbatch(self, indices: range) -> Batch:
        raise NotImplementedError

    def microbatches(
        self,
        *,
        first_sample: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> list[Batch]:
        """This dp rank's micro-batches of the global batch starting at sample ``first_sample``."""
        per_rank = global_batch_size // dp_size
        first = first_sample + dp_rank * per_rank
        return [
            self.microbatch(range(start, start + micro_batch_size))
            for start in range(first, first + per_rank, micro_batch_size)
        ]


class TrainingData(_Samples):
    """Token samples computed from their index: synthetic sequences, or windows of a byte-level
    ``--data-path`` file, so every rank draws the same sample for the same index."""

    def __init__(
        self, *, seq_length: int, vocab_size: int, seed: int, data_path: str | None = None
    ) -> None:
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.tokens: torch.Tensor | None = None
        if data_path is not None:  # its length and --vocab-size checked by the command line
            raw = Path(data_path).read_bytes()
            self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()

    def sample(self, index: int) -> torch.Tensor:
        """``seq_length + 1`` tokens of global sample ``index``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n = self.seq_length + 1
        if self.tokens is not None:
            offset = int(torch.randint(0, len(self.tokens) - n + 1, (1,), generator=generator))
            return self.tokens[offset : offset + n]
        start = int(torch.randint(0, self.vocab_size, (1,), generator=generator))
        step = int(torch.randint(1, _MAX_STEP + 1, (1,), generator=generator))
        return (start + step * torch.arange(n)) % self.vocab_size

    def microbatch(self, indices: range) -> Batch:
        rows = torch.stack([self.sample(i) for i in indices])
        shape = (len(indices), self.seq_length)
        return {
            "tokens": rows[:, :-1].contiguous(),
            "labels": rows[:, 1:].contiguous(),
            "position_ids": torch.arange(self.seq_length).expand(shape).contiguous(),
            "loss_mask": torch.ones(shape),
        }


_BATCH_KEYS = ("tokens", "labels", "position_ids", "loss_mask")


@dataclasses.dataclass(frozen=True)
class _TokenIds:
    """What ``GPTDataset`` asks of a tokenizer when tokens are already ids (the end-of-document id
    serves only flags left off; no ``pad``: the dataset then pads with an id no token has)."""

    vocab_size: int
    eod: int

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        """Part of the description megatron-core hashes to name its index cache."""
        return {"class": "bfpp-train token ids", "vocab_size": self.vocab_size, "eod": self.eod}


class IndexedTrainingData(_Samples):
    """Megatron indexed datasets through megatron-core's dataset classes (collective when the
    process group is up: rank 0 builds and caches the indices first, as in Megatron-LM)."""

    def __init__(
        self,
        source: IndexedSource,
        *,
        seq_length: int,
        vocab_size: int,
        seed: int,
        num_samples: int,
        cache_path: str | None = None,
    ) -> None:
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.source = source
        config = GPTDatasetConfig(
            random_seed=seed,
            sequence_length=seq_length,
            blend=source.blend(),
            split=source.split,
            path_to_cache=cache_path,
            tokenizer=_TokenIds(vocab_size=vocab_size, eod=vocab_size - 1),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
        )
        # Only the train part is built, with Megatron-LM's bookends for the --split: megatron-core
        # loops forever over a part with no document (a small dataset's test part under 969,30,1).
        config.split_matrix = [config.split_matrix[0], None, None]
        train, _, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, [num_samples, 0, 0], lambda: True, config
        ).build()
        if train is None:
            raise ValueError(
                f"--split {source.split}: the train part of --data-path holds no documents; "
                "give the train part a larger weight"
            )
        self.dataset = train

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        item = self.dataset[index % len(self.dataset)]
        largest = max(int(item["tokens"].max()), int(item["labels"].max()))
        if largest >= self.vocab_size:
            raise ValueError(
                f"--data-path {' '.join(self.source.prefixes)}: sample {index} holds token id "
                f"{largest}, not below --vocab-size {self.vocab_size}; give the tokenizer's "
                "vocabulary size"
            )
        return {key: item[key] for key in _BATCH_KEYS}

    def microbatch(self, indices: range) -> Batch:
        items = [self.sample(i) for i in indices]
        return {key: torch.stack([item[key] for item in items]) for key in _BATCH_KEYS}


def training_data(args: Any) -> TrainingData | IndexedTrainingData:
    common = dict(seq_length=args.seq_length, vocab_size=args.vocab_size, seed=args.seed)
    if args.data_path is None:
        return TrainingData(**common)
    source = data_source(args.data_path, seq_length=args.seq_length, split=args.split)
    if isinstance(source, TextSource):
        return TrainingData(**common, data_path=source.path)
    num_samples = args.train_iters * args.global_batch_size
    return IndexedTrainingData(
        source, **common, num_samples=num_samples, cache_path=args.data_cache_path
    )
