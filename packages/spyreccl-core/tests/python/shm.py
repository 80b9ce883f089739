"""Helpers to find spyreccl's POSIX shared-memory segments."""

from __future__ import annotations

import glob
import os
import time

SHM_GLOB = "/dev/shm/spyreccl-*"


def mapped_segments(pid: int | str = "self") -> set[str]:
    """Paths of the spyreccl segments that process `pid` maps (unlinked ones included)."""
    paths = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/spyreccl-"):
                paths.add(fields[5].split(" (deleted)")[0].strip())
    return paths


def entries() -> set[str]:
    return set(glob.glob(SHM_GLOB))


def assert_no_leftovers(before: set[str], ours: set[str], settle_s: float = 3.0) -> None:
    """`ours` (segments our processes used) must all be gone; entries that appeared since
    `before` must vanish within `settle_s` (other test runs may create short-lived ones)."""
    still = sorted(p for p in ours if os.path.exists(p))
    assert not still, f"segments left in /dev/shm: {still}"
    deadline = time.monotonic() + settle_s
    while True:
        new = entries() - before
        if not new:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"new spyreccl segments left in /dev/shm: {sorted(new)}")
        time.sleep(0.05)
