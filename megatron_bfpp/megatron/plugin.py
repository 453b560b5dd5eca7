"""``install()`` / ``uninstall()``: plug megatron_bfpp's schedules into Megatron-LM / megatron-core
at each site the installed version binds (docs/architecture.md#megatron-integration); the schedule
comes from Megatron-LM's parsed arguments once they exist, else from :func:`set_schedule`."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from megatron_bfpp.compat import (
    call_megatron_get_forward_backward_func,
    check_megatron_core,
    check_torch,
    is_multi_module_collection,
)
from megatron_bfpp.config.run_config import LAYOUT_AUTO, LAYOUT_AUTO_ALONE
from megatron_bfpp.flags import quiet_exit
from megatron_bfpp.ir import Placement, ScheduleError
from megatron_bfpp.megatron.arguments import (
    add_schedule_arguments,
    apply_schedule_defaults,
    check_schedule_args,
    schedule_options_from_args,
)
from megatron_bfpp.megatron.patches import Patches
from megatron_bfpp.plan.auto import AUTO
from megatron_bfpp.schedules.registry import SCHEDULES

__all__ = ["current_schedule", "install", "is_installed", "set_schedule", "uninstall"]

log = logging.getLogger(__name__)

SHARDING_FLAG = "--data-parallel-sharding-strategy"
# Where Megatron-LM's training loop steps the optimizer and saves: wrapped for sharding.
SHARDING_SITES = ("setup_model_and_optimizer", "save_checkpoint")
SHARDING_DEST = "data_parallel_sharding_strategy"

CORE_SITES = ("megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel")
TRAINING_MODULES = ("arguments", "initialize", "training")  # of megatron.training
# Megatron-LM >= 0.19 builds pretrain_gpt.py's model chunks here, not in get_model.
STAGES_SITE = "megatron.training.models.dist_utils"
# Where pretrain_gpt.py imports get_batch_on_this_tp_rank from (0.19+: core; 0.16: training).
BATCH_SITES = ("megatron.core.utils", "megatron.training.utils")

_lock = threading.RLock()
# What install() replaced; empty when not installed.
_patches = Patches()
# Megatron's own get_forward_backward_func, captured at install.
_megatron_get_fbf: Callable[..., Any] | None = None
_setting: tuple[str, tuple[tuple[str, Any], ...]] = ("default", ())
_training_available = False
# Megatron-LM's own default of --data-parallel-sharding-strategy, put back after parsing.
_megatron_sharding_default: Any = None


def is_installed() -> bool:
    return bool(_patches)


def set_schedule(name: str, **options: Any) -> None:
    """Choose the schedule and its ``options`` for megatron-core-only users."""
    if name != "default":
        from megatron_bfpp.runtime.api import get_forward_backward_func

        get_forward_backward_func(name, **options)  # fails now on bad names / options
    elif options:
        raise ScheduleError(f"schedule 'default' takes no options, got {sorted(options)}")
    global _setting
    _setting = (name, tuple(sorted(options.items())))


def current_schedule() -> tuple[str, dict[str, Any]]:
    """``(name, options)`` in effect: Megatron-LM's flag once parsed, else set_schedule's."""
    args = _megatron_lm_args()
    if args is not None and hasattr(args, "pipeline_schedule"):
        return args.pipeline_schedule, schedule_options_from_args(args)
    return _setting[0], dict(_setting[1])


def _current_sharding() -> str:
    """The sharding strategy our schedules run: Megatron-LM's flag when given, else ``optim``."""
    args = _megatron_lm_args()
    return str(getattr(args, "bfpp_data_parallel_sharding_strategy", "optim") or "optim")


