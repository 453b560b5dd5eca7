"""What a handler of one action kind works on: one rank's side of one training step.

A handler is a plain function of ``(step, position, action)``; a runtime module registers its
kinds as :class:`Handlers`. A protocol with state between its actions keeps it in its own
:class:`StepPart`, which the core asks the same few questions, so it never names a protocol."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch

from megatron_bfpp.ir import Action, ActionKind, Schedule, primitives
from megatron_bfpp.runtime.activations import ActivationStore
from megatron_bfpp.runtime.p2p import PipeComm, Receive, Send
from megatron_bfpp.semantics import planned_forwards

__all__ = [
    "Call",
    "DispatchTable",
    "Handler",
    "Handlers",
    "Key",
    "MemoryReport",
    "RankStep",
    "StepContext",
    "StepPart",
    "StepState",
    "Window",
    "dispatch_table",
    "key_and_peer",
]

Key = tuple[int, int]  # (stage, micro-batch)


@dataclass(frozen=True, kw_only=True)
class Call:
    """One call's megatron-core forward-backward arguments: the one declaration of their names and
    defaults (``forward_backward_pipelining_with_interleaving``'s, keyword-only there too), built
    by ``ForwardBackwardFunc`` from ``**kwargs`` and shown as its signature."""

    forward_step_func: Callable[..., Any]
    data_iterator: Iterator[Any] | list[Iterator[Any]] | None
    model: torch.nn.Module | list[torch.nn.Module]
    num_microbatches: int
    seq_length: int
    micro_batch_size: int
    decoder_seq_length: int | None = None
    forward_only: bool = False
    collect_non_loss_data: bool = False
    first_val_step: bool | None = None
    adjust_tensor_shapes_fn: Callable[..., Any] | None = None
    p2p_communicator: Any = None
    pg_collection: Any = None
    force_all_reduce: bool | None = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward_only", bool(self.forward_only))


@dataclass
class StepContext:
    """Everything a step needs besides the schedule: megatron-core's call and what was read from it
    once (chunks, a data iterator each, their config, the pipeline's messages)."""

    call: Call
    data_iterators: list[Iterator[Any] | None]
    model: list[torch.nn.Module]  # the call's model as a list of chunks
    config: Any
    model_type: Any
    cp_group_size: int
    comm: PipeComm
    measure_memory: bool = False
    sharded: Any = None  # runtime.sharding.ShardedParameters with optim_grads_params


@dataclass
class MemoryReport:
    """Measured activation memory of one rank in one step (bytes of distinct storages)."""

    peak_activation_bytes: int = 0
    peak_stored_microbatches: int = 0  # most resident at once: own and the partner's
    peak_parameter_bytes: int | None = None  # with sharded parameters: kept shards + gathered
    cuda_max_memory_allocated: int | None = None

    def observe(self, nbytes: int, microbatches: int) -> None:
        self.peak_activation_bytes = max(self.peak_activation_bytes, nbytes)
        self.peak_stored_microbatches = max(self.peak_stored_microbatches, microbatches)


@dataclass
class StepState:
    """The core's per-step bookkeeping; the executor proves it empty at the end of the step."""

    inputs: dict[Key, torch.Tensor | None] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    grads_to_send: dict[Key, torch.Tensor] = field(default_factory=dict)
    local_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # same-rank handoff
    no_sync: dict[int, contextlib.AbstractContextManager[Any]] = field(default_factory=dict)
    synced_chunks: set[int] = field(default_factory=set)
    forward_data_store: list[Any] = field(default_factory=list)
    total_num_tokens: torch.Tensor | None = None
    trace: list[str] = field(default_factory=list)
    memory: MemoryReport = field(default_factory=MemoryReport)


@dataclass
class Window:
    """One posting batch's messages (runtime.p2p): handlers add to it, the executor posts it."""

    sends: list[Send] = field(default_factory=list)
    receives: list[Receive] = field(default_factory=list)

    def post(self, comm: PipeComm, *, side: bool = False) -> None:
        comm.post(self.sends, self.receives, side=side)
        self.sends, self.receives = [], []


class StepPart:
    """A handler module's per-step state and answers to the core (default: no activations held)."""

    def begin(self, step: RankStep) -> None:
        """Set up before the rank's first action (``end`` runs after its last, also on failure)."""

    def end(self, step: RankStep) -> None:
        """Undo what ``begin`` set up."""

    def before_compute(self, step: RankStep, stage: int) -> None:
        """Make the stage's parameters usable before it computes (they may be in flight)."""

    def before_backward(self, step: RankStep, key: Key) -> None:
        """Make ``key``'s stored activations usable before its backward (they may be away)."""

    def held_tensors(self, step: RankStep) -> Iterable[torch.Tensor]:
        """Buffers this part keeps for pipelining, for the memory accounting."""
        return ()

    def held_microbatches(self, step: RankStep) -> Iterable[Key]:
        """Micro-batches whose activations this part keeps on the rank (own or a partner's)."""
        return ()

    def leftovers(self) -> dict[str, Collection[Any]]:
        """What the step must not end with, by description (empty when drained)."""
        return {}


Handler = Callable[["RankStep", int, Action], None]
P = TypeVar("P", bound=StepPart)


@dataclass(frozen=True)
class Handlers:
    """One runtime module's share of the dispatch table: ``kinds`` -> handler; ``rests``: kinds
    with a *rest* item in a later batch (an eviction's payload) -> its handler; ``part`` makes
    its per-step state; ``captures``: kinds needing the forward's saved tensors (BPipe's EV)."""

    kinds: Mapping[ActionKind, Handler]
    rests: Mapping[ActionKind, Handler] = field(default_factory=dict)
    part: Callable[[], StepPart] | None = None
    captures: frozenset[ActionKind] = frozenset()


@dataclass(frozen=True)
class DispatchTable:
    """Every action kind's handler, with the registered parts and capturing kinds."""

    handlers: Mapping[ActionKind, Handler]
    rests: Mapping[ActionKind, Handler]
    parts: tuple[Callable[[], StepPart], ...]
    captures: frozenset[ActionKind]


def dispatch_table(*modules: Handlers) -> DispatchTable:
    """Merge the modules' handlers into one table covering every action kind exactly once, checked
    at import of ``runtime.executor`` so a kind without a handler fails before any step."""
    handlers: dict[ActionKind, Handler] = {}
    for module in modules:
        twice = sorted(kind.name for kind in module.kinds if kind in handlers)
        if twice:
            raise RuntimeError(
                f"action kinds {twice} have two handlers in the runtime's dispatch table; "
                "register each kind in exactly one runtime module"
            )
        handlers.update(module.kinds)
    missing = [f"{kind.name} ({kind.value})" for kind in ActionKind if kind not in handlers]
    if missing:
        raise RuntimeError(
            f"action kinds {missing} have no handler in the runtime's dispatch table; register "
            "one in a runtime module's Handlers (listed in runtime/executor.py)"
        )
    return DispatchTable(
        handlers=handlers,
        rests={kind: rest for module in modules for kind, rest in module.rests.items()},
        parts=tuple(module.part for module in modules if module.part is not None),
        captures=frozenset().union(*(module.captures for module in modules)),
    )


class RankStep:
    """One rank's side of one step: what every handler reads and updates."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        ctx: StepContext,
        *,
        measuring: bool,
        parts: Iterable[StepPart],
    ) -> None:
        self.schedule = schedule
        self.layout = schedule.layout
        self.rank = rank
        self.ctx = ctx
        self.program = schedule.per_rank[rank]
        # each chunk's last backward (B, or I if split; a pair's too): where DDP's hooks may
        # start reducing; its last GS: what DDP dispatches (grouped, fully sharded: one per group)
        backwards = {ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT}
        self.last_backward = _last_positions(primitives(self.program), backwards)
        self.last_grad_sync = _last_positions(enumerate(self.program), {ActionKind.GRAD_SYNC})
        # With sync functions (overlap_grad_reduce) a chunk stays in no_sync through its last
        # backward and GS reduces, as megatron-core's interleaved schedule does; else DDP's hooks.
        self.grad_sync_funcs = self.per_chunk(ctx.config.grad_sync_func)
        # forwards run as megatron-core's schedule plans (--overlap-moe-expert-parallel-comm)
        overlap = getattr(ctx.config, "overlap_moe_expert_parallel_comm", False)
        self.planned = planned_forwards(self.program) if overlap else frozenset()
        self.measuring = measuring
        self.store = ActivationStore.for_modules(ctx.model if measuring else [], ctx.comm.device)
        self.state = StepState()
        self.window = Window()
        self.parts: dict[type[StepPart], StepPart] = {type(part): part for part in parts}

    def part(self, kind: type[P]) -> P:
        """The per-step part a handler module registered (every ``TABLE`` part is made per step)."""
        return cast(P, self.parts[kind])

    def frees_outputs(self, stage: int) -> bool:
        """Pseudo-free a sent output once its send completes, as megatron-core does."""
        return bool(self.ctx.config.deallocate_pipeline_outputs) and not self.ctx.call.forward_only

    def leave_no_sync(self, chunk: int) -> None:
        context = self.state.no_sync.pop(chunk, None)
        if context is not None:
            context.__exit__(None, None, None)

    def per_chunk(self, func: Any) -> list[Any]:
        """megatron-core accepts one callable for all chunks or one per chunk."""
        chunks = len(self.ctx.model)
        if func is None:
            return [None] * chunks
        if isinstance(func, list | tuple):
            if len(func) != chunks:
                raise ValueError(
                    f"config has {len(func)} per-chunk sync functions for {chunks} model chunks"
                )
            return list(func)
        # One callable for every chunk: megatron-core's interleaved schedule enters it once for
        # all chunks; entering it per chunk would nest the same context, so only chunk 0 holds it.
        return [func] + [None] * (chunks - 1)


def key_and_peer(action: Action) -> tuple[Key, int]:
    """A point-to-point action's (stage, micro-batch) and peer (``ir.Action`` checks both)."""
    assert action.microbatch is not None and action.peer is not None
    return (action.stage, action.microbatch), action.peer


def _last_positions(
    program: Iterable[tuple[int, Action]], kinds: Collection[ActionKind]
) -> set[int]:
    """The position of each stage's last action of ``kinds`` in ``program``."""
    last = {action.stage: position for position, action in program if action.kind in kinds}
    return set(last.values())
