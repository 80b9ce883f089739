"""Fixtures of the spyreccl_core binding tests (numpy only, never torch)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # dtypes.py, rank_pool.py

from rank_pool import RankPool

# Small staging areas so that modest arrays already exercise the chunked pipelines.
STAGING_BYTES = 16384


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def pool(request):
    """World sizes 2 and 3, started once per test module."""
    ranks = RankPool(request.param, chunk_bytes=STAGING_BYTES, p2p_chunk_bytes=STAGING_BYTES)
    yield ranks
    ranks.close()


class Seeded:
    """A fresh seed per test, drawn from os.urandom and reported when the test fails."""

    def __init__(self) -> None:
        self.seed = int.from_bytes(os.urandom(8), "little")

    def rng(self, *stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *stream])


@pytest.fixture
def seeded(request):
    seeded = Seeded()
    request.node.spyreccl_seed = seeded.seed
    return seeded


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = getattr(item, "spyreccl_seed", None)
    if report.failed and seed is not None:
        # Shown with the failure: rerun the inputs with Seeded.seed = this value.
        report.sections.append(("spyreccl random seed", str(seed)))
    return report
