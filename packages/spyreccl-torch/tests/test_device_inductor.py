"""Inductor (``torch.compile``'s default backend) on the emulated spyre device.

Spyre kernels come from inductor's C++ scheduling, so any graph that compiles on CPU must
compile on spyre. Each case compiles a graph on spyre tensors made from fresh random inputs
and compares the result with an independent reference: the same function run eagerly on
CPU in float64 (float cases, within float32 tolerances) or exactly (integer cases).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from spyreccl_torch import device as spyre_device

pytestmark = pytest.mark.skipif(
    not spyre_device.register(), reason="the emulated spyre device stepped aside"
)

SPYRE = torch.device("spyre")


@pytest.fixture(autouse=True)
def _no_compile_caches():
    """Every case really compiles: a cache hit would replay code generated earlier (maybe
    by another torch process with different registrations) and prove nothing."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with (
        inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        yield


@dataclass(frozen=True)
class Case:
    fn: Callable[..., torch.Tensor]
    # Builds the inputs as float64 / int64 CPU tensors from a numpy generator.
    make_inputs: Callable[[np.random.Generator], tuple[torch.Tensor, ...]]
    # The dtype the compiled graph runs in; float64 inputs are converted to it.
    dtype: torch.dtype = torch.float32


def _randn(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape))


def _randint(rng: np.random.Generator, low: int, high: int, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(low, high, size=shape, dtype=np.int64))


def _device_of(x: torch.Tensor) -> torch.device:
    return x.device


CASES: dict[str, Case] = {
    # The reproducer: an index-producing op feeding a pointwise add.
    "arange_add": Case(
        lambda x: x + torch.arange(x.shape[0], device=_device_of(x), dtype=x.dtype),
        lambda rng: (_randn(rng, 37),),
    ),
    # A factory on "spyre" without an index resolves through the device interface.
    "factory_without_index": Case(
        lambda x: x * torch.ones(x.shape, device=x.device.type, dtype=x.dtype) + 1,
        lambda rng: (_randn(rng, 5, 7),),
    ),
    "reductions_over_dims": Case(
        lambda x: torch.cat([x.sum(0), x.mean(1), x.amax(1), x.var(0)]),
        lambda rng: (_randn(rng, 24, 24),),
    ),
    "reduction_to_0d": Case(
        lambda x: (x * x).sum() / x.numel() + x.abs().max(),
        lambda rng: (_randn(rng, 9, 13),),
    ),
    "pointwise_into_reduction": Case(
        # A pointwise producer fused into a reduction (the pattern that the scheduler's
        # GPU-only loop reindexing used to break).
        lambda x, y: (x.exp() * y).reshape(8, 64).sum(1) + y.reshape(8, 64).amax(1),
        lambda rng: (_randn(rng, 16, 32), _randn(rng, 16, 32)),
    ),
    "gather_and_index_select": Case(
        lambda x, idx: x[idx] + x.index_select(1, idx[:3]).sum(1, keepdim=True),
        lambda rng: (_randn(rng, 10, 6), _randint(rng, 0, 6, 10)),
    ),
    "scatter_add": Case(
        lambda x, idx: torch.zeros(5, 4, device=x.device, dtype=x.dtype).scatter_add(0, idx, x),
        lambda rng: (_randn(rng, 7, 4), _randint(rng, 0, 5, 7, 4)),
    ),
    "matmul_bias_relu": Case(
        lambda x, w, b: torch.relu(x @ w + b),
        lambda rng: (_randn(rng, 12, 20), _randn(rng, 20, 9), _randn(rng, 9)),
    ),
    # Inductor switches convolution graphs to channels-last inputs (layout optimisation)
    # and checks the strides of the convolution's result against torch's shape function.
    "conv2d_relu": Case(
        lambda a, w, b: F.conv2d(a, w, b, padding=1).relu() * 2,
        lambda rng: (_randn(rng, 2, 3, 8, 8), _randn(rng, 4, 3, 3, 3), _randn(rng, 4)),
    ),
    "bmm": Case(
        lambda a, b: torch.bmm(a, b).tanh(),
        lambda rng: (_randn(rng, 3, 4, 5), _randn(rng, 3, 5, 6)),
    ),
    "softmax_and_log_softmax": Case(
        lambda x: torch.softmax(x, -1) + F.log_softmax(x * 0.5, 0),
        lambda rng: (_randn(rng, 6, 17),),
    ),
    "layer_norm": Case(
        lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5),
        lambda rng: (_randn(rng, 4, 3, 32), _randn(rng, 32), _randn(rng, 32)),
    ),
    "int32_arithmetic": Case(
        lambda a, b: (a * 3 + b) // 7 + torch.remainder(a, 5) - (a & b) + (a ^ 12),
        lambda rng: (_randint(rng, -1000, 1000, 40), _randint(rng, 1, 1000, 40)),
        dtype=torch.int32,
    ),
    "int64_cumsum_and_float_cast": Case(
        lambda a: torch.cumsum(a, 0) * 2 + (a.float() / 4).floor().long(),
        lambda rng: (_randint(rng, -50, 50, 33),),
        dtype=torch.int64,
    ),
    "float_to_int_floordiv": Case(
        # Values k/8 are exact in float32, so the integer result has one right answer.
        lambda x: (x * 10).to(torch.int32) // 3 - (x < 0).to(torch.int32),
        lambda rng: (_randint(rng, -400, 400, 6, 8).double() / 8,),
    ),
    "views_and_transposes": Case(
        lambda x: (
            (x.t().contiguous() * 2)[:, ::2]
            + x.view(3, 4, 5).permute(2, 0, 1).reshape(5, 12)[:, 1::2].flip(0)
        ),
        lambda rng: (_randn(rng, 12, 5),),
    ),
    "mixed_spyre_and_scalars": Case(
        # Python scalars and a 0-d CPU tensor next to spyre tensors.
        lambda x, s: x * 3.5 + 2 - s * x.sum(),
        lambda rng: (_randn(rng, 8, 3), _randn(rng)),
    ),
    "where_clamp_gelu": Case(
        lambda x: torch.where(x > 0, F.gelu(x), x.clamp(min=-0.5)) + x.sigmoid(),
        lambda rng: (_randn(rng, 31),),
    ),
}

