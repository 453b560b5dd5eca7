"""What a ``bfpp-train`` run is, read from its flags, torch-free: the command line compares it with
a checkpoint's record before any rank starts, and the trainer builds from the same values. Field
names are the flags' ``argparse`` destinations, so a difference is reported by its flag."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence
from typing import Any

from megatron_bfpp.ir import Placement, ScheduleError
from megatron_bfpp.schedules.registry import get_spec

__all__ = [
    "DEFAULT_FFN_TEXT",
    "EVEN_STAGES",
    "LAYOUT_AUTO",
    "LAYOUT_AUTO_ALONE",
    "LRSchedule",
    "Layout",
    "ModelShape",
    "RunConfig",
    "Training",
    "UnevenStages",
    "default_ffn_hidden_size",
    "flag_name",
    "layout_layer_shares",
    "layout_of",
    "layout_stage_weights",
    "layout_stages",
    "model_shape",
    "run_config",
]


def flag_name(dest: str) -> str:
    """The command-line flag of an ``argparse`` destination (``num_layers`` -> ``--num-layers``)."""
    return "--" + dest.replace("_", "-")


# :func:`default_ffn_hidden_size` in words, for the command lines' help.
DEFAULT_FFN_TEXT = "gpt 4h, llama 8h/3 rounded up to 16"


def default_ffn_hidden_size(preset: str, hidden_size: int) -> int:
    """GPT: 4h. LLaMA: 8h/3 rounded up to a multiple of 16 (SwiGLU keeps the parameter count).
    The one rule for bfpp-train's models and the planner's (``plan.presets.model_from_shape``)."""
    return -(-(8 * hidden_size // 3) // 16) * 16 if preset == "llama" else 4 * hidden_size


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the user chose about the model (flags), independent of the parallel layout."""

    preset: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None
    ffn_hidden_size: int | None
    seq_length: int
    vocab_size: int
    # Mixture-of-Experts, Megatron-LM's flags (None: dense; absent from checkpoints before them)
    num_experts: int | None = None
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or default_ffn_hidden_size(self.preset, self.hidden_size)

    @property
    def router_topk(self) -> int:
        """Experts each token goes to (megatron-core's default: 2)."""
        return self.moe_router_topk or 2

    @property
    def moe_ffn(self) -> int:
        """Each expert's FFN size (megatron-core's default: the dense one)."""
        return self.moe_ffn_hidden_size or self.ffn

    def effective_flags(self) -> dict[str, Any]:
        """The model flags, defaults filled in, by destination: two runs build the same model
        exactly when these are equal (``--ffn-hidden-size`` left out or given as its default)."""
        return {
            "model": self.preset,
            **{field.name: getattr(self, field.name) for field in dataclasses.fields(self)[1:]},
            "num_query_groups": self.num_query_groups or self.num_attention_heads,
            "ffn_hidden_size": self.ffn,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """Where the model's pieces live; ``placement`` too: looped and V-shape put other layers on a
    rank at equal stages per rank. ``data_parallel_size``: world / (tp x pp), for the reader."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    num_virtual_stages_per_pipeline_rank: int
    placement: Placement
    data_parallel_size: int
    world_size: int
    # Megatron's uneven-stage flags (docs/megatron-lm.md#uneven-stages); absent from checkpoints
    # written before them, which hold even stages
    pipeline_model_parallel_layout: str | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    expert_model_parallel_size: int = 1  # experts split over data-parallel ranks

    def layers_per_stage(self, num_layers: int) -> list[int]:
        """Transformer layers of each of the model's stages in order, by megatron-core's
        arithmetic (``get_num_layers_to_build``: stage s is rank ``s % pp``'s virtual stage
        ``s // pp``; a V places the same stages on other ranks). First/last sizes are per rank."""
        if self.pipeline_model_parallel_layout:
            return [
                stage.count("t") for stage in layout_stages(self.pipeline_model_parallel_layout)
            ]
        pp, vp = self.pipeline_model_parallel_size, self.num_virtual_stages_per_pipeline_rank
        first, last = self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        embedding = int(self.account_for_embedding_in_pipeline_split)
        loss = int(self.account_for_loss_in_pipeline_split)
        middle_ranks = pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0) + embedding + loss
        per_rank = [rest // middle_ranks if middle_ranks > 0 else 0] * pp
        per_rank[0] = per_rank[0] if first is None else first
        per_rank[-1] = per_rank[-1] if last is None else last
        layers = [per_rank[stage % pp] // vp for stage in range(pp * vp)]
        layers[0] -= embedding  # the embedding (loss) counted as a layer of the first (last) stage
        layers[-1] -= loss
        return layers

    def uneven_config(self) -> dict[str, Any]:
        """megatron-core's ``TransformerConfig`` fields for the uneven-stage flags given."""
        values = (getattr(self, dest) for dest in UNEVEN_FLAGS)
        return {
            name: value for name, value in zip(UNEVEN_CONFIG_FIELDS, values, strict=True) if value
        }


# megatron-core's repeats in a layout string, unrolled in this order: "(...)*n", then "x*n".
_LAYOUT_REPEATS = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))


def layout_stages(layout: str) -> list[str]:
    """The stages of a ``--pipeline-model-parallel-layout`` string as megatron-core's
    ``parse_str_to_list`` unrolls it ("Et*2|(t|)*2L" -> ["Ett", "t", "t", "L"]): torch-free, so
    that the Megatron-LM launcher knows the virtual stages before anything is imported, and the
    memory estimate each stage's layers."""
    text = layout.replace(",", "")
    for pattern in _LAYOUT_REPEATS:
        text = pattern.sub(lambda match: match.group(1) * int(match.group(2)), text)
    return text.split("|")


def layout_virtual_stages(layout: str, pp: int, num_layers: int | None) -> int:
    """Stages per rank a layout lists, after megatron-core's checks of it (a multiple of pp, its
    ``t`` count equal to ``--num-layers``, known layer kinds): one rule for the Megatron-LM launcher
    (before any import) and bfpp-train. Raises ``ValueError`` with the user's one line."""
    stages, flag = layout_stages(layout), f"--pipeline-model-parallel-layout {layout}"
    if unknown := sorted(set("".join(stages)) - set("EtmL")):
        raise ValueError(
            f"{flag}: {unknown[0]!r} is no layer kind; write E (embedding), t (transformer "
            "layer), m (MTP layer), L (loss), | between stages, x*n or (...)*n to repeat"
        )
    if len(stages) % pp:
        raise ValueError(
            f"{flag} lists {len(stages)} stages, not a multiple of --pipeline-model-parallel-size "
            f"{pp}; list {pp} stages per virtual stage"
        )
    layers = sum(stage.count("t") for stage in stages)
    if num_layers is not None and layers != num_layers:
        raise ValueError(
            f"{flag} places {layers} transformer layers, not --num-layers {num_layers}"
        )
    return len(stages) // pp


def layout_stage_weights(
    layout: str, pp: int, *, embedding: float, loss: float
) -> tuple[float, ...]:
    """Each stage's compute against an even stage's (its share of the layout's ``t`` layers), for
    ``CostModel.stage_weights``: a layer counts 1, the embedding ``embedding`` layers, the output
    layer with its loss ``loss``, an MTP layer a layer, an embedding lookup and a loss of its
    own (``scripts/check_stage_costs.py`` times megatron-core's MTP stage). So an even layout
    whose E and L cost nothing weighs 1 everywhere, and E and L add to the stages holding them.
    Raises ``ValueError`` with the user's one line (``layout_virtual_stages``'s checks)."""
    layout_virtual_stages(layout, pp, None)
    stages = layout_stages(layout)
    if not (layers := sum(stage.count("t") for stage in stages)):
        raise ValueError(f"--pipeline-model-parallel-layout {layout} places no transformer layer")
    even = layers / len(stages)  # an even stage's layers: the unit of t_forward / t_backward
    return tuple(
        (
            stage.count("t")
            + stage.count("m") * (1 + loss + embedding)
            + stage.count("E") * embedding
            + stage.count("L") * loss
        )
        / even
        for stage in stages
    )


def layout_layer_shares(layout: str) -> tuple[float, ...]:
    """Each stage's transformer and MTP layers against an even stage's share of them: what its
    parameters and stored activations weigh (bfpp-sim's memory of uneven stages; the embedding
    and output layer's own memory is not counted, as on even stages). Call after
    ``layout_stage_weights`` has checked the layout."""
    stages = layout_stages(layout)
    even = sum(stage.count("t") for stage in stages) / len(stages)
    return tuple((stage.count("t") + stage.count("m")) / even for stage in stages)


@dataclasses.dataclass(frozen=True, slots=True)
class UnevenStages:
    """Megatron's uneven-stage flags as the user gave them (``UNEVEN_FLAGS``), for the planner:
    each candidate's stages per rank gives its own layers per stage (``stage_layers``)."""

    pipeline_model_parallel_layout: str | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    @classmethod
    def read(cls, values: Any, names: Sequence[str] = ()) -> UnevenStages:
        """From parsed arguments (Megatron-LM's, bfpp-train's, bfpp-plan's destinations) or,
        with ``names`` = ``UNEVEN_CONFIG_FIELDS``, a TransformerConfig's (Bridge). Raises
        ``ScheduleError`` for a layout given as other than a string."""
        given = [getattr(values, name, None) for name in names or UNEVEN_FLAGS]
        layout, first, last, embedding, loss = given
        if layout is not None and not isinstance(layout, str):  # Bridge: a parsed layout object
            raise ScheduleError(
                f"the planner reads a {(names or UNEVEN_FLAGS)[0]} given as a string "
                f"('Et*3|t*4|t*4|t*3L'), not a {type(layout).__name__}"
            )
        first, last = (int(n) if n else None for n in (first, last))
        return cls(layout or None, first, last, bool(embedding), bool(loss))

    def __bool__(self) -> bool:
        return any(getattr(self, dest) for dest in UNEVEN_FLAGS)

    @property
    def partition(self) -> bool:
        """``--pipeline-model-parallel-layout auto``: the planner chooses the layers per stage."""
        return self.pipeline_model_parallel_layout == LAYOUT_AUTO

    def given(self) -> str:
        """The flags as typed, for the planner's lines."""
        values = ((flag_name(dest), getattr(self, dest)) for dest in UNEVEN_FLAGS)
        return " ".join(flag if v is True else f"{flag} {v}" for flag, v in values if v)

    def stage_layers(self, num_layers: int, pp: int, vp: int) -> tuple[int, ...]:
        """Transformer layers of each global stage at ``vp`` stages per rank, megatron-core's
        arithmetic (``Layout.layers_per_stage``), the embedding on stage 0 and the loss on the
        last. Raises ``ValueError`` with the one line saying why these flags do not split so."""
        layout = self.pipeline_model_parallel_layout
        if self.partition:
            raise ValueError("--pipeline-model-parallel-layout auto: the planner's to choose")
        if layout is not None:
            if (stages := layout_virtual_stages(layout, pp, num_layers)) != vp:
                raise ValueError(f"--pipeline-model-parallel-layout lists {stages} stages per rank")
            parts = layout_stages(layout)
            if (
                any("m" in part for part in parts[:-1])
                or "E" not in parts[0]
                or "L" not in parts[-1]
            ):
                raise ValueError(
                    "the planner plans layouts with E in the first stage, L in the last and MTP "
                    f"layers (m) only in the last, not {layout}"
                )
        fields = {dest: getattr(self, dest) for dest in UNEVEN_FLAGS}
        layers = Layout(1, pp, vp, Placement.LOOPED, 1, pp, **fields).layers_per_stage(num_layers)
        if sum(layers) != num_layers or min(layers) < 0:
            raise ValueError(f"{self.given()} does not split {num_layers} layers over {pp} x {vp}")
        return tuple(layers)


EVEN_STAGES = UnevenStages()  # no uneven-stage flag given
# --pipeline-model-parallel-layout auto: with --pipeline-schedule auto, the planner's partition
LAYOUT_AUTO = "auto"
LAYOUT_AUTO_ALONE = (
    "--pipeline-model-parallel-layout auto needs --pipeline-schedule auto (the planner chooses "
    "the layers per stage with the schedule); name a layout, or let auto choose both"
)


def layout_of(stage_layers: Sequence[int]) -> str:
    """The layout string of ``stage_layers`` with the embedding first and the loss last, in
    megatron-core's short form (runs of equal middle stages as ``(t*4|)*6``), which
    ``layout_stages`` reads back: what the planner's choice prints and writes."""

    def layers(n: int) -> str:
        return "t" * min(n, 1) + f"*{n}" * (n > 1)

    if len(stage_layers) == 1:
        return f"E{layers(stage_layers[0])}L"
    *middle, last = stage_layers[1:]
    text = f"E{layers(stage_layers[0])}|"
    for count, run in itertools.groupby(middle):
        times = len(list(run))
        text += f"{layers(count)}|" if times == 1 else f"({layers(count)}|)*{times}"
    return f"{text}{layers(last)}L"


# Layout's uneven-stage flags (destinations) and megatron-core's config fields for them.
_UNEVEN_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Layout)[6:11]}
UNEVEN_FLAGS = tuple(_UNEVEN_DEFAULTS)
UNEVEN_CONFIG_FIELDS = (
    "pipeline_model_parallel_layout", "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class LRSchedule:
    """megatron-core's ``OptimizerParamScheduler`` settings, named as its ``state_dict`` names them
    (steps count samples): a checkpoint's compare field by field, as ``load_state_dict`` does."""

    max_lr: float
    min_lr: float
    lr_warmup_steps: int
    lr_decay_steps: int
    lr_decay_style: str
    start_wd: float
    end_wd: float
    wd_incr_steps: int
    wd_incr_style: str


@dataclasses.dataclass(frozen=True, slots=True)
class Training:
    """The training flags a resume cares about. ``lr_decay_iters`` is the flag as given (``None``:
    decay over ``--train-iters``, Megatron-LM's default)."""

    lr: float
    min_lr: float
    lr_warmup_iters: int
    lr_decay_iters: int | None
    train_iters: int
    weight_decay: float
    global_batch_size: int
    micro_batch_size: int
    seed: int
    data_path: str | None  # Megatron-LM's list (prefixes, or weights and prefixes) joined by spaces
    split: str | None = None  # indexed datasets only; absent from older checkpoints
    bf16: bool = False  # bf16 weights, fp32 gradients and main weights (older checkpoints: fp32)

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters or self.train_iters

    def lr_schedule(self) -> LRSchedule:
        """Warm-up then cosine decay over ``decay_iters``, counted in samples as Megatron-LM does
        (iterations x global batch). megatron-core needs warm-up < decay: a shorter decay warms up
        less. Weight decay is constant over the decay's span: training further on the same schedule
        (``--lr-decay-iters``) changes nothing here."""
        gbs, decay = self.global_batch_size, self.decay_iters
        return LRSchedule(
            max_lr=float(self.lr),
            min_lr=float(self.min_lr),
            lr_warmup_steps=min(self.lr_warmup_iters, decay - 1) * gbs,
            lr_decay_steps=decay * gbs,
            lr_decay_style="cosine",
            start_wd=float(self.weight_decay),
            end_wd=float(self.weight_decay),
            wd_incr_steps=decay * gbs,
            wd_incr_style="constant",
        )


@dataclasses.dataclass(frozen=True, slots=True)
class RunConfig:
    """One run as a checkpoint records it."""

    model: ModelShape
    layout: Layout
    pipeline_schedule: str
    training: Training


def model_shape(args: Any) -> ModelShape:
    """The model a parsed ``bfpp-train`` namespace asks for: ``--model``, then the fields' flags."""
    values: dict[str, Any] = {
        field.name: getattr(args, field.name)
        if field.default is dataclasses.MISSING
        else getattr(args, field.name, field.default)  # the expert flags: bfpp-train's only
        for field in dataclasses.fields(ModelShape)[1:]
    }
    return ModelShape(args.model, **values)


# Training's fields read as the flags are (``data_path``'s list is joined by spaces), a flag a
# namespace lacks as the field's default.
_TRAINING_FLAGS = {f.name: f.default for f in dataclasses.fields(Training) if f.name != "data_path"}


def run_config(args: Any, world_size: int) -> RunConfig:
    """A parsed ``bfpp-train`` namespace's run on ``world_size`` ranks (tp x pp divides it)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    return RunConfig(
        model=model_shape(args),
        layout=Layout(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            num_virtual_stages_per_pipeline_rank=args.num_virtual_stages_per_pipeline_rank,
            placement=get_spec(args.pipeline_schedule).placement,
            data_parallel_size=world_size // (tp * pp),
            world_size=world_size,
            **{
                dest: getattr(args, dest, None) or default
                for dest, default in _UNEVEN_DEFAULTS.items()
            },
            expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        ),
        pipeline_schedule=args.pipeline_schedule,
        training=Training(
            **{
                name: getattr(args, name)
                if default is dataclasses.MISSING
                else getattr(args, name, default)
                for name, default in _TRAINING_FLAGS.items()
            },
            data_path=None if args.data_path is None else " ".join(args.data_path),
        ),
    )