def install() -> None:
    """Patch the sites (a no-op when already installed)."""
    global _megatron_get_fbf, _training_available
    with _lock:
        if _patches:
            return
        check_megatron_core()
        if (torch_warning := check_torch()) and os.environ.get("RANK", "0") == "0":
            _log_once(torch_warning)
        core = [importlib.import_module(name) for name in CORE_SITES]
        _megatron_get_fbf = core[0].get_forward_backward_func
        training_modules: tuple[Any, ...] | None = None
        try:
            training_modules = tuple(
                importlib.import_module(f"megatron.training.{n}") for n in TRAINING_MODULES
            )
        except ImportError as error:
            log.info(
                "megatron_bfpp.install: Megatron-LM's megatron.training is not importable (%s); "
                "patched megatron-core's get_forward_backward_func only (use set_schedule())",
                error,
            )
        _training_available = training_modules is not None
        try:
            for module in core:
                _patches.patch(module, "get_forward_backward_func", get_forward_backward_func)
            if training_modules is not None:
                arguments, initialize, training = training_modules
                _patches.patch(training, "get_forward_backward_func", get_forward_backward_func)
                if all(hasattr(training, name) for name in SHARDING_SITES):
                    _patches.wrap(training, "setup_model_and_optimizer", _wrap_setup)
                    _patches.wrap(training, "save_checkpoint", _wrap_save)
                _patches.wrap(training, "get_model", _wrap_get_model)
                stages = _import_optional(STAGES_SITE)
                _patches.wrap(stages, "build_virtual_pipeline_stages", _wrap_build_stages)
                for site in map(_import_optional, BATCH_SITES):
                    _patches.wrap(site, "get_batch_on_this_tp_rank", _wrap_tp_batch)
                from megatron.core import parallel_state

                from megatron_bfpp.megatron.seeding import record_seed_call

                _patches.wrap(parallel_state, "is_pipeline_last_stage", _wrap_is_last_stage)
                _patches.wrap(arguments, "add_megatron_arguments", _wrap_add_arguments)
                # V chunks reseed as 1F1B ranks
                _patches.wrap(initialize, "_set_random_seed", record_seed_call)
                for module in (arguments, initialize):  # Megatron-LM >= 0.17: arguments only
                    _patches.wrap(module, "validate_args", _wrap_validate)
        except BaseException:
            _patches.restore()
            raise


def add_patch(owner: Any, name: str, value: Any) -> None:
    """Replace ``owner.name`` with ``value`` so :func:`uninstall` restores it too (for the sites
    only a front end such as ``megatron.bridge`` knows). Needs :func:`install` first."""
    with _lock:
        if not _patches:
            raise ScheduleError("megatron_bfpp.install() must run before add_patch()")
        _patches.patch(owner, name, value)


def keep_prebuilt_dataset_helpers() -> None:
    """A megatron-core wheel ships the built ``helpers_cpp`` but no Makefile, so the ``make``
    Megatron-LM runs at start fails: where ``helpers_cpp`` imports, ``compile_helpers`` does
    nothing (registered, so :func:`uninstall` restores it). Needs :func:`install` first."""
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
        import megatron.core.datasets.utils as dataset_utils
    except ImportError:
        return
    add_patch(dataset_utils, "compile_helpers", lambda: None)


def uninstall() -> None:
    """Restore every original :func:`install` replaced (a no-op when not installed)."""
    global _megatron_get_fbf, _training_available
    with _lock:
        _patches.restore()
        _megatron_get_fbf = None
        _training_available = False
        _cached_forward_backward_func.cache_clear()


def get_forward_backward_func(
    pp_size: int | None = None, vp_size: int | None = None, schedule_pg_collection: Any = None
) -> Any:
    """megatron's ``get_forward_backward_func``, dispatching on the chosen schedule."""
    original = _megatron_get_fbf
    if original is None:  # called through a reference kept after uninstall()
        from megatron.core.pipeline_parallel import schedules

        original = schedules.get_forward_backward_func
    name, options = current_schedule()

    def megatrons_own() -> Any:
        return call_megatron_get_forward_backward_func(
            original,
            pp_size=pp_size,
            vp_size=vp_size,
            schedule_pg_collection=schedule_pg_collection,
        )

    if name == "default":
        return megatrons_own()
    if is_multi_module_collection(schedule_pg_collection):
        raise ScheduleError(
            f"pipeline schedule {name} does not run multi-module (cross-grid) pipelines; "
            "use --pipeline-schedule default for them"
        )
    if pp_size is None:
        from megatron.core import parallel_state

        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        _log_once(f"pipeline schedule {name} needs pp >= 2; using megatron's own (no pipelining)")
        return megatrons_own()
    sharding = _current_sharding()
    func = _cached_forward_backward_func(name, tuple(sorted(options.items())), sharding)
    sharded = "" if sharding == "optim" else f" (parameters sharded: {sharding})"
    _log_once(
        f"megatron_bfpp: pipeline schedule {name} {options or ''}".rstrip() + sharded, logging.INFO
    )
    return func


