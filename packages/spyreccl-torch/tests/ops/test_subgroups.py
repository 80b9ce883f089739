"""Sub-groups over spyreccl: new_group (all ranks, subsets, one-rank groups, spyreccl-only
groups, many created and destroyed in a loop), DeviceMesh sub-groups and split_group.

Every group is exercised with real collectives whose results are checked against a reference
computed from the members' inputs; non-members must get no group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ops_support import (
    POOL_OPTIONS,
    RUN_TIMEOUT,
    DeferredChecks,
    assert_ranks_passed,
    check_exact,
    check_result,
    device,
    rank_inputs,
    run_cases,
)
from torch.distributed.device_mesh import init_device_mesh

from spyreccl_testing.accuracy import reference_reduce
from spyreccl_testing.inputs import fresh_seed, poison_

pytestmark = pytest.mark.rank_pool_options(**POOL_OPTIONS)


def _exercise(group, members, seed, ctx, what):
    """all_reduce (AVG), all_gather_single and broadcast from the last member on `group`,
    checked against the members' inputs; `members` are global ranks in group-rank order."""
    world, rank, dev = ctx.world_size, ctx.rank, device(ctx)
    size = len(members)
    assert dist.get_world_size(group) == size, f"{what}: group size {dist.get_world_size(group)}"
    assert dist.get_rank(group) == members.index(rank), f"{what}: group rank"
    inputs = rank_inputs(seed, (1001,), torch.float32, world)
    member_inputs = [inputs[m] for m in members]
    with DeferredChecks() as check:
        tensor = inputs[rank].to(dev)
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
        expected = reference_reduce(member_inputs, "avg", torch.float32)
        check(check_result, tensor, expected, torch.float32, size, seed, f"{what}: AVG")

        output = poison_(torch.empty(size * 1001, dtype=torch.float32, device=dev))
        dist.all_gather_single(output, inputs[rank].to(dev), group=group)
        expected = torch.cat(member_inputs)
        check(check_exact, output, expected, seed, size, f"{what}: all_gather_single")

        root = members[-1]
        tensor = inputs[rank].to(dev) if rank == root else poison_(torch.empty(1001, device=dev))
        dist.broadcast(tensor, group_src=size - 1, group=group)
        check(check_exact, tensor, inputs[root], seed, size, f"{what}: broadcast")


def _check_new_groups(case, seed, ctx):
    kind, iterations = case
    world, rank = ctx.world_size, ctx.rank
    if kind == "whole":
        layouts = [list(range(world))]
    elif kind == "single":
        layouts = [[r] for r in range(world)]  # one one-rank group per rank
    else:  # "subset": the first and the last rank
        layouts = [[0, world - 1]]
    for i in range(iterations):
        for backend in (None, "spyreccl"):
            # Every rank creates every group (new_group is collective over the default group).
            groups = [dist.new_group(ranks=members, backend=backend) for members in layouts]
            for members, group in zip(layouts, groups):
                what = f"new_group({members}, backend={backend}) #{i}"
                if rank in members:
                    _exercise(group, members, seed + i, ctx, what)
                else:
                    assert group == dist.GroupMember.NON_GROUP_MEMBER, f"{what}: {group!r}"
            for group in groups:
                if group != dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(group)


def run_new_groups(cases, base_seed, ctx):
    return run_cases(_check_new_groups, cases, base_seed, ctx)


@pytest.mark.parametrize(
    ("kind", "iterations"),
    [("whole", 8), ("single", 2), ("subset", 3)],
    ids=["whole", "single", "subset"],
)
def test_new_group(rank_pool, kind, iterations):
    seed = fresh_seed()
    results = rank_pool.run(run_new_groups, [(kind, iterations)], seed, timeout=RUN_TIMEOUT)
    assert_ranks_passed(results, seed, f"new_group ({kind})")


def _mesh_members(mesh, dim, rank):
    """Global ranks of the slice of `mesh` along `dim` that contains `rank`, in order."""
    index = [int(c) for c in (mesh.mesh == rank).nonzero()[0]]
    index[dim] = slice(None)
    return [int(r) for r in mesh.mesh[tuple(index)].tolist()]


def run_device_mesh(base_seed, ctx):
    world, rank = ctx.world_size, ctx.rank
    failures = []
    for shape in ((world,), (1, world), (world, 1)):
        names = ("dp", "tp")[: len(shape)]
        mesh = init_device_mesh("spyre", shape, mesh_dim_names=names)
        for dim, name in enumerate(names):
            members = _mesh_members(mesh, dim, rank)
            try:
                _exercise(
                    mesh.get_group(name), members, base_seed + dim, ctx, f"mesh {shape} {name}"
                )
            except AssertionError as exc:
                failures.append(f"rank {rank} mesh {shape} dim {name}: {exc}")
    return failures


def test_device_mesh_sub_groups(rank_pool):
    seed = fresh_seed()
    results = rank_pool.run(run_device_mesh, seed, timeout=RUN_TIMEOUT)
    assert_ranks_passed(results, seed, "DeviceMesh sub-groups")


def run_split_group(base_seed, ctx):
    """split_group of a spyreccl-only parent bound to this rank's device: evens and odds three
    times (each split destroyed again), then a split in which only rank 0 takes part.

    The parent is not the "cpu:gloo,spyre:spyreccl" default group: splitting that one also
    splits its gloo backend, and torch 2.13 names split groups by hashing their ranks only,
    so re-splitting the same ranks after destroy_process_group reuses the name, which gloo
    uses as its store prefix: it finds the destroyed group's keys and hangs (docs/user-guide.md,
    Troubleshooting). spyreccl keys its store entries per instance, so a spyreccl-only parent
    splits any number of times, which is what this test checks.
    """
    world, rank = ctx.world_size, ctx.rank
    # torch refuses every split unless the *default* group is bound to a device
    # (init_process_group(device_id=...)), which the rank pool does not pass: bind it the
    # way init_process_group does.
    if dist.group.WORLD.bound_device_id is None:
        dist.group.WORLD.bound_device_id = device(ctx)
    parent = dist.new_group(backend="spyreccl", device_id=device(ctx))
    evens = [r for r in range(world) if r % 2 == 0]
    odds = [r for r in range(world) if r % 2 == 1]
    layouts = [g for g in (evens, odds) if g]
    for i in range(3):
        group = dist.split_group(parent_pg=parent, split_ranks=layouts)
        members = evens if rank % 2 == 0 else odds
        assert group is not None, f"split_group returned None for member {rank}"
        _exercise(group, members, base_seed + i, ctx, f"split_group({layouts}) #{i}")
        dist.destroy_process_group(group)
    group = dist.split_group(parent_pg=parent, split_ranks=[[0]])
    if rank == 0:
        _exercise(group, [0], base_seed, ctx, "split_group([[0]])")
    else:
        assert group is None, f"rank {rank} outside every split got {group!r}"
    return []


def test_split_group(rank_pool):
    seed = fresh_seed()
    results = rank_pool.run(run_split_group, seed, timeout=RUN_TIMEOUT)
    assert_ranks_passed(results, seed, "split_group")
