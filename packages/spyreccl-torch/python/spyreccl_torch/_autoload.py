"""Entry point of the ``torch.backends`` group: called by torch near the end of
``import torch`` (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).

Contract with torch: an exception escaping this hook makes ``import torch`` fail for every
user of the environment ("Failed to load the backend extension"), so :func:`autoload`
never raises. Importing this module already imported the package ``spyreccl_torch``
(which did the work: extension, device, backend registration); this hook only reports a
failure of that import as a warning. It is idempotent and cheap.
"""

from __future__ import annotations

import sys
import warnings

_PACKAGE = "spyreccl_torch"


def _forget_package() -> None:
    """Drops the half-initialised package from sys.modules so that an explicit
    ``import spyreccl_torch`` runs it again (and raises the real error)."""
    for name in [n for n in sys.modules if n == _PACKAGE or n.startswith(_PACKAGE + ".")]:
        del sys.modules[name]


def autoload() -> None:
    """Registers the spyre device and the spyreccl backend; warns instead of raising."""
    try:
        package = sys.modules.get(_PACKAGE)
        # Still initialising: the user's `import spyreccl_torch` triggered `import torch`,
        # which autoloads us; the package finishes (and reports errors) by itself.
        if package is None or not hasattr(package, "_import_error"):
            return
        error = package._import_error
        if error is None:
            return
        _forget_package()
        warnings.warn(
            "spyreccl_torch: the spyreccl backend could not be loaded at `import torch` "
            f"({type(error).__name__}: {error}). torch works without it; "
            "`import spyreccl_torch` raises the full error, and "
            "TORCH_DEVICE_BACKEND_AUTOLOAD=0 disables this hook.",
            RuntimeWarning,
            stacklevel=2,
        )
    except Exception as error:  # the hook must never break `import torch`
        warnings.warn(
            f"spyreccl_torch: autoload hook failed ({type(error).__name__}: {error})",
            RuntimeWarning,
            stacklevel=2,
        )
