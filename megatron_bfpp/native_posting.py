"""How megatron-core itself posts the point-to-point messages of its 1F1B and interleaved
schedules, as an ``nccl.Posting``, so that Megatron's own baselines are checked and timed by what
Megatron runs rather than by our runtime's lock-step posting. What it reads in megatron-core
(0.16.1, 0.19.2) and what it does not model: docs/design-notes.md, "megatron-core's own posting"."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from megatron_bfpp.ir import ActionKind, Schedule, ScheduleError, StageLayout, parts, paused_gc
from megatron_bfpp.nccl import _BLOCKING, _PAIRWISE, _POST, _RUN, _WAIT, Posting, _Lowered

__all__ = [
    "MEGATRON_CORE_DDP_DEFAULTS",
    "MEGATRON_CORE_DEFAULTS",
    "GradSyncOptions",
    "P2POptions",
    "megatron_lm_grad_sync",
    "megatron_lm_options",
    "megatron_posting",
]

K = ActionKind


@dataclass(frozen=True, slots=True)
class P2POptions:
    """megatron-core's ``overlap_p2p_comm`` and ``batch_p2p_comm`` (``ModelParallelConfig``);
    ``wait_forward_sends``: megatron-core >= 0.18 with ``deallocate_pipeline_outputs``."""

    overlap_p2p: bool = False
    batch_p2p: bool = True
    wait_forward_sends: bool = False


MEGATRON_CORE_DEFAULTS = P2POptions()  # ModelParallelConfig's defaults, 0.16 to 0.19


def megatron_lm_options(schedule: Schedule, *, core_version: tuple[int, int]) -> P2POptions:
    """What Megatron-LM's training loop sets: p2p overlap for interleaved (unless turned off),
    batched otherwise, and ``deallocate_pipeline_outputs`` (0.18 on: an early send wait)."""
    overlap = schedule.num_chunks > 1
    return P2POptions(
        overlap_p2p=overlap,
        batch_p2p=not overlap,
        wait_forward_sends=overlap and core_version >= (0, 18),  # only overlap defers sends
    )


@dataclass(frozen=True, slots=True)
class GradSyncOptions:
    """How megatron-core DDP starts each chunk's gradient reduction (``_Builder.sync_after``): its
    ``overlap_grad_reduce``, and whether ``config.grad_sync_func`` is set (``start_grad_sync``)."""

    overlap_grad_reduce: bool = False
    grad_sync_func: bool = False


MEGATRON_CORE_DDP_DEFAULTS = GradSyncOptions()  # DistributedDataParallelConfig's, no sync funcs


def megatron_lm_grad_sync(*, overlap_grad_reduce: bool, align: bool = True) -> GradSyncOptions:
    """What Megatron-LM's training setup gives megatron-core: ``grad_sync_func`` only with
    ``--overlap-grad-reduce``, unless ``--no-align-grad-reduce`` (``training.py``)."""
    return GradSyncOptions(overlap_grad_reduce, overlap_grad_reduce and align)


def megatron_posting(
    schedule: Schedule,
    options: P2POptions = MEGATRON_CORE_DEFAULTS,
    grad_sync: GradSyncOptions = MEGATRON_CORE_DDP_DEFAULTS,
) -> Posting:
    """Per rank, the p2p calls megatron-core's own schedule posts for ``schedule`` (lowered, in its
    compute order): each call a ``Batch`` (``blocking`` if waited at once, ``pairwise`` if
    non-batched), deferred waits as ``Wait`` steps, computes and PS / RL as program positions, each
    chunk's GS where megatron-core DDP starts its reduction under ``grad_sync``."""
    if options.overlap_p2p and options.batch_p2p:
        raise ScheduleError(
            "megatron-core cannot overlap batched p2p (overlap_p2p_comm with batch_p2p_comm); "
            "turn one off"
        )
    if options.overlap_p2p and schedule.num_chunks == 1:
        raise ScheduleError(
            "megatron-core overlaps p2p only in the interleaved schedule; 1F1B runs without "
            "overlap_p2p_comm"
        )
    if grad_sync.grad_sync_func and not grad_sync.overlap_grad_reduce:
        raise ScheduleError(
            "grad_sync_func without overlap_grad_reduce makes every start_grad_sync a "
            "synchronous reduction mid-schedule, which is not modelled; Megatron-LM sets "
            "grad_sync_func only with --overlap-grad-reduce"
        )
    shape = _Shape.of(schedule)
    lowered = _Lowered([], [], [], [], [])  # built as integers: ``Posting.per_rank`` when read
    with paused_gc():  # a list per batch, none freed: see paused_gc
        for rank in range(shape.num_ranks):
            builder = _Builder(schedule, rank, options, grad_sync, lowered)
            (_one_f_one_b if shape.num_chunks == 1 else _interleaved)(builder, shape)
            lowered.steps.append(builder.finish())
    name = "as megatron-core posts it" + (
        " (p2p overlap)" if options.overlap_p2p else "" if options.batch_p2p else " (non-batched)"
    )
    return Posting(name, None, lowered)


