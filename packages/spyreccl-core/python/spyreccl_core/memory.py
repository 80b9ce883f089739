"""numpy arrays in spyreccl's shareable memory arena.

Collectives read the peers' data in place (one copy between processes instead of two) when
every rank's buffers come from the arena and the message is at least
``SPYRECCL_DIRECT_MIN_BYTES`` (default 256 KiB); any other buffer works too, staged through
shared memory. See docs/design.md, "Direct transfers".
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ._core import SharedBuffer

if TYPE_CHECKING:
    import numpy as np


def empty(shape: int | tuple[int, ...], dtype: Any = "float32") -> np.ndarray:
    """An uninitialised, writable, C-contiguous numpy array in the memory arena.

    Like ``numpy.empty``; the memory is returned to the arena when the array (and every view
    of it) is garbage collected. Raises ``SystemError_`` when the arena is unavailable.
    """
    import numpy as np  # numpy is optional for spyreccl_core: imported on use

    dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"spyreccl_core.empty: negative dimension in shape {dims}")
    dt = np.dtype(dtype)
    count = math.prod(dims)
    block = SharedBuffer(count * dt.itemsize)
    return np.frombuffer(block, dtype=dt, count=count).reshape(dims)