# Inputs that stay on the CPU (Python-side scalars of the graph).
_CPU_INPUTS = {"mixed_spyre_and_scalars": {1}}


def _on(device: torch.device | str, tensors, dtype: torch.dtype, keep_cpu=frozenset()):
    out = []
    for i, t in enumerate(tensors):
        if t.is_floating_point():
            t = t.to(dtype if dtype.is_floating_point else torch.float32)
        elif t.dtype == torch.int64 and not dtype.is_floating_point:
            t = t.to(dtype)
        out.append(t if i in keep_cpu else t.to(device))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_inductor_graph_matches_cpu_reference(rng, name):
    case = CASES[name]
    inputs = case.make_inputs(rng)
    keep_cpu = _CPU_INPUTS.get(name, frozenset())
    torch._dynamo.reset()
    compiled = torch.compile(case.fn, backend="inductor")
    out = compiled(*_on(SPYRE, inputs, case.dtype, keep_cpu))
    assert out.device.type == "spyre", out.device
    if out.dtype.is_floating_point:
        expected = case.fn(*_on("cpu", inputs, torch.float64))
        assert out.dtype == case.dtype
        torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-5, atol=2e-5)
    else:  # integer results: exactly those of the eager CPU run
        expected = case.fn(*_on("cpu", inputs, case.dtype))
        assert out.dtype == expected.dtype
        torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(12, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.down = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.norm(self.up(x))))


