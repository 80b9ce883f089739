"""A 2-D DeviceMesh (data parallel x tensor parallel) on spyre + spyreccl, 4 ranks.

``init_device_mesh("spyre", (2, 2), ("dp", "tp"))`` creates one sub-group per row and per column
of the mesh; both kinds must be spyreccl communicators that reduce only among their members.
Then the standard 2-D recipe — ``parallelize_module`` over "tp", ``fully_shard`` over "dp" — is
trained for a few steps and compared with one float64 model trained on the global batch.

Four ranks on a 2-core machine: the cases are few and small on purpose.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DEVICE = "spyre"
DP, TP = 2, 2
DIM, HIDDEN, PER_DP = 12, 20, 3


def _mesh(device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    if device_type != "cpu":
        torch.accelerator.set_device_index(dist.get_rank() % torch.accelerator.device_count())
    return init_device_mesh(device_type, (DP, TP), mesh_dim_names=("dp", "tp"))


def _sub_group_collectives(device_type: str, seed: int) -> dict[str, list[int]]:
    """all_reduce / all_gather over each mesh dimension, through the c10d API on the dimension's
    ProcessGroup and through functional collectives on (mesh, dim); checked against the inputs
    every rank can regenerate from the seed."""
    import torch.distributed._functional_collectives as funcol

    mesh = _mesh(device_type)
    rank, ws = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    # float32-representable values: the gathers must then be bit exact.
    inputs = [torch.randn(7, generator=gen).double() for _ in range(ws)]
    mine = inputs[rank].float().to(device_type)
    members = {}
    for dim, name in enumerate(("dp", "tp")):
        group = mesh.get_group(name)
        ranks = dist.get_process_group_ranks(group)
        members[name] = ranks
        assert rank in ranks and len(ranks) == (DP if name == "dp" else TP)
        if device_type != "cpu":
            served_by = group._get_backend(torch.device(device_type)).name()
            assert served_by == "spyreccl", f"mesh dim {name} is served by {served_by}"
        expected_sum = sum(inputs[r] for r in ranks)
        expected_cat = torch.cat([inputs[r] for r in ranks])

        t = mine.clone()
        dist.all_reduce(t, group=group)
        torch.testing.assert_close(
            t.cpu().double(),
            expected_sum,
            rtol=1e-6,
            atol=1e-6,
            msg=f"dist.all_reduce over {name} (seed {seed})",
        )
        out = torch.full((len(ranks) * 7,), float("nan"), device=device_type)
        dist.all_gather_single(out, mine, group=group)
        torch.testing.assert_close(
            out.cpu().double(),
            expected_cat,
            rtol=0,
            atol=0,
            msg=f"dist.all_gather_single over {name} (seed {seed})",
        )
        reduced = funcol.all_reduce(mine, "sum", (mesh, dim))
        torch.testing.assert_close(
            reduced.clone().cpu().double(),
            expected_sum,
            rtol=1e-6,
            atol=1e-6,
            msg=f"funcol.all_reduce over {name} (seed {seed})",
        )
    # Rows and columns of the mesh: each dp group is a column, each tp group a row.
    assert members["tp"] == [rank // TP * TP + i for i in range(TP)], members
    assert members["dp"] == [rank % TP + i * TP for i in range(DP)], members
    return members


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp1 = MLP()
        self.mlp2 = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp1(x)
        return x + self.mlp2(x)


def _tp_dp_training(device_type: str, seed: int, steps: int) -> list[float]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = _mesh(device_type)
    rank = dist.get_rank()
    dp_rank = mesh.get_local_rank("dp")
    torch.manual_seed(seed)
    model = Model()
    reference = copy.deepcopy(model).double()

    model.to(device_type)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    for mlp in (model.mlp1, model.mlp2):
        parallelize_module(mlp, mesh["tp"], plan)
        fully_shard(mlp, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    w = model.mlp1.up.weight
    assert isinstance(w, DTensor) and w.device_mesh.ndim == 2, "expected a 2-D (dp, tp) DTensor"

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(seed + 1)
    curve = []
    for step in range(steps):
        x = torch.randn(DP * PER_DP, DIM, generator=gen, dtype=torch.float64)
        y = torch.randn(DP * PER_DP, DIM, generator=gen, dtype=torch.float64)
        mine = slice(dp_rank * PER_DP, (dp_rank + 1) * PER_DP)  # tp peers share a slice

        opt.zero_grad()
        with warnings.catch_warnings():
            # FSDP2 warns when a wrapped module returns a view; nothing here modifies one.
            warnings.filterwarnings("ignore", message=".*returned a view tensor")
            out = model(x[mine].float().to(device_type))
        loss = F.mse_loss(out, y[mine].float().to(device_type))
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)  # over all 4: tp peers agree
        curve.append(global_loss.item())

        opt_ref.zero_grad()
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        opt_ref.step()
        assert abs(curve[-1] - ref_loss.item()) <= 1e-5 * max(1.0, ref_loss.item()), (
            f"step {step}: 2-D loss {curve[-1]} vs reference {ref_loss.item()} "
            f"(rank {rank}, seed {seed})"
        )
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            p.full_tensor().detach().cpu().double(),
            ref_params[name].detach(),
            rtol=1e-4,
            atol=1e-5,
            msg=f"{name} after {steps} steps (rank {rank}, seed {seed})",
        )
    return curve


pytestmark = pytest.mark.world_sizes(DP * TP)


@pytest.fixture
def seed() -> int:
    return int.from_bytes(os.urandom(4), "little") & 0x3FFFFFFF


def test_mesh_dimension_sub_groups(rank_pool, seed):
    members = rank_pool.run(_sub_group_collectives, DEVICE, seed, timeout=120)
    assert [m["tp"] for m in members] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [m["dp"] for m in members] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_tp_x_dp_training_matches_reference(rank_pool, seed):
    curves = rank_pool.run(_tp_dp_training, DEVICE, seed, 3, timeout=180)
    assert all(c == curves[0] for c in curves), curves
