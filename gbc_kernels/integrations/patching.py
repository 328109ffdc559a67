"""The one way gbc's trainer adapters replace a trainer's function (at most once, the original
kept per class by the set that replaced it), now or right after its module's import, and put
it back.
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
        """``cls.attr = fn``, unless gbc already replaced it (``fn`` may serve several classes:
        each keeps its own original, :meth:`original`)."""
        if (cls, attr) in self._originals or getattr(getattr(cls, attr), "gbc_patched", False):
            return
        self._originals[cls, attr] = getattr(cls, attr)
        fn.gbc_patched = True
        setattr(cls, attr, fn)

    def original(self, cls, attr: str):
        """The trainer's own ``attr`` for ``cls`` (an instance's class): the original this set
        replaced on ``cls`` or the nearest base class, else the attribute as it is."""
        for c in cls.__mro__:
            if (c, attr) in self._originals:
                return self._originals[c, attr]
        return getattr(cls, attr)

    def on_import(self, name: str, patch) -> None:
        """``patch(module)`` now if ``name`` is imported, else right after its import."""
        if name in sys.modules:
            patch(sys.modules[name])
        elif not any(f.name == name for f in self._finders):
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
