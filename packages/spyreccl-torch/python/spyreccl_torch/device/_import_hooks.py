"""Running registration code once a torch submodule has been imported.

Some integrations (DTensor op handlers, compile-time RNG hooks) live in torch modules that
``import torch`` does not load and that cost time to import; registering with them must
wait until the program imports them itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["after_import"]


def _guarded(callback: Callable[[], None], what: str) -> Callable[[], None]:
    def run() -> None:
        try:
            callback()
        except Exception as error:  # runs inside an import, which must not break
            warnings.warn(f"spyreccl: {what} is unavailable: {error}", RuntimeWarning, stacklevel=2)

    return run


class _ChainedLoader(importlib.abc.Loader):
    """Runs the real loader, then ``callback``."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        module.__spec__.loader = self._loader  # loaded: hide this wrapper from now on
        module.__loader__ = self._loader
        self._callback()


class _AfterImport(importlib.abc.MetaPathFinder):
    """One-shot meta path finder that chains ``callback`` to the loading of ``name``."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self._callback = callback

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # the other finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ChainedLoader(spec.loader, self._callback)
        return spec


def after_import(name: str, callback: Callable[[], None], what: str) -> None:
    """Runs ``callback`` now if module ``name`` is loaded, else right after it loads. A
    failing callback warns (naming ``what``) instead of breaking the import."""
    run = _guarded(callback, what)
    if name in sys.modules:
        run()
    else:
        sys.meta_path.insert(0, _AfterImport(name, run))
