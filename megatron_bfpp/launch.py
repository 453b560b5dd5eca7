"""Run an unmodified Megatron-LM training script with ``--pipeline-schedule`` available.

    python -m megatron_bfpp.launch /path/to/Megatron-LM/pretrain_gpt.py <megatron args> \\
        --pipeline-schedule breadth-first
    torchrun --nproc-per-node 8 -m megatron_bfpp.launch /path/to/Megatron-LM/pretrain_gpt.py ...

Each process: (1) applies a pair-adjacent (or any) rank order from ``BFPP_RANK_ORDER`` (see
:mod:`megatron_bfpp.megatron.rank_order`); (2) puts the script's directory first on ``sys.path``,
as ``python pretrain_gpt.py`` would, so a checkout's own ``megatron/core`` and
``megatron/training`` are used together (a checkout without ``megatron/core`` uses the installed
megatron-core); (3) ``megatron_bfpp.install()``, which checks the megatron-core and torch versions
(one error line outside the supported windows, one warning line for a torch newer than the tested
ones); (4) without CUDA, enables the CPU redirects of
:mod:`megatron_bfpp.megatron.cpu_launch`; rank 0 logs one line naming the megatron-core version,
where it comes from and the device; (5) runs the script as ``__main__`` with ``sys.argv`` =
script + its arguments.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from collections.abc import Sequence
from typing import NoReturn

from megatron_bfpp.flags import printable_output

__all__ = ["main"]

log = logging.getLogger("megatron_bfpp.launch")

USAGE = "usage: python -m megatron_bfpp.launch SCRIPT.py [script arguments ...]"
PROG = "megatron_bfpp.launch"


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    printable_output()
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        _refuse(f"no such script: {argv[0]}")
    if (problem := script_problem(script, shown=argv[0])) is not None:
        _refuse(problem)
    # Checks before torch or Megatron is imported: a line per node, well under a second (preflight).
    if any(a == "--pipeline-schedule" or a.startswith("--pipeline-schedule=") for a in argv[1:]):
        from megatron_bfpp.ir import ScheduleError
        from megatron_bfpp.megatron.preflight import check_megatron_command

        try:
            check_megatron_command(argv[1:], world_size=int(os.environ.get("WORLD_SIZE", "1")))
        except ScheduleError as error:
            _refuse(str(error).splitlines()[0])
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from megatron_bfpp.megatron.rank_order import apply_rank_order_from_env

    apply_rank_order_from_env(os.environ)
    sys.path.insert(0, os.path.dirname(script))

    import torch

    from megatron_bfpp.compat import UnsupportedVersionError, megatron_core_version
    from megatron_bfpp.megatron.plugin import install, keep_prebuilt_dataset_helpers

    try:
        install()
    except UnsupportedVersionError as error:
        _refuse(str(error))
    keep_prebuilt_dataset_helpers()
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from megatron_bfpp.megatron.cpu_launch import enable_cpu_megatron_lm

        enable_cpu_megatron_lm()
    if os.environ.get("RANK", "0") == "0":
        import megatron.core

        version = ".".join(map(str, megatron_core_version()))
        where = os.path.dirname(os.path.dirname(os.path.abspath(megatron.core.__file__)))
        device = (
            "no CUDA device: running on CPU with gloo (megatron_bfpp.megatron.cpu_launch "
            "redirects CUDA-only calls)"
            if on_cpu
            else f"{torch.cuda.device_count()} CUDA device(s) visible"
        )
        log.info(
            "megatron_bfpp.launch: megatron-core %s from %s; torch %s; %s",
            version,
            where,
            torch.__version__,
            device,
        )
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


_MAX_SCRIPT_BYTES = 16 << 20  # a training script is a few hundred KiB at most


def script_problem(script: str, *, shown: str) -> str | None:
    """Why ``script`` is not a Python script the launcher can run (a shell script, a binary, a
    syntax error), found by compiling it (nothing runs) before every rank's seconds of imports."""
    try:
        with open(script, "rb") as file:
            source = file.read(_MAX_SCRIPT_BYTES + 1)
    except OSError as error:
        return f"cannot read {shown} ({error.strerror})"
    if len(source) > _MAX_SCRIPT_BYTES:
        return f"{shown} is larger than {_MAX_SCRIPT_BYTES >> 20} MiB: not a training script"
    first = source.split(b"\n", 1)[0]
    if first.startswith(b"#!") and b"python" not in first:
        interpreter = first[2:].decode("utf-8", "replace").strip()
        return (
            f"{shown} is not a Python script (it starts with #!{interpreter}); the launcher "
            "runs Megatron-LM's Python scripts (pretrain_gpt.py); run this one directly"
        )
    try:
        compile(source, script, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as error:
        where = f" (line {error.lineno}: {error.msg})" if isinstance(error, SyntaxError) else ""
        return (
            f"{shown} is not a Python script{where}; the launcher runs Megatron-LM's Python "
            "scripts (pretrain_gpt.py)"
        )
    return None


def _refuse(message: str) -> NoReturn:
    from megatron_bfpp.megatron.plugin import refuse

    refuse(message, prog=PROG)


if __name__ == "__main__":
    main()
