"""torch.spyre's random state where torch code saves and restores it: under dispatch modes
(a recording mode, FakeTensorMode, LocalTensorMode), inside torch.compile, and in activation
checkpointing's RNG preservation.

The state functions hand the state to the C++ generator as torch.cuda's do, without a torch
operator that an active mode could intercept. A recording mode proves that no operator is
dispatched; the other tests check the values that come out: states as (seed, offset) pairs,
random draws against eager draws from the same state, gradients against an unsharded
float64 reference and against the same program on CPU.

LocalTensorMode needs a default process group of the simulated world (the "fake" backend),
so those programs run in a one-process rank pool without a real group, never in the test
process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from spyreccl_testing.inputs import fresh_seed

# The LocalTensorMode programs run in a pool without a process group: they make their own.
pytestmark = pytest.mark.rank_pool_options(distributed=False)

SPYRE = "spyre"


def _seed() -> int:
    """A fresh seed with room below 2**63 for the tests' seed + k (states are int64 pairs)."""
    return fresh_seed() >> 1


def _state(seed: int, offset: int) -> torch.Tensor:
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)


def _seed_offset(state: torch.Tensor) -> list[int]:
    return state.view(torch.int64).tolist()


@pytest.fixture(autouse=True)
def _restore_spyre_rng():
    """Tests here reseed every device: put the states back for the rest of the process."""
    saved = torch.spyre.get_rng_state_all()
    yield
    torch.spyre.set_rng_state_all(saved)


