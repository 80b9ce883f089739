"""The functional collectives' fast path: what DTensor, FSDP2 and compiled graphs call.

The `_c10d_functional` ops reach the backend as asynchronous calls (``asyncOp=True``). Small
ones (at most SPYRECCL_INLINE_FUNCTIONAL_MAX_BYTES, 1 MiB by default) run on the calling thread
when the group's progress thread is idle; larger ones stay queued so that computation placed
between the collective and its ``wait_tensor`` overlaps the transfer. For spyre tensors,
``wait_tensor`` and ``all_reduce`` also have C++ autograd kernels instead of torch's Python
ones. These tests check that none of this can be observed except as lower latency: results
(float64 references on random inputs, poisoned outputs), which path runs, overlap of large
transfers, the work registry, profiler ranges, group timeouts, abort, mismatch detection and
autograd (gradients against the same computation on CPU in float64).

Which path ran is observed with one rank arriving PEER_DELAY_S late: an inline call returns
only once the late rank joined; a queued one returns at once.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from spyreccl_testing.accuracy import assert_close_dtype, reference_reduce
from spyreccl_testing.inputs import fresh_seed, poison_, random_tensor, rank_seed

C10D = torch.ops._c10d_functional
FUNCTIONAL_ENV = "SPYRECCL_INLINE_FUNCTIONAL_MAX_BYTES"
# A small bound keeps the "too large for the inline path" cases cheap.
FUNCTIONAL_MAX_BYTES = 4096

pytestmark = [
    pytest.mark.world_sizes(2, 3),
    pytest.mark.rank_pool_options(
        backend="cpu:gloo,spyre:spyreccl",
        set_device=True,
        env={FUNCTIONAL_ENV: str(FUNCTIONAL_MAX_BYTES)},
    ),
]

RUN_TIMEOUT = 300.0
# Long enough that a queued call returns well before the late rank joins, even on a loaded
# 2-core machine; an inline one cannot return before it.
PEER_DELAY_S = 1.0
QUEUED_RETURN_LIMIT_S = 0.5


class _DirectCalls:
    """The _c10d_functional ops as spyre's inductor wrappers call them: through the
    functions spyreccl_torch._C._direct_op binds (src/backend/direct_ops.cpp). With
    ``waited``, the collectives are bound as the wrappers bind one whose wait_tensor is the
    next line (``wait_follows=True``): they then run without a Work when nothing observes
    one (ProcessGroupSpyreccl::runWaited), and raise their errors from the call itself."""

    def __init__(self, waited: bool = False) -> None:
        self._waited = waited

    def __getattr__(self, op: str):
        from spyreccl_torch._C import _direct_op

        overload = getattr(C10D, op).default
        bound = _direct_op(overload, wait_follows=self._waited and op != "wait_tensor")
        assert bound is not overload, f"{op}: _direct_op handed the overload back"
        setattr(self, op, bound)
        return bound


CALLS = {"torch.ops": C10D, "direct": _DirectCalls(), "waited": _DirectCalls(waited=True)}


@contextlib.contextmanager
def _python_operator_calls():
    """Collects the OpOverloads whose Python __call__ runs on this thread meanwhile (the
    direct functions' fallback to torch's operator call)."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is _OVERLOAD_CALL:
            seen.append(str(frame.f_locals.get("self")))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


_OVERLOAD_CALL = torch._ops.OpOverload.__call__.__code__


def _name(group=None) -> str:
    return (group or dist.group.WORLD).group_name


def _inputs(seed: int, index: int, numel: int, dtype: torch.dtype, world: int):
    return [
        random_tensor(numel, dtype, seed=rank_seed(seed + index, r), nranks=world)
        for r in range(world)
    ]


# --------------------------------------------------------------------------------------------
# which path: inline below the bound, queued above it
# --------------------------------------------------------------------------------------------


def run_path_probe(seed, numel, ctx, wait_follows=None):
    """Times a functional all_reduce_ whose last rank arrives PEER_DELAY_S late; returns how
    long the call took to return on this rank, and checks the result. ``wait_follows``: the
    caller says that the wait comes next, through the function spyre's Python wrappers bind
    (``"direct"``: ``_direct_op(..., wait_follows=True)``) or the dispatcher op its C++
    wrappers call around the collective (``"op"``: ``spyreccl::_set_wait_follows``)."""
    from spyreccl_torch._C import _direct_op

    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    all_reduce_ = C10D.all_reduce_
    if wait_follows == "direct":
        all_reduce_ = _direct_op(C10D.all_reduce_.default, wait_follows=True)
    elif wait_follows == "op":

        def all_reduce_(*args):
            previous = torch.ops.spyreccl._set_wait_follows(True)
            try:
                return C10D.all_reduce_(*args)
            finally:
                assert torch.ops.spyreccl._set_wait_follows(previous)

    inputs = _inputs(seed, 0, numel, torch.float32, world)
    tensor = inputs[rank].to(dev)
    dist.barrier()
    if rank == world - 1:
        time.sleep(PEER_DELAY_S)
    start = time.monotonic()
    all_reduce_(tensor, "sum", _name())
    returned = time.monotonic() - start
    C10D.wait_tensor(tensor)
    assert_close_dtype(
        tensor.cpu(), reference_reduce(inputs, "sum"), torch.float32, world, seed=seed
    )
    return returned


