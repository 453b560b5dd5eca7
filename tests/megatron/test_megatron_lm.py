"""Megatron-LM's own ``pretrain_gpt.py`` through ``python -m megatron_bfpp.launch`` on 4 CPU ranks.

Needs a Megatron-LM checkout in ``MEGATRON_LM_PATH`` (verified: core_r0.16 training code, commit
a0cc8caec of github.com/wdykas/Megatron-LM, a fork tracking NVIDIA/Megatron-LM) and its runtime
deps in this environment (six, pyyaml, pydantic, regex, pybind11, triton). The installed
megatron-core (0.16.1) is used; only ``megatron.training`` / ``megatron.legacy`` and the
script's helpers come from the checkout (the launcher imports ``megatron.core`` before putting
the checkout on ``sys.path``).

Megatron's own interleaved schedule is run with ``--no-overlap-p2p-communication``: its default
overlapped p2p path gives different losses on gloo from the first forward on (measured: iteration
1 loss 5.541235 vs 5.536057, grad norm 13.6 vs 2.14), like megatron-core's
``batch_p2p_comm`` interleaved path at pp=2 noted in ``megatron_bfpp.testing.cpu``.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(
        not MEGATRON_LM,
        reason="set MEGATRON_LM_PATH to a Megatron-LM checkout (core_r0.16 training code, e.g. "
        "`git clone https://github.com/NVIDIA/Megatron-LM && git checkout core_r0.16.0`, or "
        "commit a0cc8caec of github.com/wdykas/Megatron-LM) and pip install six pyyaml "
        "pydantic regex pybind11 triton",
    ),
]

COMMON = shlex.split(
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --transformer-impl local "
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 8 --train-iters 3 "
    "--lr 1e-3 --lr-decay-style constant --log-interval 1 --seed 1234 "
    "--attention-dropout 0 --hidden-dropout 0 --no-gradient-accumulation-fusion "
    "--no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion --no-rope-fusion --split 100,0,0 --eval-iters 0 "
    "--eval-interval 1000 --pipeline-model-parallel-size 4"
)
VP = ["--num-virtual-stages-per-pipeline-rank", "2"]
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: (\S+) .*?grad norm: (\S+) ")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _train(tmp_path: Path, *extra: str) -> tuple[list[tuple[str, str]], str]:
    script = Path(MEGATRON_LM or "") / "pretrain_gpt.py"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
        "--master-port", str(_free_port()),
        "-m", "megatron_bfpp.launch", str(script), *COMMON, *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    losses = [(loss, norm) for _, loss, norm in LOG_LINE.findall(output)]
    assert len(losses) == 3, output[-3000:]
    assert float(losses[-1][0]) < float(losses[0][0]), losses  # training makes progress
    assert output.count("megatron_bfpp.launch: no CUDA device") == 1
    return losses, output


def test_breadth_first_equals_megatrons_interleaved(tmp_path: Path) -> None:
    ours, output = _train(tmp_path, *VP, "--pipeline-schedule", "breadth-first")
    assert "megatron_bfpp: pipeline schedule breadth-first" in output
    megatron, output = _train(
        tmp_path,
        *VP,
        "--microbatch-group-size-per-virtual-pipeline-stage", "8",
        "--no-overlap-p2p-communication",
    )  # fmt: skip
    assert "megatron_bfpp: pipeline schedule" not in output
    assert ours == megatron


@pytest.mark.parametrize("schedule", ["1f1b", "bpipe"])
def test_single_stage_schedules_equal_megatrons_default(tmp_path: Path, schedule: str) -> None:
    """1f1b, and bpipe (rank 0 parks micro-batches on rank 3 and loads them back), give
    Megatron's own 1F1B losses and grad norms exactly."""
    ours, output = _train(tmp_path, "--pipeline-schedule", schedule)
    assert f"megatron_bfpp: pipeline schedule {schedule}" in output
    megatron, _ = _train(tmp_path)
    assert ours == megatron


def test_bad_schedule_flags_exit_with_one_line(tmp_path: Path) -> None:
    script = Path(MEGATRON_LM or "") / "pretrain_gpt.py"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
        "--master-port", str(_free_port()),
        "-m", "megatron_bfpp.launch", str(script), *COMMON, "--pipeline-schedule", "breadth-first",
    ]  # fmt: skip
    result = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "megatron_bfpp: error:" in line]
    assert len(errors) == 4, result.stderr[-3000:]  # one line per rank
    assert "needs virtual pipeline stages" in errors[0]
