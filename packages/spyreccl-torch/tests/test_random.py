"""Random numbers on spyre: a counter-based (Philox4x32-10) generator with a 16-byte
(seed, offset) state, as CUDA's, and what DTensor's OffsetBasedRNGTracker builds on it.

Single-process tests check the generator against an independent Python Philox (with the
published Random123 known-answer vector), the per-element counter contract, state handling
and distribution statistics. Two-rank tests check the tracker's guarantees on a spyre mesh:
shards are distinct parts of one global stream, a row-sharded random tensor equals the one an
unsharded op generates from the same seed, replicas agree, and the ranks' generators stay in
step with an unsharded program afterwards.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from spyreccl_testing.inputs import fresh_seed

SPYRE = "spyre"
M32 = 0xFFFFFFFF

# --- an independent Philox4x32-10 ---------------------------------------------------------


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> list[int]:
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return [c0, c1, c2, c3]


def element_words(seed: int, counter: int) -> list[int]:
    """The four words element `counter` of the stream of `seed` draws from."""
    return philox4x32_10((counter & M32, counter >> 32, 0, 0), (seed & M32, seed >> 32))


def test_philox_reference_matches_random123_known_answer():
    # Random123's kat_vectors: philox4x32 10 rounds, counter 0, key 0.
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = (M32, M32, M32, M32)
    assert philox4x32_10(ones, (M32, M32)) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def _state(seed: int, offset: int) -> torch.Tensor:
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)


def test_uniform_values_are_philox_of_seed_and_element_counter():
    seed = fresh_seed()
    torch.spyre.set_rng_state(_state(seed, 1000))
    f32 = torch.rand(37, device=SPYRE).cpu()
    f64 = torch.rand(37, device=SPYRE, dtype=torch.float64).cpu()
    # float32 took counters 1000..1036, rounded up to 1040; float64 starts there.
    expect32 = [(element_words(seed, 1000 + i)[0] >> 8) * 2.0**-24 for i in range(37)]
    expect64 = []
    for i in range(37):
        w = element_words(seed, 1040 + i)
        expect64.append((((w[0] << 32) | w[1]) >> 11) * 2.0**-53)
    assert f32.tolist() == pytest.approx(expect32, abs=0, rel=0), f"seed {seed}"
    assert f64.tolist() == expect64, f"seed {seed}"


def test_state_is_seed_and_offset():
    seed = fresh_seed()
    torch.spyre.manual_seed(seed)
    state = torch.spyre.get_rng_state()
    assert state.dtype == torch.uint8 and state.numel() == 16
    assert state.view(torch.int64).tolist() == [seed, 0]
    torch.randn(10, device=SPYRE)  # 10 counters, rounded up to a multiple of 4
    assert torch.spyre.get_rng_state().view(torch.int64).tolist() == [seed, 12]
    torch.empty(3, 4, device=SPYRE).uniform_()
    torch.empty(0, device=SPYRE).normal_()  # nothing drawn, nothing advanced
    assert torch.spyre.get_rng_state().view(torch.int64).tolist() == [seed, 24]
    with pytest.raises(RuntimeError, match="expected a state of 16 bytes"):
        torch.spyre.set_rng_state(torch.zeros(5056, dtype=torch.uint8))


def test_get_set_state_round_trip_and_fork_rng():
    torch.spyre.manual_seed(fresh_seed())
    torch.rand(7, device=SPYRE)
    state = torch.spyre.get_rng_state()
    a = torch.randn(100, device=SPYRE).cpu()
    torch.spyre.set_rng_state(state)
    assert torch.equal(torch.randn(100, device=SPYRE).cpu(), a)
    before_fork = torch.spyre.get_rng_state()
    current = torch.device(SPYRE, torch.spyre.current_device())
    with torch.random.fork_rng(devices=[current], device_type="spyre"):
        torch.spyre.manual_seed(1)
        torch.rand(50, device=SPYRE)
    # fork_rng restored the state from before the block: seed unchanged, offset 100 on.
    assert torch.equal(torch.spyre.get_rng_state(), before_fork)
    seed, offset = state.view(torch.int64).tolist()
    assert before_fork.view(torch.int64).tolist() == [seed, offset + 100]


def test_manual_seed_reproducibility_and_generators():
    seed = fresh_seed()
    torch.manual_seed(seed)
    a = torch.randn(64, device="spyre:1").cpu()
    torch.manual_seed(seed)
    assert torch.equal(torch.randn(64, device="spyre:1").cpu(), a)
    torch.manual_seed(seed + 1)
    assert not torch.equal(torch.randn(64, device="spyre:1").cpu(), a)

    g = torch.Generator(device=SPYRE).manual_seed(seed)
    b = torch.randn(64, device=SPYRE, generator=g).cpu()
    assert g.get_state().view(torch.int64).tolist() == [seed, 64]
    torch.spyre.manual_seed(seed)
    assert torch.equal(torch.randn(64, device=SPYRE).cpu(), b)  # same stream as the default


def test_values_depend_only_on_element_index():
    """Element i of an op is a function of (seed, offset + i): a later slice of the stream
    reproduces the tail, and a non-contiguous output is filled in logical row-major order."""
    seed = fresh_seed()
    for fill in (
        lambda t: t.normal_(),
        lambda t: t.uniform_(-2, 3),
        lambda t: t.bernoulli_(0.4),
        lambda t: t.exponential_(),
        lambda t: t.random_(0, 1000),
    ):
        torch.spyre.set_rng_state(_state(seed, 0))
        full = fill(torch.empty(12, 10, device=SPYRE)).cpu()
        torch.spyre.set_rng_state(_state(seed, 40))
        tail = fill(torch.empty(80, device=SPYRE)).cpu()
        assert torch.equal(full.flatten()[40:], tail)
        torch.spyre.set_rng_state(_state(seed, 0))
        transposed = torch.empty(10, 12, device=SPYRE).t()  # 12 x 10, column-major storage
        fill(transposed)
        assert torch.equal(transposed.cpu(), full)


def test_distribution_statistics():
    """n = 2**20 samples each. Tolerances are 6 standard errors of the estimate (a false
    failure has probability ~1e-9 per check): the mean of n draws with variance v has standard
    error sqrt(v / n); the sample standard deviation of a normal sample has sqrt(var / 2n)."""
    torch.spyre.manual_seed(fresh_seed())
    n = 1 << 20
    z = 6.0

    x = torch.empty(n, device=SPYRE, dtype=torch.float64).normal_(1.5, 2.0).cpu()
    assert abs(x.mean().item() - 1.5) < z * 2.0 / math.sqrt(n)
    assert abs(x.std().item() - 2.0) < z * 2.0 / math.sqrt(2 * n)
    # Gaussian tail mass beyond 3 sigma: 0.0026998, binomial standard error.
    tail = ((x - 1.5).abs() > 6.0).double().mean().item()
    assert abs(tail - 0.0026998) < z * math.sqrt(0.0027 / n)

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        y = torch.randn(n, device=SPYRE, dtype=dtype).cpu().double()
        # bfloat16 rounding (8 bits) adds variance ~(2**-8)**2/12 relative: negligible here.
        assert abs(y.mean().item()) < z / math.sqrt(n), dtype
        assert abs(y.std().item() - 1.0) < z / math.sqrt(2 * n) + 2e-3, dtype

    u = torch.empty(n, device=SPYRE).uniform_(-1.0, 3.0).cpu().double()
    assert u.min().item() >= -1.0 and u.max().item() < 3.0
    assert abs(u.mean().item() - 1.0) < z * math.sqrt(16 / 12 / n)
    counts = torch.histc(u, bins=16, min=-1.0, max=3.0)
    expect = n / 16
    assert (counts - expect).abs().max().item() < z * math.sqrt(expect)

    p = 0.3
    b = torch.empty(n, device=SPYRE).bernoulli_(p).cpu()
    assert set(b.unique().tolist()) <= {0.0, 1.0}
    assert abs(b.mean().item() - p) < z * math.sqrt(p * (1 - p) / n)

    e = torch.empty(n, device=SPYRE, dtype=torch.float64).exponential_(4.0).cpu()
    assert e.min().item() > 0
    assert abs(e.mean().item() - 0.25) < z * 0.25 / math.sqrt(n)

    r = torch.randint(3, 13, (n,), device=SPYRE).cpu()
    assert r.min().item() == 3 and r.max().item() == 12
    hist = torch.bincount(r - 3).double()
    assert (hist - n / 10).abs().max().item() < z * math.sqrt(n / 10)

    i8 = torch.empty(4096, dtype=torch.int8, device=SPYRE).random_().cpu()
    assert i8.min().item() >= 0 and i8.max().item() <= 127 and i8.max().item() > 100

    ln = torch.empty(n, device=SPYRE, dtype=torch.float64).log_normal_(0.5, 0.25).cpu()
    assert abs(ln.log().mean().item() - 0.5) < z * 0.25 / math.sqrt(n)


def test_complex_normal_and_uniform_follow_cpus_convention():
    """torch.randn / torch.rand with a complex dtype (and normal_ / uniform_ on a complex
    tensor) work as on CPU: the real and imaginary parts are the consecutive elements of the
    real view, each normal with std / sqrt(2) (so the complex value has variance std^2) or
    uniform in [from, to). Checked exactly against the float stream of the same seed, then
    statistically (6 standard errors, as above)."""
    seed = fresh_seed()
    n = 1 << 18
    for ctype, rtype in ((torch.complex64, torch.float32), (torch.complex128, torch.float64)):
        torch.spyre.manual_seed(seed)
        z = torch.empty(n, device=SPYRE, dtype=ctype).normal_(0.5, 2.0)
        torch.spyre.manual_seed(seed)
        parts = torch.empty(2 * n, device=SPYRE, dtype=rtype).normal_(0.5, 2.0 / math.sqrt(2))
        torch.testing.assert_close(torch.view_as_real(z).reshape(-1).cpu(), parts.cpu())
        torch.spyre.manual_seed(seed)
        u = torch.rand(n, device=SPYRE, dtype=ctype)
        torch.spyre.manual_seed(seed)
        flat = torch.empty(2 * n, device=SPYRE, dtype=rtype).uniform_(0.0, 1.0)
        torch.testing.assert_close(torch.view_as_real(u).reshape(-1).cpu(), flat.cpu())

        w = torch.randn(n, device=SPYRE, dtype=ctype).cpu().to(torch.complex128)
        assert abs(w.mean().item()) < 6.0 / math.sqrt(n)
        variance = (w.abs() ** 2).mean().item()  # E|w|^2 = 1, Var|w|^2 = 1 (exponential)
        assert abs(variance - 1.0) < 6.0 / math.sqrt(n)
        r = torch.view_as_real(u.cpu())
        assert r.min().item() >= 0.0 and r.max().item() < 1.0
        assert abs(r.mean().item() - 0.5) < 6.0 * math.sqrt(1 / 12 / (2 * n))

    # A strided complex tensor gets the values a contiguous one of its shape gets (row-major
    # element order), and the elements between its columns stay untouched.
    base = torch.zeros(8, 6, device=SPYRE, dtype=torch.complex64)
    torch.spyre.manual_seed(seed)
    base[:, ::2].normal_()
    torch.spyre.manual_seed(seed)
    dense = torch.empty(8, 3, device=SPYRE, dtype=torch.complex64).normal_()
    torch.testing.assert_close(base[:, ::2].cpu(), dense.cpu())
    assert torch.count_nonzero(base[:, 1::2].cpu()).item() == 0
    with pytest.raises(RuntimeError, match=r"normal expects std >= 0\.0"):
        torch.empty(4, device=SPYRE, dtype=torch.complex64).normal_(0.0, -1.0)


def test_dropout_uses_the_spyre_stream():
    seed = fresh_seed()
    p = 0.25
    x = torch.randn(4000, device=SPYRE)
    torch.spyre.manual_seed(seed)
    y = F.dropout(x, p=p, training=True)
    torch.spyre.manual_seed(seed)
    keep = torch.empty(4000, device=SPYRE).bernoulli_(1 - p).bool()
    expected = torch.where(keep, x / (1 - p), torch.zeros_like(x))
    torch.testing.assert_close(y.cpu(), expected.cpu(), rtol=1e-6, atol=0)
    assert torch.equal(F.dropout(x, p=p, training=False).cpu(), x.cpu())


def test_random_ops_without_a_spyre_kernel_are_reproducible():
    # randperm, multinomial, cauchy_ run their CPU kernels with a CPU engine seeded from the
    # spyre (seed, offset); each advances the offset by one block of 4.
    seed = fresh_seed()
    torch.spyre.manual_seed(seed)
    a = (torch.randperm(50, device=SPYRE).cpu(), torch.empty(9, device=SPYRE).cauchy_().cpu())
    assert torch.spyre.get_rng_state().view(torch.int64).tolist() == [seed, 8]
    torch.spyre.manual_seed(seed)
    b = (torch.randperm(50, device=SPYRE).cpu(), torch.empty(9, device=SPYRE).cauchy_().cpu())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert sorted(a[0].tolist()) == list(range(50))


def test_bad_arguments_are_reported():
    t = torch.empty(4, device=SPYRE)
    with pytest.raises(RuntimeError, match=r"normal expects std >= 0\.0"):
        t.normal_(0, -1)
    with pytest.raises(RuntimeError, match=r"uniform_ expects to return a \[from, to\) range"):
        t.uniform_(2, 1)
    with pytest.raises(RuntimeError, match="bernoulli_ expects p to be in"):
        t.bernoulli_(1.5)
    with pytest.raises(RuntimeError, match="'from' to be less than 'to'"):
        t.random_(5, 5)
    with pytest.raises(RuntimeError, match="expected a spyre generator"):
        t.normal_(generator=torch.Generator())


# --- DTensor on a spyre mesh (2 ranks) ----------------------------------------------------


def _dtensor_random_case(seed: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.accelerator.set_device_index(rank)
    mesh = init_device_mesh(SPYRE, (ws,))
    shape = (8 * ws, 6)  # each row shard holds 48 elements: a multiple of 4

    def unsharded(fills) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        return [f(torch.empty(shape, device=SPYRE)).cpu() for f in fills]

    fills = [
        lambda t: torch.nn.init.normal_(t, 0.5, 2.0),
        lambda t: torch.nn.init.uniform_(t, -1, 1),
        lambda t: t.bernoulli_(0.5),
        lambda t: torch.nn.init.trunc_normal_(t, std=0.02),
    ]
    expected = unsharded(fills)

    # Row-sharded: the full tensor equals the unsharded one, op after op (so the ranks'
    # generators end each op where an unsharded program's would).
    torch.manual_seed(seed)
    for fill, exp in zip(fills, expected):
        d = distribute_tensor(torch.empty(shape, device=SPYRE), mesh, [Shard(0)])
        fill(d)
        assert isinstance(d, DTensor) and d.placements == (Shard(0),)
        full = d.full_tensor().cpu()
        assert torch.equal(full, exp), f"rank {rank}: sharded init differs from unsharded"
        halves = full.chunk(ws)
        assert not torch.equal(halves[0], halves[1]), "shards must differ"
    state = torch.spyre.get_rng_state()
    torch.manual_seed(seed)
    unsharded(fills)
    assert torch.equal(state, torch.spyre.get_rng_state()), "generator out of step"

    # Replicated: every rank holds the same values, equal to the unsharded tensor.
    torch.manual_seed(seed)
    r = distribute_tensor(torch.empty(shape, device=SPYRE), mesh, [Replicate()])
    torch.nn.init.normal_(r, 0.5, 2.0)
    local = r.to_local().cpu()
    assert torch.equal(local, expected[0])
    gathered = [torch.empty_like(local) for _ in range(ws)]
    dist.all_gather_object(gathered, local)
    assert all(torch.equal(g, local) for g in gathered)

    # Column-sharded: each rank's shard is the block of the global stream that starts at its
    # shard index times the shard size (the tracker's contract), so the shards differ.
    torch.manual_seed(seed)
    c = distribute_tensor(torch.empty(shape, device=SPYRE), mesh, [Shard(1)])
    torch.nn.init.uniform_(c)
    local = c.to_local().cpu()
    torch.manual_seed(seed)
    stream = torch.rand(shape[0] * shape[1], device=SPYRE).cpu()
    n_local = local.numel()
    assert torch.equal(local.flatten(), stream[rank * n_local : (rank + 1) * n_local])

    # Dropout on a row-sharded activation keeps exactly the elements an unsharded dropout keeps.
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(SPYRE)
    torch.manual_seed(seed)
    ref = F.dropout(x, p=0.3, training=True).cpu()
    torch.manual_seed(seed)
    xd = distribute_tensor(x, mesh, [Shard(0)])
    out = F.dropout(xd, p=0.3, training=True).full_tensor().cpu()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.world_sizes(2)
def test_dtensor_random_ops_follow_the_global_stream(rank_pool):
    rank_pool.run(_dtensor_random_case, fresh_seed())


@pytest.mark.world_sizes(2)
def test_dtensor_random_init_of_a_tensor_parallel_module(rank_pool):
    rank_pool.run(_tp_module_init_case, fresh_seed())


def _tp_module_init_case(seed: int) -> None:
    """reset_parameters() of ColwiseParallel/RowwiseParallel linears gives the weights that the
    unsharded module gets from the same seed where the tracker promises it (row-sharded
    weights: ColwiseParallel shards dim 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.accelerator.set_device_index(rank)
    mesh = init_device_mesh(SPYRE, (ws,))
    torch.manual_seed(seed)
    ref = torch.nn.Linear(16, 8 * ws, device=SPYRE)
    tp = parallelize_module(torch.nn.Linear(16, 8 * ws, device=SPYRE), mesh, ColwiseParallel())
    torch.manual_seed(seed)
    tp.reset_parameters()
    torch.manual_seed(seed)
    ref.reset_parameters()
    torch.testing.assert_close(
        tp.weight.full_tensor().cpu(), ref.weight.detach().cpu(), rtol=0, atol=0
    )
    torch.testing.assert_close(tp.bias.full_tensor().cpu(), ref.bias.detach().cpu(), rtol=0, atol=0)
    bound = 1 / math.sqrt(16)  # kaiming_uniform_(a=sqrt(5)) on fan_in 16
    w = tp.weight.full_tensor().cpu()
    assert w.abs().max().item() <= bound and w.std().item() > bound / 3
    np.testing.assert_equal(len(set(w.flatten().tolist())), w.numel())  # no repeated draws


def test_default_generators_share_state_for_graph_safe_rng():
    """torch.compile's graph-safe RNG swaps generator state objects: graphsafe_get_state shares
    the state (it advances with the generator), clone_state copies it, graphsafe_set_state
    makes the generator draw from another state object."""
    from torch._functorch._aot_autograd.utils import supports_graphsafe_rng

    assert supports_graphsafe_rng(torch.device(SPYRE))
    gens = torch.spyre.default_generators
    assert len(gens) == torch.spyre.device_count()
    g = torch.spyre._get_generator(torch.device("spyre:1"))
    assert g.device == torch.device("spyre:1")
    seed = fresh_seed()
    g.manual_seed(seed)
    assert gens[1].initial_seed() == seed  # the default generator itself
    shared, copy = g.graphsafe_get_state(), g.clone_state()
    torch.rand(6, device="spyre:1")
    assert shared.get_state().view(torch.int64).tolist() == [seed, 8]
    assert copy.get_state().view(torch.int64).tolist() == [seed, 0]

    other = g.clone_state().manual_seed(seed + 1)
    saved = g.graphsafe_get_state()
    g.graphsafe_set_state(other)
    drawn = torch.rand(4, device="spyre:1").cpu()
    g.graphsafe_set_state(saved)
    assert other.get_state().view(torch.int64).tolist() == [seed + 1, 4]
    assert g.get_state().view(torch.int64).tolist() == [seed, 8]
    torch.spyre.set_rng_state(_state(seed + 1, 0), 1)
    assert torch.equal(torch.rand(4, device="spyre:1").cpu(), drawn)
