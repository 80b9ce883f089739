"""DTensor tensor parallelism on spyre + spyreccl: ``init_device_mesh("spyre", ...)``,
``ColwiseParallel`` / ``RowwiseParallel`` on an MLP and on an attention block, forward and
backward compared with a single-device float64 reference built from the same weights.

The activations are replicated (TP), so every rank feeds the same random batch; the reference
runs on the CPU in float64, independently of any collective.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DEVICE = "spyre"

# Sizes divisible by 2 and 3 so both world sizes shard evenly: 6 heads of 4, hidden 48.
DIM, HEADS, HIDDEN, BATCH, SEQ = 24, 6, 48, 3, 5


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    """Causal multi-head attention; the head count is read from the projection output so the
    same code runs on a column shard (fewer local heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.q = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM)
        self.v = nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.o((attn @ v).transpose(1, 2).reshape(b, s, -1))


def _plan(kind: str) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if kind == "mlp":
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "o": RowwiseParallel(),
    }


def _tp_vs_reference(device_type: str, kind: str, seed: int) -> dict[str, float]:
    """Forward + backward of the TP module against the float64 CPU reference; returns the
    largest differences (for the test's report)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    ws, rank = dist.get_world_size(), dist.get_rank()
    if device_type != "cpu":
        torch.accelerator.set_device_index(rank % torch.accelerator.device_count())
    torch.manual_seed(seed)  # the same initial weights on every rank
    module = MLP() if kind == "mlp" else Attention()
    reference = copy.deepcopy(module).double()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)

    mesh = init_device_mesh(device_type, (ws,))
    assert mesh.device_type == device_type
    tp = parallelize_module(module.to(device_type), mesh, _plan(kind))

    # Column-sharded weights really are shards: the local piece holds 1/ws of the rows.
    first = tp.up if kind == "mlp" else tp.q
    assert isinstance(first.weight, DTensor) and first.weight.placements == (Shard(0),)
    assert first.weight.to_local().shape[0] * ws == first.weight.shape[0]
    assert first.weight.to_local().device.type == device_type

    x_dev = x.float().to(device_type).requires_grad_()
    out = tp(x_dev)
    out.backward(grad_out.float().to(device_type))

    x_ref = x.clone().requires_grad_()
    out_ref = reference(x_ref)
    out_ref.backward(grad_out)

    seed_msg = f"(rank {rank}, seed {seed}, {kind})"
    assert not isinstance(out, DTensor), "RowwiseParallel must hand back a local tensor"
    diffs = {"output": (out.detach().cpu().double() - out_ref.detach()).abs().max().item()}
    torch.testing.assert_close(
        out.detach().cpu().double(),
        out_ref.detach(),
        rtol=1e-5,
        atol=1e-5,
        msg=f"forward output {seed_msg}",
    )
    torch.testing.assert_close(
        x_dev.grad.cpu().double(),
        x_ref.grad,
        rtol=1e-5,
        atol=1e-5,
        msg=f"input gradient {seed_msg}",
    )
    ref_params = dict(reference.named_parameters())
    for name, p in tp.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(
            grad.cpu().double(),
            ref_params[name].grad,
            rtol=1e-5,
            atol=1e-5,
            msg=f"gradient of {name} {seed_msg}",
        )
        diffs[f"grad {name}"] = (grad.cpu().double() - ref_params[name].grad).abs().max().item()
    return diffs


def _tp_training_steps(device_type: str, seed: int, steps: int) -> list[float]:
    """A few SGD steps of the TP MLP: the losses and the final weights follow the reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    ws, rank = dist.get_world_size(), dist.get_rank()
    if device_type != "cpu":
        torch.accelerator.set_device_index(rank % torch.accelerator.device_count())
    torch.manual_seed(seed)
    module = MLP()
    reference = copy.deepcopy(module).double()
    tp = parallelize_module(
        module.to(device_type), init_device_mesh(device_type, (ws,)), _plan("mlp")
    )
    opt = torch.optim.SGD(tp.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    for step in range(steps):
        x = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)
        y = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)
        for model, optim, dtype, dev in (
            (tp, opt, torch.float32, device_type),
            (reference, opt_ref, torch.float64, "cpu"),
        ):
            optim.zero_grad()
            loss = F.mse_loss(model(x.to(dev, dtype)), y.to(dev, dtype))
            loss.backward()
            optim.step()
            losses.append(loss.item())
        assert math.isclose(losses[-2], losses[-1], rel_tol=1e-5, abs_tol=1e-6), (
            f"step {step}: TP loss {losses[-2]} vs reference {losses[-1]} (seed {seed})"
        )
    ref_params = dict(reference.named_parameters())
    for name, p in tp.named_parameters():
        torch.testing.assert_close(
            p.full_tensor().detach().cpu().double(),
            ref_params[name].detach(),
            rtol=1e-5,
            atol=1e-5,
            msg=f"{name} after {steps} steps (seed {seed})",
        )
    return losses[::2]


pytestmark = pytest.mark.world_sizes(2, 3)


@pytest.fixture
def seed() -> int:
    return int.from_bytes(os.urandom(4), "little") & 0x3FFFFFFF


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_tp_forward_backward(rank_pool, kind, seed):
    rank_pool.run(_tp_vs_reference, DEVICE, kind, seed)


def test_tp_training_matches_reference(rank_pool, seed):
    losses = rank_pool.run(_tp_training_steps, DEVICE, seed, 4)
    # Every rank computed the same (replicated) loss curve.
    assert all(curve == losses[0] for curve in losses), losses
