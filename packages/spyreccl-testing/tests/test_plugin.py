"""The pytest plugin seen from the outside: markers, parametrization, header, leak check."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from spyreccl_testing import _procutil

# The inner pytest runs in a subprocess (a spawned rank pool must not live inside pytester's
# in-process run) and loads the plugin explicitly, so it works from a source checkout too.
PLUGIN = ("-p", "spyreccl_testing.plugin")


def test_world_sizes_marker_and_default_parametrization(pytester: pytest.Pytester):
    pytester.makepyfile(
        test_inner="""
        import pytest

        def test_default(rank_pool):
            pass

        @pytest.mark.world_sizes(4)
        def test_marked(rank_pool):
            pass

        @pytest.mark.parametrize("rank_pool", [5], indirect=True)
        def test_indirect(rank_pool):
            pass

        def test_without_pool():
            pass
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "--collect-only", "-q", "--strict-markers")
    result.stdout.fnmatch_lines(
        [
            "test_inner.py::test_default[[]ws2[]]",
            "test_inner.py::test_default[[]ws3[]]",
            "test_inner.py::test_marked[[]ws4[]]",
            "test_inner.py::test_indirect[[]5[]]",
            "test_inner.py::test_without_pool",
        ]
    )
    assert result.ret == 0


def test_default_world_sizes_come_from_the_ini_option(pytester: pytest.Pytester):
    pytester.makeini("[pytest]\nspyreccl_world_sizes = 3 5\n")
    pytester.makepyfile(test_inner="def test_default(rank_pool):\n    pass\n")
    result = pytester.runpytest_subprocess(*PLUGIN, "--collect-only", "-q")
    result.stdout.fnmatch_lines(["*test_default[[]ws3[]]", "*test_default[[]ws5[]]"])


def test_markers_are_registered_for_strict_mode(pytester: pytest.Pytester):
    result = pytester.runpytest_subprocess(*PLUGIN, "--markers")
    result.stdout.fnmatch_lines(
        ["@pytest.mark.world_sizes(*sizes)*", "@pytest.mark.rank_pool_options*"]
    )


def test_report_header_names_versions_and_device(pytester: pytest.Pytester):
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess(*PLUGIN)
    result.stdout.fnmatch_lines(
        ["spyreccl: torch *, spyreccl-core *, spyreccl-torch *", "spyre device: *"]
    )
    result.assert_outcomes(passed=1)


def test_rank_pool_runs_module_functions_through_the_fixture(pytester: pytest.Pytester):
    pytester.makepyfile(
        test_inner="""
        import pytest
        pytestmark = pytest.mark.rank_pool_options(distributed=False)

        def square_rank(ctx):
            return ctx.rank ** 2

        @pytest.mark.world_sizes(3)
        def test_squares(rank_pool):
            assert rank_pool.run(square_rank) == [0, 1, 4]
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN)
    result.assert_outcomes(passed=1)


def test_leaked_shm_segment_fails_the_pool_teardown(pytester: pytest.Pytester):
    name = f"{_procutil.SHM_PREFIX}-leaktest-{uuid.uuid4().hex}"
    pytester.makepyfile(
        test_inner=f"""
        def test_leaks(make_pool):
            make_pool(2, distributed=False)
            open("/dev/shm/{name}", "w").close()
        """
    )
    try:
        result = pytester.runpytest_subprocess(*PLUGIN)
    finally:
        Path("/dev/shm", name).unlink(missing_ok=True)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([f"*segments were left in /dev/shm*{name}*"])


def test_unittest_base_class(pytester: pytest.Pytester):
    pytester.makepyfile(
        test_inner="""
        import os
        from spyreccl_testing import RankPoolTestCase

        def pid_and_rank(ctx):
            return os.getpid(), ctx.rank

        class PoolCase(RankPoolTestCase):
            world_size = 3
            distributed = False

            def test_ranks(self):
                results = self.run_ranks(pid_and_rank)
                self.assertEqual([r for _, r in results], [0, 1, 2])
                self.assertNotIn(os.getpid(), [p for p, _ in results])

            def test_same_pool(self):
                first = self.run_ranks(pid_and_rank)
                self.assertEqual(first, self.run_ranks(pid_and_rank))
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN)
    result.assert_outcomes(passed=2)


def test_shm_listing_sees_spyreccl_segments_only(tmp_path):
    name = f"{_procutil.SHM_PREFIX}-listtest-{os.getpid()}"
    path = Path("/dev/shm", name)
    baseline = _procutil.list_spyreccl_shm()
    path.touch()
    try:
        assert name in _procutil.list_spyreccl_shm()
        assert _procutil.new_shm_leftovers(baseline, settle_s=0.0) == {name}
    finally:
        path.unlink()
    assert _procutil.new_shm_leftovers(baseline, settle_s=0.0) == set()
