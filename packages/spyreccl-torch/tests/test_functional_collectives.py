"""Functional collectives (``torch.distributed._functional_collectives``) on spyre + spyreccl.

Covers every eager scenario of PyTorch's own ``test_c10d_functional_native.py`` (class
``TestWithNCCL``) with our own code, plus what that file does not check: fresh random inputs,
float64 references, poisoned ``out=`` tensors, odd and empty lengths, world size 3, and every
form a group may take (name, ProcessGroup, rank list, DeviceMesh, (DeviceMesh, dim)).

Every rank draws the inputs of *all* ranks from one shared seed, so each rank can compute the
expected result locally in float64 without trusting any collective. Rank functions take the
device type as an argument: the tests pass "spyre"; a CPU/gloo run of the same functions is a
cheap sanity check of the test logic itself.
"""

from __future__ import annotations

import os
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from spyreccl_testing.scripts import run_rank_scripts

DEVICE = "spyre"
C10D = torch.ops._c10d_functional

# Reduce ops as the functional API spells them, with a float64 / exact-integer reference.
_FLOAT_OPS = ("sum", "avg", "max", "min", "product")


# ----------------------------------------------------------------------------------------
# helpers (run inside the rank processes)
# ----------------------------------------------------------------------------------------


def _rank_device(device_type: str) -> torch.device:
    """The device a rank works on. Like the upstream test, rank r uses device index r (when the
    device has that many), so spyre tensors may sit on an index other than 0."""
    if device_type == "cpu":
        return torch.device("cpu")
    index = dist.get_rank() % torch.accelerator.device_count()
    torch.accelerator.set_device_index(index)
    return torch.device(device_type, index)


def _world_inputs(
    seed: int, shape: tuple[int, ...], dtype: torch.dtype, world_size: int
) -> list[torch.Tensor]:
    """Inputs of every rank, on CPU, drawn from one generator so all ranks agree on them."""
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        # Values in [0.5, 2) keep PRODUCT well conditioned and far from zero.
        return [
            (torch.rand(shape, generator=gen, dtype=torch.float64) * 1.5 + 0.5).to(dtype)
            for _ in range(world_size)
        ]
    return [torch.randint(-50, 50, shape, generator=gen, dtype=dtype) for _ in range(world_size)]


def _reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """Elementwise reduction of the per-rank inputs: float64 for floats, exact int64 for ints
    (integer AVG truncates toward zero, the rule spyreccl documents)."""
    if inputs[0].dtype.is_floating_point:
        stacked = torch.stack([t.to(torch.float64) for t in inputs])
    else:
        stacked = torch.stack([t.to(torch.int64) for t in inputs])
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        if stacked.dtype == torch.int64:
            return torch.div(stacked.sum(0), len(inputs), rounding_mode="trunc")
        return stacked.sum(0) / len(inputs)
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    if op == "product":
        return stacked.prod(0)
    raise ValueError(f"no reference for reduce op {op!r}")


