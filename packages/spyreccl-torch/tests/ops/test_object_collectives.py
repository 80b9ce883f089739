"""Object collectives (all_gather_object, broadcast_object_list, gather_object,
scatter_object_list) over spyreccl.

c10d picks the object collectives' device from the group: a "cpu:gloo,spyre:spyreccl" group
uses the CPU (gloo), so these tests run on a spyre-only group (new_group(backend="spyreccl"))
and check that its object device is spyre. The objects are random per rank and include a
blob larger than the staging chunk, nested containers, tensors and None.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from _ops_support import CHUNK_BYTES, POOL_OPTIONS, RUN_TIMEOUT
from torch.distributed.distributed_c10d import _get_object_coll_device

from spyreccl_testing.inputs import fresh_seed, rank_seed

pytestmark = pytest.mark.rank_pool_options(**POOL_OPTIONS)

_group = None


def _spyre_group():
    global _group
    if _group is None:
        _group = dist.new_group(backend="spyreccl")
        device = torch.device(_get_object_coll_device(_group))
        assert device.type == "spyre", f"object collectives of the spyreccl group use {device}"
    return _group


def _make_object(seed, rank, variant):
    """A picklable object that depends on (seed, rank); variants cover small, nested and
    large payloads. Equal inputs give equal objects on every rank."""
    rng = random.Random(rank_seed(seed, rank))
    if variant == 0:
        return {"rank": rank, "value": rng.random(), "tag": f"r{rank}-{rng.randrange(1 << 30)}"}
    if variant == 1:
        return [rank, None, (rng.random(), [rng.randrange(100) for _ in range(rng.randrange(9))])]
    if variant == 2:
        # Longer than several staging chunks once pickled.
        return bytes(rng.randrange(256) for _ in range(3 * CHUNK_BYTES + rank * 7 + 1))
    # A CPU tensor inside a container: pickled by value.
    gen = torch.Generator().manual_seed(rank_seed(seed, rank))
    return {"tensor": torch.randn(5, 3, generator=gen, dtype=torch.float64), "rank": rank}


def _same(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def run_object_collectives(seed, ctx):
    world, rank = ctx.world_size, ctx.rank
    group = _spyre_group()
    for variant in range(4):
        mine = _make_object(seed, rank, variant)
        expected = [_make_object(seed, r, variant) for r in range(world)]
        what = f"variant {variant}"

        gathered = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
        assert all(map(_same, gathered, expected)), f"all_gather_object {what}: {gathered!r:.300}"

        for root in range(world):
            objects = list(expected) if rank == root else [None] * world
            dist.broadcast_object_list(objects, src=root, group=group)
            assert all(map(_same, objects, expected)), f"broadcast_object_list {what} root {root}"

            out = [None] * world if rank == root else None
            dist.gather_object(mine, out, dst=root, group=group)
            if rank == root:
                assert all(map(_same, out, expected)), f"gather_object {what} root {root}"

            received = [None]
            sources = [_make_object(seed + 1, r, variant) for r in range(world)]
            dist.scatter_object_list(
                received, sources if rank == root else None, src=root, group=group
            )
            assert _same(received[0], sources[rank]), f"scatter_object_list {what} root {root}"
    return []


def test_object_collectives(rank_pool):
    rank_pool.run(run_object_collectives, fresh_seed(), timeout=RUN_TIMEOUT)
