"""Loads the compiled backend ``spyreccl_torch._C``.

``_C`` finds ``libspyreccl.so`` through its RPATH (``$ORIGIN/../spyreccl_core/lib``), which
holds for wheels installed side by side in one site-packages. When spyreccl-core lives
elsewhere (an editable install, another path entry), the library is loaded from the
location ``spyreccl_core`` reports and the import retried: once a library with the same
soname is loaded, the dynamic linker reuses it for ``_C``.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
from pathlib import Path
from types import ModuleType


def _core_library_candidates() -> list[Path]:
    spec = importlib.util.find_spec("spyreccl_core")
    if spec is None or not spec.submodule_search_locations:
        return []
    candidates = []
    for location in spec.submodule_search_locations:
        lib_dir = Path(location) / "lib"
        candidates.append(lib_dir / "libspyreccl.so")
        candidates.extend(sorted(lib_dir.glob("libspyreccl.so.*")))
    return [path for path in candidates if path.exists()]


def load_extension() -> ModuleType:
    try:
        return importlib.import_module("spyreccl_torch._C")
    except ImportError as first_error:
        if "libspyreccl" not in str(first_error):
            raise
        candidates = _core_library_candidates()
        if not candidates:
            raise ImportError(
                "spyreccl_torch could not load libspyreccl.so: install spyreccl-core "
                "(pip install --no-build-isolation packages/spyreccl-core); "
                f"original error: {first_error}"
            ) from first_error
        ctypes.CDLL(str(candidates[0]))
        return importlib.import_module("spyreccl_torch._C")
