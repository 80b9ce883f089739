"""Independent references and dtype-aware comparisons for reduction collectives.

The references never use torch's or the backend's arithmetic: floating inputs are reduced in
float64 with numpy, integers exactly (int64 / uint64 with two's-complement wrap-around, Python
ints where an exact 64-bit sum is needed), bools with logic operations. Only the final result is
rounded back to the tested dtype, mirroring the backend contract (float32 accumulation and a
single rounding for 16/8-bit floats, see spyreccl.h).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from spyreccl_testing import _dtypes
from spyreccl_testing.inputs import poisoned_mask


@dataclass(frozen=True)
class PreMulSum:
    """PREMUL_SUM with its scalar: the result is sum over ranks of factor * x_r."""

    factor: float


def premul_sum(factor: float) -> PreMulSum:
    """The reference-side spelling of torch.distributed's PREMUL_SUM (whose ReduceOp object does
    not expose its factor)."""
    return PreMulSum(float(factor))


_OP_ALIASES = {
    "sum": "sum",
    "prod": "prod",
    "product": "prod",
    "max": "max",
    "min": "min",
    "avg": "avg",
    "band": "band",
    "bor": "bor",
    "bxor": "bxor",
}


def normalize_op(op: Any) -> tuple[str, float | None]:
    """(name, premul factor) for a string ("sum", "PRODUCT"...), a torch.distributed ReduceOp
    (e.g. dist.ReduceOp.SUM) or a PreMulSum."""
    if isinstance(op, PreMulSum):
        return "premul_sum", op.factor
    if isinstance(op, str):
        name = op.lower()
    elif hasattr(op, "name") and type(op).__name__ == "RedOpType":
        name = op.name.lower()
    else:
        raise ValueError(
            f"reference_reduce: unsupported op {op!r}; expected a name ('sum', 'prod', 'max', "
            "'min', 'avg', 'band', 'bor', 'bxor'), a torch.distributed.ReduceOp member, or "
            "spyreccl_testing.accuracy.premul_sum(factor)"
        )
    if name == "premul_sum":
        raise ValueError(
            "reference_reduce: PREMUL_SUM needs its factor; pass "
            "spyreccl_testing.accuracy.premul_sum(factor) instead of the bare op"
        )
    try:
        return _OP_ALIASES[name], None
    except KeyError:
        raise ValueError(f"reference_reduce: unknown reduction op {op!r}") from None


def _as_cpu_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu")
    return torch.as_tensor(np.asarray(x))


def reference_reduce(
    inputs: Sequence[Any], op: Any, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Element-wise reduction of the per-rank `inputs` (tensors or arrays of equal shape),
    computed independently of any backend and returned as a CPU tensor of `dtype`.

    Semantics follow spyreccl.h: integer SUM/PROD wrap around, integer AVG divides the exact sum
    and truncates toward zero, bool SUM/MAX are OR and PROD/MIN are AND, AVG on bool and
    bitwise ops on floats are rejected, PREMUL_SUM scales every input by its factor.
    """
    if len(inputs) == 0:
        raise ValueError("reference_reduce: expected at least one rank's input, got none")
    tensors = [_as_cpu_tensor(x) for x in inputs]
    dtype = dtype if dtype is not None else tensors[0].dtype
    _dtypes.check_supported(dtype, "reference_reduce")
    shape = tensors[0].shape
    for rank, t in enumerate(tensors):
        if t.shape != shape:
            raise ValueError(
                f"reference_reduce: input of rank {rank} has shape {tuple(t.shape)}, expected "
                f"{tuple(shape)} like rank 0"
            )
    name, factor = normalize_op(op)
    if _dtypes.is_float(dtype):
        result = _reduce_float(tensors, name, factor)
    elif _dtypes.is_bool(dtype):
        result = _reduce_bool(tensors, name)
    else:
        result = _reduce_int(tensors, name, dtype)
    return result.reshape(shape).to(dtype)


