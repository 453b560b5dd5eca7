"""Every script in scripts/ starts: its imports resolve and ``--help`` prints its usage. A
benchmark that imported a helper another change removed (``bench_sharding`` once imported
``bench_fidelity.ping_pong``) failed only when someone ran it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_prints_its_usage(script: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout, result.stdout[-500:]
