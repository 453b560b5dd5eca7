"""Every rank the tests run follows NCCL's point-to-point rules on gloo
(:mod:`megatron_bfpp.testing.nccl_emulation`), so an order that would deadlock on NCCL fails on
CPU: forked ranks install it (``multirank.run_ranks``), subprocesses through the
``sitecustomize`` put first on ``PYTHONPATH``. ``BFPP_NCCL_EMULATION=0 pytest`` opts out."""

from __future__ import annotations

import os
from pathlib import Path

import megatron_bfpp.testing

os.environ.setdefault("BFPP_NCCL_EMULATION", "1")
if os.environ["BFPP_NCCL_EMULATION"] == "1":
    _SITE = str(Path(megatron_bfpp.testing.__file__).parent / "nccl_site")
    _PATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _SITE]
    os.environ["PYTHONPATH"] = os.pathsep.join([_SITE, *_PATH])
