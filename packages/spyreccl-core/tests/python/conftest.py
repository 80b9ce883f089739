"""Fixtures of the spyreccl_core binding tests (numpy only, never torch).

Everything comes from spyreccl-testing's pytest plugin: `rank_pool` (world sizes 2 and 3),
`seeded` (fresh seed, reported on failure). This file only configures the pools for the whole
directory: torch-free workers, each task called as fn(comm, *args) with its rank's
Communicator (core_support.with_communicator), and one pool per world size for the session
(every module leaves the communicator as it found it; a failing case restarts the pool).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # core_support.py, for the tests and the ranks

from core_support import with_communicator


@pytest.fixture(scope="session")
def rank_pool_defaults():
    return {"distributed": False, "task_wrapper": with_communicator, "shared": True}
