"""``--pipeline-schedule auto`` in the front ends: what each knows as an ``AutoRequest``, the
decision written back as if the user had named it. Every rank decides alone; torchrun's ranks
compare their choices in the launcher's store, since their inputs may differ. Only
:func:`probe_device` imports torch (the SLURM pre-flight uses the rest)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from megatron_bfpp.config.run_config import UNEVEN_CONFIG_FIELDS, UnevenStages, layout_of
from megatron_bfpp.ir import Placement, ScheduleError
from megatron_bfpp.megatron import arguments
from megatron_bfpp.plan.auto import (
    AUTO,
    AUTO_DEST,
    AutoRequest,
    Decision,
    Hardware,
    check_auto_flags,
    decide,
    gpus_per_node_from_env,
    hardware,
    label,
    write_report,
)
from megatron_bfpp.plan.presets import BF16_MIXED, FP32, Model, Precision, model_description
from megatron_bfpp.schedules.fit import step_batch_sizes
from megatron_bfpp.schedules.registry import SCHEDULES, SHARDING_STRATEGIES, get_spec

__all__ = [
    "agree_across_ranks",
    "announce",
    "auto_inputs",
    "bridge_request",
    "decide_alike",
    "disagreement",
    "megatron_request",
    "probe_device",
    "resolve_bridge_auto",
    "resolve_megatron_auto",
]


def probe_device() -> tuple[str | None, int | None]:
    """The CUDA device's name and total memory (``None, None`` without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None, None
    # This rank's own GPU: asking about device 0 would make every rank touch it.
    index = int(os.environ.get("LOCAL_RANK", "0") or 0) % max(1, torch.cuda.device_count())
    properties = torch.cuda.get_device_properties(index)
    return str(properties.name), int(properties.total_memory)


def hardware_from_args(args: Any, *, device: tuple[str | None, int | None] | None) -> Hardware:
    """``device``: :func:`probe_device`'s answer, or ``None`` where CUDA must not be asked."""
    name, memory = device if device is not None else (None, None)
    return hardware(
        device_name=name,
        device_memory=memory,
        gpu_flag=getattr(args, "pipeline_schedule_auto_gpu", None),
        profile_path=getattr(args, "pipeline_schedule_auto_profile", None),
    )


def is_reporting_rank(env: Mapping[str, str] = os.environ) -> bool:
    """Rank 0 of the job (torchrun's ``RANK``, srun's ``SLURM_PROCID``; no launcher: this one)."""
    return env.get("RANK", env.get("SLURM_PROCID", "0")).strip() in ("", "0")


def announce(
    decision: Decision,
    *,
    report: str | None,
    prog: str = "megatron_bfpp",
    env: Mapping[str, str] = os.environ,
) -> None:
    """The one line (stdout) and the report, by rank 0 only: once per job."""
    if not is_reporting_rank(env):
        return
    if report:
        try:
            write_report(report, decision)
        except OSError as error:
            raise ScheduleError(
                f"--pipeline-schedule-auto-report {report}: cannot write it ({error.strerror})"
            ) from None
    print(f"{prog}: {decision.line()}", file=sys.stdout, flush=True)


AGREE_TIMEOUT_S = 300.0  # how long a rank waits for the others' choices in the store
_ROUNDS = itertools.count()  # one exchange per decision, each under keys of its own
# What a rank's choice depends on besides the arguments, each with its fix, in the order named.
_INPUTS = (
    ("profile", "give every rank the same profile, by an absolute path every node reads"),
    ("GPU", "run the job on one GPU model, or name it with the auto GPU flag"),
    ("launcher environment", "start the same number of ranks on every node"),
)


def auto_inputs(
    *,
    profile_path: str | None,
    gpu_flag: str | None,
    device: tuple[str | None, int | None] | None,
    env: Mapping[str, str],
) -> dict[str, str]:
    """What a rank's decision reads besides the arguments, each as a short text (the profile
    by its contents: one path may hold other files on other nodes)."""
    profile = "none"
    if profile_path:
        try:
            with open(profile_path, "rb") as handle:
                profile = f"{profile_path} sha256 {hashlib.sha256(handle.read()).hexdigest()[:12]}"
        except OSError as error:
            profile = f"{profile_path} unreadable ({error.strerror})"
    name, memory = device if device is not None else (None, None)
    if gpu_flag:
        gpu = f"{gpu_flag} as given"
    elif name is None:
        gpu = "no CUDA"
    else:
        gpu = name + (f" {memory / 2**30:.0f} GiB" if memory else "")
    keys = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_GPUS_ON_NODE")
    launcher = " ".join(f"{key}={env[key]}" for key in keys if key in env) or "none"
    return {"profile": profile, "GPU": gpu, "launcher environment": launcher}


