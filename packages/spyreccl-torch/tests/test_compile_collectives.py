"""torch.compile of functions that mix compute and functional collectives, on spyre + spyreccl.

One function interleaves matmul / activations with all_reduce, all_gather, reduce_scatter and
explicit waits; it is compiled with ``fullgraph=True`` for the "eager", "aot_eager" and default
inductor backends, and for inductor with its C++ wrapper (``cpp_wrapper=True``). Each compiled
result must equal the eager result and a float64 reference computed from the inputs of every
rank (regenerated locally from a shared seed). For inductor we also check that it really
generated code (which calls ``_c10d_functional`` ops), and for every backend that the
collectives reached spyreccl (the backend's own profiler ranges). With the C++ wrapper, the
collectives must reach spyreccl through the dispatcher (spyre's ``_c10d_functional`` kernels:
the profiler shows the op), not through the CPU shims that call c10d directly; with the Python
wrapper, through the functions ``spyreccl_torch._C._direct_op`` binds, which reach the same
dispatcher operators.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from spyreccl_torch._torch_compat import CPP_WRAPPER_MINOR, TORCH_MINOR

# torch 2.13 renamed funcol.all_gather_tensor / reduce_scatter_tensor to *_single (same ops).
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter_single = (
    getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
)

DEVICE = "spyre"
# A line of a Python wrapper that calls a functional collective through torch.ops.
STOCK_CALL = re.compile(r"\s*(\w+ = )?torch\.ops\._c10d_functional\.\w+\.default\(")
ROWS, COLS = 6, 5  # ROWS * world_size rows after the gather; reduce_scatter splits them again


def _mixed(x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    h = torch.relu(x @ w)
    summed = funcol.wait_tensor(funcol.all_reduce(h, "sum", group))
    gathered = _all_gather_single(torch.tanh(summed) * 2.0, 0, group)
    gathered = funcol.wait_tensor(gathered)
    scattered = _reduce_scatter_single(gathered + 1.0, "sum", 0, group)
    scattered = funcol.wait_tensor(scattered)
    return scattered * summed.mean() + h


def _reference(xs: list[torch.Tensor], w: torch.Tensor, rank: int) -> torch.Tensor:
    """`_mixed` on every rank's input at once, in float64, without any collective."""
    ws = len(xs)
    hs = [torch.relu(x @ w) for x in xs]
    summed = sum(hs)
    # every rank contributes the same tanh(summed) * 2, so the gather is ws copies of it
    gathered = torch.cat([torch.tanh(summed) * 2.0] * ws)
    scattered = ((gathered + 1.0) * ws).chunk(ws)[rank]
    return scattered * summed.mean() + hs[rank]


def _inputs(seed: int, device_type: str):
    ws, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(COLS, COLS, generator=gen, dtype=torch.float64)
    xs = [torch.randn(ROWS, COLS, generator=gen, dtype=torch.float64) for _ in range(ws)]
    return xs, w, xs[rank].float().to(device_type), w.float().to(device_type)


def _spyreccl_ranges(prof) -> list[str]:
    return [e.name for e in prof.events() if e.name.startswith("spyreccl:")]


def _compiled_matches(device_type: str, backend: str, seed: int) -> dict[str, object]:
    import torch._inductor.config as inductor_config

    cpp_wrapper = backend == "inductor-cpp"
    with inductor_config.patch(cpp_wrapper=cpp_wrapper, fx_graph_cache=False):
        return _compile_and_check(
            device_type, "inductor" if cpp_wrapper else backend, seed, cpp_wrapper
        )


