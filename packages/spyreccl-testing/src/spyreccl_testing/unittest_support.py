"""A unittest base class in the spirit of torch's MultiProcessTestCase, backed by a RankPool.

Unlike MultiProcessTestCase, the ranks are not re-spawned per test method: one pool serves the
whole class. Test methods run in the test process and dispatch module-level functions to the
ranks with `self.run_ranks(fn, ...)`.

    class AllReduceTest(RankPoolTestCase):
        world_size = 3
        backend = "cpu:gloo,spyre:spyreccl"

        def test_sum(self):
            results = self.run_ranks(all_reduce_case, 1024)
"""

from __future__ import annotations

import unittest
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from spyreccl_testing import _procutil
from spyreccl_testing.pool import RankPool


class RankPoolTestCase(unittest.TestCase):
    world_size: ClassVar[int] = 2
    backend: ClassVar[str | None] = None
    distributed: ClassVar[bool] = True
    set_device: ClassVar[bool] = False
    pool_env: ClassVar[Mapping[str, str]] = {}
    check_shm: ClassVar[bool] = True

    pool: ClassVar[RankPool]
    _shm_baseline: ClassVar[set[str]]

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls._shm_baseline = _procutil.list_spyreccl_shm()
        cls.pool = RankPool(
            cls.world_size,
            backend=cls.backend,
            distributed=cls.distributed,
            set_device=cls.set_device,
            env=dict(cls.pool_env),
        )

    @classmethod
    def tearDownClass(cls) -> None:
        try:
            cls.pool.close()
            if cls.check_shm:
                leaked = _procutil.new_shm_leftovers(cls._shm_baseline)
                if leaked:
                    raise AssertionError(
                        f"{cls.__name__}: spyreccl segments left in /dev/shm: {sorted(leaked)}"
                    )
        finally:
            super().tearDownClass()

    def run_ranks(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any):
        """pool.run for this class's pool: per-rank results, RankError on any failure."""
        return self.pool.run(fn, *args, timeout=timeout, **kwargs)
