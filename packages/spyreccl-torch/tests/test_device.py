"""Tests of the host-emulated spyre device (spyreccl_torch.device).

Single process. Every value is checked against an independent reference: float64 numpy
or the same computation on CPU tensors. Checks that need a pristine interpreter
(environment variables, step-aside, import cost, inductor) run in a fresh subprocess.
"""

from __future__ import annotations

import copy
import ctypes
import importlib.util
import io
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from spyreccl_testing.numerics import assert_close, numeric_format

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
_DEV_LIBRARY = _PACKAGE_ROOT / "build" / "device" / "_device.so"

# Development layout: the package sources are not installed and the library was built
# with the standalone CMake project (see src/device/CMakeLists.txt).
if importlib.util.find_spec("spyreccl_torch") is None:
    sys.path.insert(0, str(_PACKAGE_ROOT / "python"))

from spyreccl_torch import device as spyre_device  # noqa: E402
from spyreccl_torch.device import _loader  # noqa: E402

try:
    _loader.library_path()
except FileNotFoundError:
    if _DEV_LIBRARY.is_file():
        os.environ[_loader.LIBRARY_ENV] = str(_DEV_LIBRARY)

pytestmark = pytest.mark.skipif(
    not spyre_device.register(), reason="the emulated spyre device stepped aside"
)

SPYRE = torch.device("spyre")


def randn(rng: np.random.Generator, *shape: int, dtype: torch.dtype = torch.float64):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype = torch.float64, device=SPYRE):
    """A tensor filled with NaN (or the max value), so stale output cannot pass."""
    if dtype == torch.bool:
        return torch.full(shape, True, device=device)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).max, dtype=dtype, device=device)


def assert_within_rounding(
    actual: np.ndarray, desired: np.ndarray, magnitude: np.ndarray, terms: int
):
    """Checks a float64 sum-of-products against numpy's, which sums in another order.

    A relative tolerance alone fails on cancellation (a result near zero made of large
    terms), so the bound is the classic one for a length-``terms`` dot product:
    ``|error| <= 2 * terms * eps * sum(|products|)``, elementwise (``magnitude``), passed to
    the testing plugin's comparison as its derived bound (no other tolerance).
    """
    bound = 2 * max(terms, 1) * np.finfo(np.float64).eps * np.asarray(magnitude)
    assert_close(
        np.asarray(actual),
        np.asarray(desired),
        numeric_format("float64"),
        rtol=0.0,
        atol=0.0,
        ulps=0.0,
        bound=bound,
        what=f"a sum of {terms} products against numpy's",
    )


def run_fresh(
    code: str, extra_path: tuple[Path, ...] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    """Runs `code` in a fresh interpreter that imports spyreccl_torch from where this one did
    (after the directories in `extra_path`)."""
    import spyreccl_torch

    # absolute(), not resolve(): development overlays assemble the package from symlinks.
    package_parent = str(Path(spyreccl_torch.__file__).absolute().parents[1])
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, extra_path), package_parent, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    child_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def assert_fresh_ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


# --- registration ---------------------------------------------------------------------------


def test_register_is_idempotent_and_makes_spyre_the_accelerator():
    assert spyre_device.register() is True
    assert spyre_device.register() is True
    assert spyre_device.is_registered()
    assert torch._C._get_privateuse1_backend_name() == "spyre"
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator().type == "spyre"
    assert torch.spyre.is_available() and torch.spyre.is_initialized()
    assert torch.accelerator.device_count() == torch.spyre.device_count() >= 2


def test_tensor_and_module_methods(rng):
    cpu = randn(rng, 5, 3)
    moved = cpu.spyre()
    assert moved.is_spyre and not cpu.is_spyre
    assert moved.device == torch.device("spyre", 0)
    assert torch.equal(moved.cpu(), cpu)
    module = torch.nn.Linear(3, 2).spyre()
    assert all(p.is_spyre for p in module.parameters())
    storage = cpu.untyped_storage().spyre()
    assert storage.is_spyre and storage.device.type == "spyre"


# --- allocation -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5), (2, 0, 4), (4, 3, 17)])
def test_empty_is_aligned_host_memory_on_the_device(shape, dtype):
    t = torch.empty(shape, dtype=dtype, device=SPYRE)
    assert t.device == torch.device("spyre", 0)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if t.numel():
        assert t.data_ptr() % 64 == 0


@pytest.mark.skipif(
    spyre_device.memory_mode() == "discrete",
    reason="SPYRECCL_SPYRE_MEMORY=discrete: data_ptr() faults by design "
    "(test_device_memory_mode.py proves it)",
)
def test_data_ptr_is_readable_from_the_host(rng):
    cpu = randn(rng, 37)
    t = cpu.to(SPYRE)
    raw = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
    np.testing.assert_array_equal(np.frombuffer(raw, dtype=np.float64), cpu.numpy())


