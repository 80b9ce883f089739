"""Ranks that call different collectives, counts, dtypes, roots or orders.

spyreccl compares every rank's descriptor of a collective in its first step, before any
data is combined, so a mismatch must fail on every rank with a message naming both sides,
and leave every output untouched (poisoned outputs stay poisoned, in-place inputs keep
their values). Each case forks a fresh 3-rank group, since a mismatch breaks the group.
A one-way (small) broadcast's root returns before its receivers read it: a rank that could
not see such a mismatch in the call fails at its next collective that waits for every rank,
with the same message.

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
        # 100 floats: above the largest one-way broadcast (256 bytes), so every rank
        # compares every descriptor in the call.
        y = random_tensor(100, torch.float32, "spyre", rank_seed(seed, rank), nranks=world)
        y_before = y.cpu()
        src = 1 if odd else 0
        return (lambda: dist.broadcast(y, src=src)), [(y, y_before)]
    if kind in ("root_one_way", "count_one_way"):
        # A one-way broadcast: its root returns before any receiver reads it.
        src = 1 if odd and kind == "root_one_way" else 0
        z = x[: n - 1] if odd and kind == "count_one_way" else x
        return (lambda: dist.broadcast(z, src=src)), [(x, before)]
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
    in_call = error is not None
    if error is None and kind.endswith("_one_way"):
        # A rank that could not see the mismatch in a one-way broadcast (its root, say)
        # fails at its next collective that waits for every rank.
        try:
            dist.all_reduce(torch.ones(3, device="spyre"))
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
        "in_call": in_call,
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
        "root_one_way",
        "count_one_way",
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
        if not kind.endswith("_one_way"):
            assert report["in_call"], f"rank {rank}: failed only after the call: {report}"
        if report["in_call"]:
            # (A one-way broadcast that succeeded on a receiver wrote the root's data.)
            assert all(report["untouched"]), f"rank {rank}: an output was modified: {report}"
    if kind == "count_one_way":
        # The receiver with the other count reads the root's slot: it fails in the call.
        assert reports[ODD_RANK]["in_call"], reports[ODD_RANK]


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