def _ranks_text(ranks: Sequence[int]) -> str:
    runs = itertools.groupby(enumerate(ranks), key=lambda pair: pair[1] - pair[0])
    spans = [[rank for _, rank in run] for _, run in runs]  # runs of consecutive ranks
    text = ", ".join(str(s[0]) if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def disagreement(everyone: Sequence[Mapping[str, str]]) -> str | None:
    """The one line for ranks whose choices differ (``None``: all alike), naming the first input
    that differs; ``everyone[r]``: rank r's :func:`auto_inputs` and its ``decision``."""
    decisions = [facts["decision"] for facts in everyone]
    if len(set(decisions)) < 2:
        return None
    differs = (each for each in _INPUTS if len({facts.get(each[0], "") for facts in everyone}) > 1)
    # the decisions differ: where no other input does, the arguments do
    facet, advice = next(differs, ("arguments", "give every rank the same arguments"))
    values = [facts.get(facet, "") for facts in everyone] if facet != "arguments" else decisions
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    shown = "; ".join(
        f"{_ranks_text(ranks)}: {value}"
        + (f" -> {decisions[ranks[0]]}" if facet != "arguments" else "")
        for value, ranks in groups.items()
    )
    reason = f"their {facet} differs" if facet != "arguments" else "from the same inputs"
    return (
        f"--pipeline-schedule auto: the ranks chose differently, {reason} ({shown}); "
        f"{advice}, or name the schedule"
    )


def _store(env: Mapping[str, str], timeout: float) -> Any:
    """The launcher's store when one is up before the process group (torchrun's), else ``None``."""
    world, rank = env.get("WORLD_SIZE", ""), env.get("RANK", "")
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT", "")
    if not (world.isdigit() and rank.isdigit() and port.isdigit() and host) or int(world) < 2:
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    try:
        client = dist.TCPStore(  # type: ignore[attr-defined]
            host, int(port), is_master=False, timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )  # fmt: skip
    except Exception:  # unreachable: the process group's own start will say so in its words
        return None
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"bfpp-auto/{attempt}/{next(_ROUNDS)}/", client)  # type: ignore[attr-defined]