def _reduce_float(tensors: list[torch.Tensor], name: str, factor: float | None) -> torch.Tensor:
    stack = np.stack([t.to(torch.float64).numpy().reshape(-1) for t in tensors])
    n = len(tensors)
    if name == "sum":
        out = stack.sum(axis=0)
    elif name == "prod":
        out = stack.prod(axis=0)
    elif name == "max":
        out = stack.max(axis=0, initial=-np.inf)
    elif name == "min":
        out = stack.min(axis=0, initial=np.inf)
    elif name == "avg":
        out = stack.sum(axis=0) / n
    elif name == "premul_sum":
        out = (stack * factor).sum(axis=0)
    else:
        raise ValueError(f"reference_reduce: {name.upper()} is not defined for floating types")
    # `initial` makes the reductions defined for empty tensors; numpy's max/min still
    # propagate NaN inputs, as torch does.
    return torch.from_numpy(np.ascontiguousarray(out))


def _reduce_bool(tensors: list[torch.Tensor], name: str) -> torch.Tensor:
    stack = np.stack([t.numpy().astype(np.bool_).reshape(-1) for t in tensors])
    if name in ("sum", "max", "bor"):
        out = stack.any(axis=0)
    elif name in ("prod", "min", "band"):
        out = stack.all(axis=0)
    elif name == "bxor":
        out = np.logical_xor.reduce(stack, axis=0)
    else:
        raise ValueError(f"reference_reduce: {name.upper()} is not defined for bool")
    return torch.from_numpy(np.ascontiguousarray(out))


