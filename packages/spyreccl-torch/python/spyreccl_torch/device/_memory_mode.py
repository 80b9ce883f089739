"""The emulated spyre device's memory mode: the one place that reads ``SPYRECCL_SPYRE_MEMORY``.

``host`` (the default): spyre tensors are host memory that spyreccl's core reads and writes
in place (zero copy). ``discrete``: the device behaves like a real Spyre card, whose memory
the host cannot address; spyreccl then moves spyre tensors through host buffers with the
device's own copies (the staged path, see docs/architecture.md), as it must with torch_spyre.
"""

from __future__ import annotations

import os
from typing import Literal

MEMORY_ENV = "SPYRECCL_SPYRE_MEMORY"
MemoryMode = Literal["host", "discrete"]
_MODES: tuple[MemoryMode, ...] = ("host", "discrete")


def memory_mode() -> MemoryMode:
    """``SPYRECCL_SPYRE_MEMORY`` (``host`` when unset or empty); raises ValueError naming the
    variable and the accepted values for anything else."""
    value = os.environ.get(MEMORY_ENV, "").strip().lower() or "host"
    if value not in _MODES:
        raise ValueError(
            f"{MEMORY_ENV}={os.environ[MEMORY_ENV]!r}: expected one of {', '.join(_MODES)}"
        )
    return value  # type: ignore[return-value]
