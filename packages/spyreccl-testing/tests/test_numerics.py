"""spyreccl_testing.numerics (torch-free) and the plugin features built for torch-free suites:
task_wrapper, shared pools, rank_pool_defaults, the seeded fixture.

Nothing here imports torch: these tests also run where torch is not installed."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from spyreccl_testing import FunctionRef, RankError, RankPool, numerics

PLUGIN = ("-p", "spyreccl_testing.plugin")
INT_FORMATS = [f for f in numerics.FORMATS.values() if f.is_int]
FLOAT_FORMATS = [f for f in numerics.FORMATS.values() if f.is_float]


def _exact_truncated_average(columns: np.ndarray) -> list[int]:
    """Independent model: Python integers, C division."""
    n = columns.shape[0]
    out = []
    for column in columns.T:
        total = sum(int(v) for v in column)
        out.append((abs(total) // n) * (1 if total >= 0 else -1))
    return out


@pytest.mark.parametrize("fmt", INT_FORMATS, ids=str)
@pytest.mark.parametrize("nranks", [1, 2, 3, 7])
def test_int_average_is_exact_and_truncates_toward_zero(fmt, nranks, seeded):
    rng = seeded.rng()
    stack = numerics.random_full_range(fmt, (nranks, 4001), rng)
    lo, hi = numerics.int_limits(fmt)
    # The extremes, where a float64 or a 64-bit sum would round or overflow.
    stack[:, :4] = np.array([lo, hi, lo + 1, hi - 1], dtype=object).astype(fmt.storage)
    got = numerics.int_average(stack)
    assert got.dtype == fmt.storage
    assert [int(v) for v in got] == _exact_truncated_average(stack)


def test_int_average_of_negative_sums_truncates_not_floors():
    stack = np.array([[-7], [0], [0]], dtype=np.int64)
    assert numerics.int_average(stack).tolist() == [-2]  # floor would give -3


@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=str)
def test_encode_rounds_to_nearest_even_and_decode_inverts_it(fmt):
    one_ulp = fmt.eps  # spacing just above 1.0
    values = np.array([0.0, -0.0, 1.0, 1.0 + one_ulp / 2, 1.0 + 1.5 * one_ulp, -2.5, 0.375])
    decoded = fmt.decode(fmt.encode(values))
    # Ties go to the even neighbour: 1 + ulp/2 -> 1, 1 + 1.5 ulp -> 1 + 2 ulp.
    assert decoded.tolist() == [0.0, -0.0, 1.0, 1.0, 1.0 + 2 * one_ulp, -2.5, 0.375]
    assert math.isnan(fmt.decode(fmt.encode(np.array([math.nan])))[0])
    assert np.signbit(decoded[1])


def test_float8_overflow_follows_torch():
    e4m3 = numerics.numeric_format("float8_e4m3fn")
    e5m2 = numerics.numeric_format("float8_e5m2")
    assert e4m3.max_finite == 448.0 and e5m2.max_finite == 57344.0
    # e4m3fn has no inf: torch saturates; e5m2 rounds to inf from half a spacing above max.
    assert e4m3.decode(e4m3.encode(np.array([480.0, 1e6]))).tolist() == [448.0, 448.0]
    assert e5m2.decode(e5m2.encode(np.array([61439.0, 61440.0, 1e6]))).tolist() == [
        57344.0,
        math.inf,
        math.inf,
    ]


@pytest.mark.parametrize("fmt", numerics.FORMATS.values(), ids=str)
def test_poison_is_detected_and_valid_values_are_not(fmt, seeded):
    buf = numerics.poisoned(fmt, 9)
    assert numerics.poisoned_mask(fmt, buf).all()
    values = numerics.random_values(fmt, 9, seeded.rng(), nranks=3)
    assert values.dtype == fmt.storage
    assert not numerics.poisoned_mask(fmt, values).any()


def test_low_precision_tolerance_has_an_absolute_term_for_cancellation():
    bf16 = numerics.numeric_format("bfloat16")
    exact_zero = np.zeros(1)
    residue = bf16.encode(np.array([3 * 2.0**-24]))  # float32 accumulation leftovers
    numerics.assert_close(residue, exact_zero, bf16, world_size=2)
    with pytest.raises(AssertionError, match=r"\(2 ulp\)"):
        numerics.assert_close(residue, exact_zero, bf16, world_size=2, atol=0)
    # At magnitude 1 the absolute term is negligible: 3 ulps still fail.
    three_ulps = bf16.encode(np.array([1.0 + 3 * bf16.eps]))
    with pytest.raises(AssertionError, match="2 ulp"):
        numerics.assert_close(three_ulps, np.ones(1), bf16, world_size=2)


def test_reference_accepts_spyreccl_style_enum_ops():
    class ReduceOp:  # stands in for spyreccl_core.ReduceOp (an enum with names)
        name = "MAX"

    fmt = numerics.numeric_format("int16")
    xs = [np.array([1, -5], dtype=np.int16), np.array([-2, 7], dtype=np.int16)]
    assert numerics.reduce_reference(xs, ReduceOp(), fmt).tolist() == [1, 7]
    with pytest.raises(ValueError, match="PREMUL_SUM is not defined for integer types"):
        numerics.reduce_reference(xs, numerics.premul_sum(2.0), fmt)


# --- task_wrapper and FunctionRef ---------------------------------------------------------

_resource = None


def counting_wrapper(task, args, kwargs, ctx):
    """A per-rank resource formed at the first task of each pool start."""
    global _resource
    if _resource is None:
        _resource = {"pid": os.getpid(), "tasks": 0, "generation": ctx.generation}
    _resource["tasks"] += 1
    return task(_resource, *args, **kwargs)


def read_resource(resource, tag):
    return resource["pid"], resource["tasks"], resource["generation"], tag


def fail_on_rank(resource, rank, ctx):
    if ctx.rank == rank:
        raise ValueError(f"rank {rank} fails on purpose")
    return resource["tasks"]


def call_ref(ref, value):
    return ref.resolve()(value)


def double(value):
    return 2 * value


def test_task_wrapper_hands_each_task_a_per_rank_resource(make_pool):
    pool = make_pool(2, distributed=False, task_wrapper=counting_wrapper)
    first = pool.run(read_resource, "a")
    second = pool.run(read_resource, tag="b")
    for rank in range(2):
        assert first[rank][1:] == (1, 1, "a")
        assert second[rank][1:] == (2, 1, "b")
        assert first[rank][0] == second[rank][0]  # the same worker process
    with pytest.raises(RankError, match="fails on purpose"):
        pool.run(fail_on_rank, 1)
    # Restarted: a new worker forms a new resource.
    assert [r[1:] for r in pool.run(read_resource, "c")] == [(1, 2, "c")] * 2


def test_a_wrapper_the_workers_cannot_import_is_rejected_up_front():
    with pytest.raises(TypeError, match="lambda"):
        RankPool(2, distributed=False, task_wrapper=lambda *a: None)


def test_function_refs_travel_as_task_arguments(make_pool):
    pool = make_pool(2, distributed=False)
    assert pool.run(call_ref, FunctionRef.from_callable(double), 21) == [42, 42]


def test_torch_free_pools_fork_unless_torch_is_loaded():
    import sys

    pool = RankPool(2, distributed=False)
    expected = "spawn" if "torch" in sys.modules else "fork"
    assert pool._start_method() == expected
    assert RankPool(2)._start_method() == "spawn"
    with pytest.raises(ValueError, match="start_method='fork' needs distributed=False"):
        RankPool(2, start_method="fork")
    with pytest.raises(ValueError, match="device_id=True needs distributed=True"):
        RankPool(2, distributed=False, device_id=True)


# --- plugin: shared pools, rank_pool_defaults, seeded ----------------------------------------


def test_shared_pools_start_once_per_world_size_across_modules(pytester: pytest.Pytester):
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture(scope="session")
        def rank_pool_defaults():
            return {"distributed": False, "shared": True}
        """
    )
    body = """
        import os

        def worker_pid():
            return os.getpid()

        def test_pids(rank_pool):
            print("PIDS", rank_pool.world_size, rank_pool.run(worker_pid))
        """
    pytester.makepyfile(test_one=body, test_two=body)
    result = pytester.runpytest_subprocess(*PLUGIN, "-s", "-q")
    result.assert_outcomes(passed=4)
    lines = [line[line.index("PIDS") :] for line in result.stdout.lines if "PIDS" in line]
    by_size: dict[str, set[str]] = {}
    for line in lines:
        _, size, pids = line.split(" ", 2)
        by_size.setdefault(size, set()).add(pids)
    # Both modules saw the same workers for each world size.
    assert {k: len(v) for k, v in by_size.items()} == {"2": 1, "3": 1}


