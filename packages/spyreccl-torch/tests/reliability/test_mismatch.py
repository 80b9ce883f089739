"""Ranks that call different collectives, counts, dtypes, roots or orders.

spyreccl compares every rank's descriptor of a collective in its first step, before any
data is combined, so a mismatch must fail on every rank with a message naming both sides,
and leave every output untouched (poisoned outputs stay poisoned, in-place inputs keep
their values). Each case forks a fresh 3-rank group, since a mismatch breaks the group.

With TORCH_DISTRIBUTED_DEBUG=DETAIL, c10d wraps the backend in ProcessGroupWrapper, which
checks each collective's fingerprint over a gloo helper group before running it: the
collectives must still be correct, and a mismatch must be caught (by the wrapper).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from spyreccl_testing.accuracy import assert_close_dtype, reference_reduce
from spyreccl_testing.forked import ForkedGroup, results
from spyreccl_testing.inputs import fresh_seed, poison_, poisoned_mask, random_tensor, rank_seed

WORLD_SIZE = 3
ODD_RANK = 2  # the rank that disagrees


def _mismatched_call(kind: str, rank: int, world: int, seed: int):
    """Returns (call, outputs_to_check): the call this rank makes in case `kind`, and the
    tensors it writes with the value each must still hold after the failure (None: must
    still be entirely poisoned)."""
    odd = rank == ODD_RANK
    n = 17
    x = random_tensor(n, torch.float32, "spyre", rank_seed(seed, rank), nranks=world)
    before = x.cpu()
    if kind == "op":
        op = dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM
        return (lambda: dist.all_reduce(x, op=op)), [(x, before)]
    if kind == "count":
        y = random_tensor(n + 1 if odd else n, torch.float32, "spyre", seed)
        y_before = y.cpu()
        return (lambda: dist.all_reduce(y)), [(y, y_before)]
    if kind == "dtype":
        dtype = torch.float64 if odd else torch.float32
        y = random_tensor(n, dtype, "spyre", seed)
        y_before = y.cpu()
        return (lambda: dist.all_reduce(y)), [(y, y_before)]
    if kind == "root":
        src = 1 if odd else 0
        return (lambda: dist.broadcast(x, src=src)), [(x, before)]
    if kind == "collective":
        if odd:
            out = poison_(torch.empty(n * world, device="spyre"))
            return (lambda: dist.all_gather_single(out, x)), [(out, None)]
        return (lambda: dist.all_reduce(x)), [(x, before)]
    if kind == "order":
        # Rank ODD_RANK issues the same two collectives in the opposite order.
        out = poison_(torch.empty(n * world, device="spyre"))

        def two_calls():
            if odd:
                dist.all_gather_single(out, x)
                dist.all_reduce(x)
            else:
                dist.all_reduce(x)
                dist.all_gather_single(out, x)

        return two_calls, [(x, before), (out, None)]
    raise AssertionError(kind)


def rank_mismatch(ctx, kind: str, seed: int):
    call, outputs = _mismatched_call(kind, ctx.rank, ctx.world_size, seed)
    try:
        call()
        error = None
    except Exception as exc:
        error = exc
    untouched = []
    for tensor, expected in outputs:
        host = tensor.cpu()
        if expected is None:
            written = ~poisoned_mask(host)
            untouched.append(not bool(written.any()))
        else:
            untouched.append(torch.equal(host, expected))
    return {
        "type": None if error is None else type(error).__name__,
        "dist_backend_error": isinstance(error, dist.DistBackendError),
        "message": str(error) if error else "",
        "untouched": untouched,
    }


def mismatch_scenario(kind: str, seed: int):
    return results(ForkedGroup(WORLD_SIZE, rank_mismatch, kind, seed, pg_timeout=30).finish(60))


@pytest.mark.parametrize(
    "kind",
    [
        "op",
        "count",
        "dtype",
        "root",
        "collective",
        "order",
    ],
)
def test_mismatch_fails_on_every_rank_without_corruption(launcher, kind):
    reports = launcher.run(mismatch_scenario, kind, fresh_seed(), timeout=120)[0]
    for rank, report in enumerate(reports):
        message = report["message"]
        assert report["dist_backend_error"], f"rank {rank}: {report}"
        assert "spyrecclMismatch" in message, f"rank {rank}: {message}"
        # Both sides are named: "rank 2 called allgather(...) but rank 0 called allreduce(...)".
        assert re.search(r"rank \d+ called .* but rank \d+ called ", message), (
            f"rank {rank}: {message}"
        )
        assert all(report["untouched"]), f"rank {rank}: an output was modified: {report}"


# -- TORCH_DISTRIBUTED_DEBUG=DETAIL ------------------------------------------------------------


def rank_detail(ctx, seed: int):
    backend = dist.group.WORLD._get_backend(torch.device("spyre"))
    world, rank = ctx.world_size, ctx.rank
    inputs = [
        random_tensor(33, torch.float32, seed=rank_seed(seed, r), nranks=world)
        for r in range(world)
    ]
    x = inputs[rank].to("spyre")
    dist.all_reduce(x)
    assert_close_dtype(x.cpu(), reference_reduce(inputs, "sum"), torch.float32, world, seed=seed)
    out = poison_(torch.empty(33 * world, device="spyre"))
    dist.all_gather_single(out, inputs[rank].to("spyre"))
    assert torch.equal(out.cpu(), torch.cat(inputs))
    y = inputs[rank].to("spyre") if rank == 1 else poison_(torch.empty(33, device="spyre"))
    dist.broadcast(y, src=1)
    assert torch.equal(y.cpu(), inputs[1])
    # A count mismatch: the wrapper's fingerprint check must catch it on every rank.
    z = torch.ones(8 + (rank == ODD_RANK), device="spyre")
    z_before = z.cpu()
    try:
        dist.all_reduce(z)
        error = None
    except Exception as exc:
        error = exc
    return {
        "wrapped": type(backend).__name__,
        "message": str(error) if error else "",
        "untouched": torch.equal(z.cpu(), z_before),
    }


def detail_scenario(seed: int):
    return results(
        ForkedGroup(
            WORLD_SIZE,
            rank_detail,
            seed,
            pg_timeout=30,
            env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
        ).finish(90)
    )


def test_torch_distributed_debug_detail(launcher):
    reports = launcher.run(detail_scenario, fresh_seed(), timeout=150)[0]
    for rank, report in enumerate(reports):
        assert report["wrapped"] == "_ProcessGroupWrapper", report
        assert "mismatch" in report["message"].lower(), f"rank {rank}: {report['message']}"
        assert report["untouched"], f"rank {rank}: the mismatched all_reduce wrote its tensor"