def _reduce_int(tensors: list[torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    native = np.stack([t.to(dtype).numpy().reshape(-1) for t in tensors])
    n = len(tensors)
    # Wrap-around arithmetic modulo 2**64 then narrowing modulo 2**bits equals arithmetic
    # modulo 2**bits, which is what the backend's wrapping SUM/PROD compute.
    wide = native.astype(np.uint64 if dtype == torch.uint64 else np.int64)
    target = native.dtype
    with np.errstate(over="ignore"):
        if name == "sum":
            out = wide.sum(axis=0).astype(target)
        elif name == "prod":
            out = wide.prod(axis=0).astype(target)
        elif name == "max":
            out = native.max(axis=0) if native.shape[1] else native[0]
        elif name == "min":
            out = native.min(axis=0) if native.shape[1] else native[0]
        elif name == "band":
            out = np.bitwise_and.reduce(native, axis=0)
        elif name == "bor":
            out = np.bitwise_or.reduce(native, axis=0)
        elif name == "bxor":
            out = np.bitwise_xor.reduce(native, axis=0)
        elif name == "avg":
            out = _int_avg(native, n).astype(target)
        else:
            raise ValueError(f"reference_reduce: {name.upper()} is not defined for integer types")
    return torch.from_numpy(np.ascontiguousarray(out))


def _int_avg(native: np.ndarray, n: int) -> np.ndarray:
    """Exact sum divided by n, truncated toward zero (C division), without overflow."""
    if native.dtype.itemsize < 8:
        total = native.astype(np.int64).sum(axis=0)
        return np.sign(total) * (np.abs(total) // n)
    # 64-bit: the exact sum may need 64 + log2(n) bits; Python ints never overflow.
    totals = [sum(int(v) for v in column) for column in native.T]
    return np.array([(abs(t) // n) * (1 if t >= 0 else -1) for t in totals], dtype=object).astype(
        native.dtype
    )


# ------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------


def default_tolerance(dtype: torch.dtype, world_size: int) -> dict[str, float]:
    """Tolerances assert_close_dtype uses for `dtype` when reducing over `world_size` ranks.

    Integers and bools compare exactly. float64/float32 use rtol = atol = c * n (inputs of
    magnitude ~1 as drawn by random_tensor, so atol covers cancellation). 16- and 8-bit floats
    are judged in ulps of the output type: the backend accumulates in float32 and rounds once,
    the reference rounds once from float64, so the two can differ by one rounding step; 2 ulps
    leave room for float32 accumulation error near rounding ties.
    """
    n = max(1, world_size)
    if dtype == torch.float64:
        return {"rtol": 1e-13 * n, "atol": 1e-13 * n}
    if dtype == torch.float32:
        return {"rtol": 1e-5 * n, "atol": 1e-5 * n}
    if dtype in _dtypes.LOW_PRECISION_FLOATS:
        return {"ulps": 2.0}
    return {}


def ulp(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Spacing of `dtype` at each |value| (float64 array): 2**(exponent - mantissa bits), with
    the exponent clamped to the subnormal range."""
    fmt = _dtypes.float_format(dtype)
    mag = np.abs(np.nan_to_num(values.astype(np.float64), nan=0.0, posinf=fmt.max_finite))
    _, exp = np.frexp(mag)  # mag = m * 2**exp with m in [0.5, 1): floor(log2 mag) = exp - 1
    exponent = np.maximum(exp - 1, fmt.min_exponent)
    exponent = np.where(mag == 0, fmt.min_exponent, exponent)
    return np.ldexp(1.0, exponent - fmt.mantissa_bits)


def assert_close_dtype(
    actual: Any,
    expected: Any,
    dtype: torch.dtype | None = None,
    world_size: int = 1,
    *,
    seed: int | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    ulps: float | None = None,
    what: str = "result",
    max_report: int = 8,
) -> None:
    """Asserts that `actual` matches `expected` within the tolerance of `dtype`.

    `actual` must already have `dtype` (a backend that silently changes the dtype is a bug);
    `expected` is converted to it. Elements still holding the poison are reported as such.
    Messages carry `what`, dtype, world size and `seed` so a failure can be replayed.
    """
    act = _as_cpu_tensor(actual)
    exp = _as_cpu_tensor(expected)
    dtype = dtype if dtype is not None else act.dtype
    _dtypes.check_supported(dtype, "assert_close_dtype")
    header = f"{what} (dtype={dtype}, world_size={world_size}" + (
        f", seed={seed})" if seed is not None else ")"
    )
    if act.dtype != dtype:
        raise AssertionError(f"{header}: has dtype {act.dtype}, expected {dtype}")
    if tuple(act.shape) != tuple(exp.shape):
        raise AssertionError(f"{header}: has shape {tuple(act.shape)}, expected {tuple(exp.shape)}")
    if act.numel() == 0:
        return
    exp = exp.to(dtype)
    poisoned = poisoned_mask(act).reshape(-1).numpy()

    if _dtypes.is_float(dtype):
        a = act.to(torch.float64).reshape(-1).numpy()
        e = exp.to(torch.float64).reshape(-1).numpy()
        tol = default_tolerance(dtype, world_size)
        if ulps is not None or (rtol is None and atol is None and "ulps" in tol):
            n_ulps = ulps if ulps is not None else tol["ulps"]
            allowed = n_ulps * ulp(e, dtype)
            tol_text = f"{n_ulps:g} ulp of {dtype}"
        else:
            r = rtol if rtol is not None else tol.get("rtol", 0.0)
            t = atol if atol is not None else tol.get("atol", 0.0)
            allowed = t + r * np.abs(e)
            tol_text = f"rtol={r:g}, atol={t:g}"
        with np.errstate(invalid="ignore"):
            diff = np.abs(a - e)
            ok = (a == e) | (np.isnan(a) & np.isnan(e)) | (diff <= allowed)
        # A NaN poison where the reference is a number is a never-written element, not noise.
        never_written = poisoned & ~np.isnan(e)
    else:
        a = act.reshape(-1).numpy()
        e = exp.reshape(-1).numpy()
        ok = a == e
        if _dtypes.is_bool(dtype):
            # Any byte other than 0/1 in a bool tensor is garbage even if it reads as True.
            raw = act.contiguous().reshape(-1).view(torch.uint8).numpy()
            ok &= raw <= 1
        diff = None
        allowed = None
        tol_text = "exact"
        never_written = poisoned & ~ok

    bad = np.flatnonzero(~ok)
    if bad.size == 0:
        return
    lines = [f"{header}: {bad.size} of {a.size} elements differ from the reference ({tol_text})"]
    if never_written.any():
        lines.append(
            f"  {int(never_written.sum())} of them still hold the poison value: the output was "
            "never written there"
        )
    shape = tuple(act.shape)
    for flat in bad[:max_report]:
        index = tuple(int(i) for i in np.unravel_index(int(flat), shape)) if shape else ()
        entry = f"  at {index}: actual={_fmt(a[flat])}, expected={_fmt(e[flat])}"
        if diff is not None:
            entry += f", |diff|={_fmt(diff[flat])}, allowed={_fmt(allowed[flat])}"
        lines.append(entry)
    if bad.size > max_report:
        lines.append(f"  ... and {bad.size - max_report} more")
    raise AssertionError("\n".join(lines))


def _fmt(value: Any) -> str:
    if isinstance(value, float | np.floating):
        return f"{float(value):.9g}" if math.isfinite(float(value)) else str(float(value))
    return str(value)


# ------------------------------------------------------------------------------------------
# Cross-checking against gloo
# ------------------------------------------------------------------------------------------


def compare_with_gloo(
    pool: Any,
    fn: Callable[..., Any],
    *args: Any,
    device: str = "spyre",
    timeout: float = 60.0,
    seed: int | None = None,
    ulps: float | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    **kwargs: Any,
) -> tuple[list[Any], list[Any]]:
    """Runs `fn(*args, device=..., **kwargs)` on every rank of `pool` twice, once with tensors on
    `device` (reaching spyreccl) and once on "cpu" (reaching gloo), and asserts that every
    rank's results agree tensor by tensor. Returns (device results, gloo results).

    `fn` must build its inputs from its arguments (pass a seed so both runs see the same values)
    and return tensors, or lists/tuples/dicts of them, moved to the CPU. The pool needs a
    backend that serves both devices, e.g. "cpu:gloo,spyre:spyreccl". gloo reduces 16-bit
    floats in their own precision, so the default ulp budget grows with the world size.
    """
    backend = getattr(pool, "backend", None)
    if backend is None or "gloo" not in str(backend):
        raise ValueError(
            "compare_with_gloo: the pool's backend must route CPU tensors to gloo (e.g. "
            f"backend='cpu:gloo,spyre:spyreccl'), got backend={backend!r}"
        )
    world_size = pool.world_size
    tested = pool.run(fn, *args, device=device, timeout=timeout, **kwargs)
    reference = pool.run(fn, *args, device="cpu", timeout=timeout, **kwargs)
    if ulps is None:
        ulps = float(world_size + 1)
    for rank, (got, want) in enumerate(zip(tested, reference)):
        _compare_tree(
            got,
            want,
            f"rank {rank} result of {getattr(fn, '__qualname__', fn)} on {device} vs gloo",
            world_size=world_size,
            seed=seed,
            ulps=ulps,
            rtol=rtol,
            atol=atol,
        )
    return tested, reference


def _compare_tree(got: Any, want: Any, what: str, **tol: Any) -> None:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a tensor, got {type(got).__name__}")
        low_precision = want.dtype in _dtypes.LOW_PRECISION_FLOATS
        assert_close_dtype(
            got,
            want,
            want.dtype,
            tol["world_size"],
            seed=tol["seed"],
            ulps=tol["ulps"] if low_precision else None,
            rtol=tol["rtol"],
            atol=tol["atol"],
            what=what,
        )
    elif isinstance(want, Mapping):
        if not isinstance(got, Mapping) or set(got) != set(want):
            raise AssertionError(f"{what}: keys {sorted(got)} differ from {sorted(want)}")
        for key in want:
            _compare_tree(got[key], want[key], f"{what}[{key!r}]", **tol)
    elif isinstance(want, list | tuple):
        if not isinstance(got, list | tuple) or len(got) != len(want):
            raise AssertionError(f"{what}: expected a sequence of {len(want)} items, got {got!r}")
        for i, (g, w) in enumerate(zip(got, want)):
            _compare_tree(g, w, f"{what}[{i}]", **tol)
    elif got != want:
        raise AssertionError(f"{what}: {got!r} != {want!r}")
