"""Our schedules for Megatron-Bridge's ``pretrain()`` (and NeMo's recipes built on it): Bridge
binds ``get_forward_backward_func`` at import, so :func:`use_schedule` replaces its names too;
what Bridge would run past the hook or cannot build for a schedule is refused in one line."""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

from megatron_bfpp.config.run_config import LAYOUT_AUTO
from megatron_bfpp.ir import Placement, ScheduleError
from megatron_bfpp.megatron import plugin
from megatron_bfpp.megatron.arguments import NO_V_SHAPE_FIELDS
from megatron_bfpp.megatron.auto import resolve_bridge_auto, split_world
from megatron_bfpp.plan.auto import AUTO
from megatron_bfpp.schedules.fit import check_fit, step_batch_sizes
from megatron_bfpp.schedules.registry import get_spec, schedule_names

__all__ = ["BRIDGE_SITES", "check_bridge_config", "use_schedule"]

# Bridge's modules that bind megatron-core's get_forward_backward_func at import.
BRIDGE_SITES = ("megatron.bridge.training.train", "megatron.bridge.training.eval")
VP_FIELD = "config.model.virtual_pipeline_model_parallel_size"


def use_schedule(
    config: Any,
    name: str,
    *,
    data_parallel_sharding_strategy: str = "optim",
    auto_report: str | None = None,
    auto_profile: str | None = None,
    auto_gpu: str | None = None,
    **options: Any,
) -> None:
    """Run ``name`` (a ``--pipeline-schedule`` name, ``options`` its own) in Bridge's
    ``pretrain(config, ...)``; ``auto_*`` are the ``--pipeline-schedule-auto-*`` flags. Raises
    :class:`ScheduleError` (one line) for a schedule that does not fit ``config``, before work."""
    if name == AUTO:
        if options.get("combined_1f1b"):  # as Megatron-LM's and bfpp-train's auto, before it
            raise ScheduleError("combined_1f1b needs the schedule 'interleaved', not 'auto'")
        name, options, _ = resolve_bridge_auto(
            config,
            options,
            sharding=data_parallel_sharding_strategy,
            report=auto_report,
            profile=auto_profile,
            gpu=auto_gpu,
        )
    elif auto_report or auto_profile or auto_gpu:
        raise ScheduleError("auto_report / auto_profile / auto_gpu apply to the schedule 'auto'")
    options = _with_config_options(config, name, options)
    check_bridge_config(config, name, options, sharding=data_parallel_sharding_strategy)
    plugin.install()
    plugin.set_schedule(name, **options)
    for module in map(importlib.import_module, BRIDGE_SITES):  # importing them: Bridge is in use
        if module.get_forward_backward_func is not plugin.get_forward_backward_func:
            plugin.add_patch(module, "get_forward_backward_func", plugin.get_forward_backward_func)
    evaluation = importlib.import_module("megatron.bridge.training.eval")
    if not getattr(evaluation.evaluate, "_bfpp_guard", False):
        plugin.add_patch(evaluation, "evaluate", _guard_multi_module(evaluation.evaluate))
    provide = getattr(config.model, "provide", None)  # None: a ModelConfig, the plugin's wrap
    wrapped = getattr(provide, "_bfpp_guard", False)  # by an earlier use_schedule
    if get_spec(name).placement is Placement.V_SHAPE and provide is not None and not wrapped:
        plugin.add_patch(config.model, "provide", _v_shape_provide(provide))


