"""The one registry of attribute replacements, so an uninstall never leaves a half-patched
Megatron: an owner's own attribute gets back its raw entry, an inherited one is deleted again."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Patches", "moe_without_transformer_engine"]


class _Saved(NamedTuple):
    owner: Any
    name: str
    had_own: bool
    original: Any


@dataclass(eq=False)
class Patches:
    """Replacements made through :meth:`patch`, undone by :meth:`restore`."""

    _saved: list[_Saved] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self._saved)

    def patch(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value``, remembering exactly what to put back."""
        had_own = name in vars(owner)
        original = vars(owner)[name] if had_own else getattr(owner, name)
        self._saved.append(_Saved(owner, name, had_own, original))
        setattr(owner, name, value)

    def wrap(self, owner: Any, name: str, wrapper: Callable[[Any], Any]) -> None:
        """``owner.name = wrapper(owner.name)`` where this version has it (``owner``: or None)."""
        if owner is not None and hasattr(owner, name):
            self.patch(owner, name, wrapper(getattr(owner, name)))

    def restore(self) -> None:
        """Undo every replacement, last first (a no-op when there is none)."""
        while self._saved:
            saved = self._saved.pop()
            if saved.had_own:
                setattr(saved.owner, saved.name, saved.original)
            else:
                delattr(saved.owner, saved.name)

    def owner_of(self, name: str) -> Any | None:
        """The object whose ``name`` was replaced first, or None."""
        return next((saved.owner for saved in self._saved if saved.name == name), None)


# megatron-core's Transformer Engine MoE kernels, None without TE from 0.17 on
_TE_MOE_KERNELS = (
    "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
    "fused_permute_with_probs", "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function", "fused_unpermute",
    "te_general_gemm",
)  # fmt: skip


def moe_without_transformer_engine() -> None:
    """Not a replacement, so outside the registry (nothing to undo: 0.17+ define the same).
    0.16.1 leaves its TE MoE kernels undefined when TE does not import, yet its router tests
    ``te_general_gemm is not None`` on every forward (a NameError, CPU or GPU); 0.17+ set them to
    None. Set the missing ones to None as 0.17+ do: the router then takes its torch path."""
    from megatron.core.transformer.moe import moe_utils

    for name in _TE_MOE_KERNELS:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
