"""Installs the NCCL emulation in every Python process the tests start (``BFPP_NCCL_EMULATION=1``).

``tests/conftest.py`` puts this directory first on ``PYTHONPATH``; a ``sys.meta_path`` finder
installs the emulation once ``torch`` and ``torch.distributed`` have both finished importing
(before any p2p can run; a process that never imports torch pays nothing). The ``sitecustomize``
this file shadows, the next one on ``sys.path``, is run at the end."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_WATCHED = ("torch", "torch.distributed")


class _InstallAfterTorch:
    """Wraps the loaders of torch and torch.distributed; installs once both have run."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _WATCHED:
            return None
        later = sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else []
        for finder in later:
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run(module)
                self.loaded.add(name)
                if self.loaded == set(_WATCHED):
                    self.install()

            spec.loader.exec_module = exec_module
        return spec

    def install(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            from megatron_bfpp.testing import nccl_emulation

            nccl_emulation.install()
        except Exception as error:  # keep the process alive, but never silently unemulated
            print(
                f"BFPP_NCCL_EMULATION=1 but the emulation failed to install: {error!r}",
                file=sys.stderr,
            )


def _run_the_shadowed_sitecustomize() -> None:
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if os.environ.get("BFPP_NCCL_EMULATION") == "1" and "torch" not in sys.modules:
    sys.meta_path.insert(0, _InstallAfterTorch())
_run_the_shadowed_sitecustomize()
