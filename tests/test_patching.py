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


def test_one_function_on_two_classes_and_two_sets_on_one_module(tmp_path, monkeypatch):
    """A function patched onto two classes calls each class's own original (a subclass's
    through its base); two sets' on-import patches of one module both run."""
    class A:
        def step(self):
            return "a"

    class B:
        def step(self):
            return "b"

    class SubA(A):
        pass

    p = patching.Patches()

    def step(self):
        return "gbc+" + p.original(type(self), "step")(self)

    p.set(A, "step", step)
    p.set(B, "step", step)
    assert (A().step(), B().step(), SubA().step()) == ("gbc+a", "gbc+b", "gbc+a")
    (tmp_path / "gbc_fake_mod_c.py").write_text("V = 'c'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen, other = [], patching.Patches()
    try:
        p.on_import("gbc_fake_mod_c", lambda m: seen.append("first"))
        other.on_import("gbc_fake_mod_c", lambda m: seen.append("second"))
        importlib.import_module("gbc_fake_mod_c")
        assert sorted(seen) == ["first", "second"]
    finally:
        p.undo()
        other.undo()
        sys.modules.pop("gbc_fake_mod_c", None)
    assert (A().step(), B().step()) == ("a", "b")
