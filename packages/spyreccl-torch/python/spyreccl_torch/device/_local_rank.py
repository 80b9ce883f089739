"""Device initialisation of the emulated spyre device: ``LOCAL_RANK`` (part of ``torch.spyre``).

As in torch-spyre's runtime, a process started by torchrun runs on the spyre device whose
index is its ``LOCAL_RANK``: every thread starts on that device until it selects another
(``torch.spyre.set_device``, ``torch.spyre.device``). The C++ side reads the variable
(src/device/local_rank.cc). A ``LOCAL_RANK`` that is not an integer, is negative, or
exceeds the largest device index makes device initialisation fail with a ``RuntimeError``
that starts with torch-spyre's wording for the case (``LOCAL_RANK is not a valid integer:
'x'``, ``LOCAL_RANK value is out of range: -1``, ``LOCAL_RANK value 128 exceeds the maximum
supported device index (127)``, ``Device index out of bounds.``: programs written against
torch-spyre match on these) and then names the variable, its value and the valid range.

Initialisation happens on first use, never at ``import torch``: torch calls
:func:`_lazy_init` before it creates the first spyre tensor, and ``torch.spyre``'s
``current_device``/``set_device`` call it too, as ``torch.cuda``'s do. A failed
initialisation is retried (and fails again) on the next use.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_initialized = False


def _lazy_init() -> None:
    """Validates ``LOCAL_RANK`` once per process (raises ``RuntimeError`` if invalid)."""
    global _initialized
    if _initialized:
        return
    with _lock:
        if not _initialized:
            torch.ops.spyreccl_device.init()
            _initialized = True
