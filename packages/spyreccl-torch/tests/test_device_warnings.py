"""Operators on the emulated spyre device warn exactly when the same call on CPU warns.

Every spyre operator runs a CPU kernel; where CPU has a kernel of its own, spyre must run
that kernel rather than a composite one (which, for structured operators, goes through
the ``out=`` variant and warned "An output with one or more elements was resized" for
``F.mse_loss``). Warnings are errors in this module, and values are compared with CPU.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from spyreccl_torch import device as spyre_device

pytestmark = [
    pytest.mark.skipif(
        not spyre_device.register(), reason="the emulated spyre device stepped aside"
    ),
    pytest.mark.filterwarnings("error"),
]

SPYRE = torch.device("spyre")


def _randn(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape)).float()


# Functions of (x, y), both of shape (6, 5): losses in every reduction, reductions to 0-d.
_OPS = {
    "mse_loss_mean": lambda x, y: F.mse_loss(x, y),
    "mse_loss_sum": lambda x, y: F.mse_loss(x, y, reduction="sum"),
    "mse_loss_none": lambda x, y: F.mse_loss(x, y, reduction="none"),
    "l1_loss": lambda x, y: F.l1_loss(x, y),
    "smooth_l1_loss": lambda x, y: F.smooth_l1_loss(x, y, beta=0.5),
    "huber_loss": lambda x, y: F.huber_loss(x, y, delta=0.7),
    "binary_cross_entropy_with_logits": lambda x, y: F.binary_cross_entropy_with_logits(
        x, y.sigmoid()
    ),
    "cross_entropy": lambda x, y: F.cross_entropy(x, y.argmax(1)),
    "sum_to_0d": lambda x, y: (x * y).sum(),
    "mean_to_0d": lambda x, y: x.mean() + y.amax(),
    "std_and_norm": lambda x, y: x.std() + torch.linalg.vector_norm(y),
    "dot": lambda x, y: torch.dot(x.flatten(), y.flatten()),
    "layer_norm": lambda x, y: F.layer_norm(x, (5,), y[0], y[1]),
    "addr": lambda x, y: torch.addr(x, y[:, 0], y[0]),
    "any_all_dims": lambda x, y: torch.stack([(x > y).any(1), (x < y).all(1)]).float(),
}


@pytest.mark.parametrize("name", sorted(_OPS))
def test_ops_and_their_backward_do_not_warn(rng, name):
    fn = _OPS[name]
    x, y = _randn(rng, 6, 5), _randn(rng, 6, 5)
    xs = x.to(SPYRE).requires_grad_(True)
    ys = y.to(SPYRE)
    out = fn(xs, ys)
    expected_x = x.clone().requires_grad_(True)
    expected = fn(expected_x, y)
    assert out.device.type == "spyre"
    # CPU's own kernel runs on the spyre memory: the same values.
    torch.testing.assert_close(out.cpu(), expected.detach(), rtol=0, atol=0)
    if out.requires_grad:
        grad = _randn(rng, *out.shape)
        out.backward(grad.to(SPYRE))
        expected.backward(grad)
        torch.testing.assert_close(xs.grad.cpu(), expected_x.grad, rtol=0, atol=0)


def test_out_variants_do_not_warn_when_cpu_does_not(rng):
    x, y = _randn(rng, 6, 5), _randn(rng, 6, 5)
    xs, ys = x.to(SPYRE), y.to(SPYRE)
    # A correctly shaped output, and an empty one (resized silently, as documented).
    for out in (torch.empty((), device=SPYRE), torch.empty(0, device=SPYRE)):
        result = torch.sum(xs * ys, dim=(0, 1), out=out)
        assert result is out and out.shape == ()
        torch.testing.assert_close(out.cpu(), (x * y).sum(dim=(0, 1)), rtol=0, atol=0)
    out = torch.empty(6, 5, device=SPYRE)
    assert torch.add(xs, ys, alpha=2, out=out) is out
    torch.testing.assert_close(out.cpu(), torch.add(x, y, alpha=2), rtol=0, atol=0)
    out = torch.empty(0, device=SPYRE)
    torch.mm(xs, ys.t(), out=out)
    torch.testing.assert_close(out.cpu(), x @ y.t(), rtol=0, atol=0)


def test_a_wrongly_shaped_out_warns_as_on_cpu(rng):
    # Parity in the other direction: a resize that CPU warns about warns on spyre too.
    x = _randn(rng, 4, 3)
    with warnings.catch_warnings(record=True) as on_cpu:
        warnings.simplefilter("always")
        torch.neg(x, out=torch.empty(2))
    with warnings.catch_warnings(record=True) as on_spyre:
        warnings.simplefilter("always")
        out = torch.neg(x.to(SPYRE), out=torch.empty(2, device=SPYRE))
    assert [str(w.message) for w in on_spyre] == [str(w.message) for w in on_cpu]
    assert len(on_cpu) == 1 and "was resized" in str(on_cpu[0].message)
    torch.testing.assert_close(out.cpu(), -x, rtol=0, atol=0)


def test_operators_cpu_runs_natively_run_the_cpu_kernel_on_spyre():
    # Spot checks of the routing: structured ops (functional and in-place) and composite
    # decompositions that CPU replaces by its own kernels. The binary arithmetic of two
    # tensors runs CPU's kernel through unboxed spyre kernels instead (binary_ops.cc).
    for op, source in (
        ("aten::mse_loss", "fallback.cc"),
        ("aten::mm", "fallback.cc"),
        ("aten::add.Tensor", "binary_ops.cc"),
        ("aten::mul.Tensor", "binary_ops.cc"),
        ("aten::add_.Tensor", "fallback.cc"),
        ("aten::native_layer_norm", "fallback.cc"),
        ("aten::sum.dim_IntList", "fallback.cc"),
    ):
        table = torch._C._dispatch_dump_table(op)
        entry = next(line for line in table.splitlines() if line.startswith("PrivateUse1:"))
        assert source in entry and "[kernel]" in entry, (op, entry)
    # Calling the routing again changes nothing (the loader calls it once per process).
    first = torch.ops.spyreccl_device.route_to_cpu_kernels()
    assert first > 100
    assert torch.ops.spyreccl_device.route_to_cpu_kernels() == first


def test_main_job_prints_no_warning():
    # The main job (examples/tp_llama.py under torchrun, as `nox -s demo` runs it, checks
    # only: no timing, no compilation, no picture) must print no warning at all.
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "tp_llama.py"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "PYTHONWARNINGS")}
    env.setdefault("OMP_NUM_THREADS", "1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            "--no-timing",
            "--no-compile",
            "--no-progress",
            "--train-steps",
            "2",
            "--plot",
            "",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tp_llama: OK" in result.stdout
    assert "warn" not in result.stderr.lower(), result.stderr[-3000:]
