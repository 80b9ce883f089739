"""spyreccl_torch: the torch.distributed backend ``"spyreccl"`` for IBM Spyre devices.

Importing this package (which torch does by itself at ``import torch`` through the
``torch.backends`` entry point, see :mod:`spyreccl_torch._autoload`):

1. loads the C++ backend ``spyreccl_torch._C`` (``ProcessGroupSpyreccl``);
2. makes sure a ``spyre`` device exists: ``spyreccl_torch.device.register()`` loads the
   host-emulated device when no real Spyre runtime registered one;
3. registers the backend with ``torch.distributed`` for the ``spyre`` device, so that

       dist.init_process_group()                           # spyre tensors -> spyreccl
       dist.init_process_group("cpu:gloo,spyre:spyreccl")  # CPU tensors too

   both work. The backend is also registered as ``spyreccl_shm``, a name only this package
   uses: beside IBM's torch-spyre, which registers its own backend as ``spyreccl``, that
   name stays the vendor's and ours is ``spyreccl_shm`` (see :mod:`._registration` and
   :mod:`.routing`).
"""

from __future__ import annotations

import sys

__version__ = "0.1.0"


def _torch_is_importing() -> bool:
    """True while ``import torch`` is still executing torch/__init__.py, i.e. when torch's
    device-backend autoload is what imports this package."""
    torch_module = sys.modules.get("torch")
    spec = getattr(torch_module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


try:
    import torch  # libtorch must be loaded before the extension
    import torch.distributed  # registers the c10d types _C derives from

    from ._build_match import check_torch
    from ._loader import load_extension

    check_torch(torch.__version__)

    _C = load_extension()
    ProcessGroupSpyreccl = _C.ProcessGroupSpyreccl
    Options = ProcessGroupSpyreccl.Options

    from ._registration import (
        BACKEND_NAME,
        DEVICE_TYPE,
        OWN_BACKEND_NAME,
        backend_name,
        is_registered,
        register,
        vendor_plugin,
    )

    register()

    from ._lifecycle import register_exit_hook

    register_exit_hook()
    _import_error: BaseException | None = None
except Exception as error:
    # Raising here while torch autoloads us would make `import torch` itself fail for
    # every user of this environment. Keep the error for _autoload.autoload(), which warns
    # and forgets this half-initialised package so that an explicit `import spyreccl_torch`
    # retries and raises it.
    if not _torch_is_importing():
        raise
    _import_error = error

__all__ = [
    "BACKEND_NAME",
    "DEVICE_TYPE",
    "OWN_BACKEND_NAME",
    "Options",
    "ProcessGroupSpyreccl",
    "__version__",
    "backend_name",
    "is_registered",
    "register",
    "vendor_plugin",
]
