"""The pure layers (ir, messages, semantics, validate, passes, schedules, sim, plan, the
sim/plan CLIs) import neither torch nor megatron, so schedules can be planned, checked and drawn
on a laptop; every module respects the arrows of the dependency rule (docs/architecture.md);
packages import each other in no cycle; and no product module imports the test helpers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_bfpp"
PURE = [
    "files.py",
    "flags.py",
    "ir.py",
    "messages.py",
    "nccl.py",
    "native_posting.py",
    "program.py",
    "semantics.py",
    "validate.py",
    "passes",
    "schedules",
    "sim",
    "config",
    "plan",
    "cli/sim.py",
    "cli/plan.py",
    "cli/common.py",
]
FORBIDDEN = ("torch", "megatron.", "megatron_bfpp.runtime", "megatron_bfpp.megatron")
# Which package modules each unit may import (the design's arrows); a unit is a top-level module
# or a subpackage of megatron_bfpp, and "__init__" is the package's own front door. Every unit is
# listed: a new module or package has to say where it sits.
PURE_LAYERS = {
    "files",
    "flags",
    "ir",
    "messages",
    "nccl",
    "native_posting",
    "program",
    "semantics",
    "validate",
    "passes",
    "schedules",
    "sim",
    "config",
    "plan",
}
ALLOWED = {
    "files": set(),  # every write the product makes (write_output), from any layer
    "flags": set(),  # the shared argument parser: the CLIs and the Megatron-LM pre-flight
    "ir": {"files"},  # dump_csv
    "messages": {"ir"},
    "program": {"ir", "messages", "semantics"},  # a schedule compiled once into integers
    "nccl": {"ir", "messages", "semantics", "program"},  # NCCL's rules: lock-step posting, proof
    "native_posting": {"ir", "messages", "nccl"},  # megatron-core's own p2p calls, as a posting
    "semantics": {"ir", "messages"},
    "validate": {"ir", "messages", "nccl", "semantics"},
    "passes": {"ir", "messages", "semantics", "validate", "passes"},
    "schedules": {"ir", "messages", "semantics", "validate", "passes", "schedules"},
    "sim": {
        "files",
        "ir",
        "messages",
        "nccl",
        "native_posting",
        "semantics",
        "validate",
        "passes",
        "schedules",
        "sim",
    },
    # what a run is and what its model weighs, below plan, so that plan may be read by train
    # and megatron (auto's decision) and both read config with no cycle
    "config": {"ir", "schedules", "config"},
    "plan": {
        "files",
        "ir",
        "messages",
        "semantics",
        "validate",
        "passes",
        "schedules",
        "sim",
        "plan",
        "config",
    },
    # product code that needs torch / megatron-core
    "compat": set(),  # megatron-core versions
    "local_ranks": set(),  # the local process launcher
    # semantics: which overlapped pairs run as megatron-core's combined step (combined_pairs)
    "runtime": {"ir", "messages", "nccl", "semantics", "validate", "passes", "schedules"}
    | {"compat", "runtime"},
    # + CPU adapter; plan: --pipeline-schedule auto's decision (megatron.auto)
    "megatron": {"flags", "ir", "schedules", "config", "plan", "compat", "runtime", "megatron"},
    # megatron: CPU adapter and auto's front-end glue; plan: auto's decision
    "train": {
        "files",
        "ir",
        "schedules",
        "config",
        "plan",
        "compat",
        "megatron",
        "runtime",
        "train",
    },
    # ir: ScheduleError from the preflight; flags: printable output
    "launch": {"flags", "ir", "compat", "megatron"},
    "cli": PURE_LAYERS | {"cli", "compat", "local_ranks", "runtime", "train", "stage_timing"},
    # bfpp-plan profile's measurement (torch, megatron-core); the command line imports it lazily.
    # It times I and W through the runtime's own deferred split, so a profile measures what runs.
    "stage_timing": {"files", "ir", "config", "plan", "train", "compat", "megatron", "runtime"},
    "__init__": {"ir", "schedules"},
    # tests' helpers may use everything; nothing else may use them
    "testing": PURE_LAYERS | {"compat", "local_ranks", "runtime", "megatron", "train", "testing"},
}


def _unit(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def _unit_of_name(name: str) -> str:
    return name.split(".")[1]


def _used_units(path: Path) -> set[str]:
    return {
        _unit_of_name(n) for n in _imports(path) if n.startswith("megatron_bfpp.") and "." in n
    } | {"__init__" for n in _imports(path) if n == "megatron_bfpp"}


def _files(entry: str) -> list[Path]:
    path = PACKAGE / entry
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "megatron_bfpp":
            for alias in node.names:  # ``from megatron_bfpp import sim`` imports a unit
                sub = PACKAGE / alias.name
                is_unit = sub.is_dir() or sub.with_suffix(".py").exists()
                names.append(f"megatron_bfpp.{alias.name}" if is_unit else "megatron_bfpp")
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", [p for e in PURE for p in _files(e)], ids=lambda p: p.name)
def test_pure_layer_never_imports_torch_or_megatron(path: Path) -> None:
    bad = [n for n in _imports(path) if n == "megatron" or n.startswith(FORBIDDEN)]
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


ALL_FILES = sorted(PACKAGE.rglob("*.py"))


def test_pure_layers_never_import_train() -> None:
    """The planner reads what a run is and weighs from ``config`` (a pure layer), not from
    ``train``: plan -> train -> plan was a cycle the test allowed with a unit of its own."""
    for entry in PURE:
        for path in _files(entry):
            used = [n for n in _imports(path) if n.startswith("megatron_bfpp.train")]
            assert not used, f"{path.relative_to(PACKAGE)} imports {used}"


def test_every_unit_has_its_arrows() -> None:
    units = {_unit(path) for path in ALL_FILES}
    assert units == set(ALLOWED), (
        f"add {sorted(units - set(ALLOWED))} to ALLOWED; drop {sorted(set(ALLOWED) - units)}"
    )


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_dependency_arrows(path: Path) -> None:
    unit = _unit(path)
    used = _used_units(path) - {unit}
    assert used <= ALLOWED[unit], (
        f"{path.relative_to(PACKAGE)} ({unit}) imports {sorted(used - ALLOWED[unit])}"
    )


def test_product_never_imports_testing() -> None:
    bad = [
        str(path.relative_to(PACKAGE))
        for path in ALL_FILES
        if _unit(path) != "testing" and "testing" in _used_units(path)
    ]
    assert not bad, f"product modules importing megatron_bfpp.testing: {bad}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle in ``graph`` (unit -> units it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, set())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles_between_units() -> None:
    graph: dict[str, set[str]] = {}
    for path in ALL_FILES:
        unit = _unit(path)
        graph.setdefault(unit, set()).update(_used_units(path) - {unit, "__init__"})
    assert _cycle(graph) is None, f"import cycle between packages: {' -> '.join(_cycle(graph))}"


def test_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_allowed_arrows_have_no_cycle() -> None:
    graph = {unit: allowed - {unit} for unit, allowed in ALLOWED.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_importing_pure_layers_loads_no_torch() -> None:
    code = (
        "import sys\n"
        "import megatron_bfpp, megatron_bfpp.schedules.registry, megatron_bfpp.sim, "
        "megatron_bfpp.cli.sim, megatron_bfpp.plan, megatron_bfpp.cli.plan\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


LONGEST_FUNCTION = 120  # lines, decorators and docstring included (issue 41)


def test_no_product_function_is_longer_than_the_limit() -> None:
    """Small functions: none in the product over ``LONGEST_FUNCTION`` lines."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = (node.end_lineno or node.lineno) - first + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.name} ({lines} lines)")
    assert not long, f"split these below {LONGEST_FUNCTION} lines: {long}"