def test_empty_strided_and_factories():
    t = torch.empty_strided((3, 4), (1, 3), device=SPYRE)
    assert t.stride() == (1, 3) and t.untyped_storage().nbytes() == 12 * 4
    np.testing.assert_array_equal(torch.zeros(2, 3, device=SPYRE).cpu().numpy(), np.zeros((2, 3)))
    np.testing.assert_array_equal(torch.ones(5, device=SPYRE, dtype=torch.int32).cpu(), [1] * 5)
    np.testing.assert_array_equal(torch.full((3,), 2.5, device=SPYRE).cpu(), [2.5] * 3)
    np.testing.assert_array_equal(torch.arange(7, device=SPYRE).cpu(), np.arange(7))
    np.testing.assert_allclose(
        torch.linspace(0, 1, 11, device=SPYRE, dtype=torch.float64).cpu(), np.linspace(0, 1, 11)
    )
    # A factory whose only spyre-ness is its device argument goes through the fallback.
    tril = torch.tril_indices(4, 5, device=SPYRE)
    assert tril.is_spyre
    np.testing.assert_array_equal(tril.cpu().numpy(), np.stack(np.tril_indices(4, 0, 5)))
    eye = torch.eye(3, device=SPYRE)
    np.testing.assert_array_equal(eye.cpu().numpy(), np.eye(3))


def test_deterministic_mode_fills_uninitialized_memory():
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.isnan(torch.empty(5, device=SPYRE)).all().item()
        ints = torch.empty(3, dtype=torch.int32, device=SPYRE)
        assert (ints == torch.iinfo(torch.int32).max).all().item()
        grown = torch.zeros(2, device=SPYRE).resize_(6)
        np.testing.assert_array_equal(grown[:2].cpu().numpy(), [0.0, 0.0])
        assert torch.isnan(grown[2:]).all().item()
    finally:
        torch.use_deterministic_algorithms(False)


def test_pinned_host_memory_reports_pinned():
    # Spyre memory is host memory, so "pinned" buffers are ordinary CPU memory; torch still
    # checks that what it pinned is pinned (DDP's reducer asserts it for its map of used
    # parameters), so the pinned allocator's blocks report pinned, and nothing else does.
    data = torch.randn(1000, dtype=torch.float64)
    pinned = data.pin_memory()
    assert pinned.is_pinned() and not data.is_pinned()
    assert torch.equal(pinned, data) and pinned.data_ptr() != data.data_ptr()
    assert pinned[10:20].is_pinned()  # an interior pointer of the block
    empty = torch.empty(7, 3, dtype=torch.int16, pin_memory=True)
    assert empty.is_pinned() and empty.device.type == "cpu"
    assert not torch.empty(0, pin_memory=True).is_pinned()  # no memory, as with CUDA
    assert not torch.randn(1000, dtype=torch.float64).is_pinned()
    assert not torch.empty(4, device=SPYRE).is_pinned()
    # A freed block is forgotten: a CPU tensor that reuses its address is not pinned.
    address = pinned.data_ptr()
    del pinned
    reused = [torch.empty(1000, dtype=torch.float64) for _ in range(8)]
    assert not any(t.is_pinned() for t in reused), address
    # Copies to and from pinned memory.
    staged = torch.empty(1000, dtype=torch.float64, pin_memory=True).copy_(data)
    on_spyre = staged.to(SPYRE, non_blocking=True)
    back = torch.empty_like(staged, pin_memory=True).copy_(on_spyre, non_blocking=True)
    assert torch.equal(back, data) and back.is_pinned()


def test_data_loader_pins_batches_for_spyre():
    dataset = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.arange(10))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, pin_memory=True)
    seen = []
    for x, y in loader:
        assert x.is_pinned() and y.is_pinned()
        seen.append(y)
    assert torch.equal(torch.cat(seen), torch.arange(10))


def test_pin_memory_is_rejected_for_spyre_tensors():
    with pytest.raises(RuntimeError, match="pin_memory"):
        torch.empty(3, device=SPYRE, pin_memory=True)


# --- copies ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.int64, torch.int8, torch.bool, torch.complex64]
)
@pytest.mark.parametrize("shape", [(0,), (1,), (13,), (4, 7), (3, 1, 5)])
def test_copy_round_trip(rng, shape, dtype):
    values = rng.standard_normal(shape) * 10
    if dtype == torch.bool:
        values = values > 0
    if dtype.is_complex:
        values = values + 1j * rng.standard_normal(shape)
    cpu = torch.from_numpy(np.asarray(values)).to(dtype)
    on_device = cpu.to(SPYRE)
    assert on_device.is_spyre and on_device.dtype == dtype
    back = poisoned(shape, dtype, device="cpu")
    back.copy_(on_device)
    assert torch.equal(back, cpu)
    assert torch.equal(on_device.cpu(), cpu)


@pytest.mark.parametrize("numel", [1, 32767, 32768, 40001])
def test_copies_on_either_side_of_the_one_run_bound(rng, numel):
    """Below 32768 elements a contiguous same-dtype copy is one memmove, from there the CPU
    kernel: the same values either way, in every direction, and a copy onto itself changes
    nothing."""
    cpu = randn(rng, numel)
    on_device = poisoned((numel,), torch.float64).copy_(cpu)  # cpu -> spyre
    back = poisoned((numel,), torch.float64, device="cpu").copy_(on_device)  # spyre -> cpu
    assert torch.equal(back, cpu)
    other = poisoned((numel,), torch.float64).copy_(on_device)  # spyre -> spyre
    assert torch.equal(other.cpu(), cpu)
    other.copy_(other)
    assert torch.equal(other.cpu(), cpu)