def test_module_marker_overrides_the_defaults_and_opts_out_of_sharing(pytester):
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture(scope="session")
        def rank_pool_defaults():
            return {"distributed": False, "shared": True, "env": {"FLAVOUR": "default"}}
        """
    )
    pytester.makepyfile(
        test_inner="""
        import os
        import pytest

        pytestmark = pytest.mark.rank_pool_options(shared=False, env={"FLAVOUR": "module"})

        def flavour():
            return os.environ["FLAVOUR"]

        @pytest.mark.world_sizes(2)
        def test_flavour(rank_pool):
            assert rank_pool.run(flavour) == ["module", "module"]
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "-q")
    result.assert_outcomes(passed=1)


def test_seeded_reports_the_seed_of_a_failing_test(pytester):
    pytester.makepyfile(
        test_inner="""
        def test_fails(seeded):
            assert seeded.rng(1).random() != seeded.rng(1).random()
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "-q")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*spyreccl random seed*", "SPYRECCL_TEST_SEED=*"])


def test_seeded_honours_a_pinned_seed(seeded, monkeypatch):
    from spyreccl_testing.seeds import fresh_seed

    monkeypatch.setenv("SPYRECCL_TEST_SEED", "12345")
    assert fresh_seed() == 12345
    assert 0 <= seeded.seed < 1 << 63