def _compile_and_check(
    device_type: str, backend: str, seed: int, cpp_wrapper: bool
) -> dict[str, object]:
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    rank = dist.get_rank()
    if device_type != "cpu":
        torch.accelerator.set_device_index(rank % torch.accelerator.device_count())
    xs, w64, x, w = _inputs(seed, device_type)
    group = dist.group.WORLD
    expected = _reference(xs, w64, rank)

    eager = _mixed(x, w, group)
    torch._dynamo.reset()
    compiled = torch.compile(_mixed, backend=backend, fullgraph=True)
    info: dict[str, object] = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        if backend == "inductor":
            out, codes = run_and_get_code(compiled, x, w, group)
            code = "\n".join(codes)
            # The wrapper inductor generated calls the functional collectives itself.
            sep = "::" if cpp_wrapper else "."
            if cpp_wrapper:
                assert "aoti_torch_spyre__c10d_functional_all_reduce" in code, code
            else:
                assert "_c10d_functional.all_reduce" in code, "no all_reduce in inductor's code"
                if device_type == "spyre":
                    # spyre's wrapper calls them through the functions _direct_op binds
                    # once per module, not through torch.ops (spyreccl_torch.device._inductor).
                    stock = [line.strip() for line in code.splitlines() if STOCK_CALL.match(line)]
                    assert not stock, stock
                    assert "_spyreccl_wait_tensor_default(buf" in code, code
            assert f"_c10d_functional{sep}all_gather_into_tensor" in code, code
            assert f"_c10d_functional{sep}reduce_scatter_tensor" in code, code
            assert "_c10d_functional_wait_tensor" in code or "_c10d_functional.wait_tensor" in code
            info["code_lines"] = code.count("\n")
        else:
            out = compiled(x, w, group)
    msg = f"torch.compile(backend={backend!r}) on rank {rank}, seed {seed}"
    assert out.device.type == device_type, msg
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5, msg=f"{msg}: vs eager")
    torch.testing.assert_close(
        out.cpu().double(), expected, rtol=1e-5, atol=1e-5, msg=f"{msg}: vs float64 reference"
    )
    if device_type != "cpu":
        ranges = _spyreccl_ranges(prof)
        # all_reduce, all_gather and reduce_scatter, whatever names the lowering picked.
        assert len(ranges) >= 3, f"{msg}: collectives did not reach spyreccl ({ranges})"
        info["spyreccl"] = sorted(set(ranges))
        if backend == "inductor":
            # Both wrappers reach spyre's kernels through the dispatcher.
            ops = {e.name for e in prof.events() if e.name.startswith("_c10d_functional::")}
            assert (
                "_c10d_functional::all_reduce_" in ops or "_c10d_functional::all_reduce" in ops
            ), f"{msg}: all_reduce bypassed the dispatcher ({sorted(ops)})"
    # A second call reuses the compiled graph (no recompilation) and still agrees.
    again = compiled(x, w, group)
    torch.testing.assert_close(again, out, rtol=0, atol=0, msg=f"{msg}: second call")
    return info


