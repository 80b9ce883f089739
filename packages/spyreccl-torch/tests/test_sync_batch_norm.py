"""nn.SyncBatchNorm on spyre + spyreccl against one float64 BatchNorm over the whole batch.

SyncBatchNorm normalises each channel with the statistics of the global batch: every rank
computes its own (batch_norm_stats), the ranks all-gather them with their element counts,
combine them (batch_norm_gather_stats_with_counts, which also updates the running
statistics), and the backward all-reduces two per-channel sums. The five statistics
operators are spyre kernels (src/device/sync_batch_norm.cc); the collectives are spyreccl's.
Ranks get batches of different sizes (an empty one too), so the counts matter, and inputs are
channels_last as well as contiguous. The reference is a float64 BatchNorm in training mode on
the concatenated batch: outputs, input gradients, weight and bias gradients (DDP averages
them over the ranks) and running statistics after two steps. A rank with an empty batch gets
no gradients from SyncBatchNorm (torch's behaviour), which DDP cannot reduce: that case runs
the module alone and sums the weight and bias gradients itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from spyreccl_testing.inputs import fresh_seed

pytestmark = pytest.mark.world_sizes(2, 3)

C, H, W = 5, 3, 4


def _batch_sizes(world: int, empty_rank: bool) -> list[int]:
    sizes = [2 + 3 * r % 4 for r in range(world)]  # 2, 5, 4: unequal
    if empty_rank:
        sizes[0] = 0
    return sizes


def _sync_bn_case(seed: int, empty_rank: bool, channels_last: bool, dtype_name: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.accelerator.set_device_index(rank)
    dev = torch.device("spyre", rank)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    bn = nn.BatchNorm2d(C, momentum=0.3)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(C, generator=gen) + 0.5)
        bn.bias.copy_(torch.randn(C, generator=gen))
    reference = copy.deepcopy(bn).double()
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(bn)).to(dev, dtype)
    sync_bn = synced[0]
    assert isinstance(sync_bn, nn.SyncBatchNorm)
    model = synced if empty_rank else DDP(synced)
    sizes = _batch_sizes(world, empty_rank)
    start = sum(sizes[:rank])
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    for step in range(2):
        x = torch.randn(sum(sizes), C, H, W, generator=gen, dtype=torch.float64) * 3 + 1
        dout = torch.randn(sum(sizes), C, H, W, generator=gen, dtype=torch.float64)
        mine = slice(start, start + sizes[rank])
        local = x[mine].to(dev, dtype)
        if channels_last:
            local = local.contiguous(memory_format=torch.channels_last)
        local.requires_grad_()
        out = model(local)
        out.backward(dout[mine].to(dev, dtype))

        leaf = x.clone().requires_grad_()
        want = reference(leaf)
        want.backward(dout)
        what = f"step {step}, rank {rank} of {world}, sizes {sizes}, seed {seed}"
        if channels_last and sizes[rank]:
            assert out.is_contiguous(memory_format=torch.channels_last), what
        torch.testing.assert_close(
            out.detach().cpu().double(), want.detach()[mine], **tol, msg=what
        )
        if sizes[rank]:
            torch.testing.assert_close(
                local.grad.cpu().double(), leaf.grad[mine], **tol, msg=f"input grad, {what}"
            )
        else:
            assert local.grad is None, what
        for name in ("weight", "bias"):
            param = getattr(sync_bn, name)
            if empty_rank:  # each rank's share of the global sum, summed here
                share = torch.zeros_like(param) if param.grad is None else param.grad
                dist.all_reduce(share)
                got = share.cpu().double()
            else:  # DDP averaged the shares
                got = param.grad.cpu().double() * world
            torch.testing.assert_close(
                got, getattr(reference, name).grad, **tol, msg=f"{name} grad, {what}"
            )
            getattr(sync_bn, name).grad = None
            getattr(reference, name).grad = None
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(
                getattr(sync_bn, name).cpu().double(),
                getattr(reference, name),
                **tol,
                msg=f"{name}, {what}",
            )


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("empty_rank", [False, True], ids=["all_ranks", "an_empty_rank"])
def test_sync_batch_norm_matches_whole_batch(rank_pool, empty_rank, channels_last, dtype_name):
    rank_pool.run(_sync_bn_case, fresh_seed(), empty_rank, channels_last, dtype_name, timeout=120)
