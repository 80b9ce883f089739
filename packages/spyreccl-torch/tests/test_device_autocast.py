"""``torch.autocast("spyre")`` and activation checkpointing on the emulated spyre device.

Spyre operators run CPU kernels, so autocast on spyre follows CPU's policy: every result is
compared with the same computation under ``torch.autocast("cpu")`` on CPU tensors (same
casts, same kernels: equal values) and, for the cast itself, with a float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from spyreccl_torch import device as spyre_device

pytestmark = pytest.mark.skipif(
    not spyre_device.register(), reason="the emulated spyre device stepped aside"
)

SPYRE = torch.device("spyre")
LOW = [torch.bfloat16, torch.float16]


def _randn(rng: np.random.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def _ops_with_kernel(key: str) -> set[str]:
    return {
        name
        for name in torch._C._dispatch_get_all_op_names()
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
    }


def test_autocast_op_set_is_cpus():
    # The policy table in src/device/autocast.cc mirrors AutocastCPU's: a torch upgrade
    # that adds or drops ops there must show up here.
    cpu, spyre = _ops_with_kernel("AutocastCPU"), _ops_with_kernel("AutocastPrivateUse1")
    assert cpu, "torch registers no AutocastCPU kernels?"
    assert spyre == cpu, (
        f"missing on spyre: {sorted(cpu - spyre)}; not on CPU: {sorted(spyre - cpu)}"
    )


def test_device_module_amp_api():
    assert torch.spyre.get_amp_supported_dtype() == [torch.float16, torch.bfloat16]
    assert torch.amp.is_autocast_available("spyre")
    assert not torch.spyre.is_autocast_enabled()
    with torch.autocast("spyre", dtype=torch.bfloat16):
        assert torch.spyre.is_autocast_enabled()
        assert torch.spyre.get_autocast_dtype() == torch.bfloat16
        assert torch.is_autocast_enabled("spyre") and not torch.is_autocast_enabled("cpu")
    assert not torch.spyre.is_autocast_enabled()
    with pytest.raises(ValueError, match="spyre autocast supports"):
        torch.spyre.set_autocast_dtype(torch.float64)
    # An unsupported dtype disables autocast with torch's warning, as on other devices.
    with pytest.warns(UserWarning, match="spyre"), torch.autocast("spyre", dtype=torch.float64):
        assert not torch.is_autocast_enabled("spyre")


# (name, function, input shapes): the functions take float32 tensors.
_MATMUL_OPS = [
    ("matmul", lambda a, b: a @ b, [(6, 9), (9, 5)]),
    ("mm", torch.mm, [(6, 9), (9, 5)]),
    ("bmm", torch.bmm, [(3, 4, 8), (3, 8, 2)]),
    ("linear", F.linear, [(5, 12), (7, 12), (7,)]),
    ("addmm", torch.addmm, [(4, 6), (4, 3), (3, 6)]),
    ("baddbmm", torch.baddbmm, [(2, 3, 5), (2, 3, 4), (2, 4, 5)]),
    ("conv2d", F.conv2d, [(2, 3, 8, 8), (4, 3, 3, 3), (4,)]),
    (
        "sdpa",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        [(2, 2, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8)],
    ),
]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize(("name", "fn", "shapes"), _MATMUL_OPS, ids=[op[0] for op in _MATMUL_OPS])
def test_lower_precision_ops_match_cpu_autocast(rng, dtype, name, fn, shapes):
    inputs = [_randn(rng, *s) for s in shapes]
    with torch.autocast("spyre", dtype=dtype):
        out = fn(*(t.to(SPYRE) for t in inputs))
    with torch.autocast("cpu", dtype=dtype):
        expected = fn(*inputs)
    assert out.device.type == "spyre"
    assert out.dtype == expected.dtype == dtype
    eps = torch.finfo(dtype).eps
    if name == "sdpa":
        # CPU picks its fused flash-attention kernel; spyre may take the math path, which
        # rounds the low-precision intermediates differently.
        torch.testing.assert_close(out.cpu(), expected, rtol=4 * eps, atol=4 * eps)
    else:
        # The same casts feed the same CPU kernels.
        torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    # And the cast really happened: the result is the float64 one rounded through the
    # low-precision inputs, within a few units of the dtype's precision.
    reference = fn(*(t.to(dtype).double() for t in inputs))
    torch.testing.assert_close(out.cpu().double(), reference, rtol=8 * eps, atol=8 * eps)


# Ops outside the lower-precision list, with bfloat16 and float32 inputs mixed in: the
# result dtype (fp32 policy, promotion, or untouched) must be CPU autocast's.
_OTHER_OPS = [
    ("mse_loss", F.mse_loss, [(5, 4), (5, 4)]),
    ("l1_loss", F.l1_loss, [(5, 4), (5, 4)]),
    ("prod", lambda x: x.prod(1), [(3, 4)]),
    ("cdist", torch.cdist, [(4, 3), (5, 3)]),
    ("cross_entropy", lambda x, t: F.cross_entropy(x, t.argmax(1)), [(6, 5), (6, 5)]),
    ("cat", lambda a, b: torch.cat([a, b]), [(2, 3), (4, 3)]),
    ("stack", lambda a, b: torch.stack([a, b]), [(2, 3), (2, 3)]),
    ("softmax", lambda x: torch.softmax(x, -1), [(3, 7)]),
    ("layer_norm", lambda x: F.layer_norm(x, (7,)), [(3, 7)]),
    ("exp_add", lambda a, b: a.exp() + b, [(3, 7), (3, 7)]),
    ("relu", F.relu, [(9,)]),
]


@pytest.mark.parametrize(("name", "fn", "shapes"), _OTHER_OPS, ids=[op[0] for op in _OTHER_OPS])
def test_other_ops_follow_cpu_policy(rng, name, fn, shapes):
    # First input in bfloat16, the rest float32: fp32-policy ops upcast, promote ops
    # widen, ops without a policy keep torch's type promotion.
    inputs = [
        _randn(rng, *s, dtype=torch.bfloat16 if i == 0 else torch.float32)
        for i, s in enumerate(shapes)
    ]
    with torch.autocast("spyre", dtype=torch.bfloat16):
        out = fn(*(t.to(SPYRE) for t in inputs))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = fn(*inputs)
    assert out.dtype == expected.dtype, name
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)


def test_fp32_policy_ops_compute_in_float32(rng):
    a, b = _randn(rng, 64, 8, dtype=torch.bfloat16), _randn(rng, 64, 8, dtype=torch.bfloat16)
    with torch.autocast("spyre", dtype=torch.bfloat16):
        loss = F.mse_loss(a.to(SPYRE), b.to(SPYRE))
    assert loss.dtype == torch.float32
    expected = ((a.double() - b.double()) ** 2).mean()
    torch.testing.assert_close(loss.cpu().double(), expected, rtol=1e-6, atol=1e-7)


class _Block(torch.nn.Module):
    """Pre-norm MLP block with dropout (so checkpoint recomputation must replay the
    device's random state) and an attention-like matmul."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dropout(F.gelu(self.up(self.norm(x))))
        scores = torch.softmax(x @ x.transpose(-1, -2) / x.shape[-1] ** 0.5, -1)
        return x + self.down(h) + scores @ x


class _Model(torch.nn.Module):
    def __init__(self, dim: int, depth: int, ckpt: str | None) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(dim) for _ in range(depth))
        self.head = torch.nn.Linear(dim, 3)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.ckpt is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
        return self.head(x)


