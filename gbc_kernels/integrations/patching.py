"""The one way gbc's trainer adapters replace a trainer's function (at most once, the original
kept as ``gbc_original``), now or right after its module's import, and put it back.
"""

from __future__ import annotations

import importlib.util
import sys


class Patches:
    """Replaced attributes of a trainer's classes, with their originals."""

    def __init__(self):
        self._originals = {}        # (cls, attr) -> the original attribute
        self._finders = []          # this set's pending on-import patches

    def set(self, cls, attr: str, fn) -> None:
        """``cls.attr = fn``, unless gbc already replaced it; ``fn.gbc_original`` is the
        original."""
        if (cls, attr) in self._originals or hasattr(getattr(cls, attr), "gbc_original"):
            return
        original = getattr(cls, attr)
        self._originals[cls, attr] = original
        fn.gbc_original = original
        setattr(cls, attr, fn)

    def original(self, cls, attr: str):
        """The trainer's own ``cls.attr``."""
        fn = getattr(cls, attr)
        return getattr(fn, "gbc_original", fn)

    def on_import(self, name: str, patch) -> None:
        """``patch(module)`` now if ``name`` is imported, else right after its import."""
        if name in sys.modules:
            patch(sys.modules[name])
        elif not any(isinstance(f, _PatchOnImport) and f.name == name for f in sys.meta_path):
            self._finders.append(_PatchOnImport(name, patch))
            sys.meta_path.insert(0, self._finders[-1])

    def undo(self) -> None:
        """Every attribute this set replaced gets its original back; its pending import
        patches are dropped (another adapter's stay)."""
        for (cls, attr), original in self._originals.items():
            setattr(cls, attr, original)
        self._originals.clear()
        sys.meta_path[:] = [f for f in sys.meta_path if f not in self._finders]
        self._finders.clear()


class _PatchOnImport:
    """A ``sys.meta_path`` finder that runs ``patch(module)`` right after ``name`` is
    imported."""

    def __init__(self, name, patch):
        self.name, self.patch, self._busy = name, patch, False

    def find_spec(self, name, path=None, target=None):
        if name != self.name or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        loader, patch = spec.loader, self.patch

        class _Loader:
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec
