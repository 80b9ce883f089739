"""Bounded waits: an operation whose peer never arrives must fail on the waiting rank within
the group's timeout (not hang), Work.wait(timeout) must give up after its own timeout, and a
monitored barrier that a rank skips must report it. Every scenario runs on a fresh spyreccl
sub-group with a short timeout (a timed-out communicator is unusable afterwards), in a small
dedicated pool; the default group must stay healthy throughout.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from _ops_support import POOL_OPTIONS

pytestmark = [pytest.mark.world_sizes(2), pytest.mark.rank_pool_options(**POOL_OPTIONS)]

GROUP_TIMEOUT_S = 2.0
# Upper slack for a loaded 2-core machine: failing *at all* instead of hanging is the point.
SLACK_S = 20.0


def _short_group():
    return dist.new_group(backend="spyreccl", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


def _timed_failure(call):
    start = time.monotonic()
    try:
        call()
    except RuntimeError as exc:
        return time.monotonic() - start, str(exc)
    raise AssertionError(
        f"expected a failure, but the call returned after {time.monotonic() - start:.2f}s"
    )


def _world_still_works(ctx):
    tensor = torch.full((5,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(tensor)
    expected = float(sum(range(1, ctx.world_size + 1)))
    assert tensor.cpu().tolist() == [expected] * 5, "the default group broke"


def run_collective_without_peer(ctx):
    group = _short_group()
    result = None
    if ctx.rank == 0:
        tensor = torch.ones(1001, device=ctx.device)
        elapsed, message = _timed_failure(lambda: dist.all_reduce(tensor, group=group))
        # The broken communicator refuses further work promptly instead of waiting again.
        again, message_again = _timed_failure(lambda: dist.all_reduce(tensor, group=group))
        result = (elapsed, message, again, message_again)
    _world_still_works(ctx)
    return result


def test_collective_whose_peer_never_arrives_times_out(rank_pool):
    elapsed, message, again, message_again = rank_pool.run(
        run_collective_without_peer, timeout=120
    )[0]
    assert GROUP_TIMEOUT_S * 0.9 <= elapsed <= GROUP_TIMEOUT_S + SLACK_S, (elapsed, message)
    assert "imeout" in message or "timed out" in message, message
    assert again <= SLACK_S, (again, message_again)


def run_recv_without_sender(ctx):
    group = _short_group()
    result = None
    if ctx.rank == 0:
        tensor = torch.empty(64, device=ctx.device)
        result = _timed_failure(lambda: dist.recv(tensor, src=1, group=group))
    _world_still_works(ctx)
    return result


def test_recv_without_sender_times_out(rank_pool):
    elapsed, message = rank_pool.run(run_recv_without_sender, timeout=120)[0]
    assert GROUP_TIMEOUT_S * 0.9 <= elapsed <= GROUP_TIMEOUT_S + SLACK_S, (elapsed, message)
    assert "imeout" in message or "timed out" in message, message


def run_work_wait_timeout(ctx):
    # The group's own timeout is long: Work.wait(timeout) alone must end the wait.
    group = dist.new_group(backend="spyreccl", timeout=datetime.timedelta(seconds=120))
    result = None
    if ctx.rank == 0:
        work = dist.all_reduce(torch.ones(17, device=ctx.device), group=group, async_op=True)
        elapsed, message = _timed_failure(lambda: work.wait(datetime.timedelta(seconds=1)))
        result = (elapsed, message, work.is_completed())
    _world_still_works(ctx)
    return result


def test_work_wait_with_timeout(rank_pool):
    elapsed, message, _ = rank_pool.run(run_work_wait_timeout, timeout=120)[0]
    assert 0.9 <= elapsed <= 1.0 + SLACK_S, (elapsed, message)
    assert "timed out after 1000 ms" in message, message


def run_monitored_barrier_without_peer(ctx):
    group = _short_group()
    result = None
    if ctx.rank == 0:
        backend = group._get_backend(torch.device("spyre"))
        result = _timed_failure(
            lambda: backend.monitored_barrier(datetime.timedelta(seconds=1), True)
        )
    _world_still_works(ctx)
    return result


def test_monitored_barrier_reports_missing_rank(rank_pool):
    elapsed, message = rank_pool.run(run_monitored_barrier_without_peer, timeout=120)[0]
    assert 0.9 <= elapsed <= 1.0 + SLACK_S, (elapsed, message)
    assert "not all ranks" in message and "monitoredBarrier" in message, message
