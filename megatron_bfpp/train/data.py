"""Deterministic training data for ``bfpp-train``: synthetic sequences or a local text file.

Every sample is a pure function of ``(seed, global sample index)``, so the data position is just
the number of consumed samples (a checkpoint records it): a resumed run reads exactly the samples
the uninterrupted run would have read, on any layout, and a run resumed with another
``--global-batch-size`` goes on from the next unread sample (none skipped, none repeated).

* Synthetic (default): learnable sequences, so the loss visibly falls: each sample is an
  arithmetic progression modulo the vocabulary with a random start and a random step from
  ``1..4``; the model learns to continue it.
* ``--data-path FILE``: byte-level tokens (vocabulary 256) of a local file; sample ``i`` is a
  window at a pseudo-random offset drawn from ``(seed, i)``. No tokenizer, no downloads.

A micro-batch is a dict ``tokens``, ``labels``, ``position_ids``, ``loss_mask`` of shape
``(micro_batch_size, seq_length)``.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["BYTE_VOCAB_SIZE", "Batch", "TrainingData"]

BYTE_VOCAB_SIZE = 256
_MAX_STEP = 4

Batch = dict[str, torch.Tensor]


class TrainingData:
    """Samples by global index; :meth:`microbatches` cuts one iteration's global batch into this
    data-parallel rank's micro-batches (dp rank ``d`` gets micro-batches ``d*m .. d*m+m-1``)."""

    def __init__(
        self, *, seq_length: int, vocab_size: int, seed: int, data_path: str | None = None
    ) -> None:
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.tokens: torch.Tensor | None = None
        if data_path is not None:
            raw = Path(data_path).read_bytes()
            if len(raw) < seq_length + 2:
                raise ValueError(
                    f"--data-path {data_path} has {len(raw)} bytes; need at least "
                    f"seq_length + 2 = {seq_length + 2}"
                )
            if vocab_size < BYTE_VOCAB_SIZE:
                raise ValueError(
                    f"--data-path uses byte-level tokens: --vocab-size must be >= "
                    f"{BYTE_VOCAB_SIZE}, got {vocab_size}"
                )
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

    def microbatches(
        self,
        *,
        first_sample: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> list[Batch]:
        """This data-parallel rank's micro-batches of the global batch that starts at sample
        ``first_sample`` (the samples consumed so far)."""
        per_rank = global_batch_size // dp_size
        first = first_sample + dp_rank * per_rank
        batches = []
        for start in range(first, first + per_rank, micro_batch_size):
            rows = torch.stack([self.sample(i) for i in range(start, start + micro_batch_size)])
            shape = (micro_batch_size, self.seq_length)
            batches.append(
                {
                    "tokens": rows[:, :-1].contiguous(),
                    "labels": rows[:, 1:].contiguous(),
                    "position_ids": torch.arange(self.seq_length).expand(shape).contiguous(),
                    "loss_mask": torch.ones(shape),
                }
            )
        return batches
