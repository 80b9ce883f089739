"""reference_reduce against hand-computed values and an independent Python-int model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from spyreccl_testing.accuracy import normalize_op, premul_sum, reference_reduce


def t(values, dtype):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("sum", [4.5, -1.0, 6.0]),
        ("prod", [4.5, -0.0, 8.0]),
        ("max", [3.0, 0.0, 4.0]),
        ("min", [1.5, -1.0, 2.0]),
        ("avg", [2.25, -0.5, 3.0]),
        (premul_sum(0.5), [2.25, -0.5, 3.0]),
    ],
)
def test_float32_ops_on_two_ranks(op, expected):
    inputs = [t([1.5, -1.0, 2.0], torch.float32), t([3.0, 0.0, 4.0], torch.float32)]
    out = reference_reduce(inputs, op)
    assert out.dtype == torch.float32
    assert out.tolist() == expected


def test_torch_reduce_ops_are_accepted():
    inputs = [t([1, 2], torch.int32), t([5, -7], torch.int32), t([2, 2], torch.int32)]
    assert reference_reduce(inputs, dist.ReduceOp.SUM).tolist() == [8, -3]
    assert reference_reduce(inputs, dist.ReduceOp.PRODUCT).tolist() == [10, -28]
    assert reference_reduce(inputs, dist.ReduceOp.MAX).tolist() == [5, 2]
    assert normalize_op(dist.ReduceOp.BXOR) == ("bxor", None)


def test_integer_avg_truncates_toward_zero():
    # -7/2 = -3.5 -> -3 (not floor's -4); 7/3 -> 2; -1/3 -> 0
    inputs = [t([-3, 7, -1], torch.int64), t([-4, 0, 0], torch.int64)]
    assert reference_reduce(inputs, "avg").tolist() == [-3, 3, 0]
    three = [t([7, -1], torch.int8), t([0, 0], torch.int8), t([0, 0], torch.int8)]
    assert reference_reduce(three, "avg").tolist() == [2, 0]


def test_integer_avg_uses_the_exact_sum_for_64_bit_types():
    big = (1 << 63) - 1
    assert reference_reduce([t([big], torch.int64)] * 3, "avg").tolist() == [big]
    top = (1 << 64) - 1
    # torch.tensor cannot take Python ints above 2**63: go through numpy.
    a = torch.from_numpy(np.array([top, 1], dtype=np.uint64))
    b = torch.from_numpy(np.array([top - 2, 2], dtype=np.uint64))
    out = reference_reduce([a, b], "avg")
    assert out.dtype == torch.uint64
    assert [int(v) for v in out.numpy()] == [top - 1, 1]


def test_integer_sum_and_prod_wrap_like_twos_complement():
    assert reference_reduce([t([100], torch.int8), t([100], torch.int8)], "sum").tolist() == [-56]
    assert reference_reduce([t([16], torch.int8), t([16], torch.int8)], "prod").tolist() == [0]
    assert reference_reduce([t([200], torch.uint8), t([100], torch.uint8)], "sum").tolist() == [44]


def test_bitwise_ops_on_integers():
    a, b, c = t([0b1100], torch.int16), t([0b1010], torch.int16), t([0b0110], torch.int16)
    assert reference_reduce([a, b, c], "band").tolist() == [0b0000]
    assert reference_reduce([a, b, c], "bor").tolist() == [0b1110]
    assert reference_reduce([a, b, c], "bxor").tolist() == [0b0000]
    assert reference_reduce([a, b], "bxor").tolist() == [0b0110]


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("sum", [False, True, True, True]),
        ("max", [False, True, True, True]),
        ("bor", [False, True, True, True]),
        ("prod", [False, False, False, True]),
        ("min", [False, False, False, True]),
        ("band", [False, False, False, True]),
        ("bxor", [False, True, True, False]),
    ],
)
def test_bool_ops_are_logical(op, expected):
    a = t([False, False, True, True], torch.bool)
    b = t([False, True, False, True], torch.bool)
    out = reference_reduce([a, b], op)
    assert out.dtype == torch.bool
    assert out.tolist() == expected


def test_low_precision_result_is_rounded_once_to_nearest_even():
    # 1 + 2**-8 lies exactly half-way between bfloat16 neighbours 1 and 1 + 2**-7: ties to even.
    one = t([1.0, 1.0], torch.bfloat16)
    tiny = t([2.0**-8, 3 * 2.0**-8], torch.bfloat16)
    out = reference_reduce([one, tiny], "sum")
    assert out.dtype == torch.bfloat16
    assert out.tolist() == [1.0, 1.0 + 2.0**-6]


def test_float8_premul_sum():
    inputs = [t([1.0, 2.0], torch.float8_e4m3fn), t([3.0, -4.0], torch.float8_e4m3fn)]
    out = reference_reduce(inputs, premul_sum(0.25))
    assert out.dtype == torch.float8_e4m3fn
    assert out.float().tolist() == [1.0, -0.5]


def test_empty_and_odd_shaped_inputs():
    empty = [torch.empty(0, 3, dtype=torch.float16)] * 3
    assert reference_reduce(empty, "max").shape == (0, 3)
    assert reference_reduce([torch.empty(0, dtype=torch.int32)] * 2, "min").shape == (0,)
    odd = [torch.arange(7 * 3, dtype=torch.int32).reshape(7, 3) for _ in range(3)]
    assert torch.equal(reference_reduce(odd, "sum"), odd[0] * 3)


def test_scalar_tensors():
    out = reference_reduce([torch.tensor(2.0), torch.tensor(3.0)], "prod")
    assert out.shape == () and out.item() == 6.0


@pytest.mark.parametrize(
    ("inputs", "op", "match"),
    [
        ([t([True], torch.bool)], "avg", "AVG is not defined for bool"),
        ([t([1.0], torch.float32)], "band", "BAND is not defined for floating"),
        ([t([1], torch.int32)], premul_sum(2.0), "PREMUL_SUM is not defined for integer"),
        ([t([1.0], torch.float32)], dist.ReduceOp.PREMUL_SUM, "needs its factor"),
        ([t([1.0], torch.float32)], "median", "unknown reduction op"),
        ([t([1.0], torch.float32), t([1.0, 2.0], torch.float32)], "sum", "rank 1 has shape"),
        ([], "sum", "at least one"),
    ],
)
def test_invalid_requests_are_rejected_with_a_clear_message(inputs, op, match):
    with pytest.raises(ValueError, match=match):
        reference_reduce(inputs, op)


_INT_TYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(_INT_TYPES),
    op=st.sampled_from(["sum", "prod", "max", "min", "avg", "band", "bor", "bxor"]),
    data=st.data(),
)
def test_integer_ops_match_a_python_int_model(dtype, op, data):
    bits = dtype.itemsize * 8
    lo, hi = (
        (0, (1 << bits) - 1)
        if dtype == torch.uint8
        else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    )
    nranks = data.draw(st.integers(1, 4))
    columns = data.draw(
        st.lists(st.lists(st.integers(lo, hi), min_size=nranks, max_size=nranks), max_size=6)
    )
    inputs = [t([col[r] for col in columns], dtype) for r in range(nranks)]
    out = reference_reduce(inputs, op).tolist()

    def wrap(v: int) -> int:
        v &= (1 << bits) - 1
        return v - (1 << bits) if lo < 0 and v > hi else v

    for col, got in zip(columns, out):
        if op == "sum":
            want = wrap(sum(col))
        elif op == "prod":
            p = 1
            for v in col:
                p *= v
            want = wrap(p)
        elif op == "max":
            want = max(col)
        elif op == "min":
            want = min(col)
        elif op == "avg":
            s = sum(col)
            want = abs(s) // nranks * (1 if s >= 0 else -1)
        else:
            want = col[0]
            for v in col[1:]:
                want = {"band": want & v, "bor": want | v, "bxor": want ^ v}[op]
        assert got == want, (dtype, op, col)