def _inductor_counters(device_type: str, seed: int) -> int:
    """Inductor compiled a graph for the spyre device (its counters moved)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    if device_type != "cpu":
        torch.accelerator.set_device_index(dist.get_rank() % torch.accelerator.device_count())
    _, _, x, w = _inputs(seed, device_type)
    torch._dynamo.reset()
    counters.clear()
    torch.compile(_mixed, fullgraph=True)(x, w, dist.group.WORLD)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["inductor"], "inductor did not run"
    return sum(counters["inductor"].values())


pytestmark = pytest.mark.world_sizes(2)


@pytest.fixture
def seed() -> int:
    return int.from_bytes(os.urandom(4), "little") & 0x3FFFFFFF


# Inductor's C++ wrapper for spyre needs torch 2.13 (spyreccl_torch._torch_compat).
_CPP_WRAPPER = pytest.mark.skipif(
    TORCH_MINOR < CPP_WRAPPER_MINOR,
    reason=f"spyre's C++ wrapper needs torch 2.13 (this is {torch.__version__})",
)


@pytest.mark.skipif(
    TORCH_MINOR >= CPP_WRAPPER_MINOR, reason="this torch has spyre's C++ wrapper (tested above)"
)
def test_the_cpp_wrapper_names_the_torch_it_needs() -> None:
    # One process, no group: the refusal comes from the wrapper codegen, before any kernel.
    def double(x):
        return x * 2.0

    import torch._inductor.config as inductor_config

    compiled = torch.compile(double, backend="inductor", fullgraph=True)
    with (
        inductor_config.patch(cpp_wrapper=True, fx_graph_cache=False),
        pytest.raises(Exception, match=r"C\+\+ wrapper .* needs torch >= 2\.13"),
    ):
        compiled(torch.randn(8, device="spyre"))


@pytest.mark.parametrize(
    "backend",
    [
        "eager",
        "aot_eager",
        "inductor",
        pytest.param("inductor-cpp", marks=_CPP_WRAPPER),
    ],
)
def test_compiled_collectives_match_eager(rank_pool, backend, seed):
    # inductor compiles C++ on every rank at once: allow for a slow 2-core machine.
    infos = rank_pool.run(_compiled_matches, DEVICE, backend, seed, timeout=400)
    if backend.startswith("inductor"):
        assert all(i["code_lines"] > 0 for i in infos)


def test_inductor_really_ran(rank_pool, seed):
    counts = rank_pool.run(_inductor_counters, DEVICE, seed, timeout=400)
    assert all(c > 0 for c in counts), counts


def _waited_at_once(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return funcol.all_reduce(x * 2, "sum", group_name) + 1


def _overlapped(x: torch.Tensor, w: torch.Tensor, group_name: str) -> torch.Tensor:
    # Inductor issues both collectives before the first wait, and sums the first result
    # before waiting for the second: each has work of the graph between it and its wait.
    ops = torch.ops._c10d_functional
    first = ops.all_reduce(x * 2, "sum", group_name)
    second = ops.all_reduce(w + 1, "sum", group_name)
    return ops.wait_tensor(first).sum() + ops.wait_tensor(second).sum()


def _wait_placement(seed: int, cpp_wrapper: bool = False) -> dict[str, list[str]]:
    """Both graphs on every rank's random input, against float64 references; the calls their
    Python wrappers make. A collective whose wait is the next thing the wrapper does is
    bound with wait_follows=True (``<name>_then_wait``); one with the matmul between it and
    its wait keeps the functional path, so that the transfer overlaps that work."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.accelerator.set_device_index(rank % torch.accelerator.device_count())
    xs64, w64, x, w = _inputs(seed, DEVICE)
    name = dist.group.WORLD.group_name
    summed = sum(xi * 2 for xi in xs64)
    cases = {
        "waited": (_waited_at_once, (x, name), summed + 1),
        "overlapped": (_overlapped, (x, w, name), summed.sum() + world * (w64 + 1).sum()),
    }
    calls: dict[str, list[str]] = {}
    for label, (fn, args, expected) in cases.items():
        torch._dynamo.reset()
        with inductor_config.patch(fx_graph_cache=False, cpp_wrapper=cpp_wrapper):
            out, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
        torch.testing.assert_close(
            out.cpu().double(), expected, rtol=1e-5, atol=1e-5, msg=f"{label}, rank {rank}"
        )
        code = "\n".join(codes)
        if cpp_wrapper:  # the all_reduce shims' calls (the C++ wrapper waits through c10d)
            calls[label] = re.findall(CPP_SHIM_CALL, code)
        else:
            calls[label] = re.findall(r"^\s*(_spyreccl_\w+)\(", code, re.MULTILINE)
    assert world > 1
    return calls


# A call of one of the C++ wrapper's all_reduce shims (spyreccl_torch.device._cpp_wrapper).
CPP_SHIM_CALL = r"AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_spyre__c10d_functional_(\w+)\("


