"""Run an unmodified Megatron-LM training script with ``--pipeline-schedule`` available.

    python -m megatron_bfpp.launch /path/to/Megatron-LM/pretrain_gpt.py <megatron args> \\
        --pipeline-schedule breadth-first
    torchrun --nproc-per-node 8 -m megatron_bfpp.launch /path/to/Megatron-LM/pretrain_gpt.py ...

Each process: (1) applies a pair-adjacent (or any) rank order from ``BFPP_RANK_ORDER`` (see
:mod:`megatron_bfpp.megatron.placement`); (2) imports the installed ``megatron.core`` if there is
one (so a pip megatron-core is used even though the checkout also has ``megatron/core``);
(3) puts the script's directory first on ``sys.path``; (4) ``megatron_bfpp.install()``;
(5) without CUDA, enables the CPU redirects of :mod:`megatron_bfpp.megatron.cpu_launch` and logs
one line saying so; (6) runs the script as ``__main__`` with ``sys.argv`` = script + its arguments.
"""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import sys
from collections.abc import Sequence

__all__ = ["main"]

log = logging.getLogger("megatron_bfpp.launch")

USAGE = "usage: python -m megatron_bfpp.launch SCRIPT.py [script arguments ...]"


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_bfpp.launch: error: no such script: {argv[0]}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from megatron_bfpp.megatron.placement import apply_rank_order_from_env

    apply_rank_order_from_env(os.environ)
    with contextlib.suppress(ImportError):
        import megatron.core  # noqa: F401  (the installed megatron-core wins over the checkout's)
    sys.path.insert(0, os.path.dirname(script))

    import torch

    from megatron_bfpp.megatron.plugin import install

    install()
    _use_prebuilt_dataset_helpers()
    if not torch.cuda.is_available():
        from megatron_bfpp.megatron.cpu_launch import enable_cpu_megatron_lm

        enable_cpu_megatron_lm()
        if os.environ.get("RANK", "0") == "0":
            log.info(
                "megatron_bfpp.launch: no CUDA device: running on CPU with gloo "
                "(megatron_bfpp.megatron.cpu_launch redirects CUDA-only calls)"
            )
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


def _use_prebuilt_dataset_helpers() -> None:
    """Megatron-LM runs ``make`` in megatron-core's ``datasets`` directory (rank 0, at start).
    A megatron-core wheel ships the built ``helpers_cpp`` but no Makefile, so that ``make`` fails:
    when ``helpers_cpp`` already imports, make ``compile_helpers`` a no-op."""
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
        import megatron.core.datasets.utils as dataset_utils
    except ImportError:
        return
    dataset_utils.compile_helpers = _no_compile


def _no_compile() -> None:
    return None


if __name__ == "__main__":
    main()