def test_copies_between_layouts_dtypes_and_devices(rng):
    cpu = randn(rng, 6, 9)
    # Non-contiguous source into a spyre destination, with a dtype conversion.
    dst = poisoned((9, 6), torch.float32)
    dst.copy_(cpu.t())
    assert torch.equal(dst.cpu(), cpu.t().float())
    # Spyre to spyre on another device index, then a broadcasting copy.
    other = dst.to("spyre:1")
    assert other.device == torch.device("spyre", 1)
    assert torch.equal(other.cpu(), dst.cpu())
    row = randn(rng, 9).to(SPYRE)
    target = poisoned((4, 9))
    target.copy_(row)
    np.testing.assert_array_equal(target.cpu().numpy(), np.broadcast_to(row.cpu().numpy(), (4, 9)))
    # Spyre into a non-contiguous CPU view.
    host = torch.zeros(9, 6, dtype=torch.float64)
    host.t().copy_(cpu.to(SPYRE))
    assert torch.equal(host.t(), cpu)


def test_conjugate_and_negative_views_resolve_on_copy(rng):
    z = torch.complex(randn(rng, 8), randn(rng, 8))
    on_device = z.to(SPYRE)
    conj = on_device.conj()
    assert conj.is_conj()
    np.testing.assert_array_equal(conj.cpu().numpy(), np.conj(z.numpy()))
    np.testing.assert_array_equal(conj.resolve_conj().cpu().numpy(), np.conj(z.numpy()))
    np.testing.assert_array_equal(
        torch.view_as_real(on_device.conj().resolve_conj()).cpu(),
        torch.view_as_real(z.conj().resolve_conj()),
    )


def test_item_and_scalars(rng):
    value = float(rng.standard_normal())
    t = torch.tensor(value, dtype=torch.float64).to(SPYRE)
    assert t.item() == value
    assert torch.tensor([3], device=SPYRE).item() == 3
    assert bool(torch.tensor(True, device=SPYRE))


# --- views ----------------------------------------------------------------------------------


def test_slices_transposes_and_views_share_storage(rng):
    cpu = randn(rng, 6, 8)
    base = cpu.to(SPYRE)
    ref = cpu.clone()
    part = base[2:5, 1::3]
    assert part.storage_offset() == 2 * 8 + 1
    assert part.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    part.mul_(-2)
    ref[2:5, 1::3] *= -2
    transposed = base.t()
    transposed[0].add_(1)
    ref.t()[0] += 1
    viewed = base.view(48)
    viewed[-1] = 42.0
    ref.view(48)[-1] = 42.0
    np.testing.assert_array_equal(base.cpu().numpy(), ref.numpy())


def test_view_as_real_is_a_view(rng):
    z = torch.complex(randn(rng, 5), randn(rng, 5))
    on_device = z.to(SPYRE)
    real = torch.view_as_real(on_device)
    assert real.is_spyre and real._base is on_device
    assert real.data_ptr() == on_device.data_ptr()
    real[:, 1].zero_()
    np.testing.assert_array_equal(on_device.cpu().numpy(), z.real.to(torch.complex128).numpy())


def test_unfold_is_a_view_and_writes_reach_the_base(rng):
    cpu = randn(rng, 11)
    base = cpu.to(SPYRE)
    windows = base.unfold(0, 4, 3)
    assert windows._base is base and windows.shape == (3, 4)
    np.testing.assert_array_equal(windows.cpu().numpy(), cpu.unfold(0, 4, 3).numpy())
    windows[1].fill_(7.0)
    expected = cpu.clone()
    expected[3:7] = 7.0
    np.testing.assert_array_equal(base.cpu().numpy(), expected.numpy())


def test_diagonal_and_expand_views(rng):
    cpu = randn(rng, 4, 4)
    base = cpu.to(SPYRE)
    base.diagonal().copy_(torch.arange(4.0, dtype=torch.float64))
    expected = cpu.clone()
    expected.diagonal().copy_(torch.arange(4.0, dtype=torch.float64))
    np.testing.assert_array_equal(base.cpu().numpy(), expected.numpy())
    expanded = base[:1].expand(3, 4)
    assert expanded.stride() == (0, 1)
    np.testing.assert_array_equal(expanded.cpu().numpy(), expected[:1].expand(3, 4).numpy())


def test_split_unbind_and_chunk_return_views(rng):
    cpu = randn(rng, 6, 5)
    base = cpu.to(SPYRE)
    pieces = base.split([2, 3, 1])
    assert [p.shape[0] for p in pieces] == [2, 3, 1]
    for piece in pieces:
        assert piece.is_spyre and piece.untyped_storage().data_ptr() == base.data_ptr()
    rows = base.unbind(1)
    rows[2].fill_(0.5)
    expected = cpu.clone()
    expected[:, 2] = 0.5
    np.testing.assert_array_equal(base.cpu().numpy(), expected.numpy())


# --- in-place and out= ----------------------------------------------------------------------


def test_in_place_ops_return_self(rng):
    cpu = randn(rng, 9)
    t = cpu.to(SPYRE)
    assert t.add_(1) is t
    assert t.clamp_(min=0.0) is t
    t.squeeze_()
    t.unsqueeze_(0)
    assert t.shape == (1, 9)
    np.testing.assert_array_equal(t.cpu().numpy()[0], np.maximum(cpu.numpy() + 1, 0.0))


@pytest.mark.parametrize("n", [0, 1, 7, 64])
def test_out_variants_resize_their_output(rng, n):
    a, b = randn(rng, n), randn(rng, n)
    out = torch.empty(0, dtype=torch.float64, device=SPYRE)
    result = torch.add(a.to(SPYRE), b.to(SPYRE), alpha=2.0, out=out)
    assert result is out and out.shape == (n,)
    np.testing.assert_allclose(out.cpu().numpy(), a.numpy() + 2.0 * b.numpy(), rtol=1e-15)

    m = randn(rng, 3, n)
    k = randn(rng, n, 5)
    mm_out = torch.empty(0, dtype=torch.float64, device=SPYRE)
    torch.matmul(m.to(SPYRE), k.to(SPYRE), out=mm_out)
    assert mm_out.shape == (3, 5)
    product_magnitude = np.abs(m.numpy()) @ np.abs(k.numpy())
    assert_within_rounding(mm_out.cpu().numpy(), m.numpy() @ k.numpy(), product_magnitude, n)
    # An out= of the right shape is written in place, without reallocation.
    same_shape = poisoned((3, 5))
    address = same_shape.data_ptr()
    torch.matmul(m.to(SPYRE), k.to(SPYRE), out=same_shape)
    assert same_shape.data_ptr() == address
    assert_within_rounding(same_shape.cpu().numpy(), m.numpy() @ k.numpy(), product_magnitude, n)

    cat_out = torch.empty(0, dtype=torch.float64, device=SPYRE)
    torch.cat([a.to(SPYRE), b.to(SPYRE)], out=cat_out)
    np.testing.assert_array_equal(cat_out.cpu().numpy(), np.concatenate([a.numpy(), b.numpy()]))


def test_resize_keeps_data_and_views_follow_the_storage(rng):
    cpu = randn(rng, 5)
    t = cpu.to(SPYRE)
    alias = t.view(5)
    t.resize_(40)
    assert t.shape == (40,) and t.untyped_storage().nbytes() >= 40 * 8
    np.testing.assert_array_equal(t[:5].cpu().numpy(), cpu.numpy())
    # Both tensors share one storage; after the reallocation the alias sees it too.
    assert alias.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    t[0] = 123.0
    assert alias[0].item() == 123.0


def test_storage_resize(rng):
    t = randn(rng, 4).to(SPYRE)
    storage = t.untyped_storage()
    storage.resize_(128)
    assert storage.nbytes() == 128 and storage.device.type == "spyre"


def test_set_overloads(rng):
    cpu = randn(rng, 10)
    src = cpu.to(SPYRE)
    t = torch.empty(0, dtype=torch.float64, device=SPYRE)
    t.set_(src)
    assert t.data_ptr() == src.data_ptr() and t.shape == src.shape
    t.set_(src.untyped_storage(), 2, (2, 3), (3, 1))
    np.testing.assert_array_equal(t.cpu().numpy(), cpu.numpy()[2:8].reshape(2, 3))
    t.set_(src.untyped_storage())
    assert t.shape == (10,)
    t.set_()
    assert t.numel() == 0
    with pytest.raises(RuntimeError, match="spyre"):
        t.set_(cpu)


# --- compute against float64 references -----------------------------------------------------


@pytest.mark.parametrize(("m", "k", "n"), [(1, 1, 1), (3, 7, 5), (17, 9, 33), (0, 4, 3)])
def test_matmul(rng, m, k, n):
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    out = torch.from_numpy(a).to(SPYRE) @ torch.from_numpy(b).to(SPYRE)
    assert out.is_spyre
    assert_within_rounding(out.cpu().numpy(), a @ b, np.abs(a) @ np.abs(b), k)


def test_reductions_and_elementwise(rng):
    x = rng.standard_normal((5, 13))
    t = torch.from_numpy(x).to(SPYRE)
    assert_within_rounding(t.sum(1).cpu().numpy(), x.sum(1), np.abs(x).sum(1), x.shape[1])
    assert_within_rounding(
        np.array(t.mean().item()), np.array(x.mean()), np.array(np.abs(x).mean()), x.size
    )
    values, indices = t.max(dim=0)
    assert values.is_spyre and indices.is_spyre
    np.testing.assert_array_equal(values.cpu().numpy(), x.max(0))
    np.testing.assert_array_equal(indices.cpu().numpy(), x.argmax(0))
    np.testing.assert_allclose(torch.exp(t).cpu().numpy(), np.exp(x), rtol=1e-14)
    # A 0-dim CPU tensor may take part in a spyre operation, as on other accelerators.
    scaled = t * torch.tensor(3.0, dtype=torch.float64)
    assert scaled.is_spyre
    np.testing.assert_allclose(scaled.cpu().numpy(), x * 3.0, rtol=1e-15)