@_CPP_WRAPPER
def test_the_cpp_wrapper_marks_a_collective_waited_at_once(rank_pool, seed):
    for calls in rank_pool.run(_wait_placement, seed, cpp_wrapper=True, timeout=400):
        assert calls["waited"] == ["all_reduce__then_wait"], calls
        assert calls["overlapped"] == ["all_reduce_", "all_reduce_"], calls


def test_a_collective_waited_at_once_runs_as_a_synchronous_call(rank_pool, seed):
    for calls in rank_pool.run(_wait_placement, seed, timeout=400):
        assert calls["waited"] == [
            "_spyreccl_all_reduce__default_then_wait",
            "_spyreccl_wait_tensor_default",
        ], calls
        assert calls["overlapped"] == [
            "_spyreccl_all_reduce__default",
            "_spyreccl_all_reduce__default",
            "_spyreccl_wait_tensor_default",
            "_spyreccl_wait_tensor_default",
        ], calls


def _placement_fails(seed: int) -> list[str]:
    """If telling waited-at-once collectives apart fails (inductor's internals moved), the
    graph still compiles and computes the right thing, with a warning, every collective
    keeping the functional path."""
    import warnings

    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from spyreccl_torch.device import _wait_placement

    torch.accelerator.set_device_index(dist.get_rank() % torch.accelerator.device_count())
    xs64, _, x, _ = _inputs(seed, DEVICE)

    def broken(lines):
        raise AttributeError("no such wrapper line")

    saved = _wait_placement._waited_at_once
    _wait_placement._waited_at_once = broken
    try:
        torch._dynamo.reset()
        with (
            inductor_config.patch(fx_graph_cache=False),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            out, codes = run_and_get_code(
                torch.compile(_waited_at_once, fullgraph=True), x, dist.group.WORLD.group_name
            )
    finally:
        _wait_placement._waited_at_once = saved
    expected = sum(xi * 2 for xi in xs64) + 1
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)
    assert any("waited at once" in str(w.message) for w in caught), [str(w.message) for w in caught]
    return re.findall(r"^\s*(_spyreccl_\w+)\(", "\n".join(codes), re.MULTILINE)


def test_a_failed_wait_placement_keeps_the_functional_path(rank_pool, seed):
    for calls in rank_pool.run(_placement_fails, seed, timeout=400):
        assert calls == ["_spyreccl_all_reduce__default", "_spyreccl_wait_tensor_default"], calls


