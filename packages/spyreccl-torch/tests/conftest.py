"""Fixtures shared by spyreccl-torch's test modules."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A numpy generator with a fresh seed, printed so that a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"{request.node.name}: numpy seed {seed}")
    return np.random.default_rng(seed)
