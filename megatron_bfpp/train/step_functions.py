"""The step functions megatron-core's forward-backward functions call, as Megatron-LM's
``pretrain_gpt.py`` writes them, shared by bfpp-train and tests: a test's loss is the trainer's."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from megatron_bfpp.train.data import Batch

__all__ = ["forward_step", "loss_func"]


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron-LM's ``pretrain_gpt.loss_func``: summed masked token loss, token count and their
    ``lm loss`` report; megatron-core divides by both counts: a mean token loss per micro-batch."""
    losses, mask = output_tensor.view(-1).float(), loss_mask.view(-1).float()
    loss, num_tokens = torch.sum(losses * mask), mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(
    device: torch.device | None,
    data_iterator: Iterator[Batch],
    model: torch.nn.Module,
    return_schedule_plan: bool = False,
) -> tuple[Any, Any]:
    """megatron-core's ``forward_step_func`` once ``device`` is bound (``None``: not moved); every
    stage reads the batch (``GPTModel`` ignores tokens without ``pre_process``); no mask: causal.
    ``return_schedule_plan``: the chunk's plan, for megatron-core's combined step."""
    batch = next(data_iterator)
    if device is not None:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    run: Any = model.build_schedule_plan if return_schedule_plan else model
    output = run(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])
