"""Megatron-Bridge's own ``pretrain()`` with our schedules, on 4 CPU ranks (pp=2, dp=2, a tiny
GPT on mock data, 3 iterations), through ``examples/bridge_pretrain.py``: ``1f1b`` and
``bpipe`` give exactly megatron-core's 1F1B losses and grad norms, the V-shapes its losses,
``breadth-first`` exactly megatron-core's interleaved with one group of all micro-batches.
The example selects the schedule after Bridge is imported (``use_schedule`` patches the names
Bridge bound); the other import order is checked without a run. Needs the ``bridge`` stack
(``BFPP_STACK=bridge VENV=.venv-bridge bash scripts/setup.sh``)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")
bridge_cpu = pytest.importorskip("megatron_bfpp.testing.bridge_cpu")
if __import__("importlib").util.find_spec("megatron.bridge") is None:
    pytest.skip("Megatron-Bridge is not installed (the bridge stack)", allow_module_level=True)

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "bridge_pretrain.py"
MICROBATCHES = 4  # global batch 8 / (micro batch 1 x dp 2)


def _run(*flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "4",
            str(EXAMPLE),
            "--exact-losses",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def _losses(*flags: str) -> list[tuple[int, str, str]]:
    """(iteration, loss as float.hex, grad norm) per iteration, as the last stage logged them."""
    proc = _run(*flags)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return _exact_rows(proc)


def _exact_rows(proc: subprocess.CompletedProcess[str]) -> list[tuple[int, str, str]]:
    rows = sorted(
        {
            (int(parts[1]), parts[2], parts[3])
            for line in proc.stdout.splitlines()
            if (parts := line.split()) and parts[0] == bridge_cpu.EXACT_PREFIX
        }
    )
    assert [row[0] for row in rows] == [1, 2, 3], proc.stdout[-2000:]
    return rows


@pytest.fixture(scope="module")
def megatron_1f1b() -> list[tuple[int, str, str]]:
    return _losses("--pipeline-schedule", "default")


@pytest.fixture(scope="module")
def megatron_interleaved() -> list[tuple[int, str, str]]:
    return _losses(
        "--pipeline-schedule",
        "default",
        "--virtual-pipeline-model-parallel-size",
        "2",
        "--microbatch-group-size-per-virtual-pipeline-stage",
        str(MICROBATCHES),
    )


# bpipe runs our 1F1B order through Bridge and evicts (rank 0 holds 4 > 3): one launch for both.
@pytest.mark.parametrize("schedule", ["bpipe"])
def test_one_stage_per_rank_schedules_equal_megatron_1f1b(
    schedule: str, megatron_1f1b: list[tuple[int, str, str]]
) -> None:
    assert _losses("--pipeline-schedule", schedule) == megatron_1f1b


def test_breadth_first_equals_megatron_interleaved_in_one_group(
    megatron_interleaved: list[tuple[int, str, str]],
) -> None:
    # use_schedule gives breadth-first its default 2 virtual stages, as in Megatron-LM
    assert _losses("--pipeline-schedule", "breadth-first") == megatron_interleaved


def test_a_recipe_that_cannot_load_is_one_line() -> None:
    for recipe, expected in (
        ("no_colon", "write it as MODULE:FUNCTION"),
        ("no.such.module:config", "cannot load it"),
    ):
        proc = _run("--recipe", recipe)
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
        assert expected in errors[0]


# dualpipe-v: on an uneven layout, the next test (the same provider path, and its layout).
@pytest.mark.parametrize("schedule", ["v-half", "v-zb"])
def test_v_shapes_give_megatron_1f1bs_losses(
    schedule: str, megatron_1f1b: list[tuple[int, str, str]]
) -> None:
    """Bridge's own provider builds the V (rank 0: stages 0 and 3, its tied output layer beside
    the embedding), each chunk seeded as the 1F1B rank holding its layers: 1F1B's losses bit for
    bit. The grad norm is summed per rank over the layers it holds, another grouping on the V
    (docs/megatron-lm.md#v-shapes): equal up to fp32 rounding (iteration 3 here: 6e-8)."""
    ours = _losses("--pipeline-schedule", schedule)
    assert [row[:2] for row in ours] == [row[:2] for row in megatron_1f1b]
    for row, reference in zip(ours, megatron_1f1b, strict=True):
        assert math.isclose(float(row[2]), float(reference[2]), rel_tol=1e-6), (ours, megatron_1f1b)


def test_a_v_on_an_uneven_layout_gives_1f1bs_losses_on_the_merged_layout() -> None:
    """config.model.pipeline_model_parallel_layout under a V: stage s of the model on rank s or
    2p-1-s (rank 0: the embedding alone and the last layer with the loss), against Bridge's
    1F1B on ``Et*2|t*2L``: losses bit for bit. The grad norm is summed
    per rank over the layers it holds, which group differently on the V (rank 0: the embedding
    and layer 3; 1F1B's: the embedding and layers 0-1), so, as in the test above, equal up to
    fp32 rounding (iteration 3 on an AVX-512 EPYC: 1.97772539 against 1.97772527)."""
    layout = "--pipeline-model-parallel-layout"
    ours = _losses("--pipeline-schedule", "dualpipe-v", layout, "E|t*2|t|tL")
    theirs = _losses("--pipeline-schedule", "default", layout, "Et*2|t*2L")
    assert [row[:2] for row in ours] == [row[:2] for row in theirs]
    for row, reference in zip(ours, theirs, strict=True):
        assert math.isclose(float(row[2]), float(reference[2]), rel_tol=1e-6), (ours, theirs)


def test_either_import_order_reaches_bridges_bound_names() -> None:
    """Installed before Bridge is imported, Bridge binds our function; selected after, the
    names Bridge bound are replaced; a V-shape wraps the provider's ``provide`` once, however
    often selected; uninstall restores megatron-core's and the provider's; the CPU redirects are
    undone as exactly."""
    code = """
import importlib, sys
from types import SimpleNamespace
import megatron_bfpp
from megatron_bfpp.megatron import plugin
from megatron_bfpp.megatron.bridge import BRIDGE_SITES, use_schedule
from megatron_bfpp.testing.bridge_cpu import bridge_imports
from megatron.core.pipeline_parallel import schedules
first = sys.argv[1] == "first"
if first:
    megatron_bfpp.install()
with bridge_imports():
    modules = [importlib.import_module(site) for site in BRIDGE_SITES]
config = SimpleNamespace(
    model=SimpleNamespace(pipeline_model_parallel_size=2,
                          virtual_pipeline_model_parallel_size=None),
    train=SimpleNamespace(micro_batch_size=1, global_batch_size=8), ddp=None)
use_schedule(config, "breadth-first")
assert config.model.virtual_pipeline_model_parallel_size == 2
assert all(m.get_forward_backward_func is plugin.get_forward_backward_func for m in modules)
class Provider:
    pipeline_model_parallel_size, virtual_pipeline_model_parallel_size = 2, None
    def provide(self, pre_process=None, post_process=None, vp_stage=None): ...
provider = Provider()
wrapped = []
for _ in range(2):
    use_schedule(SimpleNamespace(model=provider, train=config.train, ddp=None), "v-half")
    wrapped.append(vars(provider)["provide"])
assert wrapped[0] is wrapped[1] and wrapped[0].__name__ == "v_shape_provide", "wrapped once"
assert provider.virtual_pipeline_model_parallel_size == 2
megatron_bfpp.uninstall()
assert "provide" not in vars(provider), "the provider's own provide restored"
original = schedules.get_forward_backward_func
assert all(m.get_forward_backward_func is (plugin.get_forward_backward_func if first
           else original) for m in modules), "restored"
from megatron_bfpp.testing import bridge_cpu
setup = importlib.import_module("megatron.bridge.training.setup")
original_init = setup.initialize_megatron
bridge_cpu.enable_cpu_bridge()
assert setup.initialize_megatron is not original_init
bridge_cpu.disable_cpu_bridge()
assert setup.initialize_megatron is original_init, "CPU redirects restored"
print("ok")
"""
    for order in ("first", "after"):
        proc = subprocess.run(
            [sys.executable, "-c", code, order], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_auto_runs_its_choice_with_the_named_schedules_losses(tmp_path: Path) -> None:
    """``use_schedule(config, "auto")`` in Bridge's own ``pretrain()``: one line from rank 0,
    the report, and exactly the losses of the schedule it chose named explicitly (same virtual
    stages, group and cap), the V-shapes among its candidates."""
    import json

    report = tmp_path / "auto.json"
    proc = _run("--pipeline-schedule", "auto", "--pipeline-schedule-auto-report", str(report))
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    lines = [
        line for line in (proc.stdout + proc.stderr).splitlines() if "megatron_bfpp: auto: " in line
    ]
    assert len(lines) == 1 and "no CUDA: memory is not a constraint" in lines[0], lines
    choice = json.loads(report.read_text())["choice"]
    named = ["--pipeline-schedule", choice["schedule"]]
    if choice["virtual_stages"] > 1:
        named += ["--virtual-pipeline-model-parallel-size", str(choice["virtual_stages"])]
    assert _exact_rows(proc) == _losses(*named, *_options_named(choice))


def test_auto_chooses_the_layout_too_in_bridges_pretrain(tmp_path: Path) -> None:
    """``config.model.pipeline_model_parallel_layout = "auto"`` with the schedule ``auto``: the
    planner chooses the layers per stage with the schedule, rank 0 prints the layout that
    reproduces it, Bridge's ``pretrain()`` trains on it, and the same schedule named on that
    layout gives exactly the same losses and grad norms."""
    import json
    import re

    report = tmp_path / "auto.json"
    proc = _run(
        "--pipeline-schedule", "auto", "--pipeline-model-parallel-layout", "auto",
        "--pipeline-schedule-auto-report", str(report),
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    lines = [
        line for line in (proc.stdout + proc.stderr).splitlines() if "megatron_bfpp: auto: " in line
    ]
    assert len(lines) == 1, lines
    found = re.search(r"its layout: --pipeline-model-parallel-layout '([^']+)'", lines[0])
    assert found, lines[0]
    choice = json.loads(report.read_text())["choice"]
    named = ["--pipeline-schedule", choice["schedule"], "--pipeline-model-parallel-layout"]
    named += [found.group(1), *_options_named(choice)]
    assert _exact_rows(proc) == _losses(*named)


def _options_named(choice: dict[str, Any]) -> list[str]:
    """The flags naming auto's chosen group size or BPipe cap (its report's ``choice``)."""
    named = []
    for flag, key in (
        ("--breadth-first-group-size", "group_size"),
        ("--bpipe-max-stored", "max_stored"),
    ):
        if choice[key] is not None:
            named += [flag, str(choice[key])]
    return named
