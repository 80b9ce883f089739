"""spyreccl_torch.device.host_view: a CPU tensor over an emulated-spyre tensor's memory.

Single process. Values are random bytes per dtype (every bit pattern, NaNs included), compared
bytewise with an independent copy (``Tensor.cpu()``); outputs written through a view are
checked against the values written, and poisoned first so a missed write cannot pass.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from test_device import SPYRE, assert_fresh_ok, run_fresh

from spyreccl_testing.inputs import fresh_seed
from spyreccl_torch import device as spyre_device
from spyreccl_torch.multinode import staging

pytestmark = pytest.mark.skipif(
    not spyre_device.register(), reason="the emulated spyre device stepped aside"
)

host_view = spyre_device.host_view

ALL_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.complex128,
    torch.complex64,
    torch.complex32,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint64,
    torch.uint32,
    torch.uint16,
    torch.uint8,
    torch.bool,
)


@pytest.fixture
def rng() -> np.random.Generator:
    seed = fresh_seed()
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def random_of(rng: np.random.Generator, shape: tuple[int, ...], dtype: torch.dtype):
    """A CPU tensor of random bit patterns (bool: random 0/1)."""
    numel = int(np.prod(shape, dtype=np.int64))
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, numel, dtype=np.uint8)).bool().reshape(shape)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(rng.integers(0, 256, numel * size, dtype=np.uint8))
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included) of two CPU tensors of one dtype and shape."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    to_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return bool(torch.equal(to_bytes(a), to_bytes(b)))


def host_address(ptr: int) -> int:
    """Where the host reaches the spyre memory at `ptr`: `ptr` itself in host memory mode; in
    discrete mode (SPYRECCL_SPYRE_MEMORY=discrete, where `ptr` faults when read) its address
    in the accessible mapping of the same pages."""
    device_base, host_base, size = torch.ops.spyreccl_device.discrete_window()
    return ptr - device_base + host_base if 0 <= ptr - device_base < size else ptr


def assert_shares(view: torch.Tensor, t: torch.Tensor) -> None:
    assert view.device.type == "cpu"
    assert view.dtype == t.dtype
    assert view.shape == t.shape and view.stride() == t.stride()
    assert view.storage_offset() == t.storage_offset()
    assert view.data_ptr() == host_address(t.data_ptr())
    assert view.untyped_storage().data_ptr() == host_address(t.untyped_storage().data_ptr())


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_view_shares_memory_both_ways_in_every_dtype(rng, dtype):
    src = random_of(rng, (33, 7), dtype)
    t = src.to(SPYRE)
    view = host_view(t)
    assert_shares(view, t)
    assert same_bits(view, src)
    # spyre -> view: a write on the device is seen by the view without any call.
    other = random_of(rng, (33, 7), dtype)
    t.copy_(other.to(SPYRE))
    assert same_bits(view, other)
    # view -> spyre: a CPU write is seen by the spyre tensor.
    third = random_of(rng, (33, 7), dtype)
    view.copy_(third)
    assert same_bits(t.cpu(), third)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.t(),
        lambda t: t[3:, 1::2],
        lambda t: t[5],
        lambda t: t[:, 2:3].expand(-1, 4),
        lambda t: t.reshape(-1)[7:8].reshape(()),
    ],
    ids=["transposed", "offset-strided", "row", "expanded", "scalar"],
)
def test_non_contiguous_views_keep_geometry(rng, make):
    src = random_of(rng, (10, 6), torch.float32)
    t = src.to(SPYRE)
    part = make(t)
    view = host_view(part)
    assert_shares(view, part)
    assert same_bits(view, make(src))
    if 0 in view.stride():
        return  # overlapping elements cannot be written
    # Writes land where the spyre tensor's geometry says (poisoned first: NaN).
    t.fill_(float("nan"))
    values = random_of(rng, tuple(view.shape), torch.float32)
    view.copy_(values)
    assert same_bits(part.cpu(), values)


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2)], ids=str)
def test_empty_tensors(shape):
    t = torch.empty(shape, dtype=torch.int32, device=SPYRE)
    view = host_view(t)
    assert view.device.type == "cpu" and view.shape == t.shape and view.numel() == 0
    assert view.stride() == t.stride()


def test_view_keeps_the_spyre_memory_alive(rng):
    """The view owns a reference to the spyre storage: dropping every spyre tensor frees
    nothing while the view exists, and the memory is released with the view."""
    gc.collect()
    before = torch.spyre.memory_allocated()
    src = random_of(rng, (1 << 16,), torch.float32)  # 256 KiB: arena memory
    t = src.to(SPYRE)
    view = host_view(t[1:])
    held = torch.spyre.memory_allocated()
    assert held >= before + src.numel() * 4
    del t
    gc.collect()
    assert torch.spyre.memory_allocated() == held
    assert same_bits(view, src[1:])
    del view
    gc.collect()
    assert torch.spyre.memory_allocated() == before


def test_autograd_and_version_counter_like_detach():
    t = torch.ones(4, device=SPYRE, requires_grad=True)
    view = host_view(t)
    assert not view.requires_grad and view.grad_fn is None
    leaf = torch.zeros(4, device=SPYRE)
    v = host_view(leaf)
    before = leaf._version
    v.add_(1)  # an in-place write through the view counts as one on the tensor
    assert leaf._version == before + 1 and v._version == leaf._version
    with torch.inference_mode():
        inference = torch.ones(3, device=SPYRE)
    assert host_view(inference).is_inference()
    assert not host_view(leaf).is_inference()


def test_conjugate_bit_is_kept():
    src = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    t = src.to(SPYRE).conj()
    view = host_view(t)
    assert view.is_conj()
    assert torch.equal(view.resolve_conj(), src.conj().resolve_conj())


def test_rejects_what_is_not_a_spyre_tensor():
    with pytest.raises(
        RuntimeError,
        match=r"host_view: argument 'tensor' must be a spyre "
        r"tensor, got a tensor on cpu",
    ):
        host_view(torch.zeros(3))
    with pytest.raises(
        RuntimeError,
        match=r"host_view: argument 'tensor' must be a spyre "
        r"tensor, got a tensor on meta",
    ):
        host_view(torch.zeros(3, device="meta"))
    with pytest.raises(
        TypeError,
        match=r"host_view: argument 'tensor' must be a spyre "
        r"torch.Tensor, got list",
    ):
        host_view([1, 2])
    # The dispatcher operator itself gives the same message (no Python wrapper checks).
    with pytest.raises(RuntimeError, match=r"host_view: argument 'tensor' must be a spyre"):
        torch.ops.spyreccl_device.host_view(torch.zeros(3))


def test_zero_copy_is_on_for_the_emulated_device(monkeypatch):
    """On in the host memory mode; off in discrete mode, where the device declares its memory
    not host-addressable and the multi-node stages must copy (as on real cards)."""
    assert staging.zero_copy_available() == (spyre_device.memory_mode() == "host")
    monkeypatch.setenv(staging.ZERO_COPY_ENV, "0")
    assert not staging.zero_copy_available()


def test_no_view_and_no_zero_copy_when_a_real_runtime_owns_the_device(tmp_path):
    """With torch_spyre installed the emulation steps aside: spyre memory is not known to
    be host memory, so host_view refuses and the multi-node stages copy."""
    (tmp_path / "torch_spyre").mkdir()
    (tmp_path / "torch_spyre" / "__init__.py").write_text("")
    out = assert_fresh_ok(
        run_fresh(
            """
            import torch
            from spyreccl_torch import device
            from spyreccl_torch.multinode import staging
            try:
                device.host_view(torch.zeros(2))
            except RuntimeError as error:
                print("refused:", "not active" in str(error))
            print(device.is_registered(), staging.zero_copy_available())
            print(staging.HostStaging(staging.zero_copy_available()).zero_copy)
            """,
            extra_path=(tmp_path,),
        )
    )
    assert out.split() == ["refused:", "True", "False", "False", "False"]


# -- the multi-node layer's staging (staging.py), single process -------------------------


@pytest.mark.parametrize(
    "zero_copy",
    [
        pytest.param(
            True,
            marks=pytest.mark.xfail(
                spyre_device.memory_mode() == "discrete",
                reason="discrete memory mode: staging.same_memory compares data_ptr(), which "
                "differs from the host view's, so commit() copies the view onto itself once",
                strict=True,
            ),
        ),
        False,
    ],
    ids=["zero-copy", "copies"],
)
def test_staging_round_trip_and_copy_counts(rng, zero_copy):
    """host()/host_bytes()/commit() give the same bits either way; in zero-copy mode a
    contiguous spyre tensor is used in place (no copies counted), a non-contiguous one
    costs exactly one copy each way."""
    stage = staging.HostStaging(zero_copy)
    src = random_of(rng, (64, 5), torch.bfloat16)
    t = src.to(SPYRE)
    host = stage.host(t)
    assert same_bits(host, src)
    assert (host.data_ptr() == host_address(t.data_ptr())) == zero_copy
    new = random_of(rng, (64, 5), torch.bfloat16)
    host.copy_(new)
    stage.commit(t, host)
    assert same_bits(t.cpu(), new)
    expected = {"to_host": 0, "from_host": 0} if zero_copy else {"to_host": 1, "from_host": 1}
    assert stage.counts == expected

    strided = t.t()
    out = torch.full((64, 5), float("nan"), dtype=torch.bfloat16, device=SPYRE).t()
    b = stage.host_bytes(strided)
    assert same_bits(b.view(torch.bfloat16).reshape(5, 64), new.t().contiguous())
    dest = stage.host_bytes(out, fill=False)
    dest.copy_(b)
    stage.commit(out, dest)
    assert same_bits(out.cpu(), new.t())
    assert stage.counts["to_host"] == expected["to_host"] + 1
    assert stage.counts["from_host"] == expected["from_host"] + 1

    whole = stage.concat_bytes([t[:3], torch.ones(3, dtype=torch.bool, device=SPYRE), t[3:5]])
    want = torch.cat(
        [
            src_part.reshape(-1).view(torch.uint8)
            for src_part in (new[:3], torch.ones(3, dtype=torch.bool), new[3:5])
        ]
    )
    assert torch.equal(whole, want)
    padded = stage.padded_bytes(t[:2], 2 * 5 * 2 + 6)
    assert torch.equal(padded[:20], new[:2].reshape(-1).view(torch.uint8))
    assert not padded[20:].any()