def check_bridge_config(
    config: Any, name: str, options: dict[str, Any], *, sharding: str = "optim"
) -> None:
    """The one-line refusals for ``config``; a looped or V schedule's default vp (2) set."""
    if name not in schedule_names():
        raise ScheduleError(
            f"pipeline schedule {name!r} is unknown; choose one of: {', '.join(schedule_names())}"
        )
    spec = get_spec(name)
    model = config.model
    if getattr(model, "pipeline_model_parallel_layout", None) == LAYOUT_AUTO:
        raise ScheduleError(  # auto replaces it with its choice before this check
            "config.model.pipeline_model_parallel_layout 'auto' needs the schedule 'auto' (the "
            "planner chooses the layers per stage with the schedule)"
        )
    given = [field for field in NO_V_SHAPE_FIELDS if getattr(model, field, None)]
    if spec.placement is Placement.V_SHAPE and given:
        raise ScheduleError(
            f"pipeline schedule {name} places layers on a V (rank r holds stages r and 2p-1-r) "
            f"and does not support config.model.{given[0]} yet; unset it"
        )
    if getattr(getattr(model, "dist_train", None), "use_dist_train", False) is True:
        raise ScheduleError(
            f"pipeline schedule {name} cannot run with config.model.dist_train.use_dist_train: "
            "Bridge's dist_train calls megatron-core's non-interleaved schedule directly, past "
            "the hook; turn dist_train off or use Bridge's own schedule"
        )
    if getattr(getattr(config, "ddp", None), "use_megatron_fsdp", False):
        raise ScheduleError(
            f"pipeline schedule {name} does not run with Megatron-FSDP "
            "(config.ddp.use_megatron_fsdp); use the distributed optimizer"
        )
    if sharding != "optim":
        raise ScheduleError(
            f"pipeline schedule {name} with data_parallel_sharding_strategy={sharding!r} needs "
            "an optimizer that steps on the parameter shards, which Megatron-Bridge's setup does "
            "not build; use it from Megatron-LM or bfpp-train, or keep 'optim'"
        )
    pp = int(getattr(model, "pipeline_model_parallel_size", 1) or 1)
    if pp < 2:
        raise ScheduleError(
            f"pipeline schedule {name} needs config.model.pipeline_model_parallel_size >= 2 "
            f"(it is {pp})"
        )
    if spec.placement is not Placement.SINGLE and not model.virtual_pipeline_model_parallel_size:
        model.virtual_pipeline_model_parallel_size = spec.default_stages_per_rank
    vp = model.virtual_pipeline_model_parallel_size
    world = os.environ.get("WORLD_SIZE", "")
    if not world.isdigit():  # the runtime checks the micro-batches at the first step
        spec.chunks_for(vp, vp_flag=VP_FIELD)
        return
    dp = split_world(model, int(world))[3]
    check_fit(
        name,
        pp=pp,
        vp=vp,
        dp=dp,
        micro_batch_size=int(config.train.micro_batch_size),
        global_batch_size=int(config.train.global_batch_size or config.train.micro_batch_size * dp),
        vp_flag=VP_FIELD,
        options=options,
        batch_schedule=step_batch_sizes(config.train),
        overlapped=bool(getattr(model, "overlap_moe_expert_parallel_comm", False)),
    )


def _with_config_options(config: Any, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Interleaved's micro-batch group from Bridge's own field, as Megatron-LM's flag does."""
    group = getattr(config.model, "microbatch_group_size_per_vp_stage", None)
    if name == "interleaved" and group and "microbatch_group_size" not in options:
        return {**options, "microbatch_group_size": int(group)}
    return dict(options)


def _v_shape_provide(provide: Any) -> Callable[..., Any]:
    """A Bridge provider's ``provide`` building the V's chunks while a V-shape runs, as the plugin
    wraps Megatron-LM's ``model_provider``: Bridge hands a provider its process groups on
    ``_pg_collection``, where each chunk's view of them is set for its build only."""
    model = provide.__self__
    placed: list[Callable[..., Any]] = []

    def build(*, pg_collection: Any, **flags: Any) -> Any:
        groups, model._pg_collection = model._pg_collection, pg_collection
        try:
            return provide(**flags)
        finally:
            model._pg_collection = groups

    def v_shape_provide(*args: Any, vp_stage: Any = None, **kwargs: Any) -> Any:
        if not plugin._v_shape_active():
            return provide(*args, vp_stage=vp_stage, **kwargs)
        pp = model._pg_collection.pp
        placed[:] = placed or [plugin._v_shape_provider(build, pp.size(), pp.rank(), pp)]
        return placed[0](vp_stage=vp_stage, pg_collection=model._pg_collection)

    v_shape_provide._bfpp_guard = True  # type: ignore[attr-defined]
    return v_shape_provide


def _guard_multi_module(evaluate: Callable[..., Any]) -> Callable[..., Any]:
    """Bridge's ``evaluate``, refusing multi-module evaluation, which it runs past our schedule."""
    signature = inspect.signature(evaluate)

    @functools.wraps(evaluate)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        from megatron_bfpp.compat import is_multi_module_collection
        from megatron_bfpp.megatron.plugin import current_schedule, refuse

        bound = signature.bind_partial(*args, **kwargs).arguments
        name = current_schedule()[0]
        multi = is_multi_module_collection(bound.get("pg_collection")) or (
            type(bound.get("p2p_communicator")).__name__ == "MultiModulePipelineCommunicator"
        )
        if name != "default" and multi:
            refuse(
                f"pipeline schedule {name} does not run multi-module (MegatronMIMO) evaluation: "
                "Bridge evaluates it with megatron-core's non-interleaved schedule directly; use "
                "the default schedule for it"
            )
        return evaluate(*args, **kwargs)

    guarded._bfpp_guard = True  # type: ignore[attr-defined]
    return guarded
