"""The compatibility module: the version window, and one clear line outside it at every entry
point (API, install(), bfpp-train, the Megatron-LM launcher), whatever megatron-core is there."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron.core import package_info

import megatron_bfpp
from megatron_bfpp import compat
from megatron_bfpp.megatron import plugin

# Runs the given code with megatron-core reporting version 0.21.0 (outside the window).
FAKE_0_21 = "import megatron.core.package_info as p; p.MINOR = 21; p.PATCH = 0\n"


@pytest.fixture
def fake_version(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(package_info, "MINOR", 21)
    monkeypatch.setattr(package_info, "PATCH", 0)
    compat.megatron_core_version.cache_clear()
    yield
    compat.megatron_core_version.cache_clear()


@pytest.mark.parametrize(
    "version", [(0, 16, 0), (0, 16, 1), (0, 17, 1), (0, 18, 2), (0, 19, 0), (0, 19, 2), (0, 20, 0)]
)
def test_window_accepts(version: tuple[int, int, int]) -> None:
    assert compat.check_megatron_core(version) == version


@pytest.mark.parametrize("version", [(0, 15, 3), (0, 14, 0), (0, 21, 0), (1, 0, 0)])
def test_window_rejects_with_one_line_naming_the_version(version: tuple[int, int, int]) -> None:
    with pytest.raises(compat.UnsupportedMegatronError) as info:
        compat.check_megatron_core(version)
    text = str(info.value)
    assert "\n" not in text
    assert f"megatron-core {'.'.join(map(str, version))} is not supported" in text
    assert "0.19" in text and "0.16" in text  # says what to install instead


def test_installed_version_is_read_from_package_info() -> None:
    installed = (package_info.MAJOR, package_info.MINOR, package_info.PATCH)
    assert compat.megatron_core_version() == installed
    assert compat.is_supported(installed)


def test_api_refuses_an_unsupported_version(fake_version: None) -> None:
    with pytest.raises(compat.UnsupportedMegatronError, match=r"megatron-core 0\.21\.0 is not"):
        megatron_bfpp.get_forward_backward_func("1f1b")


def test_install_refuses_an_unsupported_version_and_patches_nothing(fake_version: None) -> None:
    from megatron.core.pipeline_parallel import schedules

    before = schedules.get_forward_backward_func
    with pytest.raises(compat.UnsupportedMegatronError, match=r"0\.21\.0"):
        megatron_bfpp.install()
    assert not plugin.is_installed()
    assert schedules.get_forward_backward_func is before


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", FAKE_0_21 + code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,  # imports megatron-core: minutes on a loaded machine
        check=False,
    )


def test_bfpp_train_says_one_line_before_starting_ranks(tmp_path: Path) -> None:
    result = _run(
        "from megatron_bfpp.cli.train import main\nraise SystemExit(main(['--train-iters', '1']))",
        tmp_path,
    )
    assert result.returncode == 2
    # (The fake imports megatron-core before bfpp-train's warning filters: only count errors.)
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert lines == [
        "bfpp-train: error: megatron-core 0.21.0 is not supported by megatron_bfpp; install "
        "megatron-core 0.16.x (Python 3.10/3.11) or 0.17.x-0.20.x (Python >= 3.12) "
        "(e.g. pip install 'megatron-core==0.19.2' on Python 3.12)"
    ]


def test_megatron_lm_launcher_says_one_line(tmp_path: Path) -> None:
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    result = _run(f"from megatron_bfpp.launch import main\nmain([{str(script)!r}])", tmp_path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("megatron_bfpp.launch: error: megatron-core 0.21.0 is not")
    assert "must not run" not in result.stderr


# --- torch: older than the window refused in one line, newer runs with one warning line ---------
FAKE_OLD_TORCH = "import torch; torch.__version__ = '2.12.1'\n"
FAKE_NEW_TORCH = "import torch; torch.__version__ = '2.15.0'\n"


def _run_torch(fake: str, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", fake + code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,  # imports megatron-core: minutes on a loaded machine
        check=False,
    )


def test_launcher_refuses_an_older_torch_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    code = f"from megatron_bfpp.launch import main\nmain([{str(script)!r}])"
    result = _run_torch(FAKE_OLD_TORCH, code, tmp_path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == [
        "megatron_bfpp.launch: error: torch 2.12.1 is older than megatron_bfpp supports "
        "(torch >= 2.13; tested: 2.13.0, 2.14.1); install e.g. pip install 'torch==2.14.1'"
    ], result.stderr
    assert "must not run" not in result.stderr


def test_bfpp_train_refuses_an_older_torch_in_one_line(tmp_path: Path) -> None:
    code = (
        "from megatron_bfpp.cli.train import main\nraise SystemExit(main(['--train-iters', '1']))"
    )
    result = _run_torch(FAKE_OLD_TORCH, code, tmp_path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("bfpp-train: error: torch 2.12.1 is older")


def test_a_newer_torch_runs_with_one_warning_naming_the_tested_versions(tmp_path: Path) -> None:
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("print('the script ran')\n")
    code = f"from megatron_bfpp.launch import main\nmain([{str(script)!r}])"
    result = _run_torch(FAKE_NEW_TORCH, code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "the script ran" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if "warning: torch" in line]
    assert warnings == [
        "megatron_bfpp: warning: torch 2.15.0 is newer than the versions megatron_bfpp is "
        "tested with (2.13.0, 2.14.1); it runs, untested"
    ], result.stderr


def test_the_moe_router_runs_without_transformer_engine() -> None:
    """0.16.1's router names ``te_general_gemm`` even when Transformer Engine does not import (a
    NameError on every MoE forward, bfpp-train's included); after the shim every release routes
    through torch, with the plain linear's values and gradients."""
    import torch
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.HAVE_TE:
        pytest.skip("Transformer Engine imports: its kernels route")
    from megatron_bfpp.megatron.patches import moe_without_transformer_engine

    moe_without_transformer_engine()
    inp = torch.randn(3, 8, requires_grad=True)
    weight = torch.randn(4, 8, requires_grad=True)
    out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    torch.testing.assert_close(out, inp @ weight.T)
    out.sum().backward()
    assert inp.grad is not None and weight.grad is not None
