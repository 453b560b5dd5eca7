"""What the execution model says of a grid of schedules, recorded once as a fixture so that a
rewrite of the model (the one-program issue) is held to every figure it gave before.

``observe`` runs every use of the model on one schedule: the lock-step posting the runtime runs,
the NCCL proof and report, validation, and ``simulate`` under every p2p timing model and two cost
models (the default and one where every cost is non-zero, BPipe's transfers and the host time
included), memory peaks and each timeline's events as a digest. ``cases`` is the grid: every
catalogue schedule and option at pp 2-8, vp 1-4, m from 1 to 3p, both sharding strategies, BPipe
caps, and the golden CSV files.

    python -m tests.model_fixtures      # re-record tests/fixtures/model_results.json

Re-record only on purpose (a model change whose figures moved for a stated reason): the test
(tests/unit/test_model_differential.py) is the proof that a refactor changed nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from megatron_bfpp.ir import Schedule, ScheduleError, load_csv
from megatron_bfpp.nccl import lockstep_posting, nccl_report
from megatron_bfpp.schedules.registry import build_schedule
from megatron_bfpp.sim import CostModel, simulate
from megatron_bfpp.sim.simulator import P2P_MODELS
from megatron_bfpp.validate import validate_schedule

FIXTURE = Path(__file__).parent / "fixtures" / "model_results.json"
GOLDEN = Path(__file__).parent / "golden"
COSTS = {
    "unit": CostModel(),
    "rich": CostModel(
        t_forward=1.0,
        t_backward=2.25,
        t_weight=0.75,
        t_p2p=0.125,
        t_grad_reduce=0.75,
        t_param_gather=0.5,
        t_evict=0.625,
        t_host=0.0625,
    ),
}


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _attempt(call: Callable[[], Any]) -> Any:
    """The call's value, or its ScheduleError's text (an error is a result the model gives)."""
    try:
        return call()
    except ScheduleError as error:
        return {"error": str(error)}


def _simulated(schedule: Schedule, costs: CostModel, p2p: str) -> dict[str, Any]:
    result = simulate(schedule, costs, p2p=p2p)
    return {
        "step": result.step_time,
        "bubble": result.bubble_fraction,
        "exposed": result.exposed_dp_comm_time,
        "ranks": _digest([rank.to_dict() for rank in result.per_rank]),
        "events": _digest(result.events),
    }


def observe(schedule: Schedule) -> dict[str, Any]:
    """Every figure the model gives of ``schedule`` (module docstring)."""
    record: dict[str, Any] = {
        "posting": _attempt(lambda: _digest(lockstep_posting(schedule))),
        "nccl": _attempt(lambda: nccl_report(schedule)),
        "validate": _attempt(lambda: validate_schedule(schedule) or "ok"),
    }
    for p2p in P2P_MODELS:
        for name, costs in COSTS.items():
            record[f"{p2p}/{name}"] = _attempt(lambda c=costs, p=p2p: _simulated(schedule, c, p))
    return record


def _built(name: str, p: int, m: int, **options: Any) -> Callable[[], Schedule]:
    return lambda: build_schedule(name, num_ranks=p, num_microbatches=m, **options)


def cases() -> Iterator[tuple[str, Callable[[], Schedule]]]:
    """(case name, a function building its schedule)."""
    for p in (2, 3, 4, 8):
        for m in sorted({1, 2, p, p + 1, 2 * p, 3 * p}):
            for name in ("gpipe", "1f1b", "v-min", "v-half", "v-zb", "dualpipe-v"):
                yield f"{name} p{p} m{m}", _built(name, p, m)
            for cap in (None, 2, (p + 3) // 2):
                yield f"bpipe p{p} m{m} cap{cap}", _built("bpipe", p, m, max_stored=cap)
            for v in (2, 3, 4) if p <= 4 else (2,):
                for sharding in ("optim", "optim_grads_params"):
                    for group in (None, 2, p):
                        yield (
                            f"breadth-first p{p} v{v} m{m} {sharding} g{group}",
                            _built(
                                "breadth-first",
                                p,
                                m,
                                num_chunks=v,
                                sharding=sharding,
                                group_size=group,
                            ),
                        )
                    for group in (None, p + 1):
                        yield (
                            f"interleaved p{p} v{v} m{m} {sharding} g{group}",
                            _built(
                                "interleaved",
                                p,
                                m,
                                num_chunks=v,
                                sharding=sharding,
                                microbatch_group_size=group,
                            ),
                        )
    for path in sorted(GOLDEN.glob("*.csv")):
        yield f"csv {path.name}", lambda path=path: load_csv(path)


def record_all() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case, build in cases():
        schedule = _attempt(build)
        results[case] = schedule if isinstance(schedule, dict) else observe(schedule)
    return results


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(record_all(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
