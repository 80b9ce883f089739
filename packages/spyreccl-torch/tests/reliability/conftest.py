"""Fixtures of the reliability suite.

`launcher` is a one-rank, torch-free RankPool (spyreccl-testing) whose worker imports torch
once and then forks a fresh process group per scenario (spyreccl_testing.forked). It is session
scoped: every module of the suite shares the one torch import, which is what keeps the
whole directory within its time budget on a 2-core machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from process_hygiene import new_segments, shm_segments

from spyreccl_testing import RankPool


@pytest.fixture(scope="session")
def launcher() -> Iterator[RankPool]:
    before = shm_segments()
    # failure_grace is irrelevant with one rank; start_timeout covers a slow torch import
    # on a loaded machine (it happens lazily, at the first task).
    pool = RankPool(1, distributed=False, start_timeout=120.0, env={"OMP_NUM_THREADS": "1"})
    try:
        yield pool
    finally:
        pool.close()
    leaked = new_segments(before)
    if leaked:
        pytest.fail(f"spyreccl segments left in /dev/shm by the reliability suite: {leaked}")
