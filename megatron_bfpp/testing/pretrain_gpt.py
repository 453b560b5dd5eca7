"""A GPT script for Megatron-LM's ``pretrain()`` (GPT, local layer spec, learnable mock data): the
wheels ship ``megatron.training`` from 0.17 on but not ``pretrain_gpt.py``, which tests need."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch

from megatron_bfpp.train.step_functions import loss_func


@dataclasses.dataclass(eq=False)  # a torch Dataset: hashed by identity
class MockTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``num_samples`` sequences counting up (modulo the vocabulary) from a start seeded by
    ``(seed, i)``: the same on every rank and resume, with a learnable next token."""

    num_samples: int
    seq_length: int
    vocab_size: int
    seed: int

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + int(index))
        start = torch.randint(0, self.vocab_size, (1,), generator=generator)
        text = (start + torch.arange(self.seq_length + 1)) % self.vocab_size
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float),
            "position_ids": torch.arange(self.seq_length),
        }


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config: Any = None,
    pg_collection: Any = None,
) -> Any:
    """One model chunk (``vp_stage``) of megatron-core's GPT, sized by Megatron-LM's arguments
    (``--num-experts``: every layer's MLP megatron-core's local MoE layer)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = core_transformer_config_from_args(args) if config is None else config
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=args.num_experts, moe_grouped_gemm=False, normalization=args.normalization
        ),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def datasets_provider(
    train_val_test_num_samples: Any, vp_stage: int | None = None
) -> tuple[Any, None, None]:
    """The training set only (the tests run with ``--eval-iters 0``)."""
    from megatron.training import get_args

    args, samples = get_args(), int(train_val_test_num_samples[0])
    return MockTokens(samples, args.seq_length, args.vocab_size, args.seed), None, None


PLANS_BUILT = [0]  # forwards built as schedule plans (megatron-core's combined step asked)


def forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> Any:
    """One micro-batch through one model chunk; the loss function for the last stage.
    ``return_schedule_plan``: the chunk's plan, as Megatron-LM's pretrain_gpt.py builds it."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tokens = labels = loss_mask = position_ids = None
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    ends = (parallel_state.is_pipeline_first_stage, parallel_state.is_pipeline_last_stage)
    if any(end(ignore_virtual=False, vp_stage=vp_stage) for end in ends):  # embeds, or the loss
        batch = {name: value.to(device) for name, value in next(data_iterator).items()}
        tokens, labels = batch["tokens"], batch["labels"]
        loss_mask, position_ids = batch["loss_mask"], batch["position_ids"]
    PLANS_BUILT[0] += return_schedule_plan
    run = model.build_schedule_plan if return_schedule_plan else model
    return run(tokens, position_ids, None, labels=labels), functools.partial(loss_func, loss_mask)


def main() -> None:
    from megatron.core.enums import ModelType
    from megatron.training import training

    datasets_provider.is_distributed = True  # type: ignore[attr-defined]  # every rank builds it
    if "cfg_container" in inspect.signature(training.pretrain).parameters:  # 0.19 on
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args

        # By name: 0.18 has model_provider second, 0.19 after forward_step_func.
        training.pretrain(
            pretrain_cfg_container_from_args(parse_and_validate_args()),
            train_valid_test_dataset_provider=datasets_provider,
            model_provider=model_provider,
            model_type=ModelType.encoder_or_decoder,
            forward_step_func=forward_step,
        )
    else:  # 0.17
        training.pretrain(
            datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step
        )
    if PLANS_BUILT[0]:
        print(f"pretrain_gpt: {PLANS_BUILT[0]} forwards built as schedule plans", flush=True)


if __name__ == "__main__":
    main()
