#!/usr/bin/env python3
"""Start Megatron-LM's ``pretrain_gpt.py`` through ``megatron_bfpp.launch`` on a SLURM allocation.

Run once per job from an sbatch script; it builds one ``torchrun`` command per node and starts
them all with ``srun`` (one task per node), or with ``--dry-run`` prints the exact command lines
(and environment) it would run, node by node, without needing SLURM or GPUs:

    python scripts/slurm/launch.py --megatron-lm /opt/Megatron-LM --gpus-per-node 8 \\
        --rank-placement pair-adjacent --dry-run -- \\
        --pipeline-model-parallel-size 16 --pipeline-schedule bpipe ...

Everything after ``--`` goes to ``pretrain_gpt.py``. Nodes come from ``SLURM_JOB_NODELIST``
(expanded with ``scontrol show hostnames``; ``--nodes host1,host2`` overrides, e.g. in tests;
a missing or failing ``scontrol`` is one line with its own message).
``MASTER_ADDR`` is the first node, ``CUDA_DEVICE_MAX_CONNECTIONS=1`` as Megatron-LM expects.

Before it prints or starts anything, the Megatron arguments are checked for the job's world size
(nodes x ``--gpus-per-node``) with megatron_bfpp's own checks
(:func:`megatron_bfpp.megatron.preflight.check_megatron_command`): a schedule, layout or batch
that cannot run stops here with one ``launch.py: error:`` line and exit code 1, not on the GPUs.

``--rank-placement pair-adjacent`` (for BPipe) computes
:func:`megatron_bfpp.megatron.rank_order.pair_adjacent_rank_order` from the parallel sizes in the
Megatron arguments and exports it as ``BFPP_RANK_ORDER``; ``megatron_bfpp.launch`` then rewrites
each process's ``RANK`` so that pipeline stages x and p-1-x share a node.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from megatron_bfpp.flags import OneLineParser, positive_int
from megatron_bfpp.ir import ScheduleError
from megatron_bfpp.megatron.preflight import check_megatron_command
from megatron_bfpp.megatron.rank_order import (
    RANK_ORDER_ENV,
    PlacementError,
    format_rank_order,
    node_stages,
    pair_adjacent_rank_order,
)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    megatron_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, megatron_args = argv[:cut], argv[cut + 1 :]
    parser = OneLineParser(prog="launch.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", required=True, help="Megatron-LM checkout")
    parser.add_argument("--script", default="pretrain_gpt.py", help="script in the checkout")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8)
    parser.add_argument("--nodes", default=None, help="comma-separated hosts (default: SLURM)")
    parser.add_argument("--master-port", type=positive_int, default=6000)
    parser.add_argument("--python", default="python", help="interpreter on the compute nodes")
    parser.add_argument(
        "--rank-placement",
        choices=("default", "pair-adjacent"),
        default="default",
        help="pair-adjacent: BPipe evictor/acceptor pairs on one node (Figure 2)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return parser.parse_args(argv), megatron_args


def expand_nodes(nodelist: str | None, environ: Mapping[str, str]) -> list[str]:
    if nodelist:
        return [node for node in nodelist.split(",") if node]
    slurm = environ.get("SLURM_JOB_NODELIST")
    if not slurm:
        raise SystemExit("launch.py: error: no SLURM_JOB_NODELIST (run inside sbatch, or --nodes)")
    if "[" not in slurm and "," not in slurm:
        return [slurm]
    return _scontrol_hostnames(slurm)


def _scontrol_hostnames(nodelist: str) -> list[str]:
    """A missing or failing ``scontrol`` is the user's to fix (outside SLURM, a broken PATH):
    one line with scontrol's own message, and the way round it (``--nodes``)."""
    command = ["scontrol", "show", "hostnames", nodelist]
    way_round = "run inside a SLURM job, or name the hosts with --nodes host1,host2"
    try:
        result = subprocess.run(command, check=False, capture_output=True, text=True)
    except OSError as error:
        raise SystemExit(
            f"launch.py: error: cannot expand SLURM_JOB_NODELIST={nodelist}: scontrol: "
            f"{error.strerror or error}; {way_round}"
        ) from None
    hosts = result.stdout.split()
    if result.returncode != 0 or not hosts:
        said = " ".join(result.stderr.split()) or (
            f"exit status {result.returncode}" if result.returncode else "no host names"
        )
        raise SystemExit(f"launch.py: error: `{shlex.join(command)}` failed: {said}; {way_round}")
    return hosts


