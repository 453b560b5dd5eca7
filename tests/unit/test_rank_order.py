"""Pair-adjacent rank placement (BPipe re-evaluation paper, Figure 2) and the SLURM launcher's
dry run (the sbatch templates: test_sbatch.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bfpp.megatron.rank_order import (
    PlacementError,
    apply_rank_order_from_env,
    format_rank_order,
    node_stages,
    pair_adjacent_rank_order,
    parse_rank_order,
    pipeline_stage_of_rank,
)

REPO = Path(__file__).resolve().parents[2]


def test_figure_2_is_reproduced() -> None:
    order = pair_adjacent_rank_order(pipeline_parallel_size=16, gpus_per_node=8)
    nodes = node_stages(order, gpus_per_node=8, pipeline_parallel_size=16)
    assert nodes[0] == [0, 15, 1, 14, 2, 13, 3, 12]  # GPU 0 .. GPU 7
    # The figure draws node 1 right to left: GPU 15 .. GPU 8 hold 8,7,9,6,10,5,11,4.
    assert nodes[1][::-1] == [8, 7, 9, 6, 10, 5, 11, 4]


@pytest.mark.parametrize(
    ("pp", "gpn", "tp", "dp", "order"),
    [
        (16, 8, 1, 1, "tp-dp-pp"),
        (8, 8, 4, 2, "tp-dp-pp"),  # the paper's t=4, p=8 experiments on 4 nodes
        (8, 8, 4, 2, "tp-pp-dp"),
        (4, 8, 1, 2, "tp-dp-pp"),
        (4, 4, 2, 3, "tp-dp-pp"),
        (2, 2, 1, 1, "tp-dp-pp"),
        (4, 16, 2, 1, "tp-pp-dp"),  # whole pipeline smaller than a node
    ],
)
def test_every_pair_shares_a_node(pp: int, gpn: int, tp: int, dp: int, order: str) -> None:
    slots = pair_adjacent_rank_order(
        pipeline_parallel_size=pp,
        gpus_per_node=gpn,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        order=order,
    )
    world = pp * tp * dp
    assert sorted(slots) == list(range(world))
    node_of_rank = {rank: slot // gpn for slot, rank in enumerate(slots)}

    def rank(t: int, d: int, x: int) -> int:
        return t + tp * d + tp * dp * x if order == "tp-dp-pp" else t + tp * x + tp * pp * d

    for d in range(dp):
        for x in range(pp):
            for t in range(tp):
                r = rank(t, d, x)
                assert (
                    pipeline_stage_of_rank(
                        r,
                        pipeline_parallel_size=pp,
                        tensor_parallel_size=tp,
                        data_parallel_size=dp,
                        order=order,
                    )
                    == x
                )
                # evictor/acceptor pair on one node, and a TP group on one node
                assert node_of_rank[r] == node_of_rank[rank(t, d, pp - 1 - x)]
                assert node_of_rank[r] == node_of_rank[rank(0, d, x)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(pipeline_parallel_size=5, gpus_per_node=8), "must be even"),
        (dict(pipeline_parallel_size=4, gpus_per_node=8, tensor_parallel_size=8), "2 x tensor"),
        (dict(pipeline_parallel_size=4, gpus_per_node=6, data_parallel_size=2), "multiple of"),
        (dict(pipeline_parallel_size=0, gpus_per_node=8), "positive integer"),
        (dict(pipeline_parallel_size=4, gpus_per_node=8, order="pp-dp-tp"), "order must be"),
    ],
)
def test_invalid_inputs_are_clear_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        pair_adjacent_rank_order(**kwargs)  # type: ignore[arg-type]


def test_rank_order_round_trip_and_env() -> None:
    order = pair_adjacent_rank_order(pipeline_parallel_size=4, gpus_per_node=4)
    assert order == (0, 3, 1, 2)
    assert parse_rank_order(format_rank_order(order)) == order
    slots = {}  # what the launcher does in each slot: Megatron rank -> the slot it runs in
    for slot in range(4):
        env = {"BFPP_RANK_ORDER": format_rank_order(order), "RANK": str(slot), "WORLD_SIZE": "4"}
        slots[apply_rank_order_from_env(env)] = slot
    assert [slots[rank] for rank in range(4)] == [0, 2, 3, 1]
    env = {"BFPP_RANK_ORDER": "0,3,1,2", "RANK": "1", "WORLD_SIZE": "4"}
    assert apply_rank_order_from_env(env) == 3
    assert env["RANK"] == "3" and env["BFPP_LAUNCH_RANK"] == "1"
    assert apply_rank_order_from_env(env) == 3  # idempotent: the slot is remembered
    assert apply_rank_order_from_env({"RANK": "2"}) is None
    with pytest.raises(PlacementError, match="permutation"):
        parse_rank_order("0,1,1")
    with pytest.raises(PlacementError, match="WORLD_SIZE"):
        apply_rank_order_from_env({"BFPP_RANK_ORDER": "0,1", "RANK": "0", "WORLD_SIZE": "4"})


def _dry_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "slurm" / "launch.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_slurm_dry_run_prints_one_command_per_node() -> None:
    megatron = (
        "--pipeline-model-parallel-size", "16", "--micro-batch-size", "1",
        "--global-batch-size", "32", "--pipeline-schedule", "bpipe",
    )  # fmt: skip
    result = _dry_run(
        "--megatron-lm", "/opt/Megatron-LM", "--gpus-per-node", "8", "--dry-run",
        "--rank-placement", "pair-adjacent", "--", *megatron,
        env={"SLURM_JOB_NODELIST": "gpu-a"},  # a single host needs no scontrol
    )  # fmt: skip
    assert result.returncode == 1  # 16 stages do not fit one node of 8: one line
    assert result.stderr == (
        "launch.py: error: world size 8 is not a multiple of tensor x pipeline x context "
        "parallel sizes (1 x 16 x 1 = 16); change the node count or the sizes\n"
    )
    result = _dry_run(
        "--megatron-lm", "/opt/Megatron-LM", "--gpus-per-node", "8", "--dry-run",
        "--nodes", "gpu-a,gpu-b", "--rank-placement", "pair-adjacent", "--", *megatron,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    for node_rank, (line, host) in enumerate(zip(lines, ("gpu-a", "gpu-b"), strict=True)):
        assert line.startswith(f"[{host}] env MASTER_ADDR=gpu-a ")
        assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in line
        assert "BFPP_RANK_ORDER=0,15,1,14,2,13,3,12,4,11,5,10,6,9,7,8" in line
        assert f"--nnodes=2 --nproc-per-node=8 --node-rank={node_rank}" in line
        assert line.endswith(
            "-m megatron_bfpp.launch /opt/Megatron-LM/pretrain_gpt.py " + " ".join(megatron)
        )
    assert "# node 1: pipeline stages [4, 11, 5, 10, 6, 9, 7, 8]" in result.stderr


def test_launcher_flags_and_placement_errors_are_one_line() -> None:
    for args, message in (
        (("--gpus-per-node", "eight"), "argument --gpus-per-node: expected a positive integer"),
        (
            ("--nodes", "a,b", "--gpus-per-node", "4", "--rank-placement", "pair-adjacent",
             "--", "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
             "--micro-batch-size", "1"),
            "--rank-placement pair-adjacent: a node must hold whole",
        ),
        (("--nodes", "a", "--"), "--micro-batch-size is missing; Megatron-LM needs it"),
    ):  # fmt: skip
        result = _dry_run("--megatron-lm", "/opt/Megatron-LM", "--dry-run", *args)
        assert result.returncode != 0
        assert result.stderr.startswith("launch.py: error: ")
        assert message in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr


def _path_without_scontrol(extra: Path | None = None) -> str:
    """This machine's PATH less any directory holding an ``scontrol`` (a SLURM login node has
    one), with ``extra`` first."""
    kept = [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "scontrol").exists()]
    return os.pathsep.join(([str(extra)] if extra else []) + kept)


def _failing_scontrol(directory: Path) -> Path:
    script = directory / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        'echo "scontrol: error: Invalid node name specified" >&2\n'
        'echo "(second line of its own)" >&2\n'
        "exit 1\n"
    )
    script.chmod(0o755)
    return directory


def test_a_bracketed_node_list_without_scontrol_is_one_line(tmp_path: Path) -> None:
    """``node[01-02]`` needs ``scontrol show hostnames``: missing (no traceback of
    FileNotFoundError) or failing (its own stderr shown, not a CalledProcessError), one line."""
    args = ("--megatron-lm", "/opt/Megatron-LM", "--dry-run", "--", "--micro-batch-size", "1")
    missing = _dry_run(
        *args, env={"SLURM_JOB_NODELIST": "node[01-02]", "PATH": _path_without_scontrol()}
    )
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr == (
        "launch.py: error: cannot expand SLURM_JOB_NODELIST=node[01-02]: scontrol: No such file "
        "or directory; run inside a SLURM job, or name the hosts with --nodes host1,host2\n"
    )
    path = _path_without_scontrol(_failing_scontrol(tmp_path))
    failing = _dry_run(*args, env={"SLURM_JOB_NODELIST": "node[01-02]", "PATH": path})
    assert failing.returncode == 1 and failing.stdout == ""
    assert failing.stderr == (
        "launch.py: error: `scontrol show hostnames 'node[01-02]'` failed: scontrol: error: "
        "Invalid node name specified (second line of its own); run inside a SLURM job, or name "
        "the hosts with --nodes host1,host2\n"
    )
