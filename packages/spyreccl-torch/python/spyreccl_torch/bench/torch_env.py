"""Setting up torch.distributed for the torch levels inside a rank process.

``spyreccl``: the default process group on our backend (``spyreccl``, or ``spyreccl_shm`` beside
a vendor backend that holds that name) with ``spyre`` tensors.
``gloo``: the default process group on gloo with CPU tensors (the baseline).
Both at once (:func:`init_levels`): one default group ``spyre:spyreccl,cpu:gloo``; c10d picks
the backend from each tensor's device, so the same process measures both, case by case.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

__all__ = ["LEVELS", "TorchEnv", "init_level", "init_levels", "torch_dtype"]

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
    return init_levels(
        (level,),
        rank=rank,
        world_size=world_size,
        init_method=init_method,
        timeout=timeout,
        threads=threads,
    )[level]


def _spyre_index(torch: Any, rank: int) -> int:
    spyre = getattr(torch, "spyre", None)
    if spyre is None or not spyre.is_available():
        raise RuntimeError(
            "level 'spyreccl' needs the spyre device: torch.spyre is missing or reports "
            "no device (is spyreccl-torch installed and autoloaded at `import torch`?)"
        )
    index = rank % spyre.device_count()
    spyre.set_device(index)
    return index


def init_levels(
    levels: tuple[str, ...] | list[str],
    *,
    rank: int,
    world_size: int,
    init_method: str,
    timeout: datetime.timedelta,
    threads: int = 1,
) -> dict[str, TorchEnv]:
    """Initialises one default process group serving every level of ``levels``.

    Every rank runs with ``threads`` intra-op threads (default 1), as in :func:`init_level`.
    """
    import torch
    import torch.distributed as dist

    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or not levels:
        raise ValueError(f"unknown torch level(s) {list(levels)!r}; expected some of {LEVELS}")
    torch.set_num_threads(threads)
    if tuple(levels) == ("gloo",):
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
        return {"gloo": TorchEnv(torch, dist, torch.device("cpu"), _no_sync)}
    index = _spyre_index(torch, rank)
    # Ours by the name it holds here: beside torch-spyre, `spyreccl` is the vendor's backend.
    from spyreccl_torch import backend_name

    backend = f"spyre:{backend_name()}" + (",cpu:gloo" if "gloo" in levels else "")
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    envs = {
        "spyreccl": TorchEnv(torch, dist, torch.device("spyre", index), torch.spyre.synchronize)
    }
    if "gloo" in levels:
        envs["gloo"] = TorchEnv(torch, dist, torch.device("cpu"), _no_sync)
    return {lv: envs[lv] for lv in levels}