@pytest.mark.parametrize(
    ("numel", "wait_follows", "inline"),
    [
        (1, None, True),
        (FUNCTIONAL_MAX_BYTES // 4, None, True),
        (FUNCTIONAL_MAX_BYTES // 4 + 1, None, False),
        # A collective whose wait comes next is a synchronous call: inline up to the bound
        # of synchronous calls (SPYRECCL_INLINE_MAX_BYTES, 4 MiB), whatever the functional one.
        (FUNCTIONAL_MAX_BYTES // 4 + 1, "direct", True),
        (1 << 18, "direct", True),
        (1 << 18, "op", True),
    ],
    ids=[
        "tiny",
        "at-bound",
        "above-bound",
        "above-bound-wait-follows",
        "1MiB-wait-follows",
        "1MiB-wait-follows-op",
    ],
)
def test_functional_all_reduce_path_follows_the_bound(rank_pool, numel, wait_follows, inline):
    returned = rank_pool.run(
        run_path_probe, fresh_seed(), numel, wait_follows=wait_follows, timeout=RUN_TIMEOUT
    )
    for rank, seconds in enumerate(returned[:-1]):  # only the early ranks can tell
        if inline:
            assert seconds >= PEER_DELAY_S * 0.5, (
                f"rank {rank}: {numel} float32 returned after {seconds:.3f} s: not inline"
            )
        else:
            assert seconds < QUEUED_RETURN_LIMIT_S, (
                f"rank {rank}: {numel} float32 returned after {seconds:.3f} s: it blocked the "
                "caller instead of overlapping with it"
            )


def _group_with_bound(value: str):
    """A new group whose spyreccl backend read SPYRECCL_INLINE_FUNCTIONAL_MAX_BYTES=`value`
    ("" means unset: the built-in default)."""
    import os

    saved = os.environ.get(FUNCTIONAL_ENV)
    if value:
        os.environ[FUNCTIONAL_ENV] = value
    else:
        os.environ.pop(FUNCTIONAL_ENV, None)
    try:
        return dist.new_group()
    finally:
        if saved is None:
            os.environ.pop(FUNCTIONAL_ENV, None)
        else:
            os.environ[FUNCTIONAL_ENV] = saved


def run_bound_probe(value, numel, ctx):
    """A functional all_reduce_ of `numel` float32 on a group created with the bound `value`,
    and dist.all_reduce(async_op=True) of the same tensor, the last rank PEER_DELAY_S late:
    how long each call took to return on this rank, and whether the Work of the eager call
    had completed on return."""
    group = _group_with_bound(value)
    tensor = torch.full((numel,), float(ctx.rank + 1), device=ctx.device)
    timings = []
    completed_on_return = None
    for form in ("functional", "eager"):
        dist.barrier(group=group)
        if ctx.rank == ctx.world_size - 1:
            time.sleep(PEER_DELAY_S)
        start = time.monotonic()
        if form == "functional":
            C10D.all_reduce_(tensor, "sum", _name(group))
            timings.append(time.monotonic() - start)
            C10D.wait_tensor(tensor)
        else:
            work = dist.all_reduce(tensor, group=group, async_op=True)
            timings.append(time.monotonic() - start)
            completed_on_return = work.is_completed()
            work.wait()
    world = ctx.world_size
    expected = float(sum(range(1, world + 1))) * world  # two sums in a row
    assert torch.equal(tensor.cpu(), torch.full((numel,), expected)), "wrong all_reduce result"
    dist.destroy_process_group(group)
    return timings, completed_on_return


@pytest.mark.parametrize(
    ("value", "numel", "inline"),
    [
        ("0", 1, False),
        ("400", 100, True),
        ("400", 101, False),
        # The default covers every all_reduce of a tensor-parallel decode step (at most
        # 32 x 8192 float32 = 1 MiB), which eager DTensor waits for at the next use.
        ("", 1 << 18, True),
        ("", (1 << 18) + 1, False),
    ],
    ids=["disabled", "at-bound", "above-bound", "default-1MiB", "above-default"],
)
def test_functional_bound_is_configurable_and_async_op_never_inline(
    rank_pool, value, numel, inline
):
    results = rank_pool.run(run_bound_probe, value, numel, timeout=RUN_TIMEOUT)
    for rank, ((functional_s, eager_s), completed) in enumerate(results[:-1]):
        what = f"rank {rank}: {FUNCTIONAL_ENV}={value!r}, {numel} float32"
        if inline:
            assert functional_s >= PEER_DELAY_S * 0.5, f"{what}: functional call not inline"
        else:
            assert functional_s < QUEUED_RETURN_LIMIT_S, f"{what}: functional call blocked"
        # dist.all_reduce(async_op=True) returns at once, whatever the bound.
        assert eager_s < QUEUED_RETURN_LIMIT_S and not completed, (
            f"{what}: async_op=True blocked the caller ({eager_s:.3f} s)"
        )


# --------------------------------------------------------------------------------------------
# every functional op, on both paths, against float64 references
# --------------------------------------------------------------------------------------------


def run_every_op(seed, numel, ctx, group_object=False, calls="torch.ops"):
    """Every _c10d_functional op of this size; out-of-place outputs and out= tensors are
    poisoned (or fresh) so that an unwritten element fails. The group is passed by name, or
    as the ProcessGroup object (the ops' ``Any group_name`` takes both). ``calls``: through
    torch.ops, or through the functions spyre's inductor wrappers call (``direct``), which
    must not fall back to torch's Python operator call unless given a group object.

    Returns the number of fallbacks, of calls run without a Work, and of calls waited at once
    that took a Work only because the progress thread had work at that moment (a job it
    had just finished, e.g. the previous test's: which calls, if any, depends on thread
    scheduling)."""
    from spyreccl_torch import _C

    ops = CALLS[calls]
    registry = torch._C._distributed_c10d._get_work_registry_size
    base = registry()
    before = _C._waited_functional_calls(), _C._waited_behind_progress_thread_calls()
    with _python_operator_calls() as fallbacks:
        _every_op(ops, seed, numel, ctx, dist.group.WORLD if group_object else _name())
    if calls != "torch.ops":
        assert bool(fallbacks) == group_object, fallbacks
    assert registry() == base, ("left registered", registry() - base)
    return (
        len(fallbacks),
        _C._waited_functional_calls() - before[0],
        _C._waited_behind_progress_thread_calls() - before[1],
    )


def _every_op(ops, seed, numel, ctx, name):
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    f32 = torch.float32

    def check(got, expected, what):
        assert_close_dtype(got.cpu(), expected, f32, world, seed=seed, what=what)

    # all_reduce (out of place) and all_reduce_ with every float reduction
    for i, op in enumerate(("sum", "avg", "max", "min", "product")):
        inputs = _inputs(seed, 10 + i, numel, f32, world)
        mine = inputs[rank].to(dev)
        out = ops.wait_tensor(ops.all_reduce(mine, op, name))
        check(out, reference_reduce(inputs, op), f"all_reduce {op}")
        check(mine, inputs[rank], "all_reduce must leave its input alone")
        ops.wait_tensor(ops.all_reduce_(mine, op, name))
        check(mine, reference_reduce(inputs, op), f"all_reduce_ {op}")

    # coalesced forms, with an odd length and an empty tensor in the list
    lists = [_inputs(seed, 20 + j, n, f32, world) for j, n in enumerate((numel, 3, 0))]
    mine = [per_rank[rank].to(dev) for per_rank in lists]
    outs = ops.all_reduce_coalesced(mine, "sum", name)
    for j, out in enumerate(outs):
        check(ops.wait_tensor(out), reference_reduce(lists[j], "sum"), f"coalesced {j}")
    ops.all_reduce_coalesced_(mine, "sum", name)
    for j, t in enumerate(mine):
        check(ops.wait_tensor(t), reference_reduce(lists[j], "sum"), f"coalesced_ {j}")

    # all_gather_into_tensor (+ _out, + coalesced)
    gathered_inputs = _inputs(seed, 30, numel, f32, world)
    expected = torch.cat(gathered_inputs)
    mine = gathered_inputs[rank].to(dev)
    check(ops.wait_tensor(ops.all_gather_into_tensor(mine, world, name)), expected, "ag")
    out = poison_(torch.empty(numel * world, device=dev))
    ops.wait_tensor(ops.all_gather_into_tensor_out(mine, world, name, out=out))
    check(out, expected, "all_gather_into_tensor_out")
    outs = ops.all_gather_into_tensor_coalesced([mine, mine[:1]], world, name)
    check(ops.wait_tensor(outs[0]), expected, "ag coalesced 0")
    check(ops.wait_tensor(outs[1]), torch.stack([x[0] for x in gathered_inputs]), "ag c 1")

    # reduce_scatter_tensor (+ coalesced): rank r gets block r of the reduction
    rs_inputs = _inputs(seed, 40, numel * world, f32, world)
    reduced = reference_reduce(rs_inputs, "sum")
    block = reduced[rank * numel : (rank + 1) * numel]
    mine = rs_inputs[rank].to(dev)
    check(ops.wait_tensor(ops.reduce_scatter_tensor(mine, "sum", world, name)), block, "rs")
    outs = ops.reduce_scatter_tensor_coalesced([mine], "avg", world, name)
    avg_block = reference_reduce(rs_inputs, "avg")[rank * numel : (rank + 1) * numel]
    check(ops.wait_tensor(outs[0]), avg_block, "reduce_scatter_tensor_coalesced avg")

    # all_to_all_single with uneven splits: rank r sends (s + 1) elements to rank s
    a2a_inputs = [
        random_tensor(sum(s + 1 for s in range(world)) * 1, f32, seed=rank_seed(seed + 50, r))
        for r in range(world)
    ]
    offsets = [sum(k + 1 for k in range(s)) for s in range(world)]
    expected = torch.cat(
        [a2a_inputs[r][offsets[rank] : offsets[rank] + rank + 1] for r in range(world)]
    )
    out = ops.all_to_all_single(
        a2a_inputs[rank].to(dev), [rank + 1] * world, [s + 1 for s in range(world)], name
    )
    check(ops.wait_tensor(out), expected, "all_to_all_single")

    # broadcast / broadcast_ from the last rank
    src = world - 1
    bc_inputs = _inputs(seed, 60, numel, f32, world)
    mine = bc_inputs[rank].to(dev)
    check(ops.wait_tensor(ops.broadcast(mine, src, name)), bc_inputs[src], "broadcast")
    ops.wait_tensor(ops.broadcast_(mine, src, name))
    check(mine, bc_inputs[src], "broadcast_")


@pytest.mark.parametrize("calls", CALLS)
@pytest.mark.parametrize(
    "numel", [1, 37, FUNCTIONAL_MAX_BYTES // 4 + 1, 20_011], ids=["1", "37", "above-bound", "20011"]
)
def test_every_functional_op_matches_float64(rank_pool, numel, calls):
    results = rank_pool.run(run_every_op, fresh_seed(), numel, calls=calls, timeout=RUN_TIMEOUT)
    # Waited at once, every one of them ran without a Work (none falls back to torch's
    # implementation at these sizes), except where the progress thread was still busy with a
    # job it had finished (scheduling decides that, so such a call counts as well, by its own
    # counter: one refused for any other reason — size, bound, the switch — counts nowhere);
    # otherwise none did.
    expected = LEAN_CALLS_OF_EVERY_OP if calls == "waited" else 0
    assert [waited + behind for _, waited, behind in results] == [expected] * len(results), results


@pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12),
    reason=f"functional ops take a ProcessGroup from torch 2.12 on (this is {torch.__version__})",
)
@pytest.mark.parametrize("calls", CALLS)
def test_every_functional_op_takes_a_process_group_object(rank_pool, calls):
    rank_pool.run(
        run_every_op, fresh_seed(), 37, group_object=True, calls=calls, timeout=RUN_TIMEOUT
    )


# --------------------------------------------------------------------------------------------
# the lean path: spyreccl's backend called without c10d's ProcessGroup layer
# --------------------------------------------------------------------------------------------

# The calls of run_every_op, all of which take the lean path: all_reduce and all_reduce_ with
# five reductions each, all_reduce_coalesced(_), all_gather_into_tensor(_out, _coalesced),
# reduce_scatter_tensor(_coalesced), all_to_all_single, broadcast(_).
LEAN_CALLS_OF_EVERY_OP = 10 + 2 + 3 + 2 + 1 + 2


def run_lean_and_torch_paths(seed, numel, ctx):
    """run_every_op with the lean path on (counting the calls that took it), then off (none
    may take it, the results are checked the same way)."""
    from spyreccl_torch import _C

    assert _C._lean_functional()
    before = _C._lean_functional_calls()
    run_every_op(seed, numel, ctx)
    lean = _C._lean_functional_calls() - before
    _C._set_lean_functional(False)
    try:
        before = _C._lean_functional_calls()
        run_every_op(seed + 1, numel, ctx)
        assert _C._lean_functional_calls() == before, "the lean path ran while switched off"
    finally:
        _C._set_lean_functional(True)
    return lean


@pytest.mark.parametrize("numel", [1, FUNCTIONAL_MAX_BYTES // 4 + 1], ids=["1", "above-bound"])
def test_lean_path_is_taken_and_agrees_with_torchs_path(rank_pool, numel):
    lean = rank_pool.run(run_lean_and_torch_paths, fresh_seed(), numel, timeout=RUN_TIMEOUT)
    assert lean == [LEAN_CALLS_OF_EVERY_OP] * len(lean)


def run_lean_edges(seed, ctx):
    """What the lean path shapes itself (empty tensors, a 0-d all_gather input) against float64
    references, and what it leaves to torch's implementation: complex tensors (viewed as
    real there) and a reduce_op torch rejects (its error, on the calling rank)."""
    from spyreccl_torch import _C

    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    name = _name()
    f32 = torch.float32

    def check(got, expected, what):
        assert_close_dtype(got.cpu(), expected, got.dtype, world, seed=seed, what=what)

    before = _C._lean_functional_calls()
    empty = torch.empty(0, device=dev)
    assert C10D.wait_tensor(C10D.all_reduce_(empty, "sum", name)).shape == (0,)
    assert C10D.wait_tensor(C10D.all_gather_into_tensor(empty, world, name)).shape == (0,)
    assert C10D.wait_tensor(C10D.reduce_scatter_tensor(empty, "sum", world, name)).shape == (0,)
    assert C10D.wait_tensor(C10D.broadcast(empty, 0, name)).shape == (0,)
    scalars = _inputs(seed, 70, 1, f32, world)
    gathered = C10D.wait_tensor(C10D.all_gather_into_tensor(scalars[rank][0].to(dev), world, name))
    assert gathered.shape == (world,)
    check(gathered, torch.cat(scalars), "0-d all_gather_into_tensor")
    assert _C._lean_functional_calls() - before == 5

    before = _C._lean_functional_calls()
    real = _inputs(seed, 71, 6, f32, world)
    mine = real[rank].view(torch.complex64).to(dev)
    out = C10D.wait_tensor(C10D.all_reduce(mine, "sum", name))
    assert out.dtype == torch.complex64
    check(torch.view_as_real(out).reshape(-1), reference_reduce(real, "sum"), "complex all_reduce")
    with pytest.raises(RuntimeError, match="reduce_op"):
        C10D.all_reduce_(real[rank].to(dev), "bogus", name)
    assert _C._lean_functional_calls() == before, "torch's cases took the lean path"
    dist.barrier()


def test_lean_path_edges_and_what_it_leaves_to_torch(rank_pool):
    rank_pool.run(run_lean_edges, fresh_seed(), timeout=RUN_TIMEOUT)


# --------------------------------------------------------------------------------------------
# overlap: computation between a large collective and its wait runs during the transfer
# --------------------------------------------------------------------------------------------


def run_overlap(ctx):
    """The late rank joins PEER_DELAY_S late. An early rank issues a large functional
    all_reduce_, computes for a while, then waits: with the collective in flight on the
    progress thread, the computation finishes before the late rank even arrives, and the
    total is about PEER_DELAY_S, not PEER_DELAY_S + the computation."""
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    tensor = torch.full((1 << 18,), float(rank + 1), device=dev)  # 1 MiB
    a = torch.randn(128, 128, dtype=torch.float64)
    dist.barrier()
    if rank == world - 1:
        time.sleep(PEER_DELAY_S)
    start = time.monotonic()
    C10D.all_reduce_(tensor, "sum", _name())
    computed_until = None
    while time.monotonic() - start < PEER_DELAY_S * 0.6:
        a = (a @ a).clamp_(-1, 1)  # independent of the collective
        computed_until = time.monotonic() - start
    C10D.wait_tensor(tensor)
    total = time.monotonic() - start
    expected = float(sum(range(1, world + 1)))
    assert torch.equal(tensor.cpu(), torch.full_like(tensor.cpu(), expected))
    return computed_until, total


def test_large_collective_overlaps_the_computation_before_its_wait(rank_pool):
    for rank, (computed, total) in enumerate(rank_pool.run(run_overlap, timeout=RUN_TIMEOUT)[:-1]):
        assert computed is not None and computed < PEER_DELAY_S, (rank, computed, total)
        # The computation ran while the collective waited for its peer.
        assert total < PEER_DELAY_S * 1.5, (rank, computed, total)


# --------------------------------------------------------------------------------------------
# registry, profiler
# --------------------------------------------------------------------------------------------


def run_registry_and_profiler(seed, numel, ctx, calls="torch.ops"):
    """The work registry holds one entry per unwaited output (popped by its wait), and the
    profiler shows the dispatcher's op and a spyreccl:all_reduce range, on both paths."""
    ops = CALLS[calls]
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    registry = torch._C._distributed_c10d._get_work_registry_size
    base = registry()
    inputs = _inputs(seed, 0, numel, torch.float32, world)
    mine = inputs[rank].to(dev)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = ops.all_reduce(mine, "sum", _name())
        unwaited = registry() - base
        ops.wait_tensor(out)
    assert unwaited == 1 and registry() == base, (unwaited, registry() - base)
    assert_close_dtype(out.cpu(), reference_reduce(inputs, "sum"), torch.float32, world, seed=seed)
    names = {event.name for event in prof.events()}
    assert "spyreccl:all_reduce" in names, sorted(n for n in names if "reduce" in n)
    assert "_c10d_functional::all_reduce" in names, sorted(n for n in names if "reduce" in n)


@pytest.mark.parametrize("numel", [5, FUNCTIONAL_MAX_BYTES // 4 + 1], ids=["inline", "queued"])
@pytest.mark.parametrize("calls", CALLS)
def test_registry_and_profiler_ranges(rank_pool, numel, calls):
    rank_pool.run(run_registry_and_profiler, fresh_seed(), numel, calls=calls, timeout=RUN_TIMEOUT)


def run_waited_without_work(seed, numel, ctx):
    """An all_reduce(_) waited at once runs without a Work: nothing enters the registry, the
    wait that follows finds nothing to wait for, and the result is right. With the profiler
    on, or the switch off, it creates its Work as before (range recorded, one registry
    entry until the wait)."""
    from spyreccl_torch import _C

    waited = CALLS["waited"]
    registry = torch._C._distributed_c10d._get_work_registry_size
    base = registry()
    inputs = _inputs(seed, 0, numel, torch.float32, ctx.world_size)
    expected = reference_reduce(inputs, "sum")
    mine = inputs[ctx.rank].to(ctx.device)

    def check(out, what):
        assert_close_dtype(out.cpu(), expected, torch.float32, ctx.world_size, seed=seed, what=what)

    def behind() -> int:
        # Calls that took a Work only because the progress thread was still busy (with the
        # previous test's last job): scheduling decides, and such a call registers its Work.
        return _C._waited_behind_progress_thread_calls()

    before, behind_before = _C._waited_functional_calls(), behind()
    tensor = mine.clone()
    waited.all_reduce_(tensor, "sum", _name())
    assert registry() - base == behind() - behind_before, ("registered", registry() - base)
    waited.wait_tensor(tensor)
    check(tensor, "all_reduce_")
    behind_first = behind()
    out = waited.all_reduce(mine, "sum", _name())
    assert registry() - base == behind() - behind_first, ("registered", registry() - base)
    waited.wait_tensor(out)
    check(out, "all_reduce")
    torch.testing.assert_close(mine.cpu(), inputs[ctx.rank])  # out of place: input untouched
    ran_without_work = _C._waited_functional_calls() - before
    assert ran_without_work + behind() - behind_before == 2

    _C._set_waited_without_work(False)
    try:
        tensor = mine.clone()
        waited.all_reduce_(tensor, "sum", _name())
        assert registry() - base == 1, ("switched off: registered", registry() - base)
        waited.wait_tensor(tensor)
        check(tensor, "all_reduce_, switched off")
    finally:
        _C._set_waited_without_work(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tensor = mine.clone()
        waited.all_reduce_(tensor, "sum", _name())
        assert registry() - base == 1, ("profiled: registered", registry() - base)
        waited.wait_tensor(tensor)
    check(tensor, "all_reduce_, profiled")
    assert "spyreccl:all_reduce" in {event.name for event in prof.events()}
    assert _C._waited_functional_calls() - before == ran_without_work
    assert registry() == base


@pytest.mark.parametrize("numel", [7, FUNCTIONAL_MAX_BYTES // 4 + 1], ids=["small", "above-bound"])
def test_waited_collective_runs_without_a_work(rank_pool, numel):
    rank_pool.run(run_waited_without_work, fresh_seed(), numel, timeout=RUN_TIMEOUT)


# --------------------------------------------------------------------------------------------
# errors on this path: timeout, abort, mismatch
# --------------------------------------------------------------------------------------------

GROUP_TIMEOUT_S = 2.0


def run_timeout(numel, ctx, calls="torch.ops"):
    ops = CALLS[calls]
    group = dist.new_group(timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    result = None
    if ctx.rank == 0:  # the others never join
        tensor = torch.ones(numel, device=ctx.device)
        start = time.monotonic()
        try:
            # Queued, the error comes with the wait; run inline, with the call.
            ops.all_reduce_(tensor, "sum", _name(group))
            ops.wait_tensor(tensor)
        except dist.DistBackendError as exc:
            result = (time.monotonic() - start, str(exc))
        else:
            raise AssertionError("a functional all_reduce without peers did not time out")
    dist.barrier()
    return result


@pytest.mark.parametrize("numel", [3, FUNCTIONAL_MAX_BYTES // 4 + 1], ids=["inline", "queued"])
@pytest.mark.parametrize("calls", CALLS)
def test_group_timeout_bounds_a_functional_collective(rank_pool, numel, calls):
    elapsed, message = rank_pool.run(run_timeout, numel, calls=calls, timeout=120)[0]
    assert GROUP_TIMEOUT_S * 0.9 <= elapsed <= GROUP_TIMEOUT_S + 20.0, (elapsed, message)
    assert "imeout" in message and "allreduce" in message, message


def run_abort(numel, ctx, calls="torch.ops"):
    """Rank 0 issues a functional all_reduce_ that its peers never join; another thread
    aborts the group after 0.3 s. The call (inline: blocked in it; queued: in flight) ends,
    and wait_tensor raises naming the abort."""
    ops = CALLS[calls]
    group = dist.new_group(timeout=datetime.timedelta(seconds=60))
    result = None
    if ctx.rank == 0:
        backend = group._get_backend(torch.device(ctx.device))
        timer = threading.Timer(0.3, backend.abort)
        timer.start()
        tensor = torch.ones(numel, device=ctx.device)
        start = time.monotonic()
        try:
            ops.all_reduce_(tensor, "sum", _name(group))
            ops.wait_tensor(tensor)
        except Exception as exc:  # the type is checked by the test
            result = (time.monotonic() - start, type(exc).__name__, str(exc))
        finally:
            timer.join()
        assert result is not None, "an aborted functional all_reduce did not raise"
    dist.barrier()
    return result


@pytest.mark.parametrize("numel", [3, FUNCTIONAL_MAX_BYTES // 4 + 1], ids=["inline", "queued"])
@pytest.mark.parametrize("calls", CALLS)
def test_abort_ends_a_functional_collective(rank_pool, numel, calls):
    elapsed, kind, message = rank_pool.run(run_abort, numel, calls=calls, timeout=120)[0]
    assert elapsed < 10.0, (elapsed, message)
    assert kind == "DistBackendError", (kind, message)
    assert "abort" in message.lower(), message


def run_mismatch(numel, ctx, calls="torch.ops"):
    ops = CALLS[calls]
    group = dist.new_group(timeout=datetime.timedelta(seconds=30))
    tensor = torch.ones(numel + ctx.rank, device=ctx.device)  # counts differ across ranks
    try:
        ops.wait_tensor(ops.all_reduce_(tensor, "sum", _name(group)))
    except dist.DistBackendError as exc:
        return str(exc)
    finally:
        dist.barrier()
    raise AssertionError(f"rank {ctx.rank}: a count mismatch did not raise")


@pytest.mark.parametrize("numel", [5, FUNCTIONAL_MAX_BYTES // 4 + 1], ids=["inline", "queued"])
@pytest.mark.parametrize("calls", CALLS)
def test_mismatch_is_detected_on_every_rank(rank_pool, numel, calls):
    for rank, message in enumerate(rank_pool.run(run_mismatch, numel, calls=calls, timeout=120)):
        assert "spyrecclMismatch" in message and "allreduce" in message, f"rank {rank}: {message}"


# --------------------------------------------------------------------------------------------
# autograd through the C++ kernels of wait_tensor and all_reduce
# --------------------------------------------------------------------------------------------


def run_autograd(seed, ctx):
    """y = sum(w_r * all_reduce(x_r)) on every rank; d/dx_r = all_reduce(w)_r (the backward
    all-reduces the gradient), compared with float64 on CPU. A non-sum reduction refuses
    backward, like torch's own formula."""
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    xs = _inputs(seed, 0, 9, torch.float64, world)
    ws = _inputs(seed, 1, 9, torch.float64, world)
    x = xs[rank].to(torch.float32).to(dev).requires_grad_(True)
    w = ws[rank].to(torch.float32).to(dev)
    reduced = C10D.wait_tensor(C10D.all_reduce(x, "sum", _name()))
    assert reduced.requires_grad and reduced.grad_fn is not None
    (reduced * w).sum().backward()
    expected_grad = reference_reduce(ws, "sum")
    assert_close_dtype(x.grad.cpu(), expected_grad, torch.float32, world, seed=seed, what="grad")
    assert_close_dtype(
        reduced.detach().cpu(), reference_reduce(xs, "sum"), torch.float32, world, seed=seed
    )
    # wait_tensor alone: identity gradient, the output is the input itself
    z = torch.randn(4, device=dev, requires_grad=True)
    waited = C10D.wait_tensor(z * 3)
    waited.sum().backward()
    assert torch.equal(z.grad.cpu(), torch.full((4,), 3.0))
    # torch's formula refuses non-sum reductions when backward runs
    m = C10D.wait_tensor(C10D.all_reduce(x, "max", _name()))
    with pytest.raises(RuntimeError, match="only supports 'sum'"):
        m.sum().backward()
    # no gradient wanted: no graph
    with torch.no_grad():
        assert C10D.wait_tensor(C10D.all_reduce(x, "sum", _name())).grad_fn is None


def test_autograd_of_the_cpp_kernels(rank_pool):
    rank_pool.run(run_autograd, fresh_seed(), timeout=RUN_TIMEOUT)


# --------------------------------------------------------------------------------------------
# a stream of queued, stolen and inline operations keeps issue order
# --------------------------------------------------------------------------------------------


def run_mixed_stream(seed, ctx):
    """dist.all_reduce(async_op=True) of mixed sizes interleaved with functional all_reduces
    (small: inline when nothing is queued; large: queued), waited in a shuffled order: a wait
    runs its operation itself only when it is next in line, so every result must match its
    float64 reference whichever thread ran it."""
    import random

    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    sizes = [1, 5000, 3, 70_000, 17, 2, 40_000, 9]
    pending = []
    for i, numel in enumerate(sizes):
        inputs = _inputs(seed, i, numel, torch.float32, world)
        tensor = inputs[rank].to(dev)
        if i % 2 == 0:
            pending.append((dist.all_reduce(tensor, async_op=True), tensor, inputs))
        else:
            C10D.all_reduce_(tensor, "sum", _name())
            pending.append((None, tensor, inputs))
    order = list(range(len(pending)))
    random.Random(seed + rank).shuffle(order)  # a different order on every rank
    for index in order:
        work, tensor, inputs = pending[index]
        if work is None:
            C10D.wait_tensor(tensor)
        else:
            work.wait()
        assert_close_dtype(
            tensor.cpu(),
            reference_reduce(inputs, "sum"),
            torch.float32,
            world,
            seed=seed,
            what=f"operation {index} of the stream",
        )


def test_mixed_stream_keeps_issue_order(rank_pool):
    for _ in range(3):
        rank_pool.run(run_mixed_stream, fresh_seed(), timeout=RUN_TIMEOUT)
