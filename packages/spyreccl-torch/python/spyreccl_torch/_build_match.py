"""Checks that the running torch is the one the compiled extensions were built against.

The extensions link libtorch and use its C++ ABI (class layouts, virtual tables, mangled
symbols), which changes between torch releases: loading them into another torch fails with an
undefined symbol at best and misbehaves at worst. The build records torch's version in the
generated module ``spyreccl_torch._build_info``; this check runs before the extensions load
and raises an ImportError that names both versions and the rebuild command. At
``import torch`` the autoload hook turns it into a warning (see :mod:`spyreccl_torch._autoload`).
"""

from __future__ import annotations

import importlib

REBUILD_COMMAND = (
    "pip install --no-build-isolation --no-deps --force-reinstall packages/spyreccl-torch"
)


def built_for() -> str | None:
    """torch.__version__ at build time, or None for a source tree without a build."""
    try:
        info = importlib.import_module("spyreccl_torch._build_info")
    except ImportError:
        return None
    return getattr(info, "TORCH_VERSION", None)


def check_torch(running: str) -> None:
    """Raises ImportError when the extensions were built for a torch other than `running`."""
    expected = built_for()
    if expected is None or expected == running:
        return
    raise ImportError(
        f"spyreccl_torch was built against torch {expected} but torch {running} is installed; "
        "its compiled extensions only work with the torch they were built against. Rebuild it "
        f"against the installed torch from a spyreccl checkout: {REBUILD_COMMAND} "
        f"(or install torch=={expected.split('+')[0]})."
    )
