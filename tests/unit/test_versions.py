"""Versions written once: the package's in megatron_bfpp/__init__.py, the supported megatron-core
window in compat.SUPPORTED_WINDOW, torch's in compat.TORCH_WINDOW; setup.py, scripts/setup.sh and
.ci/run must agree with them."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import megatron_bfpp
from megatron_bfpp.compat import SUPPORTED_WINDOW, TORCH_WINDOW, is_supported

ROOT = Path(__file__).resolve().parents[2]
# Every release megatron-core could plausibly publish around the window.
CANDIDATES = [(0, minor, patch) for minor in range(12, 25) for patch in range(6)]
# The versions our stacks and Megatron-LM checkouts run (README "Status").
TESTED = [(0, 16, 1), (0, 17, 1), (0, 18, 2), (0, 19, 2), (0, 20, 0)]
# Every torch release around the window.
TORCH_CANDIDATES = [(2, minor, patch) for minor in range(8, 20) for patch in range(4)]


def _setup_constant(name: str) -> str:
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == name for target in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, str)
            return value
    raise AssertionError(f"setup.py defines no {name}")


def _pin() -> SpecifierSet:
    requirement = _setup_constant("MEGATRON_CORE")
    assert requirement.startswith("megatron-core"), requirement
    return SpecifierSet(requirement.removeprefix("megatron-core"))


def _version(v: tuple[int, int, int]) -> Version:
    return Version(".".join(map(str, v)))


def test_setup_pin_admits_nothing_outside_the_window() -> None:
    pin = _pin()
    outside = [v for v in CANDIDATES if _version(v) in pin and not is_supported(v)]
    assert not outside, f"setup.py's pin admits unsupported megatron-core {outside}"


def test_setup_pin_admits_every_minor_of_the_window_and_the_tested_versions() -> None:
    pin = _pin()
    for v in TESTED:
        assert is_supported(v) and _version(v) in pin, v
    for window in SUPPORTED_WINDOW:
        for minor in range(window.first[1], window.last[1] + 1):
            admitted = [v for v in CANDIDATES if v[1] == minor and _version(v) in pin]
            assert admitted, f"setup.py's pin refuses every megatron-core 0.{minor}.x"


def _setup_sh_stacks() -> dict[str, tuple[SpecifierSet, str]]:
    """``stack -> (megatron-core specifier, torch version)`` from scripts/setup.sh's table."""
    text = (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    rows = re.findall(
        r'^\s*([\w.]+)\) CORE="megatron-core([^"]+)" TORCH="([^"]+)" ;;$', text, re.MULTILINE
    )
    return {stack: (SpecifierSet(core), torch) for stack, core, torch in rows}


def test_setup_sh_stacks_lie_in_the_window() -> None:
    stacks = _setup_sh_stacks()
    assert set(stacks) == {"0.16", "0.17", "0.18", "0.19", "bridge"}, stacks
    for name, (spec, _) in stacks.items():
        admitted = [v for v in CANDIDATES if _version(v) in spec]
        assert admitted and all(is_supported(v) for v in admitted), (name, spec, admitted)
    # Every megatron-core release a wheel stack serves has one (0.20 is a checkout's).
    for minor in (16, 17, 18, 19):
        specs = [spec for spec, _ in stacks.values()]
        assert any(_version((0, minor, p)) in spec for spec in specs for p in range(6)), minor


def test_torch_pins_setup_sh_and_the_window_agree() -> None:
    stacks = _setup_sh_stacks()
    used = {torch for _, torch in stacks.values()}
    assert used == set(TORCH_WINDOW.tested), (used, TORCH_WINDOW.tested)
    assert stacks["0.19"][1] == max(TORCH_WINDOW.tested, key=Version)  # primary: the newest
    assert stacks["0.16"][1] != stacks["0.19"][1]  # and an older one beside it
    requirement = _setup_constant("TORCH")
    assert requirement.startswith("torch"), requirement
    pin = SpecifierSet(requirement.removeprefix("torch"))
    for v in TORCH_CANDIDATES:
        assert (Version(".".join(map(str, v))) in pin) == (v[:2] >= TORCH_WINDOW.first), v
    assert all(Version(v) in pin for v in TORCH_WINDOW.tested)


def test_ci_runs_every_stack() -> None:
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ran = set(re.findall(r"(?:BFPP_STACK=|^\s*(?:setup|release) )([\w.]+)", text, re.MULTILINE))
    assert ran == set(_setup_sh_stacks()), ran


def test_an_older_torch_reads_as_one_line_and_a_newer_one_warns() -> None:
    from megatron_bfpp.compat import UnsupportedTorchError, check_torch

    with pytest.raises(UnsupportedTorchError) as error:
        check_torch("2.12.1+cpu")
    assert "\n" not in str(error.value) and "torch 2.12.1+cpu is older" in str(error.value)
    for tested in TORCH_WINDOW.tested:
        assert check_torch(tested) is None
        assert check_torch(f"{tested}+cu130") is None
    warning = check_torch("2.15.0")
    assert warning is not None and "\n" not in warning
    assert all(tested in warning for tested in TORCH_WINDOW.tested)


def test_the_window_reads_as_one_line() -> None:
    from megatron_bfpp.compat import UnsupportedMegatronError, check_megatron_core

    with pytest.raises(UnsupportedMegatronError) as error:
        check_megatron_core((0, 21, 0))
    message = str(error.value)
    assert "\n" not in message and "0.21.0" in message
    assert all(str(window) in message for window in SUPPORTED_WINDOW)


def test_package_version_is_written_once_and_setup_reads_it() -> None:
    assert Version(megatron_bfpp.__version__).is_prerelease  # a beta until GPUs measured it
    assert "version=VERSION" in (ROOT / "setup.py").read_text(encoding="utf-8")
    printed = subprocess.run(
        [sys.executable, "setup.py", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert printed[-1] == megatron_bfpp.__version__
