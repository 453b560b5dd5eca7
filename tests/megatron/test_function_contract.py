"""``megatron_bfpp.get_forward_backward_func(name)`` is a drop-in for megatron-core's function:
code written for that (loggers of ``fn.__name__``, ``functools.wraps``, ``functools.partial``)
works on ours, and its docstring is the one contract of what it takes and returns."""

from __future__ import annotations

import functools
import inspect

import pytest

import megatron_bfpp

MEGATRON_CORE_ARGUMENTS = (
    "forward_step_func",
    "data_iterator",
    "model",
    "num_microbatches",
    "seq_length",
    "micro_batch_size",
    "decoder_seq_length",
    "forward_only",
    "collect_non_loss_data",
    "first_val_step",
    "adjust_tensor_shapes_fn",
    "p2p_communicator",
    "pg_collection",
    "force_all_reduce",
)


@pytest.mark.parametrize("name", ["breadth-first", "1f1b", "v-half"])
def test_function_attributes(name: str) -> None:
    fn = megatron_bfpp.get_forward_backward_func(name)
    expected = "forward_backward_" + name.replace("-", "_")
    assert fn.__name__ == expected
    assert fn.__qualname__ == expected
    assert fn.__module__ == "megatron_bfpp.runtime.api"
    assert fn.__doc__ and "Returns" in fn.__doc__
    assert callable(fn)


def test_wraps_and_partial_work_as_on_a_function() -> None:
    fn = megatron_bfpp.get_forward_backward_func("breadth-first", group_size=2)
    calls: list[dict[str, object]] = []

    @functools.wraps(fn)
    def logged(**kwargs: object) -> object:
        calls.append(kwargs)
        return "ran"

    assert logged.__name__ == fn.__name__ and logged.__doc__ == fn.__doc__
    assert logged.__wrapped__ is fn  # type: ignore[attr-defined]
    assert logged(num_microbatches=4) == "ran" and calls == [{"num_microbatches": 4}]

    bound = functools.partial(fn, forward_only=True)
    assert bound.func is fn and bound.keywords == {"forward_only": True}


def test_signature_and_docstring_name_every_megatron_core_argument() -> None:
    fn = megatron_bfpp.get_forward_backward_func("1f1b")
    parameters = inspect.signature(fn).parameters
    assert tuple(parameters) == MEGATRON_CORE_ARGUMENTS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values())
    for argument in MEGATRON_CORE_ARGUMENTS:
        assert f"``{argument}" in (fn.__doc__ or ""), argument


def test_megatron_core_signature_is_ours() -> None:
    """The arguments megatron-core's own functions take are the ones ours accepts."""
    from megatron.core.pipeline_parallel import schedules

    theirs = inspect.signature(schedules.forward_backward_pipelining_with_interleaving).parameters
    ours = inspect.signature(megatron_bfpp.get_forward_backward_func("1f1b")).parameters
    missing = [name for name in theirs if name not in ours]
    assert not missing, f"megatron-core passes {missing}, which ours does not take"
    # Declared once (runtime.step.Call) and shown as the function's: names, kinds, defaults.
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


def test_an_unknown_or_missing_argument_is_a_type_error_naming_it() -> None:
    fn = megatron_bfpp.get_forward_backward_func("1f1b")
    with pytest.raises(
        TypeError,
        match=r"^forward_backward_1f1b\(\) got an unexpected keyword "
        "argument 'num_micro_batches'$",
    ):
        fn(num_micro_batches=4)
    with pytest.raises(TypeError, match=r"^forward_backward_1f1b\(\) missing .*'model'"):
        fn(
            forward_step_func=print,
            data_iterator=None,
            num_microbatches=1,
            seq_length=8,
            micro_batch_size=1,
        )
    with pytest.raises(TypeError):
        fn(print)  # keyword-only, as megatron-core's


@pytest.mark.parametrize("case", ["early", "twice", "missing", "none"])
def test_a_schedule_object_with_misplaced_grad_sync_is_refused(case: str) -> None:
    """A hand-made schedule whose GS comes before its chunk's last backward, twice, or not at
    all is refused in one line naming the action and its step, under ``optim`` as under
    ``optim_grads_params`` (here ``optim``: the default)."""
    from megatron_bfpp.ir import Action, ActionKind, ScheduleError
    from megatron_bfpp.schedules.registry import build_schedule

    built = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    megatron_bfpp.get_forward_backward_func(built)  # as built: accepted
    rank0 = list(built.per_rank[0])
    sync = [a for a in rank0 if a.kind is ActionKind.GRAD_SYNC]
    plain = [a for a in rank0 if a.kind is not ActionKind.GRAD_SYNC]
    last = max(i for i, a in enumerate(plain) if a.kind is ActionKind.BACKWARD)
    edited = {
        "early": [*plain[:last], Action(0, ActionKind.GRAD_SYNC), *plain[last:]],
        "twice": [*rank0, *sync],
        "missing": plain,
        "none": [a for a in plain if a.kind is not ActionKind.PARAM_SYNC],
    }[case]
    rank1 = built.per_rank[1]
    if case == "none":
        rank1 = tuple(
            a for a in rank1 if a.kind not in (ActionKind.GRAD_SYNC, ActionKind.PARAM_SYNC)
        )
    schedule = built.with_programs([tuple(edited), rank1])
    expected = {
        "early": r"^rank 0, step \d+: 0GS: starts stage 0's gradient reduction before its last",
        "twice": r"^rank 0, step \d+: 0GS: reduces stage 0's gradients a second time",
        "missing": r"^rank 0, step \d+: 0B1: the last backward of stage 0 is followed by no GS",
        "none": r"^rank 0, step \d+: 0B1: the last backward of stage 0 is followed by no GS",
    }[case]
    with pytest.raises(ScheduleError, match=expected):
        megatron_bfpp.get_forward_backward_func(schedule)
