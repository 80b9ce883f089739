"""Test utilities shared by the spyreccl packages.

- `RankPool` (+ the `rank_pool` / `make_pool` / `seeded` pytest fixtures): persistent
  multi-rank workers, torch.distributed or torch-free.
- `spyreccl_testing.numerics` (numpy only): number formats and codecs (bfloat16, float8),
  random inputs, poisoning, float64 / exact reduction references and dtype-aware tolerances.
- `spyreccl_testing.inputs` / `spyreccl_testing.accuracy`: the same for torch tensors, plus
  gloo cross-checks.
- `spyreccl_testing.shm`: spyreccl's /dev/shm segments (mapped, left behind).
- `spyreccl_testing.scripts`: ranks as whole Python processes run to their real exit (for
  tests of exit behaviour, which pools and forked groups skip).

Only torch-free modules are imported here: `inputs` and `accuracy` import torch, which
torch-free users of the plugin (spyreccl-core's tests) must not pay for.
"""

from spyreccl_testing._tasks import FunctionRef
from spyreccl_testing.context import RankContext
from spyreccl_testing.pool import RankError, RankFailure, RankPool
from spyreccl_testing.unittest_support import RankPoolTestCase

__all__ = ["FunctionRef", "RankContext", "RankError", "RankFailure", "RankPool", "RankPoolTestCase"]
__version__ = "0.1.0"
