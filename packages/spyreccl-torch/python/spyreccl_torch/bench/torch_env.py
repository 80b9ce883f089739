"""Setting up torch.distributed for one torch level inside a rank process.

``spyreccl``: the default process group on the ``spyreccl`` backend with ``spyre`` tensors.
``gloo``: the default process group on gloo with CPU tensors (the baseline).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

__all__ = ["LEVELS", "TorchEnv", "init_level", "torch_dtype"]

LEVELS = ("spyreccl", "gloo")


@dataclass
class TorchEnv:
    torch: Any
    dist: Any
    device: Any
    synchronize: Any  # () -> None, waits for the device (no-op for CPU)


def torch_dtype(torch: Any, name: str) -> Any:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def _no_sync() -> None:
    return None


def init_level(
    level: str,
    *,
    rank: int,
    world_size: int,
    init_method: str,
    timeout: datetime.timedelta,
    threads: int = 1,
) -> TorchEnv:
    """Initialises the default process group of this rank for ``level``.

    Every rank runs with ``threads`` intra-op threads (default 1): the benchmark's ranks
    already share a few cores, and the collectives themselves are single-threaded per rank
    in spyreccl and gloo alike; more threads would only add contention to the measurement.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if level == "gloo":
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
        return TorchEnv(torch, dist, torch.device("cpu"), _no_sync)
    if level == "spyreccl":
        spyre = getattr(torch, "spyre", None)
        if spyre is None or not spyre.is_available():
            raise RuntimeError(
                "level 'spyreccl' needs the spyre device: torch.spyre is missing or reports "
                "no device (is spyreccl-torch installed and autoloaded at `import torch`?)"
            )
        index = rank % spyre.device_count()
        spyre.set_device(index)
        dist.init_process_group(
            "spyre:spyreccl",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        return TorchEnv(torch, dist, torch.device("spyre", index), spyre.synchronize)
    raise ValueError(f"unknown torch level {level!r}; expected one of {LEVELS}")