def test_binary_arithmetic_on_a_second_device(rng):
    # add/sub/mul/div of two tensors have unboxed spyre kernels (binary_ops.cc): they must
    # agree with the fallback's behaviour: broadcasting, alpha, type promotion, 0-dim CPU
    # operands on either side, results on the first spyre operand's device, inputs intact.
    x = rng.standard_normal((5, 1))
    y = rng.standard_normal((1, 13))
    n = rng.integers(-50, 50, size=(5, 13))
    tx, ty, tn = (torch.from_numpy(v).to("spyre:1") for v in (x, y, n))
    three = torch.tensor(3.0, dtype=torch.float64)
    cases = {
        "add": (tx + ty, x + y),
        # alpha: CPU's kernel may fuse the multiply-add (one rounding instead of two).
        "add alpha": (torch.add(tx, ty, alpha=2.5), x + 2.5 * y, np.abs(x) + np.abs(2.5 * y)),
        "sub alpha": (torch.sub(tx, ty, alpha=-1.5), x + 1.5 * y, np.abs(x) + np.abs(1.5 * y)),
        "mul": (tx * ty, x * y),
        "div": (tx / ty, x / y),
        "int + float": (tn + tx, n + x),
        # True division of integers gives the default dtype; float64 then rounding to
        # float32 is the correctly rounded float32 quotient.
        "int / int": (tn / (tn.abs() + 1), (n / (np.abs(n) + 1)).astype(np.float32)),
        "cpu 0-dim first": (three - ty, 3.0 - y),
        "cpu 0-dim second": (tx / three, x / 3.0),
    }
    for what, (out, expected, *magnitude) in cases.items():
        assert out.device == torch.device("spyre:1"), what
        assert out.dtype == torch.from_numpy(expected).dtype, what
        if magnitude:
            bound = 2 * np.finfo(np.float64).eps * magnitude[0]
            assert np.all(np.abs(out.cpu().numpy() - expected) <= bound), what
        else:
            np.testing.assert_array_equal(out.cpu().numpy(), expected, err_msg=what)
    for t, v in ((tx, x), (ty, y), (tn, n)):
        np.testing.assert_array_equal(t.cpu().numpy(), v)
    a = tx.clone().requires_grad_()
    (a * ty).sum().backward()
    # d/da sum(a * y) sums y over the broadcast dimension: summation order is free.
    bound = y.shape[1] * np.finfo(np.float64).eps * np.abs(y).sum()
    assert np.all(np.abs(a.grad.cpu().numpy() - y.sum()) <= bound)
    assert a.grad.shape == (5, 1)


def test_indexing(rng):
    x = rng.standard_normal((7, 4))
    t = torch.from_numpy(x).to(SPYRE)
    rows = torch.tensor([5, 0, 5, 2])
    np.testing.assert_array_equal(t[rows.to(SPYRE)].cpu().numpy(), x[rows.numpy()])
    np.testing.assert_array_equal(t[rows].cpu().numpy(), x[rows.numpy()])
    mask = t > 0
    np.testing.assert_array_equal(t[mask].cpu().numpy(), x[x > 0])
    t[mask] = 0.0
    np.testing.assert_array_equal(t.cpu().numpy(), np.where(x > 0, 0.0, x))
    t[rows.to(SPYRE), torch.tensor([0, 1, 2, 3], device=SPYRE)] = -1.0
    expected = np.where(x > 0, 0.0, x)
    expected[rows.numpy(), [0, 1, 2, 3]] = -1.0
    np.testing.assert_array_equal(t.cpu().numpy(), expected)
    # Optional-tensor index lists (None for the sliced dimension).
    cols = torch.tensor([3, 3, 0])
    np.testing.assert_array_equal(t[:, cols.to(SPYRE)].cpu().numpy(), expected[:, [3, 3, 0]])
    gathered = torch.gather(t, 1, torch.zeros(7, 1, dtype=torch.long, device=SPYRE))
    np.testing.assert_array_equal(gathered.cpu().numpy(), expected[:, :1])


def test_cat_stack_and_foreach(rng):
    parts = [rng.standard_normal((n, 3)) for n in (1, 4, 0, 2)]
    on_device = [torch.from_numpy(p).to(SPYRE) for p in parts]
    np.testing.assert_array_equal(torch.cat(on_device).cpu().numpy(), np.concatenate(parts))
    squares = [torch.from_numpy(rng.standard_normal((2, 2))).to(SPYRE) for _ in range(3)]
    np.testing.assert_array_equal(
        torch.stack(squares).cpu().numpy(), np.stack([s.cpu().numpy() for s in squares])
    )
    summed = torch._foreach_add(on_device, 1.5)
    for got, ref in zip(summed, parts):
        assert got.is_spyre
        np.testing.assert_array_equal(got.cpu().numpy(), ref + 1.5)
    torch._foreach_mul_(on_device, 2.0)
    for got, ref in zip(on_device, parts):
        np.testing.assert_array_equal(got.cpu().numpy(), ref * 2.0)