class _RecordOps(TorchDispatchMode):
    """Records every operator dispatched while it is active, and runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_state_functions_dispatch_no_operator():
    seed = _seed()
    last = torch.spyre.device_count() - 1
    target = _state(seed + 1, 1000)
    others = [_state(seed + 2 + i, 4 * i) for i in range(torch.spyre.device_count())]
    spare = torch.spyre.default_generators[last].clone_state().manual_seed(seed + 50)
    torch.spyre.current_device()  # device initialisation (LOCAL_RANK) is not under test

    got: dict[str, Any] = {}
    with _RecordOps() as mode:
        got["count"] = torch.spyre.device_count()
        torch.spyre.set_device(last)
        got["current"] = torch.spyre.current_device()
        torch.spyre.set_device(0)
        with torch.spyre.device(last):
            got["inside"] = torch.spyre.current_device()
        torch.spyre.manual_seed(seed)
        got["initial"] = torch.spyre.initial_seed()
        got["seeded"] = torch.spyre.get_rng_state()
        torch.spyre.set_rng_state(target, f"spyre:{last}")
        got["target"] = torch.spyre.get_rng_state(torch.device(SPYRE, last))
        torch.spyre.manual_seed_all(seed + 3)
        got["all_seeded"] = torch.spyre.get_rng_state_all()
        torch.spyre.set_rng_state_all(others)
        got["all_set"] = torch.spyre.get_rng_state_all()
        torch.spyre.seed()
        got["reseeded"] = torch.spyre.initial_seed()
        torch.spyre.seed_all()
        got["reseeded_all"] = [g.initial_seed() for g in torch.spyre.default_generators]
        generator = torch.spyre._get_generator(torch.device(SPYRE, last))
        generator.set_state(target)
        got["generator"] = generator.get_state()
        shared = generator.graphsafe_get_state()
        generator.graphsafe_set_state(spare)
        got["swapped"] = torch.spyre.get_rng_state(last)
        generator.graphsafe_set_state(shared)
        got["swapped_back"] = torch.spyre.get_rng_state(last)
    assert mode.ops == [], f"torch operators dispatched: {mode.ops}"

    assert got["count"] == last + 1
    assert got["current"] == got["inside"] == last
    assert torch.spyre.current_device() == 0
    assert got["initial"] == seed
    assert _seed_offset(got["seeded"]) == [seed, 0]
    assert torch.equal(got["target"], target)
    assert [_seed_offset(s) for s in got["all_seeded"]] == [[seed + 3, 0]] * (last + 1)
    assert all(torch.equal(a, b) for a, b in zip(got["all_set"], others, strict=True))
    seeds = got["reseeded_all"]
    assert seeds == [seeds[0]] * (last + 1) and seeds[0] != got["reseeded"]
    assert torch.equal(got["generator"], target)
    assert _seed_offset(got["swapped"]) == [seed + 50, 0]
    assert torch.equal(got["swapped_back"], target)


def test_rng_state_inside_fake_tensor_mode():
    """The state a fake mode sees is the real one: get returns a real CPU tensor, set takes
    effect (DTensor's sharding propagation runs under such a mode)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    seed = _seed()
    target = _state(seed, 40)
    torch.spyre.manual_seed(seed + 1)
    with FakeTensorMode():  # without allow_non_fake_inputs: an op on a real tensor raises
        before = torch.spyre.get_rng_state()
        torch.spyre.set_rng_state(target)
        after = torch.spyre.get_rng_state()
        fake = torch.empty(16, dtype=torch.uint8)
        with pytest.raises(RuntimeError, match="got a tensor subclass"):
            torch.spyre.set_rng_state(fake)
    assert isinstance(fake, FakeTensor)
    for state in (before, after):
        assert type(state) is torch.Tensor and state.device.type == "cpu"
    assert _seed_offset(before) == [seed + 1, 0]
    assert torch.equal(after, target) and torch.equal(torch.spyre.get_rng_state(), target)
    drawn = torch.rand(64, device=SPYRE).cpu()
    torch.spyre.manual_seed(seed)
    torch.rand(40, device=SPYRE)  # counters 0..39: the stream continues at offset 40
    assert torch.equal(torch.rand(64, device=SPYRE).cpu(), drawn)


def test_set_rng_state_rejects_what_is_not_a_state():
    # As torch.cuda's: the state is not converted (that would be a torch operator).
    before = torch.spyre.get_rng_state()
    for bad, what in (
        (torch.zeros(2, dtype=torch.int64), "Long"),
        (torch.zeros(16, dtype=torch.uint8, device=SPYRE), "spyre"),
        (torch.zeros(32, dtype=torch.uint8)[::2], "contiguous"),
    ):
        with pytest.raises(RuntimeError, match=r"expected a contiguous CPU torch\.uint8 tensor"):
            torch.spyre.set_rng_state(bad)
        assert torch.equal(torch.spyre.get_rng_state(), before), what


def _save_draw_restore(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    state = torch.spyre.get_rng_state()
    a = torch.rand_like(x)
    torch.spyre.set_rng_state(state)
    b = torch.rand_like(x)  # the same numbers again
    kept = F.dropout(x, p=0.5, training=True)
    return a, b, x * b, kept


def test_compiled_function_saves_and_restores_the_state():
    """torch.compile (AOT autograd, which traces with fake tensors) around a function that
    saves and restores the spyre state gives eager's numbers and leaves the generator where
    eager leaves it."""
    torch._dynamo.reset()
    seed = _seed()
    x = torch.randn(33, 5, generator=torch.Generator().manual_seed(seed)).to(SPYRE)
    torch.spyre.manual_seed(seed)
    expected = [t.cpu() for t in _save_draw_restore(x)]
    expected_state = torch.spyre.get_rng_state()
    # offsets: 165 counters rounded to 168 for a; b redraws them; dropout takes 168 more
    assert _seed_offset(expected_state) == [seed, 336]
    compiled = torch.compile(_save_draw_restore, backend="aot_eager")
    for _ in range(2):  # the first call compiles, the second runs the compiled code
        torch.spyre.manual_seed(seed)
        got = [t.cpu() for t in compiled(x)]
        for g, e, name in zip(got, expected, ("a", "b", "x * b", "dropout"), strict=True):
            assert torch.equal(g, e), name
        assert torch.equal(got[0], got[1])  # the state was restored between the draws
        assert torch.equal(torch.spyre.get_rng_state(), expected_state)


class _DropoutMLP(torch.nn.Module):
    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(24, 48, generator=generator) / 5)
        self.w2 = torch.nn.Parameter(torch.randn(48, 24, generator=generator) / 7)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(x @ self.w1), p=0.3, training=True)
        return F.dropout(h @ self.w2, p=0.2, training=True)