@dataclass(frozen=True, slots=True)
class _Shape:
    """What megatron-core's schedule reads: sizes, the schedule table, the group size."""

    num_ranks: int
    num_chunks: int
    num_microbatches: int
    table: tuple[tuple[int, int], ...]  # (micro-batch, chunk) per forward, every rank alike
    group: int
    combined: bool  # overlapped pairs: its interleaved schedule's combined 1F1B (combined_1f1b.py)

    @classmethod
    def of(cls, schedule: Schedule) -> _Shape:
        p, v, m = schedule.num_ranks, schedule.num_chunks, schedule.num_microbatches
        if schedule.layout != StageLayout.looped(p, v):
            raise ScheduleError(
                f"{schedule.name}: megatron-core posts only its own looped placement (stage s on "
                f"rank s % {p}); this layout is not"
            )
        combined = any(a.kind is K.OVERLAP_F_B for actions in schedule.per_rank for a in actions)
        if combined and v == 1:
            raise ScheduleError(
                f"{schedule.name}: megatron-core runs overlapped pairs (F&B) only in interleaved "
                "(combined 1F1B); time this schedule as our runtime posts it (lockstep)"
            )
        tables = {  # looped: a stage's chunk is stage // p; a pair's micro-batch: its forward's
            tuple((a.microbatch or 0, a.stage // p) for a in actions if a.kind in _FORWARDS)
            for actions in schedule.per_rank
        }
        if len(tables) != 1:
            raise ScheduleError(
                f"{schedule.name}: its ranks run their forwards in different micro-batch and "
                "chunk orders; megatron-core runs one schedule table on every rank"
            )
        (table,) = tables
        group = next((i for i, (_, chunk) in enumerate(table) if chunk != 0), len(table))
        return cls(p, v, m, table, group if v > 1 else m, combined)

    def warmup(self, rank: int) -> tuple[int, bool]:
        """megatron-core's ``get_pp_rank_microbatches``: warm-up forwards, all in warm-up?"""
        total, warmup = self.num_microbatches * self.num_chunks, self.num_ranks - rank - 1
        if self.num_chunks > 1:
            warmup = warmup * 2 + (self.num_chunks - 1) * self.group + self.combined
        return min(warmup, total), warmup >= total

    def chunk(self, k: int, forward: bool) -> int:
        """megatron-core's ``get_model_chunk_id``: the chunk of virtual micro-batch k."""
        chunk = self.table[k % len(self.table)][1]
        return chunk if forward else self.num_chunks - 1 - chunk

    def receives(self, rank: int, k: int, forward: bool) -> bool:
        """``recv_tensor_from_previous_stage``: whether step k receives in that direction."""
        p = self.num_ranks
        if rank != (0 if forward else p - 1):  # not the leading rank
            return True
        if k < p - 1:  # the ending rank has sent nothing yet
            return False
        return self.chunk(k - (p - 1), forward) != (self.num_chunks - 1 if forward else 0)


# a ``_communicate``'s ops, indices into what ``_Builder.call`` returns
_SEND_PREV, _RECV_PREV, _SEND_NEXT, _RECV_NEXT = range(4)
_FORWARDS = frozenset({K.FORWARD, K.OVERLAP_F_B})
_BATCHED_ORDER = (_SEND_PREV, _RECV_PREV, _SEND_NEXT, _RECV_NEXT)
_EVEN_ORDER = (_SEND_NEXT, _RECV_PREV, _SEND_PREV, _RECV_NEXT)
_ODD_ORDER = (_RECV_PREV, _SEND_NEXT, _RECV_NEXT, _SEND_PREV)


@dataclass
class _Builder:
    """One rank's steps as ``_Lowered`` integers, built call by call as megatron-core does."""

    schedule: Schedule
    rank: int
    options: P2POptions
    grad_sync: GradSyncOptions
    lowered: _Lowered
    steps: list[int] = field(default_factory=list)
    forwards: list[int] = field(default_factory=list)  # positions, in run order
    backwards: list[int] = field(default_factory=list)
    computes: list[int] = field(default_factory=list)  # positions, in program order
    before: dict[int, list[int]] = field(default_factory=dict)  # compute -> PS before it
    after: dict[int, list[int]] = field(default_factory=dict)  # compute -> GS / RL after it
    sends: dict[tuple[ActionKind, int, int], int] = field(default_factory=dict)
    receives: dict[tuple[ActionKind, int], deque[int]] = field(default_factory=dict)
    grad_syncs: dict[int, int] = field(default_factory=dict)  # chunk -> its GS, until started
    ran: int = 0  # computes run so far

    def __post_init__(self) -> None:
        # RL after the compute before it, PS before the compute after it (its forward's
        # preparation); GS where megatron-core DDP starts the chunk's reduction (sync_after).
        self.actions = actions = self.schedule.per_rank[self.rank]
        self.num_ranks, self.first_batch = self.schedule.num_ranks, len(self.lowered.batch_items)
        self.last_stage = self.schedule.layout.num_stages - 1
        pairwise = not self.options.batch_p2p
        self.order = (_ODD_ORDER if self.rank % 2 else _EVEN_ORDER) if pairwise else _BATCHED_ORDER
        self.flags = (_PAIRWISE * pairwise, _PAIRWISE * pairwise | _BLOCKING)  # by ``wait``
        pending: list[int] = []
        for position, action in enumerate(actions):
            kind = action.kind
            if kind is K.FORWARD or kind is K.BACKWARD or kind is K.OVERLAP_F_B:
                for part in parts(action):  # a pair is a forward and a backward
                    (self.forwards if part.kind is K.FORWARD else self.backwards).append(position)
                early = [q for q in pending if actions[q].kind is not K.PARAM_SYNC]  # RL
                if early and self.computes:
                    self.after[self.computes[-1]] += early
                    pending = [q for q in pending if q not in early]
                self.before[position], pending = pending, []
                self.after[position] = []
                self.computes.append(position)
            elif kind in (K.SEND_ACT, K.SEND_GRAD):
                self.sends[(kind, action.stage, action.microbatch or 0)] = position
            elif kind in (K.RECV_ACT, K.RECV_GRAD):
                self.receives.setdefault((kind, action.peer or 0), deque()).append(position)
            elif kind is K.GRAD_SYNC:
                chunk = action.stage // self.num_ranks  # looped (``_Shape.of``)
                if chunk in self.grad_syncs:
                    raise self.refuse(
                        f"it reduces stage {action.stage}'s gradients twice per step; "
                        "megatron-core DDP reduces each chunk once"
                    )
                self.grad_syncs[chunk] = position
            elif kind in (K.PARAM_SYNC, K.RELEASE):
                pending.append(position)
            else:
                raise self.refuse(f"step {position} is {action}, which megatron-core never runs")
        if pending and not self.computes:
            raise self.refuse("it runs no compute")
        if pending:
            self.after[self.computes[-1]] += pending
        self.runs = {  # each compute's steps: PS before it, itself, GS / RL after it
            q: [s * 4 + _RUN for s in [*self.before[q], q, *self.after[q]]] for q in self.computes
        }

    def run(self, position: int) -> None:
        """Run a compute, which must be the next in the rank's program (a pair's backward: ran)."""
        if self.ran and self.computes[self.ran - 1] == position:
            return
        if self.ran >= len(self.computes) or self.computes[self.ran] != position:
            got = self.actions[self.computes[self.ran]] if self.ran < len(self.computes) else "none"
            raise self.refuse(
                f"its compute #{self.ran} is {got} where megatron-core runs "
                f"{self.actions[position]} (warm-up, one forward one backward, cool-down)"
            )
        self.ran += 1
        self.steps += self.runs[position]

    def sync_after(self, k: int, shape: _Shape) -> None:
        """The GS of the chunk whose reduction megatron-core DDP starts right after backward k,
        which just ran, if any (docs/design-notes.md, "megatron-core's own posting")."""
        if not self.grad_sync.overlap_grad_reduce:
            return  # all in finalize_model_grads
        if shape.num_chunks == 1:  # forward_backward_pipelining_without_interleaving
            hooks = not self.grad_sync.grad_sync_func or self.rank == 0  # enable_grad_sync first
            chunk = 0 if k == shape.num_microbatches - 1 and hooks else None
        else:
            if self.grad_sync.grad_sync_func:  # backward_step_helper_postprocess's micro-batch
                k -= self.rank  # (without: backward_step_helper_preprocess lifts no_sync)
            # is_last_microbatch_for_model_chunk: k is its chunk's last (backward: mirrored)
            last = 0 <= k < len(shape.table) and shape.table[k][0] == shape.num_microbatches - 1
            chunk = shape.chunk(k, False) if last else None
        if chunk is not None and chunk in self.grad_syncs:
            self.steps.append(self.grad_syncs.pop(chunk) * 4 + _RUN)

    def output(self, position: int, forward: bool) -> int | None:
        """A forward's activation or a backward's input gradient (a pair's: its part's), unless
        its stage is the pipeline's last (first): megatron-core sets the tensor to None there."""
        action = parts(self.actions[position])[0 if forward else -1]
        if action.stage == (self.last_stage if forward else 0):
            return None
        key = (K.SEND_ACT if forward else K.SEND_GRAD, action.stage, action.microbatch or 0)
        if key not in self.sends:
            raise self.refuse(f"{action}'s output is never sent")
        return self.sends[key]

    def call(
        self,
        *,
        send_prev: int | None = None,
        recv_prev: bool = False,
        send_next: int | None = None,
        recv_next: bool = False,
        wait: bool = True,
    ) -> tuple[int | None, ...]:
        """One ``_communicate``: its ops in megatron-core's order; each op's position."""
        asked = (
            send_prev,
            self._receive(K.RECV_ACT) if recv_prev else None,
            send_next,
            self._receive(K.RECV_GRAD) if recv_next else None,
        )
        items = [q * 2 for op in self.order if (q := asked[op]) is not None]
        if items:
            self.steps.append(len(self.lowered.batch_items) * 4 + _POST)
            self.lowered.batch_items.append(items)
            self.lowered.batch_tick.append(-1)
            self.lowered.batch_flags.append(self.flags[wait])
        return asked

    def wait(self, position: int | None) -> None:
        if position is not None:
            self.steps.append(len(self.lowered.waits) * 4 + _WAIT)
            self.lowered.waits.append((position,))

    def _receive(self, kind: ActionKind) -> int:
        """The next receive of ``kind``: from the previous rank (activations) or the next."""
        peer = (self.rank + (-1 if kind is K.RECV_ACT else 1)) % self.num_ranks
        queue = self.receives.get((kind, peer))
        if not queue:
            what = "activation" if kind is K.RECV_ACT else "gradient"
            raise self.refuse(f"megatron-core receives an {what} from rank {peer} it never sends")
        return queue.popleft()

    def finish(self) -> list[int]:
        """After the last p2p call: the reductions not started yet, in chunk order (as interleaved's
        ``synchronized_model_chunks``, 1F1B's last ``grad_sync_func`` or finalize do)."""
        self.steps += [self.grad_syncs[chunk] * 4 + _RUN for chunk in sorted(self.grad_syncs)]
        posted = {i >> 1 for items in self.lowered.batch_items[self.first_batch :] for i in items}
        missing = [q for q, a in enumerate(self.actions) if a.kind.is_p2p and q not in posted]
        missing += self.computes[self.ran :]
        if missing:
            raise self.refuse(f"megatron-core never posts or runs its step {missing[0]}")
        return self.steps

    def refuse(self, reason: str) -> ScheduleError:
        return ScheduleError(
            f"{self.schedule.name}, rank {self.rank}: {reason}; only megatron's own 1f1b and "
            "interleaved orders are posted as megatron-core posts them"
        )


def _one_f_one_b(b: _Builder, shape: _Shape) -> None:
    """``forward_backward_pipelining_without_interleaving``; every call waited right away."""
    p, r = shape.num_ranks, b.rank
    first, last = r == 0, r == p - 1
    warmup, _ = shape.warmup(r)
    remaining = shape.num_microbatches - warmup
    if len(b.forwards) != shape.num_microbatches or len(b.backwards) != len(b.forwards):
        raise b.refuse("it does not run one forward and one backward per micro-batch")
    forwards, backwards = b.forwards, b.backwards
    for i in range(warmup):
        b.call(recv_prev=not first)  # recv_forward
        b.run(forwards[i])
        b.call(send_next=b.output(forwards[i], True))  # send_forward
    if remaining:
        b.call(recv_prev=not first)
    for i in range(remaining):
        forward, backward = forwards[warmup + i], backwards[i]
        b.run(forward)
        b.call(send_next=b.output(forward, True), recv_next=not last)  # send_forward_recv_backward
        b.run(backward)
        b.sync_after(i, shape)
        final = i == remaining - 1  # send_backward, else send_backward_recv_forward
        b.call(send_prev=b.output(backward, False), recv_prev=not first and not final)
    for i in range(warmup):
        b.call(recv_next=not last)  # recv_backward
        b.run(backwards[remaining + i])
        b.sync_after(remaining + i, shape)
        b.call(send_prev=b.output(backwards[remaining + i], False))  # send_backward


def _interleaved(b: _Builder, shape: _Shape) -> None:
    """``forward_backward_pipelining_with_interleaving`` without warm-up / flush overlap."""
    p, v, r = shape.num_ranks, shape.num_chunks, b.rank
    last, total = r == p - 1, shape.num_microbatches * v
    warmup, all_warmup = shape.warmup(r)
    remaining = total - warmup
    overlap, wait_forward_sends = b.options.overlap_p2p, b.options.wait_forward_sends
    forwards, backwards = b.forwards, b.backwards
    if len(forwards) != total or len(backwards) != total:
        raise b.refuse("it does not run one forward and one backward per micro-batch and chunk")
    # Deferred requests (overlap only): receives waited oldest first, the latest send each way.
    recv_prev_waits: deque[int] = deque()
    recv_next_waits: deque[int | None] = deque()
    send_next_wait: int | None = None
    send_prev_wait: int | None = None

    def receives_input(position: int, forward: bool) -> bool:  # not the first (last) stage
        action = parts(b.actions[position])[0 if forward else -1]
        return action.stage != (0 if forward else b.last_stage)

    b.call(recv_prev=r != 0)  # recv_forward for chunk 0
    for k in range(warmup):
        recv_prev = shape.receives(r, k, True) and k != total - 1
        b.run(forwards[k])
        output = b.output(forwards[k], True)
        at_end = k == warmup - 1 and not all_warmup  # the last warm-up step also receives
        b.call(send_next=output, recv_prev=recv_prev, recv_next=at_end and not overlap and not last)
        if overlap and at_end and not last:
            recv_next_waits.append(b.call(recv_next=True, wait=False)[_RECV_NEXT])
    for k in range(remaining):
        forward, backward = forwards[warmup + k], backwards[k]
        recv_prev = shape.receives(r, warmup + k, True) and k != remaining - 1
        recv_next = shape.receives(r, k, False)
        if not overlap:
            b.run(forward)
            b.run(backward)
            b.sync_after(k, shape)
            b.call(
                send_next=b.output(forward, True),
                send_prev=b.output(backward, False),
                recv_prev=recv_prev,
                recv_next=recv_next,
            )
            continue
        if receives_input(forward, True) and recv_prev_waits:  # pp_pre_forward
            b.wait(recv_prev_waits.popleft())
        if shape.combined and receives_input(backward, False) and recv_next_waits:
            b.wait(recv_next_waits.popleft())  # pp_pre_backward: a pair's, before it runs
        b.run(forward)
        handles = b.call(send_next=b.output(forward, True), recv_prev=recv_prev, wait=False)
        b.wait(send_next_wait)  # the previous forward send
        send_next_wait = handles[_SEND_NEXT]
        if (handle := handles[_RECV_PREV]) is not None:
            recv_prev_waits.append(handle)
        if wait_forward_sends:
            b.wait(send_next_wait)
            send_next_wait = None
        if not shape.combined and receives_input(backward, False) and recv_next_waits:
            b.wait(recv_next_waits.popleft())  # pp_pre_backward
        b.run(backward)
        b.sync_after(k, shape)  # no chunk ends in a pair: one more warm-up forward
        handles = b.call(send_prev=b.output(backward, False), recv_next=recv_next, wait=False)
        b.wait(send_prev_wait)
        send_prev_wait = handles[_SEND_PREV]
        if (handle := handles[_RECV_NEXT]) is not None:
            recv_next_waits.append(handle)
    if all_warmup:
        b.call(recv_next=not last)  # recv_backward for the last chunk
    for k in range(remaining, total):
        backward = backwards[k]
        if receives_input(backward, False) and k != 0 and recv_next_waits:
            b.wait(recv_next_waits.popleft())
        recv_next = shape.receives(r, k, False) and k != total - 1
        b.run(backward)
        b.sync_after(k, shape)
        b.call(send_prev=b.output(backward, False), recv_next=recv_next)
    b.wait(send_prev_wait)
