"""The one patch registry: restoring puts back exactly what was there, last patch first."""

from __future__ import annotations

import types

from megatron_bfpp.megatron.patches import Patches


class _Base:
    def inherited(self) -> str:
        return "base"


class _Owner(_Base):
    @staticmethod
    def static() -> str:
        return "static"


def test_restore_puts_back_raw_entries_and_removes_inherited_overrides() -> None:
    raw_static = vars(_Owner)["static"]
    patches = Patches()
    assert not patches
    patches.patch(_Owner, "static", lambda: "patched")
    patches.patch(_Owner, "inherited", lambda self: "patched")
    assert patches
    assert _Owner.static() == "patched"
    assert _Owner().inherited() == "patched"
    assert patches.owner_of("inherited") is _Owner
    patches.restore()
    assert not patches
    assert vars(_Owner)["static"] is raw_static  # still a staticmethod, not a plain function
    assert "inherited" not in vars(_Owner)  # served by the base class again
    assert _Owner().inherited() == "base"
    assert patches.owner_of("inherited") is None


def test_patching_one_name_twice_restores_the_first_original() -> None:
    module = types.ModuleType("m")
    module.f = "original"  # type: ignore[attr-defined]
    patches = Patches()
    patches.patch(module, "f", "first")
    patches.patch(module, "f", "second")
    patches.restore()
    assert module.f == "original"  # type: ignore[attr-defined]


def test_the_integration_layers_share_the_registry() -> None:
    """cpu.py, cpu_launch.py and plugin.py keep no restore loop of their own."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "megatron_bfpp" / "megatron"
    for name in ("cpu.py", "cpu_launch.py", "plugin.py"):
        text = (root / name).read_text(encoding="utf-8")
        assert "Patches()" in text, name
        assert "setattr(owner" not in text and "delattr(" not in text, name