def agree_across_ranks(
    facts: Mapping[str, str],
    *,
    env: Mapping[str, str] = os.environ,
    timeout: float = AGREE_TIMEOUT_S,
) -> None:
    """Raise :class:`ScheduleError` on every rank where the ranks' choices differ (through the
    launcher's store), so a split job stops at once, not at a collective's time-out."""
    store = _store(env, timeout)
    if store is None:
        return
    world = int(env["WORLD_SIZE"])
    store.set(env["RANK"], json.dumps(dict(facts), sort_keys=True))
    keys = [str(rank) for rank in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # torch's store time-out (DistStoreError, a RuntimeError before 2.3)
        missing = [rank for rank in range(world) if not store.check([str(rank)])]
        raise ScheduleError(
            f"--pipeline-schedule auto: {_ranks_text(missing)} did not decide within "
            f"{timeout:g} s; see {'their logs' if len(missing) > 1 else 'its log'}"
        ) from None
    if (problem := disagreement([json.loads(store.get(key)) for key in keys])) is not None:
        raise ScheduleError(problem)


def decide_alike(
    request_of: Callable[[], AutoRequest],
    *,
    inputs: Mapping[str, str],
    env: Mapping[str, str],
    agree: bool = True,
) -> Decision:
    """:func:`decide`, then the choices (a refusal too) compared across the job's ranks."""
    try:
        decision = decide(request_of())
    except ScheduleError as error:
        if agree:
            refused = f"refused ({str(error).splitlines()[0]})"
            agree_across_ranks({**inputs, "decision": refused}, env=env)
        raise
    if agree:
        agree_across_ranks({**inputs, "decision": label(decision.chosen.candidate)}, env=env)
    return decision


def precision_of(*, sixteen_bit: bool, optimizer: str = "adam") -> Precision:
    """Bytes per element as megatron-core keeps them: bf16/fp16 weights with fp32 gradients and
    master weights, or fp32 throughout; Adam keeps two moments, SGD one (momentum)."""
    base = BF16_MIXED if sixteen_bit else FP32
    if optimizer == "sgd":
        master = 4 if sixteen_bit else 0
        return dataclasses.replace(base, name=f"{base.name}-sgd", optimizer_bytes=master + 4)
    return base


def _megatron_model(args: Any) -> Model:
    """Megatron-LM's parsed arguments as the planner's model (``validate_args``'s defaults)."""
    groups = getattr(args, "group_query_attention", False) and getattr(args, "num_query_groups", 0)
    vocab = getattr(args, "vocab_size", None) or {"GPT2BPETokenizer": 50257}.get(
        str(getattr(args, "tokenizer_type", ""))
    )
    return model_description(
        num_layers=int(args.num_layers),
        hidden_size=int(args.hidden_size),
        num_attention_heads=int(args.num_attention_heads),
        seq_length=int(args.seq_length),
        gated=bool(getattr(args, "swiglu", False)),
        ffn_default="megatron-lm",
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
        num_query_groups=int(groups) if groups else None,
        vocab_size=vocab,
        dropout=_has_dropout(args),
        moe=moe_settings(args, "num_experts"),
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
    )


def moe_settings(config: Any, experts: str) -> dict[str, Any]:
    """The MoE settings in megatron's names (``experts``: Megatron-LM's ``num_experts``,
    TransformerConfig's ``num_moe_experts``); ``--moe-layer-freq``'s list as a tuple."""
    names = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
    freq = getattr(config, "moe_layer_freq", None)
    return {
        "num_experts": getattr(config, experts, None),
        **{name: getattr(config, name, None) for name in names},
        "moe_layer_freq": tuple(freq) if isinstance(freq, list | tuple) else freq,
    }


def _expert_parallel(config: Any) -> int:
    return int(getattr(config, "expert_model_parallel_size", 1) or 1)


def _has_dropout(config: Any) -> bool:
    """Whether activations hold dropout masks (Megatron-LM's and TransformerConfig's names)."""
    return any(
        float(getattr(config, name, 0.0) or 0.0) > 0
        for name in ("hidden_dropout", "attention_dropout")
    )


def split_world(config: Any, world: int, *, megatron: bool = False) -> tuple[int, int, int, int]:
    """``(tp, pp, cp, dp)``: the parallel sizes Megatron-LM's ``args`` or a ``TransformerConfig``
    name alike, and the data-parallel size they leave of ``world`` ranks (in either's words)."""
    tp, pp, cp = (
        int(getattr(config, f"{kind}_parallel_size", 1) or 1)
        for kind in ("tensor_model", "pipeline_model", "context")
    )
    if world % (tp * pp * cp):
        world_text, sizes = ("world size", "sizes") if megatron else ("WORLD_SIZE", "size")
        raise ScheduleError(
            f"{world_text} {world} is not a multiple of tensor x pipeline x context parallel "
            f"{sizes} ({tp} x {pp} x {cp})"
        )
    return tp, pp, cp, world // (tp * pp * cp)


def megatron_request(
    args: Any, *, world_size: int, env: Mapping[str, str], hw: Hardware, sharding: str | None
) -> AutoRequest:
    """What Megatron-LM's parsed arguments fixed, derived as its ``validate_args`` would."""
    if getattr(args, "rampup_batch_size", None):
        raise ScheduleError("--pipeline-schedule auto does not support --rampup-batch-size")
    needed = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")
    missing = [
        flag
        for flag in (*needed, "--micro-batch-size")
        if getattr(args, flag[2:].replace("-", "_"), None) is None
    ]
    if missing:
        raise ScheduleError(f"--pipeline-schedule auto needs {', '.join(missing)}")
    tp, pp, cp, dp = split_world(args, world_size, megatron=True)
    mbs = int(args.micro_batch_size)
    # --step-batch-size-schedule: timed at the last step's batch (a ramp's end), every step checked
    steps = step_batch_sizes(args)
    granularity = getattr(args, "recompute_granularity", None)
    model = _megatron_model(args)  # its refusals before vp's, in the request's field order
    vp = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    if per_stage := getattr(args, "num_layers_per_virtual_pipeline_stage", None):
        vp = arguments.stages_of_layers(int(args.num_layers) // pp, int(per_stage))
    unavailable = [
        (name, f"Megatron-LM's {flag} does not run with a V-shape")
        for flag in arguments.given_flags(args, arguments.NO_V_SHAPE_FLAGS)
        for name, spec in SCHEDULES.items()
        if spec.placement is Placement.V_SHAPE
    ]
    return AutoRequest(
        model=model,
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        micro_batch_size=mbs,
        global_batch_size=steps[-1]
        if steps
        else int(getattr(args, "global_batch_size", None) or mbs * dp),
        batch_schedule=steps,
        hardware=hw,
        recompute=str(granularity) if granularity in ("selective", "full") else "none",
        precision=precision_of(
            sixteen_bit=bool(getattr(args, "bf16", False) or getattr(args, "fp16", False)),
            optimizer=str(getattr(args, "optimizer", "adam") or "adam"),
        ),
        sharding=sharding if sharding in SHARDING_STRATEGIES else "optim",  # else Megatron-FSDP's
        distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        gpus_per_node=gpus_per_node_from_env(env, world_size),
        vp=int(vp) if vp else None,
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        group_size=getattr(args, "breadth_first_group_size", None),
        max_stored=getattr(args, "bpipe_max_stored", None),
        unavailable=tuple(unavailable),
        ep=_expert_parallel(args),
        moe_overlap=bool(getattr(args, "overlap_moe_expert_parallel_comm", False)),
        uneven=UnevenStages.read(args),
    )


def resolve_megatron_auto(
    args: Any,
    *,
    sharding: str | None,
    env: Mapping[str, str] = os.environ,
    device: tuple[str | None, int | None] | None = None,
    quiet: bool = False,
) -> Decision | None:
    """``--pipeline-schedule auto`` on Megatron-LM's parsed ``args``: decide, announce (unless
    ``quiet``) and write the choice back; ``None`` without auto or pipeline parallelism."""
    if getattr(args, "pipeline_schedule", None) != AUTO:
        return None
    check_auto_flags(args)  # --combined-1f1b: refused before auto decides
    world = getattr(args, "world_size", None) or int(env.get("WORLD_SIZE", "1"))
    if int(getattr(args, "pipeline_model_parallel_size", 1) or 1) < 2:
        args.pipeline_schedule = "default"
        setattr(args, AUTO_DEST, "auto: no pipeline (pp=1)")
        if not quiet and is_reporting_rank(env):
            print(
                "megatron_bfpp: auto: pipeline-model-parallel-size 1, no pipeline schedule to "
                "choose; Megatron's own runs",
                flush=True,
            )
        return None
    decision = decide_alike(
        lambda: megatron_request(
            args,
            world_size=int(world),
            env=env,
            hw=hardware_from_args(args, device=device),
            sharding=sharding,
        ),
        inputs=auto_inputs(
            profile_path=getattr(args, "pipeline_schedule_auto_profile", None),
            gpu_flag=getattr(args, "pipeline_schedule_auto_gpu", None),
            device=device,
            env=env,
        ),
        env=env,
        agree=not quiet,
    )
    if not quiet:
        announce(decision, report=getattr(args, "pipeline_schedule_auto_report", None), env=env)
    c = decision.chosen.candidate  # written back as if the user had typed it
    args.pipeline_schedule = c.schedule
    if decision.request.uneven.partition:  # --pipeline-model-parallel-layout auto: its choice
        args.pipeline_model_parallel_layout = layout_of(c.stage_layers)
    looped = get_spec(c.schedule).placement is not Placement.SINGLE
    fixed = getattr(args, "num_layers_per_virtual_pipeline_stage", None) or getattr(
        args, "pipeline_model_parallel_layout", None
    )  # a layout string fixes the stages per rank itself
    if looped and not fixed:
        args.num_virtual_stages_per_pipeline_rank = c.vp
    args.breadth_first_group_size = c.group_size
    args.bpipe_max_stored = c.max_stored
    if c.combined_1f1b:  # chosen under --overlap-moe-expert-parallel-comm
        args.combined_1f1b = True
    setattr(args, AUTO_DEST, decision.line())
    return decision


def bridge_request(
    config: Any, *, options: Mapping[str, Any], sharding: str, env: Mapping[str, str], hw: Hardware
) -> AutoRequest:
    """What a Bridge ``ConfigContainer`` fixed; the data-parallel size from the launcher's
    ``WORLD_SIZE``, since every rank decides before Bridge initialises anything."""
    model = config.model
    world = env.get("WORLD_SIZE", "")
    if not world.isdigit():
        raise ScheduleError(
            "pipeline schedule auto needs the job's WORLD_SIZE (start it with torchrun or srun)"
        )
    tp, pp, cp, dp = split_world(model, int(world))
    seq = getattr(model, "seq_length", None) or getattr(
        getattr(config, "dataset", None), "sequence_length", None
    )
    shape = model_description(
        num_layers=int(model.num_layers),
        hidden_size=int(model.hidden_size),
        num_attention_heads=int(model.num_attention_heads),
        seq_length=int(seq or 2048),
        gated=bool(getattr(model, "gated_linear_unit", False)),
        ffn_default="megatron-core",  # Bridge's config is a TransformerConfig
        ffn_hidden_size=getattr(model, "ffn_hidden_size", None),
        num_query_groups=getattr(model, "num_query_groups", None),
        vocab_size=getattr(model, "vocab_size", None),
        dropout=_has_dropout(model),
        moe=moe_settings(model, "num_moe_experts"),
        mtp_num_layers=getattr(model, "mtp_num_layers", None),
    )
    optimizer = getattr(config, "optimizer", None)
    granularity = getattr(model, "recompute_granularity", None)
    steps = step_batch_sizes(config.train)  # where Bridge's config carries Megatron's schedule
    no_v = [field for field in arguments.NO_V_SHAPE_FIELDS if getattr(model, field, None)]
    return AutoRequest(
        model=shape,
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        micro_batch_size=int(config.train.micro_batch_size),
        global_batch_size=steps[-1] if steps else int(config.train.global_batch_size),
        batch_schedule=steps,
        hardware=hw,
        recompute=str(granularity) if granularity in ("selective", "full") else "none",
        precision=precision_of(
            sixteen_bit=bool(getattr(model, "bf16", False) or getattr(model, "fp16", False)),
            optimizer=str(getattr(optimizer, "optimizer", "adam") or "adam"),
        ),
        sharding=sharding,
        distributed_optimizer=bool(getattr(optimizer, "use_distributed_optimizer", True)),
        gpus_per_node=gpus_per_node_from_env(env, int(world)),
        vp=getattr(model, "virtual_pipeline_model_parallel_size", None),
        sequence_parallel=bool(getattr(model, "sequence_parallel", False)),
        group_size=options.get("group_size"),
        max_stored=options.get("max_stored"),
        vp_flag="config.model.virtual_pipeline_model_parallel_size",
        unavailable=tuple(
            (name, f"config.model.{no_v[0]} does not run with a V-shape")
            for name, spec in SCHEDULES.items()
            if spec.placement is Placement.V_SHAPE and no_v
        ),
        ep=_expert_parallel(model),
        moe_overlap=bool(getattr(model, "overlap_moe_expert_parallel_comm", False)),
        uneven=UnevenStages.read(model, UNEVEN_CONFIG_FIELDS),
    )


def resolve_bridge_auto(
    config: Any,
    options: Mapping[str, Any],
    *,
    sharding: str = "optim",
    report: str | None = None,
    profile: str | None = None,
    gpu: str | None = None,
    env: Mapping[str, str] = os.environ,
    device: tuple[str | None, int | None] | None = None,
) -> tuple[str, dict[str, Any], Decision]:
    """Decide for Bridge's ``pretrain``: the schedule's name and options for ``use_schedule``."""
    name, memory = probe_device() if device is None else device
    decision = decide_alike(
        lambda: bridge_request(
            config,
            options=options,
            sharding=sharding,
            env=env,
            hw=hardware(device_name=name, device_memory=memory, gpu_flag=gpu, profile_path=profile),
        ),
        inputs=auto_inputs(profile_path=profile, gpu_flag=gpu, device=(name, memory), env=env),
        env=env,
    )
    announce(decision, report=report, env=env)
    c = decision.chosen.candidate
    if decision.request.uneven.partition:  # pipeline_model_parallel_layout "auto": its choice
        config.model.pipeline_model_parallel_layout = layout_of(c.stage_layers)
    layout = getattr(config.model, "pipeline_model_parallel_layout", None)
    if get_spec(c.schedule).placement is Placement.LOOPED and not layout:
        config.model.virtual_pipeline_model_parallel_size = c.vp
    chosen = {k: v for k, v in options.items() if k not in ("group_size", "max_stored")}
    chosen.update(decision.options)
    if c.schedule != "interleaved":
        chosen.pop("microbatch_group_size", None)
    return c.schedule, chosen, decision