@functools.lru_cache(maxsize=16)
def _cached_forward_backward_func(
    name: str, options: tuple[tuple[str, Any], ...], sharding: str = "optim"
) -> Any:
    from megatron_bfpp.runtime.api import get_forward_backward_func as ours

    return ours(name, data_parallel_sharding_strategy=sharding, **dict(options))


def _megatron_lm_args() -> Any:
    if not _training_available:
        return None
    try:
        from megatron.training import global_vars
    except ImportError:
        return None
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def _wrap_add_arguments(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def add_megatron_arguments(parser: Any, *args: Any, **kwargs: Any) -> Any:
        global _megatron_sharding_default
        parser = original(parser, *args, **kwargs)
        if os.environ.get("LOCAL_RANK", "0") != "0":
            # Every rank parses the same arguments: local rank 0 prints an argparse error and
            # its usage (once per node, not once per rank), the others exit with its code.
            parser.error = lambda message: quiet_exit(2)
        options = {o for action in getattr(parser, "_actions", ()) for o in action.option_strings}
        if "--pipeline-schedule" not in options:
            add_schedule_arguments(parser)
        if SHARDING_FLAG in options:
            # "Not given" must be visible to validate_args: Megatron-FSDP's default is not ours.
            _megatron_sharding_default = parser.get_default(SHARDING_DEST)
            parser.set_defaults(**{SHARDING_DEST: None})
        else:
            parser.add_argument(SHARDING_FLAG, dest=SHARDING_DEST, default=None)
        return parser

    add_megatron_arguments.__dict__["megatron_bfpp_wrapped"] = True
    return add_megatron_arguments


def _wrap_validate(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def validate_args(args: Any, *rest: Any, **kwargs: Any) -> Any:
        given = getattr(args, SHARDING_DEST, None)
        if getattr(args, "pipeline_schedule", "default") == AUTO:
            from megatron_bfpp.megatron.auto import probe_device, resolve_megatron_auto

            try:  # decided alike on every rank, before Megatron derives vp
                resolve_megatron_auto(args, sharding=given, device=probe_device())
            except ScheduleError as error:
                refuse(str(error).splitlines()[0])
        if getattr(args, "pipeline_model_parallel_layout", None) == LAYOUT_AUTO:
            refuse(LAYOUT_AUTO_ALONE)  # auto replaces it with its choice
        apply_schedule_defaults(args)
        if given is None:
            setattr(args, SHARDING_DEST, _megatron_sharding_default)
        ours = getattr(args, "pipeline_schedule", "default") != "default"
        fsdp = bool(getattr(args, "use_megatron_fsdp", False))
        args.bfpp_data_parallel_sharding_strategy = given if ours and not fsdp else None
        wired = _patches.owner_of("setup_model_and_optimizer") is not None
        if given not in (None, "optim") and ours and not fsdp and not wired:
            refuse(
                "this Megatron-LM's megatron.training.training has no "
                f"{' / '.join(SHARDING_SITES)} to wrap, so --data-parallel-sharding-strategy "
                f"{given} cannot run with our schedules; use optim"
            )
        result = original(args, *rest, **kwargs)
        validated = result if result is not None else args
        if not hasattr(validated, "pipeline_schedule"):
            validated.pipeline_schedule = "default"  # parsed by a parser we never saw
        try:
            check_schedule_args(validated)
        except ScheduleError as error:
            refuse(str(error).splitlines()[0])
        return result

    validate_args.__dict__["megatron_bfpp_wrapped"] = True
    return validate_args


def refuse(message: str, *, prog: str = "megatron_bfpp") -> NoReturn:
    """End a rank for an argument error: exit 2, the line printed by local rank 0 only."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        quiet_exit(2)
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _wrap_setup(original: Callable[..., Any]) -> Callable[..., Any]:
    """Fully sharded, the optimizer Megatron-LM steps must step on the kept shards."""

    @functools.wraps(original)
    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        model, optimizer = result[0], result[1]
        if _current_sharding() != "optim" and optimizer is not None:
            chunks = model if isinstance(model, list) else [model]
            optimizer.step = functools.partial(_sharded_step, chunks, optimizer, optimizer.step)
        return result

    return setup_model_and_optimizer


def _sharded_step(chunks: list[Any], optimizer: Any, step: Callable[[], Any]) -> Any:
    from megatron_bfpp.runtime.sharding import sharded_parameters

    return sharded_parameters(chunks).optimizer_step(step, optimizer)


def _wrap_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """Save sharded parameters gathered: the checkpoint is the unsharded run's."""

    @functools.wraps(original)
    def save_checkpoint(iteration: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        if _current_sharding() == "optim":
            return original(iteration, model, *args, **kwargs)
        from megatron_bfpp.runtime.sharding import sharded_parameters

        with sharded_parameters(model if isinstance(model, list) else [model]).whole():
            return original(iteration, model, *args, **kwargs)

    return save_checkpoint


def _v_shape_active() -> bool:
    spec = SCHEDULES.get(current_schedule()[0])
    return spec is not None and spec.placement is Placement.V_SHAPE


def _wrap_get_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """Under a V-shape schedule Megatron-LM's ``get_model`` builds V-shape chunks."""

    @functools.wraps(original)
    def get_model(model_provider_func: Any, *args: Any, **kwargs: Any) -> Any:
        if not _v_shape_active():
            return original(model_provider_func, *args, **kwargs)
        from megatron.core import parallel_state

        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        rank = parallel_state.get_pipeline_model_parallel_rank()
        return original(_v_shape_provider(model_provider_func, pp_size, rank), *args, **kwargs)

    return get_model


def _v_shape_provider(provider: Any, num_ranks: int, rank: int, group: Any = None) -> Any:
    """``provider`` building this rank's V-shape chunks, each seeded as 1F1B's pipeline rank:
    Megatron-LM's seeding replayed, else (Bridge) from the generators ``group``'s ranks hold now."""
    from megatron_bfpp.megatron import seeding
    from megatron_bfpp.megatron.chunks import placed_provider

    seeded_as: Any = seeding.seeded_as_pipeline_rank
    if seeding._seed_call is None and group is not None:
        seeded_as = functools.partial(seeded_as, states=seeding.gathered_states(group))
    return placed_provider(
        provider,
        num_ranks=num_ranks,
        rank=rank,
        share_embeddings_and_output_weights=not getattr(
            _megatron_lm_args(), "untie_embeddings_and_output_weights", False
        ),
        seeded_as=seeded_as,
    )


def _wrap_build_stages(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron-LM >= 0.19's model builders: V-shape chunks under a V-shape schedule."""

    @functools.wraps(original)
    def build_virtual_pipeline_stages(
        build_model_func: Any, pg_collection: Any, vp_size: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not _v_shape_active() or vp_size is None:
            return original(build_model_func, pg_collection, vp_size, *args, **kwargs)

        def provider(*, pg_collection: Any, **flags: Any) -> Any:
            return build_model_func(pg_collection, **flags)

        pp = pg_collection.pp
        placed = _v_shape_provider(provider, pp.size(), pp.rank(), pp)

        def build(groups: Any, **flags: Any) -> Any:
            return placed(pg_collection=groups, **flags)

        return original(build, pg_collection, vp_size, *args, **kwargs)

    return build_virtual_pipeline_stages


def _wrap_tp_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    """Under a V-shape schedule pipeline rank 0 both embeds and computes the loss, so it keeps
    every batch field, as Megatron-LM does for multi-token-prediction layers."""

    @functools.wraps(original)
    def get_batch_on_this_tp_rank(*args: Any, **kwargs: Any) -> Any:
        if _v_shape_active():
            from megatron.core import parallel_state

            if parallel_state.get_pipeline_model_parallel_rank() == 0:
                kwargs["mtp_on_this_rank"] = True
        return original(*args, **kwargs)

    return get_batch_on_this_tp_rank


def _import_optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _wrap_is_last_stage(original: Callable[..., Any]) -> Callable[..., Any]:
    """Asked about one chunk under a V-shape: is it rank 0's chunk 1? Else megatron's answer."""

    @functools.wraps(original)
    def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
        if ignore_virtual or vp_stage is None or not _v_shape_active():
            return bool(original(ignore_virtual=ignore_virtual, vp_stage=vp_stage))
        from megatron.core import parallel_state

        return parallel_state.get_pipeline_model_parallel_rank() == 0 and vp_stage == 1

    return is_pipeline_last_stage


_logged: set[str] = set()


def _log_once(message: str, level: int = logging.WARNING) -> None:
    if message not in _logged:
        _logged.add(message)
        log.log(level, message)