def _train_step(model: _Model, x: torch.Tensor, y: torch.Tensor, device: str, seed: int):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if device == "spyre":
        torch.spyre.manual_seed(seed)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant"])
def test_checkpointed_training_under_autocast(rng, ckpt):
    torch.manual_seed(int(rng.integers(1 << 31)))
    plain = _Model(16, 2, ckpt=None)
    checkpointed = _Model(16, 2, ckpt=ckpt)
    checkpointed.load_state_dict(plain.state_dict())
    plain.to(SPYRE)
    checkpointed.to(SPYRE)
    # Reentrant checkpointing needs an input that requires grad.
    x = _randn(rng, 4, 10, 16).to(SPYRE).requires_grad_(ckpt == "reentrant")
    y = torch.from_numpy(rng.integers(0, 3, size=(4, 10))).to(SPYRE)
    seed = int(rng.integers(1 << 31))

    ref_loss, ref_grads = _train_step(plain, x, y, "spyre", seed)
    loss, grads = _train_step(checkpointed, x, y, "spyre", seed)

    assert loss.dtype == torch.float32  # cross_entropy is on the fp32 list
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    eps = torch.finfo(torch.bfloat16).eps
    for name, ref in ref_grads.items():
        if ckpt == "non_reentrant":
            # The recomputation replays the same casts, kernels and dropout masks, and
            # autograd sums the gradients in the same order.
            torch.testing.assert_close(grads[name], ref, rtol=0, atol=0, msg=name)
        else:
            # Reentrant checkpointing runs each segment's backward separately and feeds
            # the segment input's gradient back as a whole, so bfloat16 gradient
            # contributions are rounded at other points than in the plain run (torch does
            # the same on CPU: the CPU comparison below is exact): a few bfloat16 units
            # of the gradient's scale.
            scale = float(ref.abs().max())
            torch.testing.assert_close(grads[name], ref, rtol=0, atol=4 * eps * scale, msg=name)


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant"])
def test_checkpointed_training_under_autocast_matches_cpu(rng, ckpt):
    torch.manual_seed(int(rng.integers(1 << 31)))
    on_cpu = _Model(16, 2, ckpt=ckpt)
    on_spyre = _Model(16, 2, ckpt=ckpt)
    for model in (on_cpu, on_spyre):
        for block in model.blocks:
            block.dropout.p = 0.0  # spyre and CPU generators draw different masks
    on_spyre.load_state_dict(on_cpu.state_dict())
    on_spyre.to(SPYRE)
    x = _randn(rng, 4, 10, 16).requires_grad_(True)
    y = torch.from_numpy(rng.integers(0, 3, size=(4, 10)))

    ref_loss, ref_grads = _train_step(on_cpu, x, y, "cpu", 0)
    loss, grads = _train_step(
        on_spyre, x.detach().to(SPYRE).requires_grad_(True), y.to(SPYRE), "spyre", 0
    )

    # Same casts, same CPU kernels, same checkpoint logic: the same numbers.
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, ref in ref_grads.items():
        assert grads[name].dtype == ref.dtype == torch.float32, name
        torch.testing.assert_close(grads[name], ref, rtol=0, atol=0, msg=name)


