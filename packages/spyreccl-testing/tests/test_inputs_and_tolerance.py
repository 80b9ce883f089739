"""Random inputs, poisoning, ulp arithmetic and assert_close_dtype's verdicts and messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spyreccl_testing import RankPool
from spyreccl_testing.accuracy import assert_close_dtype, compare_with_gloo, ulp
from spyreccl_testing.inputs import (
    POISON_BYTE,
    fresh_seed,
    int_value_bound,
    poison_,
    poison_value,
    poisoned_mask,
    random_tensor,
    rank_seed,
)

ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]

# --- inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_random_tensor_is_reproducible_and_fresh(dtype):
    seed = fresh_seed()
    a = random_tensor((17, 3), dtype, seed=seed)
    b = random_tensor((17, 3), dtype, seed=seed)
    assert a.dtype == dtype and a.shape == (17, 3)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"seed={seed}"
    c = random_tensor((4096,), dtype, seed=rank_seed(seed, 1))
    d = random_tensor((4096,), dtype, seed=rank_seed(seed, 2))
    assert not torch.equal(c.view(torch.uint8), d.view(torch.uint8)), f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("nranks", [1, 2, 3, 8])
def test_integer_inputs_cannot_overflow_sum_or_prod(dtype, nranks):
    lo, hi = int_value_bound(dtype, nranks)
    limit = (1 << (dtype.itemsize * 8 - (0 if dtype == torch.uint8 else 1))) - 1
    bound = max(abs(lo), hi)
    assert bound >= 1
    assert bound**nranks <= limit and bound * nranks <= limit
    values = random_tensor(10_000, dtype, nranks=nranks)
    assert int(values.min()) >= lo and int(values.max()) <= hi
    if dtype != torch.uint8:
        assert int(values.min()) < 0, "signed inputs must include negatives (integer AVG)"


def test_float_inputs_are_in_unit_range_and_exactly_representable():
    for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        values = random_tensor(5000, dtype).to(torch.float64)
        assert values.abs().max() <= 1.0
        assert values.unique().numel() > 10


def test_random_tensor_edge_shapes():
    assert random_tensor(0, torch.float32).shape == (0,)
    assert random_tensor((), torch.int32).shape == ()
    assert random_tensor(torch.Size([2, 0, 5]), torch.bool).shape == (2, 0, 5)


def test_seeds(monkeypatch):
    assert fresh_seed() != fresh_seed()
    monkeypatch.setenv("SPYRECCL_TEST_SEED", "0x2a")
    assert fresh_seed() == 42
    monkeypatch.setenv("SPYRECCL_TEST_SEED", "banana")
    with pytest.raises(ValueError, match="SPYRECCL_TEST_SEED"):
        fresh_seed()
    seeds = {rank_seed(123, r) for r in range(64)}
    assert len(seeds) == 64


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_poison_marks_every_element(dtype):
    x = random_tensor((5, 7), dtype)
    assert not poisoned_mask(x).any()
    poison_(x)
    assert poisoned_mask(x).all()
    if dtype.is_floating_point:
        assert torch.isnan(x.to(torch.float32)).all()
    elif dtype != torch.bool:
        assert (x.to(torch.int64) == poison_value(dtype)).all()
    else:
        assert (x.view(torch.uint8) == POISON_BYTE).all()


def test_poison_handles_empty_and_rejects_non_contiguous():
    poison_(torch.empty(0, dtype=torch.int32))
    poison_(torch.tensor(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        poison_(torch.zeros(4, 4, dtype=torch.int32).t())
    assert poison_value(torch.int16) == -0x5A5B
    assert poison_value(torch.uint8) == 0xA5


# --- ulp and tolerances ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "value", "expected"),
    [
        (torch.float16, 1.0, 2.0**-10),
        (torch.float16, 1.5, 2.0**-10),
        (torch.float16, 2.0, 2.0**-9),
        (torch.float16, 0.0, 2.0**-24),
        (torch.float16, 2.0**-20, 2.0**-24),  # subnormal range
        (torch.bfloat16, 1.0, 2.0**-7),
        (torch.bfloat16, -3.0, 2.0**-6),
        (torch.float8_e4m3fn, 1.0, 2.0**-3),
        (torch.float8_e4m3fn, 2.0**-8, 2.0**-9),
        (torch.float8_e5m2, 1.0, 2.0**-2),
        (torch.float32, 1.0, 2.0**-23),
    ],
)
def test_ulp(dtype, value, expected):
    assert ulp(np.array([value]), dtype)[0] == expected


def test_exact_types_reject_any_difference_and_report_the_seed():
    expected = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert_close_dtype(expected.clone(), expected, torch.int32, 3)
    actual = torch.tensor([1, 2, 4], dtype=torch.int32)
    with pytest.raises(AssertionError, match=r"seed=77\): 1 of 3 elements") as info:
        assert_close_dtype(actual, expected, torch.int32, 3, seed=77)
    assert "at (2,): actual=4, expected=3" in str(info.value)


def test_float32_tolerance_scales_with_world_size():
    expected = torch.ones(4, dtype=torch.float32)
    close = expected + 3e-5
    assert_close_dtype(close, expected, torch.float32, world_size=4)
    with pytest.raises(AssertionError, match="rtol"):
        assert_close_dtype(close, expected, torch.float32, world_size=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_low_precision_floats_allow_two_ulps_not_three(dtype):
    expected = torch.tensor([1.0], dtype=dtype)
    step = ulp(np.array([1.0]), dtype)[0]
    assert_close_dtype(torch.tensor([1.0 + 2 * step], dtype=dtype), expected, dtype, 8)
    with pytest.raises(AssertionError, match="ulp"):
        assert_close_dtype(torch.tensor([1.0 + 3 * step], dtype=dtype), expected, dtype, 8)


def test_poisoned_elements_are_called_out():
    expected = torch.zeros(6, dtype=torch.float32)
    actual = expected.clone()
    poison_(actual[2:4])
    with pytest.raises(AssertionError, match="2 of them still hold the poison"):
        assert_close_dtype(actual, expected, torch.float32, 2)
    ints = poison_(torch.empty(3, dtype=torch.int64))
    with pytest.raises(AssertionError, match="3 of them still hold the poison"):
        assert_close_dtype(ints, torch.zeros(3, dtype=torch.int64), torch.int64, 2)


def test_bool_garbage_bytes_fail_even_if_truthy():
    expected = torch.ones(3, dtype=torch.bool)
    actual = poison_(torch.empty(3, dtype=torch.bool))
    with pytest.raises(AssertionError, match="poison"):
        assert_close_dtype(actual, expected, torch.bool, 2)


def test_nan_matches_nan_and_inf_matches_inf():
    values = torch.tensor([float("nan"), float("inf"), -float("inf")])
    assert_close_dtype(values.clone(), values, torch.float32, 2)
    with pytest.raises(AssertionError):
        assert_close_dtype(values.flip(0), values, torch.float32, 2)


def test_dtype_and_shape_mismatches_fail():
    with pytest.raises(AssertionError, match=r"has dtype torch\.float32, expected torch\.float16"):
        assert_close_dtype(torch.zeros(2), torch.zeros(2), torch.float16)
    with pytest.raises(AssertionError, match=r"has shape \(2,\), expected \(3,\)"):
        assert_close_dtype(torch.zeros(2), torch.zeros(3))
    assert_close_dtype(torch.zeros(0, 4), torch.zeros(0, 4))


# --- compare_with_gloo -------------------------------------------------------------------------


def summed(seed: int, n: int, dtype_name: str, device: str, ctx):
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    x = random_tensor(n, dtype, seed=rank_seed(seed, ctx.rank)).to("cpu")
    dist.all_reduce(x)
    if device == "cpu:0" and ctx.rank == 1:
        x[0] += 1  # a deliberately wrong "device" result
    return {"out": x, "rank": ctx.rank}


def test_compare_with_gloo_accepts_agreement_and_reports_disagreement(make_pool):
    pool = make_pool(2, backend="gloo")
    seed = fresh_seed()
    tested, _ = compare_with_gloo(pool, summed, seed, 33, "float16", device="cpu", seed=seed)
    assert [r["rank"] for r in tested] == [0, 1]
    with pytest.raises(AssertionError, match=r"rank 1 result of summed.*\['out'\]"):
        compare_with_gloo(pool, summed, seed, 33, "int32", device="cpu:0", seed=seed)


def test_compare_with_gloo_needs_a_gloo_backend():
    with pytest.raises(ValueError, match="cpu:gloo"):
        compare_with_gloo(RankPool(2, backend=None), summed, 0, 1, "float32")
