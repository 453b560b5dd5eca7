"""The pure layers (ir, messages, execution, passes, validate, schedules, sim, cli) import neither
torch nor megatron, so schedules can be planned, checked and drawn on a laptop; and they respect
the arrows of the design's dependency rule."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_bfpp"
PURE = [
    "ir.py",
    "messages.py",
    "execution.py",
    "validate.py",
    "passes",
    "schedules",
    "sim",
    "plan",
    "cli/sim.py",
    "cli/plan.py",
    "cli/common.py",
]
FORBIDDEN = ("torch", "megatron.", "megatron_bfpp.runtime", "megatron_bfpp.megatron")
# Which package modules each pure layer may import (the design's arrows).
ALLOWED = {
    "ir": set(),
    "messages": {"ir"},
    "execution": {"ir", "messages"},
    "validate": {"ir", "messages", "execution"},
    "passes": {"ir", "messages", "execution", "validate", "passes"},
    "schedules": {"ir", "messages", "execution", "validate", "passes", "schedules"},
    "sim": {"ir", "messages", "execution", "validate", "passes", "schedules", "sim"},
    "plan": {"ir", "messages", "execution", "validate", "passes", "schedules", "sim", "plan"},
}


def _files(entry: str) -> list[Path]:
    path = PACKAGE / entry
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", [p for e in PURE for p in _files(e)], ids=lambda p: p.name)
def test_pure_layer_never_imports_torch_or_megatron(path: Path) -> None:
    bad = [n for n in _imports(path) if n == "megatron" or n.startswith(FORBIDDEN)]
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


@pytest.mark.parametrize("layer", list(ALLOWED))
def test_dependency_arrows(layer: str) -> None:
    entry = f"{layer}.py" if (PACKAGE / f"{layer}.py").exists() else layer
    for path in _files(entry):
        used = {
            n.split(".")[1]
            for n in _imports(path)
            if n.startswith("megatron_bfpp.") and len(n.split(".")) > 1
        }
        assert used <= ALLOWED[layer], f"{path.name} imports {sorted(used - ALLOWED[layer])}"


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