def test_compiled_checkpointed_training_under_autocast(rng):
    # torch.compile (inductor) + activation checkpointing + bfloat16 autocast on spyre,
    # against the same model run eagerly under CPU autocast.
    torch.manual_seed(int(rng.integers(1 << 31)))
    on_cpu = _Model(16, 2, ckpt="non_reentrant")
    on_spyre = _Model(16, 2, ckpt="non_reentrant")
    for model in (on_cpu, on_spyre):
        for block in model.blocks:
            block.dropout.p = 0.0
    on_spyre.load_state_dict(on_cpu.state_dict())
    on_spyre.to(SPYRE)
    x = _randn(rng, 4, 10, 16)
    y = torch.from_numpy(rng.integers(0, 3, size=(4, 10)))

    ref_loss, ref_grads = _train_step(on_cpu, x, y, "cpu", 0)
    torch._dynamo.reset()
    compiled = torch.compile(on_spyre, backend="inductor")
    loss, _ = _train_step(compiled, x.to(SPYRE), y.to(SPYRE), "spyre", 0)
    grads = {name: p.grad.cpu() for name, p in on_spyre.named_parameters()}

    # Inductor fuses the float32 ops around the bfloat16 matmuls, so intermediate values
    # are rounded to bfloat16 at other points than in eager mode: a few bfloat16 units of
    # each gradient's scale (the loss is float32: cross_entropy is on the fp32 list).
    # The scale is the module's (its weight's and bias's gradients alike): a bias gradient
    # sums the output gradients over every token, terms of about the weight gradient's size
    # that may cancel, while each term carries its own bfloat16 rounding. Against the bias
    # gradient's own magnitude, numpy seed 1885701437 gave blocks.0.down.bias 9.4 units
    # (5.6e-4 off a gradient of 7.7e-3; 1.8 units of its module's 8.0e-2).
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(loss, ref_loss, rtol=4 * eps, atol=0)
    assert grads.keys() == ref_grads.keys()
    module_scale: dict[str, float] = {}
    for name, ref in ref_grads.items():
        module = name.rsplit(".", 1)[0]
        module_scale[module] = max(module_scale.get(module, 0.0), float(ref.abs().max()))
    for name, ref in ref_grads.items():
        assert grads[name].dtype == torch.float32, name
        scale = module_scale[name.rsplit(".", 1)[0]]
        torch.testing.assert_close(grads[name], ref, rtol=0, atol=4 * eps * scale, msg=name)


def test_grad_scaler_matches_cpu(rng):
    # float16 autocast with torch.amp.GradScaler("spyre"): the scaled steps, an overflowing
    # step (skipped, scale halved) and the parameters equal a CPU run's.
    torch.manual_seed(int(rng.integers(1 << 31)))
    on_cpu = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 3))
    on_spyre = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 3))
    on_spyre.load_state_dict(on_cpu.state_dict())
    on_spyre.to(SPYRE)
    batches = [(_randn(rng, 8, 6), _randn(rng, 8, 3)) for _ in range(4)]
    batches[2] = (batches[2][0] * 1e6, batches[2][1])  # float16 overflow in the forward

    def run(model: torch.nn.Module, device: str) -> tuple[list[float], list[float]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
        scales, losses = [], []
        for x, y in batches:
            with torch.autocast(device, dtype=torch.float16):
                loss = F.mse_loss(model(x.to(device)), y.to(device))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale())
            losses.append(float(loss.detach()))
        return scales, losses

    cpu_scales, cpu_losses = run(on_cpu, "cpu")
    scales, losses = run(on_spyre, "spyre")
    assert scales == cpu_scales and scales[2] == scales[1] / 2, scales
    assert losses[2] != losses[2]  # the overflowing step's loss is NaN on both
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(cpu_losses), rtol=0, atol=0, equal_nan=True
    )
    for (name, p), ref in zip(on_spyre.named_parameters(), on_cpu.parameters()):
        torch.testing.assert_close(p.detach().cpu(), ref.detach(), rtol=0, atol=0, msg=name)