def test_linear_forward_and_backward_match_cpu(rng):
    torch.manual_seed(int(rng.integers(1 << 31)))
    reference = torch.nn.Linear(13, 7, dtype=torch.float64)
    on_device = copy.deepcopy(reference).to(SPYRE)
    x = randn(rng, 5, 13)
    grad = randn(rng, 5, 7)
    x_ref = x.clone().requires_grad_()
    x_dev = x.to(SPYRE).requires_grad_()
    out_ref = torch.relu(reference(x_ref))
    out_dev = torch.relu(on_device(x_dev))
    assert out_dev.is_spyre
    np.testing.assert_allclose(
        out_dev.detach().cpu().numpy(), out_ref.detach().numpy(), rtol=1e-12, atol=1e-12
    )
    out_ref.backward(grad)
    out_dev.backward(grad.to(SPYRE))
    for p_ref, p_dev in zip(reference.parameters(), on_device.parameters()):
        assert p_dev.grad.is_spyre
        np.testing.assert_allclose(
            p_dev.grad.cpu().numpy(), p_ref.grad.numpy(), rtol=1e-12, atol=1e-12
        )
    np.testing.assert_allclose(x_dev.grad.cpu().numpy(), x_ref.grad.numpy(), rtol=1e-12, atol=1e-12)
    # An optimizer step (foreach implementation on accelerators) matches CPU too.
    for params in (reference.parameters(), on_device.parameters()):
        torch.optim.SGD(params, lr=0.1, momentum=0.9).step()
    for p_ref, p_dev in zip(reference.parameters(), on_device.parameters()):
        np.testing.assert_allclose(
            p_dev.detach().cpu().numpy(), p_ref.detach().numpy(), rtol=1e-12, atol=1e-12
        )


@pytest.mark.parametrize("transposed", [False, True])
def test_convolution_forward_and_backward_match_cpu(rng, transposed):
    torch.manual_seed(int(rng.integers(1 << 31)))
    cls = torch.nn.ConvTranspose2d if transposed else torch.nn.Conv2d
    reference = cls(4, 6, 3, stride=2, padding=1, groups=2, dtype=torch.float64)
    on_device = copy.deepcopy(reference).to(SPYRE)
    x = randn(rng, 2, 4, 7, 9)
    x_ref, x_dev = x.clone().requires_grad_(), x.to(SPYRE).requires_grad_()
    out_ref, out_dev = reference(x_ref), on_device(x_dev)
    assert out_dev.is_spyre and out_dev.shape == out_ref.shape
    np.testing.assert_allclose(out_dev.detach().cpu().numpy(), out_ref.detach().numpy(), rtol=1e-12)
    grad = randn(rng, *out_ref.shape)
    out_ref.backward(grad)
    out_dev.backward(grad.to(SPYRE))
    np.testing.assert_allclose(x_dev.grad.cpu().numpy(), x_ref.grad.numpy(), rtol=1e-12)
    for p_ref, p_dev in zip(reference.parameters(), on_device.parameters()):
        np.testing.assert_allclose(p_dev.grad.cpu().numpy(), p_ref.grad.numpy(), rtol=1e-11)


