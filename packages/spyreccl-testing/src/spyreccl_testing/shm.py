"""Finding spyreccl's POSIX shared-memory segments: who maps them, and whether any was left
behind (torch-free)."""

from __future__ import annotations

import os
import time

from spyreccl_testing._procutil import SHM_DIR, SHM_PREFIX, list_spyreccl_shm, new_shm_leftovers

__all__ = [
    "assert_no_leftovers",
    "list_spyreccl_shm",
    "mapped_segments",
    "new_shm_leftovers",
    "spyreccl_segments",
]


def spyreccl_segments() -> set[str]:
    """Full paths of the spyreccl segments currently in /dev/shm."""
    return {str(SHM_DIR / name) for name in list_spyreccl_shm()}


def mapped_segments(pid: int | str = "self") -> set[str]:
    """Paths of the spyreccl segments process `pid` maps (unlinked ones included), read from
    /proc/<pid>/maps."""
    prefix = f"{SHM_DIR}/{SHM_PREFIX}"
    paths = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix):
                paths.add(fields[5].split(" (deleted)")[0].strip())
    return paths


def assert_no_leftovers(before: set[str], ours: set[str], settle_s: float = 3.0) -> None:
    """Every path of `ours` (segments our processes used) must be gone, and the segments that
    appeared since `before` (a spyreccl_segments() snapshot) must vanish within `settle_s`:
    other jobs on the machine may be creating short-lived ones right now."""
    still = sorted(p for p in ours if os.path.exists(p))
    if still:
        raise AssertionError(f"segments left in /dev/shm: {still}")
    deadline = time.monotonic() + settle_s
    while True:
        new = spyreccl_segments() - before
        if not new:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"new spyreccl segments left in /dev/shm: {sorted(new)}")
        time.sleep(0.05)