def _every_kind(xs: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    """One of each functional collective whose arguments differ in kind (tensor lists, int
    lists, an int source rank), every result used by a later kernel."""
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = xs
    reduced = funcol.all_reduce_coalesced([a * 2, b - 1], "sum", group_name)
    gathered = funcol.all_gather_into_tensor_coalesced([a + 1, b * 3], group_name)
    scattered = funcol.reduce_scatter_tensor_coalesced([a.repeat(world, 1)], "sum", [0], group_name)
    splits = [r + 1 for r in range(world)]  # rank r sends r+1 rows to every rank ...
    exchanged = funcol.all_to_all_single(
        b[: sum(splits)].clone(), [rank + 1] * world, splits, group_name
    )  # ... and receives rank+1 rows from each
    broadcast = funcol.broadcast(a - b[: a.shape[0]], world - 1, group_name)
    return [t * 1.0 for t in (*reduced, *gathered, *scattered, exchanged, broadcast)]


def _every_kind_compiled(seed: int) -> list[str]:
    """_every_kind compiled with inductor on spyre against float64 references built from every
    rank's inputs; the calls its Python wrapper makes."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.accelerator.set_device_index(rank % torch.accelerator.device_count())
    gen = torch.Generator().manual_seed(seed)
    rows = world * (world + 1) // 2 + ROWS
    inputs = [
        (
            torch.randn(ROWS, COLS, generator=gen, dtype=torch.float64),
            torch.randn(rows, COLS, generator=gen, dtype=torch.float64),
        )
        for _ in range(world)
    ]
    a = [p[0] for p in inputs]
    b = [p[1] for p in inputs]
    offsets = [sum(range(1, s + 1)) for s in range(world)]  # rank r's rows for s start here
    expected = [
        sum(x * 2 for x in a),
        sum(x - 1 for x in b),
        torch.cat([x + 1 for x in a]),
        torch.cat([x * 3 for x in b]),
        sum(a),  # every rank's block r of a.repeat(world, 1) is its a
        torch.cat([b[r][offsets[rank] : offsets[rank] + rank + 1] for r in range(world)]),
        a[world - 1] - b[world - 1][:ROWS],
    ]
    mine = [t.float().to(DEVICE) for t in inputs[rank]]
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False):
        outs, codes = run_and_get_code(
            torch.compile(_every_kind, fullgraph=True), mine, dist.group.WORLD.group_name
        )
    assert len(outs) == len(expected)
    for i, (got, want) in enumerate(zip(outs, expected, strict=True)):
        torch.testing.assert_close(
            got.cpu().double(), want, rtol=1e-5, atol=1e-5, msg=f"output {i}, rank {rank}"
        )
    code = "\n".join(codes)
    stock = [line.strip() for line in code.splitlines() if STOCK_CALL.match(line)]
    assert not stock, stock
    calls = set(re.findall(r"^\s*(?:\w+ = )?(_spyreccl_\w+)\(", code, re.MULTILINE))
    return sorted(calls - {"_spyreccl_direct_op"})  # the module's binding lines


def test_every_kind_of_functional_collective_in_a_compiled_graph(rank_pool, seed):
    for calls in rank_pool.run(_every_kind_compiled, seed, timeout=400):
        ops = {re.sub(r"_default(_then_wait)?$", "", c.removeprefix("_spyreccl_")) for c in calls}
        assert {
            "all_reduce_coalesced_",
            "all_gather_into_tensor_coalesced",
            "reduce_scatter_tensor_coalesced",
            "all_to_all_single",
            "broadcast_",
            "wait_tensor",
        } <= ops, calls


def _branches(x: torch.Tensor, flag: torch.Tensor, group_name: str) -> torch.Tensor:
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", group_name) + 1

    def shifted(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x - 1, "sum", group_name) * 3

    return torch.cond(flag, doubled, shifted, (x,))


def _collectives_in_subgraphs(seed: int) -> list[str]:
    """torch.cond with a collective in each branch: inductor writes the branches through
    subgraph wrappers, whose collectives' functions the module binds once (in its root
    wrapper). Both branches against float64, through one compiled graph."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    rank = dist.get_rank()
    torch.accelerator.set_device_index(rank % torch.accelerator.device_count())
    xs64, _, x, _ = _inputs(seed, DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(_branches, fullgraph=True)
    name = dist.group.WORLD.group_name
    with inductor_config.patch(fx_graph_cache=False):
        out, codes = run_and_get_code(compiled, x, torch.tensor(True), name)
    other = compiled(x, torch.tensor(False), name)
    torch.testing.assert_close(
        out.cpu().double(), sum(t * 2 for t in xs64) + 1, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        other.cpu().double(), sum(t - 1 for t in xs64) * 3, rtol=1e-5, atol=1e-5
    )
    code = "\n".join(codes)
    stock = [line.strip() for line in code.splitlines() if STOCK_CALL.match(line)]
    assert not stock, stock
    return re.findall(r"^\s*(_spyreccl_\w+)\(", code, re.MULTILINE)


def test_collectives_inside_control_flow_subgraphs(rank_pool, seed):
    for calls in rank_pool.run(_collectives_in_subgraphs, seed, timeout=400):
        # one all_reduce and its wait in each branch
        assert calls.count("_spyreccl_all_reduce__default_then_wait") == 2, calls
        assert calls.count("_spyreccl_wait_tensor_default") == 2, calls