def _grads(model: _DropoutMLP, x: torch.Tensor, seed: int, **ckpt: Any) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.spyre.manual_seed(seed)
    xs = x.detach().requires_grad_()
    out = checkpoint(model.block, xs, **ckpt) if ckpt else model.block(xs)
    (out * out).sum().backward()
    return [t.grad.cpu() for t in (xs, model.w1, model.w2)]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_preserves_the_spyre_rng_state(use_reentrant: bool):
    """Recomputation in the backward replays the forward's dropout masks: the gradients equal
    those of the same program without checkpointing, and the generator ends where it does."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    model = _DropoutMLP(g).to(SPYRE)
    x = torch.randn(17, 24, generator=g).to(SPYRE)
    expected = _grads(model, x, seed)
    expected_state = torch.spyre.get_rng_state()
    got = _grads(model, x, seed, use_reentrant=use_reentrant, preserve_rng_state=True)
    for e, name in zip(expected, ("x", "w1", "w2"), strict=True):
        assert e.abs().sum().item() > 0, name
    for g_, e, name in zip(got, expected, ("x", "w1", "w2"), strict=True):
        torch.testing.assert_close(g_, e, rtol=0, atol=0, msg=f"grad of {name}")
    assert torch.equal(torch.spyre.get_rng_state(), expected_state)
    # Without preservation the recomputed masks are new draws, so the gradients differ: the
    # equality above is the RNG state being restored, not dropout being inert.
    unpreserved = _grads(model, x, seed, use_reentrant=use_reentrant, preserve_rng_state=False)
    assert not torch.equal(unpreserved[0], expected[0])


# --- LocalTensorMode (single-process SPMD simulation) ---------------------------------------

WORLD = 3


def _local_tensor_program(device_type: str, seed: int) -> dict[str, Any]:
    """DTensor redistributes forward and backward, and a sharded random init, on a simulated
    mesh of WORLD ranks. LocalTensorMode saves and restores the accelerator's (spyre's) RNG
    state around every rank's step of every op, whatever the mesh's device."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def single(t: torch.Tensor) -> torch.Tensor:
        # Every simulated rank must hold the same values; one copy, on the host.
        return (t.reconcile() if isinstance(t, LocalTensor) else t).detach().cpu()

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 5, dtype=torch.float64, generator=g)  # 7 rows: shards of 3, 3, 1
    w = torch.randn(5, 4, dtype=torch.float64, generator=g)
    c = torch.randn(7, 4, dtype=torch.float64, generator=g)
    dist.init_process_group(f"cpu:fake,{SPYRE}:fake", rank=0, world_size=WORLD, store=FakeStore())
    try:
        with LocalTensorMode(frozenset(range(WORLD))):
            mesh = init_device_mesh(device_type, (WORLD,))
            d = distribute_tensor(x.to(device_type).requires_grad_(), mesh, [Shard(0)])
            r = d.redistribute(mesh, [Replicate()])  # all-gather
            s = r.redistribute(mesh, [Shard(1)])  # local chunk
            t = s.redistribute(mesh, [Shard(0)])  # all-to-all
            u = t @ distribute_tensor(w.to(device_type), mesh, [Replicate()])
            cd = distribute_tensor(c.to(device_type), mesh, [Shard(0)])
            loss = (torch.tanh(u) * cd).sum()
            loss.backward()
            result = {
                "u": single(u.full_tensor()),
                "loss": single(loss.full_tensor()),
                "grad": single(d.grad.full_tensor()),
                "grad_placements": d.grad.placements,
            }
            if device_type == SPYRE:
                # Sharded random init from an explicit spyre generator. (Without one,
                # torch's LocalTensorMode RNG tracker asks torch.cuda for the current device.)
                gen = torch.Generator(SPYRE).manual_seed(seed)
                init = distribute_tensor(torch.empty(7, 4, device=SPYRE), mesh, [Shard(0)])
                torch.nn.init.uniform_(init, generator=gen)
                result["init"] = single(init.full_tensor())
                result["init_local_rows"] = [
                    init.to_local()._local_tensors[r].shape[0] for r in range(WORLD)
                ]
                result["generator_after"] = gen.get_state()
        return result
    finally:
        dist.destroy_process_group()


def _local_tensor_case(seed: int) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor]:
    spyre = _local_tensor_program(SPYRE, seed)
    cpu = _local_tensor_program("cpu", seed)
    gen = torch.Generator(SPYRE).manual_seed(seed)
    unsharded = torch.empty(7, 4, device=SPYRE).uniform_(generator=gen).cpu()
    return spyre, cpu, unsharded


@pytest.mark.parametrize("rank_pool", [1], indirect=True)
def test_local_tensor_mode_dtensor_program_on_spyre_equals_cpu(rank_pool):
    seed = _seed()
    [(spyre, cpu, unsharded)] = rank_pool.run(_local_tensor_case, seed, timeout=240)

    # Independent reference: the unsharded program in float64 with plain autograd.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 5, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(5, 4, dtype=torch.float64, generator=g)
    c = torch.randn(7, 4, dtype=torch.float64, generator=g)
    u = x @ w
    loss = (torch.tanh(u) * c).sum()
    loss.backward()
    for result in (spyre, cpu):
        torch.testing.assert_close(result["u"], u.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(result["loss"], loss.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(result["grad"], x.grad, rtol=1e-12, atol=1e-12)
    # The same program on a CPU mesh: identical values and placements.
    for key in ("u", "loss", "grad"):
        assert torch.equal(spyre[key], cpu[key]), key
    assert spyre["grad_placements"] == cpu["grad_placements"]

    # The row-sharded init is the unsharded tensor: each rank drew its part of the stream.
    assert spyre["init_local_rows"] == [3, 3, 1]
    assert torch.equal(spyre["init"], unsharded)
    assert not torch.equal(spyre["init"][:3], spyre["init"][3:6])  # not one draw per shard
    assert _seed_offset(spyre["generator_after"]) == [seed, 28]
