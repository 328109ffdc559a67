"""integrations.patching: the one record of replaced trainer functions."""

import importlib
import sys

from gbc_kernels.integrations import patching


def test_set_once_original_and_undo_own_only(tmp_path, monkeypatch):
    """``set`` replaces once and keeps the original; ``undo`` restores it and drops only its
    own pending on-import patches (OpenRLHF's disable() must not drop verl's)."""
    class Trainer:
        def step(self):
            return "trainer"

    mine, other = patching.Patches(), patching.Patches()
    mine.set(Trainer, "step", lambda self: "gbc")
    mine.set(Trainer, "step", lambda self: "twice")          # already replaced: kept
    assert Trainer().step() == "gbc"
    assert mine.original(Trainer, "step")(Trainer()) == "trainer"
    (tmp_path / "gbc_fake_mod_a.py").write_text("V = 'a'\n")
    (tmp_path / "gbc_fake_mod_b.py").write_text("V = 'b'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    try:
        mine.on_import("gbc_fake_mod_a", lambda m: seen.append(m.V))
        other.on_import("gbc_fake_mod_b", lambda m: seen.append(m.V))
        mine.undo()
        assert Trainer().step() == "trainer"
        importlib.import_module("gbc_fake_mod_a")
        importlib.import_module("gbc_fake_mod_b")
        assert seen == ["b"]
    finally:
        other.undo()
        for name in ("gbc_fake_mod_a", "gbc_fake_mod_b"):
            sys.modules.pop(name, None)