@pytest.mark.parametrize("cpp_wrapper", [False, True], ids=["python-wrapper", "cpp-wrapper"])
def test_inductor_backward_through_mlp_matches_float64(rng, cpp_wrapper):
    import torch._inductor.config as inductor_config

    torch.manual_seed(int(rng.integers(1 << 31)))
    reference = _MLP().double()
    model = _MLP()
    model.load_state_dict(reference.state_dict())
    model.to(SPYRE)
    x, target = _randn(rng, 16, 12), _randn(rng, 16, 5)

    def loss_fn(m: torch.nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(x), t)

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="inductor")
    with inductor_config.patch(cpp_wrapper=cpp_wrapper):
        loss = compiled(model, x.float().to(SPYRE), target.float().to(SPYRE))
        loss.backward()
    expected = loss_fn(reference, x, target)
    expected.backward()

    assert loss.device.type == "spyre"
    torch.testing.assert_close(loss.cpu().double(), expected.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.grad is not None and p.grad.device.type == "spyre", name
        torch.testing.assert_close(p.grad.cpu().double(), ref.grad, rtol=1e-4, atol=1e-5)


def _cpp_wrapper_graph(x: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # C++ kernels (pointwise, reductions, an index factory), an out= extern kernel (mm) and
    # two fallback ops without a spyre C shim (sort, and the integer index_select).
    h = torch.relu(x @ w) + torch.arange(w.shape[1], device=x.device, dtype=x.dtype)
    s = h.sort(dim=1).values
    picked = torch.index_select(s, 0, k)
    return torch.cat([picked.sum(0, keepdim=True), s.mean(0, keepdim=True) * h.amax()])


def test_cpp_wrapper_graph_matches_float64(rng):
    """inductor's C++ wrapper on spyre: allocations on spyre, spyre ops through the
    dispatcher; one compile, since C++ wrappers take long to build."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    x, w = _randn(rng, 9, 6), _randn(rng, 6, 7)
    k = _randint(rng, 0, 9, 4)
    torch._dynamo.reset()
    with inductor_config.patch(cpp_wrapper=True):
        compiled = torch.compile(_cpp_wrapper_graph, backend="inductor", fullgraph=True)
        spyre_args = (x.float().to(SPYRE), w.float().to(SPYRE), k.to(SPYRE))
        out, codes = run_and_get_code(compiled, *spyre_args)
    code = "\n".join(codes)
    assert "inductor_entry" in code and "cached_torch_device_type_privateuse1" in code, code
    assert out.device.type == "spyre", out.device
    expected = _cpp_wrapper_graph(x, w, k)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-5, atol=2e-5)
    # A second call runs the compiled C++ again on new data.
    x2 = _randn(rng, 9, 6)
    again = compiled(x2.float().to(SPYRE), *spyre_args[1:])
    torch.testing.assert_close(
        again.cpu().double(), _cpp_wrapper_graph(x2, w, k), rtol=2e-5, atol=2e-5
    )


def test_backend_name_is_cpp_for_spyre_only():
    import torch._inductor.codegen.common as codegen_common
    import torch._inductor.config as inductor_config
    import torch._inductor.scheduler as scheduler
    import torch._inductor.utils as inductor_utils

    torch.spyre.Scheduling  # noqa: B018  (registers spyre with inductor)
    get_backend = inductor_utils.get_current_backend
    assert get_backend("spyre") == "cpp"
    assert get_backend("cpu") == inductor_config.cpu_backend
    # Other devices keep torch's answer, and the user-visible config is untouched.
    assert get_backend("cuda") == inductor_config.cuda_backend == "triton"
    default = os.environ.get("TORCHINDUCTOR_LOOP_REINDEXING_AFTER_FUSION", "1") == "1"
    assert inductor_config.loop_reindexing_after_fusion is default
    # Modules that imported the function by name see the spyre-aware one.
    assert codegen_common.get_current_backend is get_backend
    assert scheduler.get_current_backend is get_backend


def test_device_interface_worker_tracks_the_current_device():
    from torch._dynamo.device_interface import (
        caching_worker_current_devices,
        get_interface_for_device,
    )

    torch.spyre.Scheduling  # noqa: B018
    worker = get_interface_for_device("spyre").Worker
    saved = caching_worker_current_devices.pop("spyre", None)
    previous = torch.spyre.current_device()
    try:
        other = (previous + 1) % torch.spyre.device_count()
        with torch.spyre.device(other):
            assert worker.current_device() == other
        assert worker.current_device() == previous
        worker.set_device(other)
        assert worker.current_device() == other
        with pytest.raises(ValueError, match="invalid spyre device index"):
            worker.set_device(torch.spyre.device_count())
        assert worker.get_device_properties() is not None
    finally:
        caching_worker_current_devices.pop("spyre", None)
        if saved is not None:
            caching_worker_current_devices["spyre"] = saved


def test_convolution_results_have_the_strides_torch_predicts(rng):
    # FakeTensor (what torch.compile traces with) predicts the Overrideable backend's
    # format for PrivateUse1 convolutions; eager spyre results must have those strides.
    from torch._subclasses.fake_tensor import FakeTensorMode

    a = _randn(rng, 2, 3, 8, 8).float().to(SPYRE).to(memory_format=torch.channels_last)
    w = _randn(rng, 4, 3, 3, 3).float().to(SPYRE).to(memory_format=torch.channels_last)
    a.requires_grad_(True)
    w.requires_grad_(True)
    out = F.conv2d(a, w, padding=1)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        predicted = F.conv2d(mode.from_tensor(a), mode.from_tensor(w), padding=1)
    assert out.stride() == predicted.stride()
    expected = F.conv2d(a.detach().cpu().double(), w.detach().cpu().double(), padding=1)
    torch.testing.assert_close(out.detach().cpu().double(), expected, rtol=1e-5, atol=1e-5)
    out.backward(torch.ones_like(out))
    assert a.grad is not None and w.grad is not None


# Functions of float tensors whose gradients are checked: (function, input shapes).
_BACKWARD_CASES = {
    "group_norm": (lambda x, w, b: F.group_norm(x, 2, w, b), [(3, 6, 5, 5), (6,), (6,)]),
    "rms_norm_silu_rope": (
        lambda q, w, c, s: (
            torch.cat([q[..., :4] * c - q[..., 4:] * s, q[..., 4:] * c + q[..., :4] * s], -1)
            * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
            * w
            * F.silu(q)
        ),
        [(2, 3, 5, 8), (8,), (5, 4), (5, 4)],
    ),
    "causal_sdpa": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        [(2, 2, 6, 4), (2, 2, 6, 4), (2, 2, 6, 4)],
    ),
    "interpolate_avg_pool": (
        lambda x: F.avg_pool2d(F.interpolate(x, scale_factor=2, mode="bilinear"), 3),
        [(2, 3, 6, 6)],
    ),
}


@pytest.mark.parametrize("name", sorted(_BACKWARD_CASES))
def test_inductor_backward_matches_float64(rng, name):
    fn, shapes = _BACKWARD_CASES[name]
    inputs = [_randn(rng, *s) for s in shapes]
    spyre_inputs = [t.float().to(SPYRE).requires_grad_(True) for t in inputs]
    ref_inputs = [t.clone().requires_grad_(True) for t in inputs]
    torch._dynamo.reset()
    out = torch.compile(fn, backend="inductor")(*spyre_inputs)
    expected = fn(*ref_inputs)
    grad = _randn(rng, *expected.shape)
    out.backward(grad.float().to(SPYRE))
    expected.backward(grad)
    torch.testing.assert_close(out.detach().cpu().double(), expected.detach(), rtol=1e-4, atol=1e-5)
    for i, (got, ref) in enumerate(zip(spyre_inputs, ref_inputs)):
        assert got.grad is not None and got.grad.device.type == "spyre", i
        torch.testing.assert_close(got.grad.cpu().double(), ref.grad, rtol=1e-4, atol=1e-5)


def test_inductor_dynamic_shapes(rng):
    torch._dynamo.reset()
    compiled = torch.compile(lambda a: (a * 2).softmax(0).sum(1), backend="inductor", dynamic=True)
    for n in (3, 5, 9):
        a = _randn(rng, n, 4)
        out = compiled(a.float().to(SPYRE))
        torch.testing.assert_close(
            out.cpu().double(), (a * 2).softmax(0).sum(1), rtol=1e-5, atol=1e-6
        )


# --- buffer allocation in the generated Python wrapper ---------------------------------------


def test_wrapper_allocates_spyre_buffers_with_the_fast_function(rng):
    """The Python wrapper of a spyre graph allocates its buffers through
    spyreccl_torch._C._empty_strided_spyre (not torch.empty_strided(device="spyre")), dynamic
    shapes included, and the graph still computes the CPU float64 result."""
    from torch._inductor.utils import run_and_get_code

    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = (a @ b).relu()  # an extern matmul: its output is an allocated buffer
        return h.softmax(1), (h * 3).sum(0)

    for dynamic in (False, True):
        torch._dynamo.reset()
        a, b = _randn(rng, 5, 7), _randn(rng, 7, 6)
        compiled = torch.compile(fn, backend="inductor", dynamic=dynamic)
        (soft, total), (code, *_) = run_and_get_code(
            compiled, a.float().to(SPYRE), b.float().to(SPYRE)
        )
        assert "from spyreccl_torch._C import _empty_strided_spyre" in code, code
        assert "empty_strided_spyre((" in code, code
        assert re.search(r"\bempty_strided\(\(", code) is None, code  # torch's generic call
        ref_soft, ref_total = fn(a, b)
        assert soft.device.type == total.device.type == "spyre"
        torch.testing.assert_close(soft.cpu().double(), ref_soft, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(total.cpu().double(), ref_total, rtol=2e-5, atol=2e-5)


def test_fast_allocation_function_matches_empty_strided():
    """_empty_strided_spyre(size, stride, dtype) is torch.empty_strided(size, stride,
    device="spyre", dtype=dtype): the current spyre device, the requested geometry and dtype,
    memory from the spyre allocator (counted by torch.spyre.memory_allocated), NaN-filled when
    torch's deterministic mode asks for it; bad arguments raise naming the argument."""
    from spyreccl_torch._C import _empty_strided_spyre as fast

    previous = torch.spyre.current_device()
    try:
        for index in range(min(torch.spyre.device_count(), 2)):
            torch.spyre.set_device(index)
            for size, stride, dtype in [
                ((2, 3), (3, 1), torch.float32),
                ((4, 5), (1, 4), torch.bfloat16),
                ((), (), torch.int64),
                ((0, 3), (3, 1), torch.float16),
            ]:
                got = fast(size, stride, dtype)
                want = torch.empty_strided(size, stride, device="spyre", dtype=dtype)
                assert (got.device, got.shape, got.stride(), got.dtype) == (
                    want.device,
                    want.shape,
                    want.stride(),
                    want.dtype,
                )
                assert got.device == torch.device("spyre", index)
    finally:
        torch.spyre.set_device(previous)

    before = torch.spyre.memory_allocated()
    held = fast((1024,), (1,), torch.float32)
    assert torch.spyre.memory_allocated() - before >= 4096
    del held

    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    try:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        assert torch.isnan(fast((64,), (1,), torch.float32).cpu()).all()
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill

    with pytest.raises(TypeError, match="takes 3 arguments"):
        fast((2,), (1,))
    with pytest.raises(TypeError, match="'size' must be a tuple of ints"):
        fast([2], (1,), torch.float32)
    with pytest.raises(TypeError, match="'stride' must be a tuple of ints"):
        fast((2,), (1.5,), torch.float32)
    with pytest.raises(ValueError, match="size has 1 dimensions but stride has 2"):
        fast((2,), (1, 1), torch.float32)
    with pytest.raises(TypeError, match=r"'dtype' must be a torch\.dtype"):
        fast((2,), (1,), "float32")


@pytest.mark.parametrize("autograd_cache", [False, True], ids=["fx-graph", "aot-autograd"])
def test_compile_cache_keys_name_spyre_code_generation(rng, monkeypatch, autograd_cache):
    """Inductor's caches key a spyre graph on spyre's code generation: compiled again, the
    same graph hits the cache; once that identity changes (another spyreccl-torch), it
    misses, so that code generated by an older version is never replayed. Both the FX graph
    cache and AOT autograd's cache in front of it. The identity digests the device's Python
    modules and the extensions, and tells the direct collective calls from the stock ones."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    from spyreccl_torch.device import _inductor as spyre_inductor

    names = {os.path.basename(path) for path in spyre_inductor.codegen_files()}
    assert {"_inductor.py", "_cpp_wrapper.py"} <= names, names
    assert any(name.startswith("_C.") for name in names), names
    identity = spyre_inductor.CodegenIdentity()
    with monkeypatch.context() as patch:
        patch.setattr(spyre_inductor, "DIRECT_COLLECTIVE_CALLS", False)
        stock = identity.uuid()
    assert stock != identity.uuid()  # the setting changes the generated calls

    def fn(a: torch.Tensor) -> torch.Tensor:
        return (a * 2 + 1).sin()

    a = _randn(rng, 33)

    def compile_and_check() -> None:
        torch._dynamo.reset()
        out = torch.compile(fn, backend="inductor")(a.float().to(SPYRE))
        assert out.device.type == "spyre"
        torch.testing.assert_close(out.cpu().double(), fn(a), rtol=2e-5, atol=2e-5)

    if autograd_cache:
        group, miss, hit = "aot_autograd", "autograd_cache_miss", "autograd_cache_hit"
    else:
        group, miss, hit = "inductor", "fxgraph_cache_miss", "fxgraph_cache_hit"
    with (
        fresh_cache(),
        inductor_config.patch(fx_graph_cache=True),
        functorch_config.patch(enable_autograd_cache=autograd_cache),
    ):
        counters.clear()
        compile_and_check()
        compile_and_check()
        got = counters[group]
        assert (got[miss], got[hit]) == (1, 1), dict(counters)
        monkeypatch.setattr(
            spyre_inductor.CodegenIdentity, "uuid", lambda self: b"another spyreccl-torch"
        )
        compile_and_check()
        assert (got[miss], got[hit]) == (2, 1), dict(counters)