def rank_order(opts: argparse.Namespace, megatron: argparse.Namespace) -> str:
    """``megatron``: the checked arguments from :func:`check_megatron_command`."""
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    if megatron.context_parallel_size != 1:
        raise SystemExit("launch.py: error: pair-adjacent placement supports context parallel 1")
    order = "tp-pp-dp" if megatron.use_tp_pp_dp_mapping else "tp-dp-pp"
    dp = megatron.data_parallel_size
    try:
        slots = pair_adjacent_rank_order(
            pipeline_parallel_size=pp,
            gpus_per_node=opts.gpus_per_node,
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            order=order,
        )
    except PlacementError as error:
        raise SystemExit(f"launch.py: error: --rank-placement pair-adjacent: {error}") from None
    for node, stages in enumerate(
        node_stages(
            slots,
            gpus_per_node=opts.gpus_per_node,
            pipeline_parallel_size=pp,
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            order=order,
        )
    ):
        print(f"# node {node}: pipeline stages {stages}", file=sys.stderr)
    return format_rank_order(slots)


def check_arguments(
    opts: argparse.Namespace, megatron_args: Sequence[str], nodes: Sequence[str]
) -> argparse.Namespace:
    """Here, before anything starts, is the first place that knows the job's world size."""
    try:
        return check_megatron_command(megatron_args, world_size=len(nodes) * opts.gpus_per_node)
    except ScheduleError as error:
        raise SystemExit(f"launch.py: error: {str(error).splitlines()[0]}") from None


def node_commands(
    opts: argparse.Namespace, megatron_args: Sequence[str], nodes: Sequence[str]
) -> list[tuple[dict[str, str], list[str]]]:
    checked = check_arguments(opts, megatron_args, nodes)
    env = {"MASTER_ADDR": nodes[0], "MASTER_PORT": str(opts.master_port)}
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if opts.rank_placement == "pair-adjacent":
        env[RANK_ORDER_ENV] = rank_order(opts, checked)
    script = os.path.join(opts.megatron_lm, opts.script)
    commands = []
    for node_rank, _ in enumerate(nodes):
        cmd = [
            opts.python, "-m", "torch.distributed.run",
            f"--nnodes={len(nodes)}", f"--nproc-per-node={opts.gpus_per_node}",
            f"--node-rank={node_rank}",
            f"--master-addr={nodes[0]}", f"--master-port={opts.master_port}",
            "-m", "megatron_bfpp.launch", script, *megatron_args,
        ]  # fmt: skip
        commands.append((dict(env), cmd))
    return commands


def main(argv: Sequence[str] | None = None) -> int:
    opts, megatron_args = parse(sys.argv[1:] if argv is None else argv)
    nodes = expand_nodes(opts.nodes, os.environ)
    commands = node_commands(opts, megatron_args, nodes)
    if opts.dry_run:
        for node, (env, cmd) in zip(nodes, commands, strict=True):
            exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
            print(f"[{node}] env {exports} {shlex.join(cmd)}")
        return 0
    procs = []
    for node, (env, cmd) in zip(nodes, commands, strict=True):
        srun = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--kill-on-bad-exit=1"]
        procs.append(subprocess.Popen([*srun, *cmd], env={**os.environ, **env}))
    codes = [proc.wait() for proc in procs]
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    raise SystemExit(main())