def _poisoned_like(t: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    out = torch.empty(t.shape if shape is None else shape, dtype=t.dtype, device=t.device)
    out.fill_(float("nan") if t.dtype.is_floating_point else -7777)
    return out


def _check(actual: torch.Tensor, expected: torch.Tensor, what: str, seed: int) -> None:
    # clone is not a view op: on an AsyncCollectiveTensor it triggers (and records) the wait,
    # which is what user code relies on.
    got = actual.clone().detach().to("cpu")
    assert got.shape == expected.shape, (
        f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    )
    msg = f"{what} (rank {dist.get_rank()}, seed {seed})"
    if expected.dtype.is_floating_point:
        # float32 results of <= 3 operands: a few ulp; PRODUCT and AVG compound one rounding each.
        torch.testing.assert_close(
            got.to(torch.float64), expected.to(torch.float64), rtol=4e-6, atol=1e-6, msg=msg
        )
    else:
        assert torch.equal(got.to(torch.int64), expected.to(torch.int64)), (
            f"{msg}: {got.tolist()} != {expected.tolist()}"
        )


def _assert_async(out: torch.Tensor, what: str) -> None:
    """The Python API must hand back an AsyncCollectiveTensor that is waited lazily."""
    assert isinstance(out, AsyncCollectiveTensor), f"{what}: got {type(out).__name__}"
    assert not out.completed, f"{what}: completed before first use"


def _world_name() -> str:
    return dist.group.WORLD.group_name


# ----------------------------------------------------------------------------------------
# rank functions
# ----------------------------------------------------------------------------------------


def _all_reduce(device_type: str, seed: int) -> None:
    dev, ws, rank = _rank_device(device_type), dist.get_world_size(), dist.get_rank()
    for i, op in enumerate(_FLOAT_OPS):
        inputs = _world_inputs(seed + i, (7, 13), torch.float32, ws)
        expected = _reference(inputs, op)
        inp = inputs[rank].to(dev, copy=True)
        before = inp.clone()

        out = C10D.wait_tensor(C10D.all_reduce(inp, op, _world_name()))
        assert out is not inp and out.device == dev
        _check(out, expected, f"_c10d_functional.all_reduce({op})", seed)
        assert torch.equal(inp, before), "all_reduce modified its input"

        acs = funcol.all_reduce(inp, op.upper(), dist.group.WORLD)
        _assert_async(acs, "funcol.all_reduce")
        _check(acs, expected, f"funcol.all_reduce({op})", seed)

    # In place: the op returns its argument, reduced.
    inputs = _world_inputs(seed + 100, (33,), torch.float32, ws)
    inp = inputs[rank].to(dev, copy=True)
    out = C10D.wait_tensor(C10D.all_reduce_(inp, "avg", _world_name()))
    assert out is inp, "all_reduce_ must return its input"
    _check(inp, _reference(inputs, "avg"), "all_reduce_(avg)", seed)

    # Integer AVG truncates toward zero.
    inputs = _world_inputs(seed + 200, (5, 3), torch.int64, ws)
    out = C10D.wait_tensor(C10D.all_reduce(inputs[rank].to(dev, copy=True), "avg", _world_name()))
    _check(out, _reference(inputs, "avg"), "all_reduce(avg, int64)", seed)


def _all_reduce_dtypes(device_type: str, seed: int) -> None:
    """SUM over the dtypes training uses. Inputs in [0.5, 2) make every partial sum exact in
    float32, and spyreccl rounds 16-bit results once from a float32 accumulator, so the
    float64 reference rounded to the dtype must match bit for bit."""
    dev, ws, rank = _rank_device(device_type), dist.get_world_size(), dist.get_rank()
    for i, dtype in enumerate(
        (torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int8)
    ):
        inputs = _world_inputs(seed + i, (3, 37), dtype, ws)
        if dtype == torch.int8:
            inputs = [t.clamp(-40, 40) for t in inputs]  # no wrap-around at world size 3
        expected = _reference(inputs, "sum").to(dtype)
        out = C10D.wait_tensor(
            C10D.all_reduce(inputs[rank].to(dev, copy=True), "sum", _world_name())
        )
        assert out.dtype == dtype, f"all_reduce returned {out.dtype} for {dtype}"
        got = out.to("cpu")
        assert torch.equal(got, expected), (
            f"all_reduce(sum, {dtype}) (rank {rank}, seed {seed}): max diff "
            f"{(got.double() - expected.double()).abs().max().item()}"
        )


def _all_reduce_coalesced(device_type: str, seed: int) -> None:
    dev, ws, rank = _rank_device(device_type), dist.get_world_size(), dist.get_rank()
    # Square shapes 0x0 .. 6x6 (the first member is empty), like the upstream test, plus an
    # odd 1-D length.
    shapes = [(i, i) for i in range(7)] + [(1001,)]
    per_member = [_world_inputs(seed + i, s, torch.float32, ws) for i, s in enumerate(shapes)]
    expected = [_reference(m, "avg") for m in per_member]
    inputs = [m[rank].to(dev, copy=True) for m in per_member]

    outs = C10D.all_reduce_coalesced(inputs, "avg", _world_name())
    for i, (out, inp) in enumerate(zip(outs, inputs)):
        out = C10D.wait_tensor(out)
        assert out is not inp
        _check(out, expected[i], f"all_reduce_coalesced member {i}", seed)

    acs = funcol.all_reduce_coalesced(inputs, "avg", dist.group.WORLD)
    for i, out in enumerate(acs):
        _assert_async(out, "funcol.all_reduce_coalesced")
        _check(out, expected[i], f"funcol.all_reduce_coalesced member {i}", seed)
        assert out.completed

    outs = C10D.all_reduce_coalesced_(inputs, "avg", _world_name())
    for i, (out, inp) in enumerate(zip(outs, inputs)):
        out = C10D.wait_tensor(out)
        assert out is inp, "all_reduce_coalesced_ must return its inputs"
        _check(inp, expected[i], f"all_reduce_coalesced_ member {i}", seed)


def _all_gather(device_type: str, seed: int) -> None:
    dev, ws, rank = _rank_device(device_type), dist.get_world_size(), dist.get_rank()
    inputs = _world_inputs(seed, (5, 3), torch.float32, ws)
    expected = torch.cat(inputs)
    inp = inputs[rank].to(dev, copy=True)

    out = C10D.wait_tensor(C10D.all_gather_into_tensor(inp, ws, _world_name()))
    _check(out, expected, "all_gather_into_tensor", seed)

    out = _poisoned_like(inp, tuple(expected.shape))
    ret = C10D.wait_tensor(C10D.all_gather_into_tensor_out(inp, ws, _world_name(), out=out))
    assert ret.data_ptr() == out.data_ptr(), "all_gather_into_tensor_out must fill out="
    _check(out, expected, "all_gather_into_tensor_out", seed)

    acs = funcol.all_gather_single(inp, 0, dist.group.WORLD)
    _assert_async(acs, "funcol.all_gather_single")
    _check(acs, expected, "funcol.all_gather_single(dim 0)", seed)
    assert acs.completed

    # gather_dim != 0 goes through a chunk + cat on the gathered buffer.
    _check(
        funcol.all_gather_single(inp, 1, dist.group.WORLD),
        torch.cat(inputs, dim=1),
        "funcol.all_gather_single(dim 1)",
        seed,
    )
    # The deprecated spelling still works (and says so).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        legacy = funcol.all_gather_tensor(inp, 0, dist.group.WORLD)
    assert any(issubclass(w.category, FutureWarning) for w in caught)
    _check(legacy, expected, "funcol.all_gather_tensor", seed)

    # Odd length and an empty tensor.
    inputs = _world_inputs(seed + 1, (17,), torch.float32, ws)
    _check(
        funcol.all_gather_single(inputs[rank].to(dev, copy=True), 0, dist.group.WORLD),
        torch.cat(inputs),
        "all_gather odd length",
        seed,
    )
    empty = torch.empty(0, 4, device=dev)
    out = C10D.wait_tensor(C10D.all_gather_into_tensor(empty, ws, _world_name()))
    assert tuple(out.shape) == (0, 4) and out.device == dev


def _all_gather_coalesced(device_type: str, seed: int) -> None:
    dev, ws, rank = _rank_device(device_type), dist.get_world_size(), dist.get_rank()
    shapes = [(4, 4), (0,), (9,), (2, 3, 5)]
    per_member = [_world_inputs(seed + i, s, torch.float32, ws) for i, s in enumerate(shapes)]
    expected = [torch.cat(m) for m in per_member]
    inputs = [m[rank].to(dev, copy=True) for m in per_member]

    outs = C10D.all_gather_into_tensor_coalesced(inputs, ws, _world_name())
    for i, out in enumerate(outs):
        _check(C10D.wait_tensor(out), expected[i], f"all_gather_into_tensor_coalesced {i}", seed)

    acs = funcol.all_gather_single_coalesced(inputs, dist.group.WORLD)
    for i, out in enumerate(acs):
        _assert_async(out, "funcol.all_gather_single_coalesced")
        _check(out, expected[i], f"funcol.all_gather_single_coalesced {i}", seed)


def _inference_mode(device_type: str, seed: int) -> None:
    """Under inference_mode an op on an AsyncCollectiveTensor must first wait, then return a
    plain tensor (pytorch issue 133421); also checks a bfloat16 conversion on the device."""
    dev, ws, rank = _rank_device(device_type), dist.get_world_size(), dist.get_rank()
    inputs = _world_inputs(seed, (2, 2), torch.float32, ws)
    with torch.inference_mode():
        gathered = funcol.all_gather_single(inputs[rank].to(dev, copy=True), 0, dist.group.WORLD)
        converted = gathered.to(dtype=torch.bfloat16)
    assert type(converted) is torch.Tensor, f"got {type(converted).__name__}"
    assert converted.device == dev and converted.dtype == torch.bfloat16
    _check(converted, torch.cat(inputs).to(torch.bfloat16), "inference-mode all_gather", seed)


def _batched_p2p(device_type: str, seed: int) -> None:
    """batch_p2p_ops: rank 0 sends to rank 1 (ranks >= 2 sit out, as upstream)."""
    dev, rank = _rank_device(device_type), dist.get_rank()
    payload = _world_inputs(seed, (10,), torch.float32, 1)[0]
    if rank > 1:
        return
    with torch.inference_mode():
        tensor = (
            payload.to(dev, copy=True) if rank == 0 else _poisoned_like(payload.to(dev, copy=True))
        )
        (out,) = funcol.batch_p2p_ops_inplace(
            op_list=["isend" if rank == 0 else "irecv"],
            peer_list=[1 if rank == 0 else 0],
            tag_list=[0],
            tensors=[tensor],
            group_name="",
        )
        out = funcol.wait_tensor(out)
    if rank == 0:
        assert out.numel() == 0, "an isend returns an empty placeholder"
    else:
        _check(out, payload, "batch_p2p_ops irecv", seed)


def _reduce_scatter(device_type: str, seed: int) -> None:
    dev, ws, rank = _rank_device(device_type), dist.get_world_size(), dist.get_rank()

    # int64 AVG, the upstream case gloo cannot run: exact, truncating.
    inputs = _world_inputs(seed, (ws * 3, 2), torch.int64, ws)
    expected = _reference(inputs, "avg").chunk(ws)[rank]
    inp = inputs[rank].to(dev, copy=True)
    out = C10D.wait_tensor(C10D.reduce_scatter_tensor(inp, "avg", ws, _world_name()))
    _check(out, expected, "reduce_scatter_tensor(avg, int64)", seed)

    out = _poisoned_like(inp, tuple(expected.shape))
    work = C10D.reduce_scatter_tensor_out(inp, "avg", ws, _world_name(), out=out)
    C10D.wait_tensor(work)
    _check(out, expected, "reduce_scatter_tensor_out(avg, int64)", seed)

    acs = funcol.reduce_scatter_single(inp, "avg", 0, dist.group.WORLD)
    _assert_async(acs, "funcol.reduce_scatter_single")
    _check(acs, expected, "funcol.reduce_scatter_single(avg, int64)", seed)

    # float32 SUM along dim 1 (chunk + cat before the collective), odd row count.
    inputs = _world_inputs(seed + 1, (3, ws * 5), torch.float32, ws)
    expected = _reference(inputs, "sum").chunk(ws, dim=1)[rank]
    _check(
        funcol.reduce_scatter_single(inputs[rank].to(dev, copy=True), "sum", 1, dist.group.WORLD),
        expected,
        "funcol.reduce_scatter_single(sum, dim 1)",
        seed,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        legacy = funcol.reduce_scatter_tensor(
            inputs[rank].to(dev, copy=True), "sum", 1, dist.group.WORLD
        )
    assert any(issubclass(w.category, FutureWarning) for w in caught)
    _check(legacy, expected, "funcol.reduce_scatter_tensor", seed)


def _reduce_scatter_coalesced(device_type: str, seed: int) -> None:
    dev, ws, rank = _rank_device(device_type), dist.get_world_size(), dist.get_rank()
    shapes = [(ws * i, 2) for i in range(6)]  # the first member is empty
    per_member = [_world_inputs(seed + i, s, torch.int64, ws) for i, s in enumerate(shapes)]
    expected = [
        _reference(m, "avg").chunk(ws)[rank] if m[0].numel() else m[0][:0] for m in per_member
    ]
    inputs = [m[rank].to(dev, copy=True) for m in per_member]

    outs = C10D.reduce_scatter_tensor_coalesced(inputs, "avg", ws, _world_name())
    for i, out in enumerate(outs):
        _check(C10D.wait_tensor(out), expected[i], f"reduce_scatter_tensor_coalesced {i}", seed)

    acs = funcol.reduce_scatter_single_coalesced(
        list(inputs), "avg", [0] * len(inputs), dist.group.WORLD
    )
    for i, out in enumerate(acs):
        _assert_async(out, "funcol.reduce_scatter_single_coalesced")
        _check(out, expected[i], f"funcol.reduce_scatter_single_coalesced {i}", seed)


def _all_to_all(device_type: str, seed: int) -> None:
    dev, ws, rank = _rank_device(device_type), dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    # sizes[i][j]: rows rank i sends to rank j; zeros included on purpose.
    sizes = torch.randint(0, 6, (ws, ws), generator=gen)
    sizes[0][ws - 1] = 0
    # What rank i sends to rank j is a deterministic block, so everyone can build references.
    blocks = [
        [
            torch.rand(int(sizes[i][j]), 3, generator=gen, dtype=torch.float64).float()
            for j in range(ws)
        ]
        for i in range(ws)
    ]
    in_splits = sizes[rank].tolist()
    out_splits = sizes[:, rank].tolist()
    inp = torch.cat(blocks[rank]).to(dev, copy=True)
    expected = torch.cat([blocks[i][rank] for i in range(ws)])

    out = C10D.wait_tensor(C10D.all_to_all_single(inp, out_splits, in_splits, _world_name()))
    _check(out, expected, "all_to_all_single(splits)", seed)

    acs = funcol.all_to_all_single(inp, out_splits, in_splits, dist.group.WORLD)
    _assert_async(acs, "funcol.all_to_all_single")
    _check(acs, expected, "funcol.all_to_all_single(splits)", seed)
    assert acs.completed

    # Without split sizes: equal chunks of dim 0.
    inputs = _world_inputs(seed + 1, (ws * 2, 5), torch.float32, ws)
    expected = torch.cat([inputs[i].chunk(ws)[rank] for i in range(ws)])
    _check(
        funcol.all_to_all_single(inputs[rank].to(dev, copy=True), None, None, dist.group.WORLD),
        expected,
        "funcol.all_to_all_single(equal splits)",
        seed,
    )


def _broadcast(device_type: str, seed: int) -> None:
    dev, ws, rank = _rank_device(device_type), dist.get_world_size(), dist.get_rank()
    src = 1  # a non-zero root, as upstream
    inputs = _world_inputs(seed, (10, 3), torch.float32, ws)
    inp = inputs[rank].to(dev, copy=True)

    out = C10D.wait_tensor(C10D.broadcast(inp, src, _world_name()))
    assert out is not inp
    _check(out, inputs[src], "_c10d_functional.broadcast", seed)
    _check(inp, inputs[rank], "broadcast must not modify its input", seed)

    acs = funcol.broadcast(inp, src, dist.group.WORLD)
    _assert_async(acs, "funcol.broadcast")
    _check(acs, inputs[src], "funcol.broadcast", seed)

    out = C10D.wait_tensor(C10D.broadcast_(inp, src, _world_name()))
    assert out is inp
    _check(inp, inputs[src], "_c10d_functional.broadcast_", seed)


def _wait_tensor_registry(device_type: str, seed: int) -> None:
    dev = _rank_device(device_type)
    # Counts are relative: the pool's processes are shared with earlier cases.
    base = torch._C._distributed_c10d._get_work_registry_size()

    def registry_size() -> int:
        return torch._C._distributed_c10d._get_work_registry_size() - base

    inp = torch.full((10, 10), float(dist.get_rank()), device=dev)
    out = C10D.all_reduce(inp, "avg", _world_name())
    assert registry_size() == 1
    C10D.wait_tensor(out)
    assert registry_size() == 0, "wait_tensor must pop the work"
    # A coalesced call registers one entry per output, each popped by its own wait.
    outs = C10D.all_reduce_coalesced([inp, inp * 2], "sum", _world_name())
    assert registry_size() == 2
    C10D.wait_tensor(outs[0])
    assert registry_size() == 1
    C10D.wait_tensor(outs[1])
    assert registry_size() == 0
    expected = torch.full((10, 10), float(sum(range(dist.get_world_size()))))
    _check(outs[0], expected, "all_reduce_coalesced after wait_tensors", seed)


def _group_forms(device_type: str, seed: int) -> None:
    """The same all_reduce through every form a funcol group may take, and the raw op with a
    ProcessGroup object in its ``Any group_name`` slot."""
    from torch.distributed.device_mesh import init_device_mesh

    dev, ws, rank = _rank_device(device_type), dist.get_world_size(), dist.get_rank()
    inputs = _world_inputs(seed, (6,), torch.float32, ws)
    expected = _reference(inputs, "sum")
    inp = inputs[rank].to(dev, copy=True)
    mesh = init_device_mesh(device_type, (ws,))
    forms = {
        "group name": _world_name(),
        "ProcessGroup": dist.group.WORLD,
        "DeviceMesh": mesh,
        "(DeviceMesh, dim)": (mesh, 0),
    }
    for what, group in forms.items():
        _check(funcol.all_reduce(inp, "sum", group), expected, f"all_reduce via {what}", seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ranks + tag is deprecated, still works
        _check(funcol.all_reduce(inp, "sum", list(range(ws))), expected, "via rank list", seed)
    out = C10D.wait_tensor(C10D.all_reduce(inp, "sum", dist.group.WORLD))
    _check(out, expected, "raw op with a ProcessGroup object", seed)

    # A sub-group: ranks 0 and 1 only (others do not take part).
    sub = dist.new_group([0, 1])
    if rank < 2:
        _check(
            funcol.all_reduce(inp, "sum", sub),
            _reference(inputs[:2], "sum"),
            "all_reduce on new_group([0, 1])",
            seed,
        )
    dist.destroy_process_group(sub)


def _reached_spyreccl(device_type: str) -> str:
    """Name of the backend that serves the device's tensors in the default group."""
    return dist.group.WORLD._get_backend(torch.device(device_type)).name()


# ----------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------

pytestmark = pytest.mark.world_sizes(2, 3)


@pytest.fixture
def seed() -> int:
    return int.from_bytes(os.urandom(4), "little") & 0x3FFFFFFF


def test_collectives_go_to_spyreccl(rank_pool):
    assert rank_pool.run(_reached_spyreccl, DEVICE) == ["spyreccl"] * rank_pool.world_size


@pytest.mark.parametrize(
    "case",
    [
        _all_reduce,
        _all_reduce_dtypes,
        _all_reduce_coalesced,
        _all_gather,
        _all_gather_coalesced,
        _inference_mode,
        _batched_p2p,
        _reduce_scatter,
        _reduce_scatter_coalesced,
        _all_to_all,
        _broadcast,
        _wait_tensor_registry,
        _group_forms,
    ],
    ids=lambda f: f.__name__.lstrip("_"),
)
def test_functional(rank_pool, case, seed):
    rank_pool.run(case, DEVICE, seed)


_UNWAITED_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    dist.init_process_group()
    rank = dist.get_rank()
    x = torch.full((10, 10), float(rank), device="spyre")
    registry_size = torch._C._distributed_c10d._get_work_registry_size
    assert registry_size() == 0
    torch.ops._c10d_functional.all_reduce(x, "avg", dist.group.WORLD.group_name)
    assert registry_size() == 1
    # The same through the functions compiled graphs call (spyreccl_torch._C._direct_op),
    # one of them just above 1 MiB and queued (above the functional inline bound) at exit.
    from spyreccl_torch._C import _direct_op
    all_reduce = _direct_op(torch.ops._c10d_functional.all_reduce.default)
    all_reduce(x, "avg", dist.group.WORLD.group_name)
    big = torch.full((513, 512), float(rank), device="spyre")
    all_reduce(big, "sum", dist.group.WORLD.group_name)
    assert registry_size() == 3
    print("UNWAITED-OK", flush=True)
    # exit without wait_tensor and without destroy_process_group
    """
)


@pytest.mark.world_sizes(2)
def test_unwaited_collective_at_exit(tmp_path):
    """A process that leaves a functional collective unwaited must still exit cleanly."""
    script = tmp_path / "unwaited.py"
    script.write_text(_UNWAITED_SCRIPT)
    exits = run_rank_scripts([str(script)], 2, timeout=120)
    if any(e.hung for e in exits):
        pytest.fail("a rank hung at exit with an unwaited collective")
    for e in exits:
        assert e.returncode == 0 and "UNWAITED-OK" in e.output, (
            f"rank {e.rank} exited {e.returncode}:\n{e.output}"
        )
