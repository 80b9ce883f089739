"""Test utilities shared by the spyreccl packages.

- `RankPool` (+ the `rank_pool` / `make_pool` pytest fixtures): persistent multi-rank workers.
- `spyreccl_testing.inputs`: seeded random tensors per dtype, output poisoning.
- `spyreccl_testing.accuracy`: float64 reference reductions, dtype-aware tolerances, gloo
  cross-checks.

Only the pool lives at the top level: `inputs` and `accuracy` import torch, which torch-free
users of the plugin (spyreccl-core's tests) must not pay for.
"""

from spyreccl_testing.context import RankContext
from spyreccl_testing.pool import RankError, RankFailure, RankPool
from spyreccl_testing.unittest_support import RankPoolTestCase

__all__ = ["RankContext", "RankError", "RankFailure", "RankPool", "RankPoolTestCase"]
__version__ = "0.1.0"