def test_scaled_dot_product_attention_matches_reference(rng):
    q, k, v = (rng.standard_normal((2, 3, 5, 8)) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(t).to(SPYRE) for t in (q, k, v)), is_causal=True
    )
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(8)
    scores = np.where(np.tril(np.ones((5, 5), dtype=bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    assert out.is_spyre
    np.testing.assert_allclose(out.cpu().numpy(), weights @ v, rtol=1e-12, atol=1e-12)


def test_inference_mode_results(rng):
    x = randn(rng, 4, 3).to(SPYRE)
    with torch.inference_mode():
        y = (x + 1).view(-1)[2:]
        assert y.is_inference() and y.is_spyre
    np.testing.assert_array_equal(y.cpu().numpy(), (x.cpu() + 1).view(-1)[2:].numpy())


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_low_precision_conversions_match_cpu(rng, dtype):
    x = randn(rng, 257, dtype=torch.float32) * 4
    expected = x.to(dtype)
    on_device = x.to(SPYRE).to(dtype)
    assert on_device.is_spyre and on_device.dtype == dtype
    assert torch.equal(on_device.cpu().view(torch.uint8), expected.view(torch.uint8))
    widened = on_device.to(torch.float64)
    assert torch.equal(widened.cpu(), expected.to(torch.float64))
    uploaded = expected.to(SPYRE)
    assert torch.equal(uploaded.cpu().view(torch.uint8), expected.view(torch.uint8))


# --- devices --------------------------------------------------------------------------------


def test_current_device_and_guards():
    assert torch.spyre.current_device() == 0
    torch.accelerator.set_device_index(1)
    try:
        assert torch.spyre.current_device() == 1
        assert torch.accelerator.current_device_index() == 1
        assert torch.empty(1, device=SPYRE).device == torch.device("spyre", 1)
        with torch.spyre.device(2):
            assert torch.accelerator.current_device_index() == 2
            assert torch.zeros(2, device=SPYRE).device == torch.device("spyre", 2)
        assert torch.spyre.current_device() == 1
        with torch.accelerator.device_index(0):
            assert torch.spyre.current_device() == 0
        assert torch.spyre.current_device() == 1
    finally:
        torch.spyre.set_device(0)
    last = torch.spyre.device_count() - 1
    t = torch.ones(3, device=f"spyre:{last}")
    assert (t + t).device == torch.device("spyre", last)
    assert torch.spyre.current_device() == 0
    with pytest.raises(RuntimeError, match="invalid spyre device index"):
        torch.empty(1, device=f"spyre:{torch.spyre.device_count()}")
    with pytest.raises(ValueError, match="invalid spyre device index"):
        torch.spyre.set_device(torch.spyre.device_count())
    torch.spyre.synchronize()
    torch.accelerator.synchronize()


def test_current_device_is_per_thread():
    seen = []

    def probe() -> None:
        seen.append((torch.spyre.current_device(), torch.empty(1, device=SPYRE).device))

    torch.spyre.set_device(1)
    try:
        worker = threading.Thread(target=probe)
        worker.start()
        worker.join()
    finally:
        torch.spyre.set_device(0)
    assert seen == [(0, torch.device("spyre", 0))]


def test_device_count_comes_from_the_environment():
    out = assert_fresh_ok(
        run_fresh(
            """
            import torch
            from spyreccl_torch import device
            assert device.register()
            print(torch.spyre.device_count(), torch.accelerator.device_count())
            t = torch.ones(2, device="spyre:2")
            print(t.device)
            try:
                torch.ones(2, device="spyre:3")
            except RuntimeError as e:
                print("rejected" if "invalid spyre device index 3" in str(e) else e)
            """,
            SPYRECCL_SPYRE_DEVICE_COUNT="3",
        )
    )
    assert out.split() == ["3", "3", "spyre:2", "rejected"]


def test_malformed_device_count_is_rejected():
    result = run_fresh(
        """
        try:
            # The package registers the device on import already.
            from spyreccl_torch import device

            device.register()
        except ValueError as e:
            print("ValueError", e)
        """,
        SPYRECCL_SPYRE_DEVICE_COUNT="eight",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )
    assert "ValueError SPYRECCL_SPYRE_DEVICE_COUNT='eight'" in assert_fresh_ok(result)


def test_streams_and_events_are_synchronous():
    stream = torch.spyre.Stream()
    assert stream.device == torch.device("spyre", 0)
    assert stream == torch.spyre.current_stream() == torch.accelerator.current_stream()
    assert torch.spyre.Stream("spyre:1").device == torch.device("spyre", 1)
    start = torch.spyre.Event(enable_timing=True)
    end = torch.spyre.Event(enable_timing=True)
    start.record()
    x = torch.ones(64, device=SPYRE)
    with torch.spyre.stream(stream):
        y = x * 3
    y.record_stream(stream)
    end.record(stream)
    stream.wait_event(end)
    stream.wait_stream(torch.spyre.default_stream())
    assert end.query() and stream.query()
    end.synchronize()
    assert end.elapsed_time(start) <= 0.0 <= start.elapsed_time(end)
    np.testing.assert_array_equal(y.cpu().numpy(), np.full(64, 3.0))
    with pytest.raises(ValueError, match="spyre stream"):
        torch.spyre.set_stream(torch.Stream("cpu"))


# --- random numbers -------------------------------------------------------------------------


def test_spyre_generators_are_seeded_independently_of_cpu():
    torch.spyre.manual_seed(1234)
    first = torch.randn(100, device=SPYRE)
    torch.rand(3)  # consuming CPU random numbers must not shift the spyre stream
    torch.spyre.manual_seed(1234)
    second = torch.randn(100, device=SPYRE)
    assert first.is_spyre and torch.equal(first.cpu(), second.cpu())
    assert torch.spyre.initial_seed() == 1234

    state = torch.spyre.get_rng_state()
    a = torch.rand(50, device=SPYRE)
    torch.spyre.set_rng_state(state)
    b = torch.rand(50, device=SPYRE)
    assert torch.equal(a.cpu(), b.cpu())

    generator = torch.Generator(device=SPYRE)
    assert generator.device.type == "spyre"
    generator.manual_seed(7)
    c = torch.randn(20, device=SPYRE, generator=generator)
    generator.manual_seed(7)
    d = torch.randn(20, device=SPYRE, generator=generator)
    assert torch.equal(c.cpu(), d.cpu())

    torch.manual_seed(99)  # also seeds every spyre device through manual_seed_all
    e = torch.rand(10, device="spyre:1")
    torch.spyre.manual_seed_all(99)
    f = torch.rand(10, device="spyre:1")
    assert torch.equal(e.cpu(), f.cpu())
    with pytest.raises(RuntimeError, match="spyre generator"):
        torch.randn(3, device=SPYRE, generator=torch.Generator())


def test_dropout_and_randperm(rng):
    torch.spyre.manual_seed(int(rng.integers(1 << 31)))
    x = torch.ones(1000, device=SPYRE)
    y = torch.nn.functional.dropout(x, p=0.5, training=True)
    kept = y.cpu().numpy()
    assert set(np.unique(kept)) <= {0.0, 2.0} and 300 < (kept > 0).sum() < 700
    perm = torch.randperm(31, device=SPYRE)
    assert perm.is_spyre
    np.testing.assert_array_equal(np.sort(perm.cpu().numpy()), np.arange(31))


# --- serialization --------------------------------------------------------------------------


def test_save_load_round_trip(rng):
    data = {"w": randn(rng, 3, 4).to("spyre:1"), "i": torch.arange(5, device=SPYRE)}
    data["view"] = data["w"][1:]
    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded["w"].device == torch.device("spyre", 1)
    assert loaded["i"].device == torch.device("spyre", 0)
    for key in data:
        assert torch.equal(loaded[key].cpu(), data[key].cpu())
    # Views stay views of the same storage after loading.
    assert loaded["view"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()
    buffer.seek(0)
    on_cpu = torch.load(buffer, map_location="cpu")
    assert on_cpu["w"].device.type == "cpu" and torch.equal(on_cpu["w"], data["w"].cpu())


def test_deepcopy_and_clone(rng):
    t = randn(rng, 4, 4).to(SPYRE)
    copied = copy.deepcopy(t)
    cloned = t.clone()
    for other in (copied, cloned):
        assert other.is_spyre and other.data_ptr() != t.data_ptr()
        assert torch.equal(other.cpu(), t.cpu())


# --- fresh interpreters ---------------------------------------------------------------------


def test_import_does_not_import_inductor():
    out = assert_fresh_ok(
        run_fresh(
            """
            import sys
            import torch
            from spyreccl_torch import device
            assert device.register()
            torch.ones(3, device="spyre").add_(1)
            print("torch._inductor" in sys.modules, "torch._dynamo" in sys.modules)
            """
        )
    )
    assert out.split() == ["False", "False"]


def test_steps_aside_when_privateuse1_is_already_claimed():
    out = assert_fresh_ok(
        run_fresh(
            """
            import logging
            import torch
            logging.basicConfig(level=logging.DEBUG, format="%(name)s %(message)s")
            torch.utils.rename_privateuse1_backend("othervendor")
            from spyreccl_torch import device
            print(device.register(), device.register())
            print(hasattr(torch, "spyre"), torch._C._get_privateuse1_backend_name())
            """,
            # The other vendor claims PrivateUse1 before spyreccl_torch is imported.
            TORCH_DEVICE_BACKEND_AUTOLOAD="0",
        )
    )
    assert out.split() == ["False", "False", "False", "othervendor"]


def test_steps_aside_when_torch_spyre_is_installed(tmp_path):
    (tmp_path / "torch_spyre").mkdir()
    (tmp_path / "torch_spyre" / "__init__.py").write_text("raise AssertionError('not imported')\n")
    out = assert_fresh_ok(
        run_fresh(
            """
            import sys
            import torch
            from spyreccl_torch import device
            print(device.register(), hasattr(torch, "spyre"), "torch_spyre" in sys.modules)
            """,
            extra_path=(tmp_path,),
        )
    )
    assert out.split() == ["False", "False", "False"]


def test_steps_aside_when_another_module_owns_torch_spyre():
    out = assert_fresh_ok(
        run_fresh(
            """
            import types
            import torch
            torch.utils.rename_privateuse1_backend("spyre")
            vendor = types.ModuleType("vendor_spyre")
            torch._register_device_module("spyre", vendor)
            from spyreccl_torch import device
            print(device.register(), torch.spyre is vendor)
            """,
            TORCH_DEVICE_BACKEND_AUTOLOAD="0",
        )
    )
    assert out.split() == ["False", "True"]


def test_steps_aside_when_disabled_by_environment():
    out = assert_fresh_ok(
        run_fresh(
            """
            import torch
            from spyreccl_torch import device
            print(device.register(), hasattr(torch, "spyre"))
            """,
            SPYRECCL_EMULATE_SPYRE="0",
        )
    )
    assert out.split() == ["False", "False"]


# --- torch.compile --------------------------------------------------------------------------


def _compiled_model(x, w, b):
    return torch.relu(x @ w) + b


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_matches_eager(rng, backend):
    x, w, b = (randn(rng, *s, dtype=torch.float32).to(SPYRE) for s in ((8, 16), (16, 4), (4,)))
    expected = _compiled_model(x, w, b).cpu()
    torch._dynamo.reset()
    out = torch.compile(_compiled_model, backend=backend, fullgraph=True)(x, w, b)
    assert out.is_spyre
    torch.testing.assert_close(out.cpu(), expected)


def test_compile_inductor_matches_eager():
    # Fresh interpreter: inductor compiles C++ and registers spyre lazily on first use.
    out = assert_fresh_ok(
        run_fresh(
            """
            import numpy as np
            import torch
            from spyreccl_torch import device
            assert device.register()
            from torch._inductor.utils import run_and_get_code

            def f(x, w, b):
                return torch.relu(x @ w) + b * 2

            rng = np.random.default_rng()
            x, w, b = (torch.from_numpy(rng.standard_normal(s)).float().to("spyre")
                       for s in ((8, 16), (16, 5), (5,)))
            expected = (torch.relu(x.cpu().double() @ w.cpu().double())
                        + b.cpu().double() * 2)
            out, (code, *_) = run_and_get_code(torch.compile(f), x, w, b)
            assert out.device.type == "spyre", out.device
            torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.cpu(), f(x, w, b).cpu())
            # torch 2.10 names the device with its index ('spyre:0'), later torches without.
            print("cpp_fused" in code, "device='spyre" in code)
            """
        )
    )
    assert out.split()[-2:] == ["True", "True"]
