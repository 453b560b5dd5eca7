"""Versions written once: the package's in megatron_bfpp/__init__.py, the supported megatron-core
window in compat.SUPPORTED_WINDOW; setup.py and scripts/setup.sh must agree with them."""

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
from megatron_bfpp.compat import SUPPORTED_WINDOW, is_supported

ROOT = Path(__file__).resolve().parents[2]
# Every release megatron-core could plausibly publish around the window.
CANDIDATES = [(0, minor, patch) for minor in range(12, 25) for patch in range(6)]
# The versions our stacks and Megatron-LM checkouts run (README "Status").
TESTED = [(0, 16, 1), (0, 19, 2), (0, 20, 0)]


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


def test_setup_sh_stacks_lie_in_the_window() -> None:
    text = (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    pins = re.findall(r'CORE="megatron-core([^"]+)"', text)
    assert len(pins) == 3, pins  # 0.19, 0.16 and the bridge stack (0.19.2)
    for spec in map(SpecifierSet, pins):
        admitted = [v for v in CANDIDATES if _version(v) in spec]
        assert admitted and all(is_supported(v) for v in admitted), (spec, admitted)


def test_the_window_reads_as_one_line() -> None:
    from megatron_bfpp.compat import UnsupportedMegatronError, check_megatron_core

    with pytest.raises(UnsupportedMegatronError) as error:
        check_megatron_core((0, 18, 0))
    message = str(error.value)
    assert "\n" not in message and "0.18.0" in message
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
