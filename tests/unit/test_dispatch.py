"""The runtime's dispatch table (one process, no communication): every action kind has exactly
one handler, and a kind left out, or handled twice, fails when the table is built."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_bfpp.ir import ActionKind, StageLayout, parse_action, parse_schedule
from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.runtime import bpipe, sharding, split_backward
from megatron_bfpp.runtime.api import ForwardBackwardFunc
from megatron_bfpp.runtime.executor import CORE, TABLE
from megatron_bfpp.runtime.step import MemoryReport, dispatch_table


def test_the_table_has_a_handler_for_every_action_kind() -> None:
    # Fails when a kind is added to ir.ActionKind without a handler (importing the executor
    # already fails then; this says so by name).
    assert set(TABLE.handlers) == set(ActionKind)


def test_each_kind_is_handled_by_one_module() -> None:
    modules = (CORE, bpipe.HANDLERS, sharding.HANDLERS, split_backward.HANDLERS)
    counts = {kind: sum(kind in module.kinds for module in modules) for kind in ActionKind}
    assert counts == dict.fromkeys(ActionKind, 1)


def test_a_kind_without_handler_fails_when_the_table_is_built() -> None:
    with pytest.raises(RuntimeError, match=r"EVICT \(EV\).*have no handler") as error:
        dispatch_table(CORE, sharding.HANDLERS, split_backward.HANDLERS)  # BPipe's left out
    for kind in ("ACCEPT (AC)", "RESTORE (RS)", "LOAD (LD)"):
        assert kind in str(error.value)
    assert "FORWARD" not in str(error.value)


def test_a_kind_with_two_handlers_fails_when_the_table_is_built() -> None:
    with pytest.raises(
        RuntimeError, match=r"\['BACKWARD_INPUT', 'BACKWARD_WEIGHT'\].*two handlers"
    ):
        modules = (CORE, bpipe.HANDLERS, sharding.HANDLERS, split_backward.HANDLERS)
        dispatch_table(*modules, split_backward.HANDLERS)


def test_parts_and_capturing_kinds_come_from_the_modules() -> None:
    assert TABLE.parts == (bpipe.Transfers, sharding.ShardingPart, split_backward.SplitBackward)
    assert TABLE.captures == {ActionKind.EVICT}


def test_a_release_without_sharded_parameters_names_the_action_and_the_way_out() -> None:
    action = parse_action("1RL")
    step: Any = SimpleNamespace(
        rank=1, schedule=SimpleNamespace(name="breadth-first"), ctx=SimpleNamespace(sharded=None)
    )
    with pytest.raises(RuntimeError) as error:
        TABLE.handlers[action.kind](step, 7, action)
    message = str(error.value)
    assert message.startswith("pipeline rank 1: schedule 'breadth-first' releases parameters")
    assert "(1RL at position 7)" in message and "optim_grads_params" in message


def test_forward_backward_func_keeps_its_state_on_itself() -> None:
    first, second = ForwardBackwardFunc("bpipe"), ForwardBackwardFunc("bpipe")
    assert first.schedule == "bpipe" and first.last_trace == []
    assert first.last_memory == MemoryReport()
    first.last_trace.append("0F0")
    assert second.last_trace == []  # each function's state is its own
    assert first != second and len({first, second}) == 2  # hashable by identity, as a function


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("num_microbatches_with_partial_activation_checkpoints", 2, "partial_activation"),
        ("fine_grained_activation_offloading", True, "fine_grained_activation_offloading"),
        ("cuda_graph_impl", "local", "--cuda-graph-impl none"),
    ],
)
def test_megatron_features_the_runtime_lacks_are_refused(
    field: str, value: Any, words: str
) -> None:
    from megatron_bfpp.runtime.api import _reject_unsupported

    _reject_unsupported(SimpleNamespace(cuda_graph_impl="none"))  # the default runs
    with pytest.raises(NotImplementedError, match=words):
        _reject_unsupported(SimpleNamespace(**{field: value}))


# --- a plan: the validated schedule with its posting, made once, handed to every step --------


def test_plan_schedule_hands_the_executor_the_posting_it_proved_once() -> None:
    from megatron_bfpp.nccl import lockstep_posting
    from megatron_bfpp.runtime.api import plan_schedule

    plan = plan_schedule("interleaved", 2, 2, 4, (), False)
    assert plan.posting == lockstep_posting(plan.schedule)
    assert plan is plan_schedule("interleaved", 2, 2, 4, (), False)  # cached: built once
    evaluation = plan_schedule("interleaved", 2, 2, 4, (), True)
    kinds = {a.kind for actions in evaluation.schedule.per_rank for a in actions}
    assert ActionKind.BACKWARD not in kinds and ActionKind.FORWARD in kinds
    assert evaluation.posting == lockstep_posting(evaluation.schedule)


def test_a_prebuilt_schedule_is_validated_and_planned_once_per_function() -> None:
    from megatron_bfpp import get_forward_backward_func
    from megatron_bfpp.ir import ScheduleError
    from megatron_bfpp.nccl import lockstep_posting
    from megatron_bfpp.schedules.registry import build_schedule

    built = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    fn = get_forward_backward_func(built)
    plan = fn.prebuilt_plan(forward_only=False)
    assert plan.schedule is built and plan.posting == lockstep_posting(built)
    assert fn.prebuilt_plan(forward_only=False) is plan  # every step runs this one
    evaluation = fn.prebuilt_plan(forward_only=True)
    assert evaluation is fn.prebuilt_plan(forward_only=True) and evaluation is not plan
    # Validation is the registry's, data order included: forwards out of order are refused.
    compute = parse_schedule(
        ["0F1 0F0 0B1 0B0", "1F1 1B1 1F0 1B0"], layout=StageLayout.looped(2), num_microbatches=2
    )
    swapped = add_grad_sync(add_communication(compute))
    with pytest.raises(ScheduleError, match="0F0 runs stage 0's micro-batch 0 after its micro"):
        get_forward_backward_func(swapped)


def test_a_prebuilt_schedule_pairing_other_ranks_than_partners_fails_when_made() -> None:
    # get_forward_backward_func plans a prebuilt schedule once, before any rank communicates:
    # the pair groups BPipe's payloads run on join x and p-1-x only (runtime.p2p.pair_group)
    from megatron_bfpp.ir import ScheduleError
    from megatron_bfpp.runtime.api import get_forward_backward_func
    from tests.unit.test_nccl import WRONG_PARTNER

    with pytest.raises(ScheduleError, match="give rank 0 the partner 3"):
        get_forward_backward_func(add_grad_sync(WRONG_PARTNER))


def test_an_overlapped_pair_runs_its_parts_handlers_in_order_at_its_position(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron_bfpp.runtime import executor

    ran: list[tuple[int, str]] = []
    for kind in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
        monkeypatch.setitem(
            TABLE.handlers,  # type: ignore[arg-type]  # a dict, read-only by its annotation
            kind,
            lambda step, position, action: ran.append((position, str(action))),
        )
    assert TABLE.handlers[ActionKind.OVERLAP_F_B] is executor.overlapped
    step: Any = SimpleNamespace(measuring=False, planned=frozenset())  # measured between parts
    executor.overlapped(step, 7, parse_action("3F5&1B2"))
    executor.overlapped(step, 9, parse_action("4F0&0I1"))
    assert ran == [(7, "3F5"), (7, "1B2"), (9, "4F0"), (9, "0I1")]


def test_overlap_needs_a_forward_step_func_that_builds_schedule_plans() -> None:
    """megatron-core's combined step calls forward_step_func(..., return_schedule_plan=True);
    one without it is refused in one line before any work (Megatron-LM's pretrain_gpt has it)."""
    from megatron_bfpp.runtime.combined import check_forward_step_func
    from megatron_bfpp.train.step_functions import forward_step

    check_forward_step_func(functools.partial(forward_step, None))
    with pytest.raises(ValueError, match="must take return_schedule_plan") as error:
        check_forward_step_func(lambda data_iterator, model: None)
    assert "\n" not in str(error.value)
