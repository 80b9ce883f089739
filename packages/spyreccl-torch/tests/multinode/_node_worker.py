"""One rank of a job on simulated nodes (started by torchrun, see _launch.py).

``python _node_worker.py MODE``; writes ``rank<R>.json`` into $SPYRECCL_MN_OUT:

- ``ops``: a table of cases over every operation (random inputs from a base seed, poisoned
  outputs, float64 / exact references computed on this rank from every rank's inputs), then
  subgroups (node-aligned and node-crossing), a 2-d DeviceMesh and DDP across nodes. Failed
  checks are collected (the collectives go on on every rank), exceptions abort the batch.
- ``kill``: rank $SPYRECCL_MN_VICTIM dies while the others have collectives in flight on
  groups, one per route; everyone else records the error each group gives and how
  long after the death it came.
- ``nojoin``: (started without torchrun) the first node of a job whose second node never
  starts: init_process_group must fail within the timeout.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import pickle
import socket
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))

from _ops_support import (
    DTYPES,
    LARGE,
    REDUCE_OPS,
    case_seed,
    check_exact,
    check_result,
    check_untouched,
    dist_op,
    dtype_id,
    expect_rejection,
    premul_factor,
    rank_inputs,
    reduction_valid,
    reference_op,
    rejection_pattern,
)

from spyreccl_testing.accuracy import assert_close_dtype, reference_reduce
from spyreccl_testing.inputs import poison_, random_tensor, rank_seed

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

OUT = Path(os.environ.get("SPYRECCL_MN_OUT", "."))
TIMEOUT_S = float(os.environ.get("SPYRECCL_MN_PG_TIMEOUT", "60"))


class Ctx:
    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = f"spyre:{self.local_rank}"


def _dev(ctx: Ctx) -> torch.device:
    return torch.device(ctx.device)


def _write(report: dict) -> None:
    rank = report["rank"]
    tmp = OUT / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.rename(OUT / f"rank{rank}.json")


# -- the cases (each: case tuple, seed, ctx) ---------------------------------------------


def c_all_reduce(case, seed, ctx):
    _, dtype, op, shape, async_op = case
    factor = premul_factor(seed) if op == "PREMUL_SUM" else None
    inputs = rank_inputs(seed, shape, dtype, ctx.world_size)
    t = inputs[ctx.rank].to(_dev(ctx))
    if not reduction_valid(dtype, op):
        # Rejected on every rank before anything moves; the group stays usable (the
        # following cases prove it).
        expect_rejection(
            lambda: dist.all_reduce(t, op=dist_op(op, factor)),
            rejection_pattern(dtype, op),
            f"all_reduce {op} {dtype_id(dtype)}",
        )
        return
    work = dist.all_reduce(t, op=dist_op(op, factor), async_op=async_op)
    if async_op:
        assert work.wait() and work.is_completed()
    expected = reference_reduce(inputs, reference_op(op, factor), dtype)
    check_result(
        t, expected, dtype, ctx.world_size, seed, f"all_reduce {op} {dtype_id(dtype)} {shape}"
    )


def c_all_reduce_wide_unsigned(case, seed, ctx):
    """uint32/uint64 (gloo has neither): uint64 values on both sides of 2**63 (random int64
    bit patterns), so that MIN/MAX must compare them as unsigned."""
    _, dtype, op, n = case
    w = ctx.world_size
    signed = torch.int64 if dtype == torch.uint64 else torch.int32
    inputs = [x.view(dtype) for x in rank_inputs(seed, n, signed, w)]
    t = inputs[ctx.rank].to(_dev(ctx))
    dist.all_reduce(t, op=dist_op(op))
    expected = reference_reduce(inputs, reference_op(op), dtype)
    check_exact(t, expected, seed, w, f"all_reduce {op} {dtype_id(dtype)} n={n}")


def c_all_reduce_complex(case, seed, ctx):
    """complex64: reduced as (real, imaginary) pairs; the reference reduces both parts."""
    _, op, n = case
    w = ctx.world_size
    factor = premul_factor(seed) if op == "PREMUL_SUM" else None
    re = rank_inputs(seed, n, torch.float32, w)
    im = rank_inputs(seed, n, torch.float32, w, salt=1)
    t = torch.complex(re[ctx.rank], im[ctx.rank]).to(_dev(ctx))
    dist.all_reduce(t, op=dist_op(op, factor))
    ref = reference_op(op, factor)
    expected = torch.stack(
        [reference_reduce(re, ref, torch.float32), reference_reduce(im, ref, torch.float32)],
        dim=-1,
    )
    got = torch.view_as_real(t.cpu())
    assert_close_dtype(got, expected, torch.float32, w, seed=seed, what=f"all_reduce {op} c64")


def c_reduce(case, seed, ctx):
    _, dtype, op, n, root = case
    factor = premul_factor(seed) if op == "PREMUL_SUM" else None
    inputs = rank_inputs(seed, n, dtype, ctx.world_size)
    t = inputs[ctx.rank].to(_dev(ctx))
    dist.reduce(t, dst=root, op=dist_op(op, factor))
    what = f"reduce {op} {dtype_id(dtype)} n={n} root={root}"
    if ctx.rank == root:
        expected = reference_reduce(inputs, reference_op(op, factor), dtype)
        check_result(t, expected, dtype, ctx.world_size, seed, what)
    else:
        check_untouched(t, inputs[ctx.rank], what + " (non-root input)")


def c_broadcast(case, seed, ctx):
    _, dtype, n, root = case
    src = random_tensor(n, dtype, "cpu", seed, nranks=ctx.world_size)
    t = (
        src.to(_dev(ctx))
        if ctx.rank == root
        else poison_(torch.empty(n, dtype=dtype, device=_dev(ctx)))
    )
    dist.broadcast(t, src=root)
    check_exact(t, src, seed, ctx.world_size, f"broadcast {dtype_id(dtype)} n={n} root={root}")


def c_all_gather(case, seed, ctx):
    _, dtype, shape, into_tensor = case
    inputs = rank_inputs(seed, shape, dtype, ctx.world_size)
    mine = inputs[ctx.rank].to(_dev(ctx))
    what = f"all_gather {dtype_id(dtype)} {shape} into_tensor={into_tensor}"
    if into_tensor:
        out = poison_(
            torch.empty((ctx.world_size * inputs[0].numel(),), dtype=dtype, device=_dev(ctx))
        )
        dist.all_gather_into_tensor(out, mine)
        check_exact(out, torch.cat([x.reshape(-1) for x in inputs]), seed, ctx.world_size, what)
    else:
        outs = [poison_(torch.empty(shape, dtype=dtype, device=_dev(ctx))) for _ in inputs]
        dist.all_gather(outs, mine)
        for r, (o, x) in enumerate(zip(outs, inputs, strict=True)):
            check_exact(o, x, seed, ctx.world_size, f"{what} [from rank {r}]")
    check_untouched(mine, inputs[ctx.rank], what + " (input)")


def c_reduce_scatter(case, seed, ctx):
    _, dtype, op, n, tensor_api = case
    factor = premul_factor(seed) if op == "PREMUL_SUM" else None
    w = ctx.world_size
    inputs = rank_inputs(seed, n * w, dtype, w)
    mine = inputs[ctx.rank].to(_dev(ctx))
    out = poison_(torch.empty(n, dtype=dtype, device=_dev(ctx)))
    if tensor_api:
        dist.reduce_scatter_tensor(out, mine, op=dist_op(op, factor))
    else:
        dist.reduce_scatter(out, list(mine.chunk(w)), op=dist_op(op, factor))
    full = reference_reduce(inputs, reference_op(op, factor), dtype)
    expected = full[ctx.rank * n : (ctx.rank + 1) * n]
    what = f"reduce_scatter {op} {dtype_id(dtype)} n={n} tensor_api={tensor_api}"
    check_result(out, expected, dtype, w, seed, what)
    check_untouched(mine, inputs[ctx.rank], what + " (input)")


def c_gather_scatter(case, seed, ctx):
    _, dtype, n, root = case
    w = ctx.world_size
    inputs = rank_inputs(seed, n, dtype, w)
    gl = (
        [poison_(torch.empty(n, dtype=dtype, device=_dev(ctx))) for _ in range(w)]
        if ctx.rank == root
        else None
    )
    dist.gather(inputs[ctx.rank].to(_dev(ctx)), gl, dst=root)
    if ctx.rank == root:
        for r in range(w):
            check_exact(
                gl[r], inputs[r], seed, w, f"gather {dtype_id(dtype)} root={root} [rank {r}]"
            )
    chunks = rank_inputs(seed, n, dtype, w, salt=7)
    out = poison_(torch.empty(n, dtype=dtype, device=_dev(ctx)))
    sl = [c.to(_dev(ctx)) for c in chunks] if ctx.rank == root else None
    dist.scatter(out, sl, src=root)
    check_exact(out, chunks[ctx.rank], seed, w, f"scatter {dtype_id(dtype)} root={root}")


def c_all_to_all(case, seed, ctx):
    _, dtype, with_splits = case
    w, r = ctx.world_size, ctx.rank
    cols = 3
    if with_splits:
        # rank s sends (s + d) % 3 + 1 rows to rank d (some uneven, none empty... and one empty)
        def rows(s, d):
            return (s * 2 + d) % 4

        in_splits = [rows(r, d) for d in range(w)]
        out_splits = [rows(s, r) for s in range(w)]
    else:
        in_splits = out_splits = [2] * w
    per_rank = [
        random_tensor(
            (sum(rows(s, d) for d in range(w)) if with_splits else 2 * w, cols),
            dtype,
            "cpu",
            rank_seed(seed, s),
            nranks=w,
        )
        for s in range(w)
    ]
    src = per_rank[r].to(_dev(ctx))
    out = poison_(torch.empty((sum(out_splits), cols), dtype=dtype, device=_dev(ctx)))
    dist.all_to_all_single(
        out,
        src,
        output_split_sizes=out_splits if with_splits else None,
        input_split_sizes=in_splits if with_splits else None,
    )
    pieces = []
    for s in range(w):
        s_splits = [rows(s, d) for d in range(w)] if with_splits else [2] * w
        start = sum(s_splits[:r])
        pieces.append(per_rank[s][start : start + s_splits[r]])
    check_exact(
        out, torch.cat(pieces), seed, w, f"all_to_all_single {dtype_id(dtype)} splits={with_splits}"
    )
    # list form
    ins = [random_tensor(5, dtype, "cpu", rank_seed(seed + d, r), nranks=w) for d in range(w)]
    outs = [poison_(torch.empty(5, dtype=dtype, device=_dev(ctx))) for _ in range(w)]
    dist.all_to_all(outs, [x.to(_dev(ctx)) for x in ins])
    for s in range(w):
        want = random_tensor(5, dtype, "cpu", rank_seed(seed + r, s), nranks=w)
        check_exact(outs[s], want, seed, w, f"all_to_all {dtype_id(dtype)} [from {s}]")


def c_p2p(case, seed, ctx):
    _, dtype, n, batched = case
    w, r = ctx.world_size, ctx.rank
    nxt, prv = (r + 1) % w, (r - 1) % w
    far = (r + w // 2) % w  # on another node for 2 x 2
    mine = random_tensor(n, dtype, "cpu", rank_seed(seed, r), nranks=w)
    got_prev = poison_(torch.empty(n, dtype=dtype, device=_dev(ctx)))
    got_far = poison_(torch.empty(n, dtype=dtype, device=_dev(ctx)))
    far_src = (r - w // 2) % w
    ops = [
        dist.P2POp(dist.isend, mine.to(_dev(ctx)), nxt),
        dist.P2POp(dist.irecv, got_prev, prv),
        dist.P2POp(dist.isend, mine.to(_dev(ctx)), far),
        dist.P2POp(dist.irecv, got_far, far_src),
    ]
    if batched:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    else:
        # gloo's send/recv Works complete only in wait() (polling is_completed() alone
        # never finishes them, with gloo alone too), so: wait, then the state must say so.
        reqs = [op.op(op.tensor, op.peer) for op in ops]
        for req in reqs:
            assert req.wait()
        assert all(req.is_completed() for req in reqs), "a request not completed after wait()"
        assert all(req.exception() is None for req in reqs)
    what = f"send/recv {dtype_id(dtype)} n={n} batched={batched}"
    check_exact(
        got_prev,
        random_tensor(n, dtype, "cpu", rank_seed(seed, prv), nranks=w),
        seed,
        w,
        what + f" from {prv}",
    )
    check_exact(
        got_far,
        random_tensor(n, dtype, "cpu", rank_seed(seed, far_src), nranks=w),
        seed,
        w,
        what + f" from {far_src}",
    )


def c_coalesced(case, seed, ctx):
    _, dtype, op = case
    w = ctx.world_size
    shapes = [(3,), (0,), (17, 5), (1001,)]
    per = [rank_inputs(seed + i, s, dtype, w) for i, s in enumerate(shapes)]
    ts = [p[ctx.rank].to(_dev(ctx)) for p in per]
    dist.all_reduce_coalesced(ts, op=dist_op(op))
    for i, t in enumerate(ts):
        check_result(
            t,
            reference_reduce(per[i], reference_op(op), dtype),
            dtype,
            w,
            seed,
            f"all_reduce_coalesced {op} [{i}]",
        )
    # fast-path coalescing of all_gather_into_tensor / reduce_scatter_tensor
    ins = [p[ctx.rank].to(_dev(ctx)) for p in per if p[0].numel()]
    outs = [poison_(torch.empty(x.numel() * w, dtype=dtype, device=_dev(ctx))) for x in ins]
    with dist._coalescing_manager(device=_dev(ctx)):
        for o, x in zip(outs, ins, strict=True):
            dist.all_gather_into_tensor(o, x)
    k = 0
    for p in per:
        if p[0].numel():
            check_exact(
                outs[k],
                torch.cat([x.reshape(-1) for x in p]),
                seed,
                w,
                f"coalesced all_gather [{k}]",
            )
            k += 1


def c_cpu_and_objects(case, seed, ctx):
    w = ctx.world_size
    inputs = rank_inputs(seed, 257, torch.float64, w)
    t = inputs[ctx.rank].clone()
    dist.all_reduce(t)  # a CPU tensor: gloo over all ranks
    assert_close_dtype(
        t,
        reference_reduce(inputs, "sum", torch.float64),
        torch.float64,
        w,
        seed=seed,
        what="cpu all_reduce",
    )
    objs = [None] * w
    dist.all_gather_object(objs, {"rank": ctx.rank, "seed": seed})
    assert objs == [{"rank": r, "seed": seed} for r in range(w)], objs
    box = [("payload", seed)] if ctx.rank == w - 1 else [None]
    dist.broadcast_object_list(box, src=w - 1)
    assert box == [("payload", seed)], box
    dist.barrier()


def dispatch(case, seed, ctx):
    return CASE_FUNCS[case[0]](case, seed, ctx)


CASE_FUNCS = {
    "all_reduce": c_all_reduce,
    "reduce": c_reduce,
    "all_reduce_unsigned": c_all_reduce_wide_unsigned,
    "all_reduce_complex": c_all_reduce_complex,
    "broadcast": c_broadcast,
    "all_gather": c_all_gather,
    "reduce_scatter": c_reduce_scatter,
    "gather_scatter": c_gather_scatter,
    "all_to_all": c_all_to_all,
    "p2p": c_p2p,
    "coalesced": c_coalesced,
    "cpu_objects": c_cpu_and_objects,
}

MOVE_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.int16,
    torch.bool,
    torch.float8_e5m2,
    torch.int64,
)


def op_cases(world: int, full: bool) -> list[tuple]:
    cases: list[tuple] = []
    shapes = [(), (1001,), (LARGE,), (7, 11, 13)] if full else [(1001,), (LARGE,)]
    i = 0
    for dtype in DTYPES:
        for op in REDUCE_OPS:
            if not reduction_valid(dtype, op):
                cases.append(("all_reduce", dtype, op, (5,), False))
                continue
            for shape in shapes:
                cases.append(("all_reduce", dtype, op, shape, i % 2 == 1))
                i += 1
    for dtype in (torch.uint32, torch.uint64):
        for op in ("SUM", "MIN", "MAX", "BXOR", "PRODUCT") + (
            ("AVG",) if dtype == torch.uint32 else ()
        ):
            cases.append(("all_reduce_unsigned", dtype, op, 1001))
            cases.append(("all_reduce_unsigned", dtype, op, LARGE))
    for op in ("SUM", "AVG", "PREMUL_SUM"):
        cases.append(("all_reduce_complex", op, 1001))
        cases.append(("all_reduce_complex", op, LARGE))
    last = world - 1
    red_dtypes = (
        torch.float32,
        torch.bfloat16,
        torch.int32,
        torch.bool,
        torch.float8_e4m3fn,
        torch.int8,
    )
    for dtype in red_dtypes:
        for op in ("SUM", "AVG", "MAX", "PREMUL_SUM", "BXOR", "PRODUCT"):
            if reduction_valid(dtype, op):
                cases.append(("reduce", dtype, op, 1001, last if op in ("SUM", "MAX") else 1))
                cases.append(("reduce_scatter", dtype, op, 333, op in ("SUM", "AVG", "BXOR")))
    # large enough for the sharded reduce (>= 64 KiB in the 2 x 2 launch)
    cases.append(("reduce", torch.float32, "SUM", LARGE, last))
    cases.append(("reduce", torch.bfloat16, "AVG", LARGE, 1))
    cases.append(("reduce_scatter", torch.float32, "SUM", LARGE, True))
    # large enough for the sharded reduce-scatter in every dtype (>= 64 KiB in the launch)
    for dtype, op, tensor_api in (
        (torch.bfloat16, "AVG", True),
        (torch.bool, "SUM", False),
        (torch.float8_e4m3fn, "PREMUL_SUM", True),
        (torch.int8, "PRODUCT", False),
        (torch.int64, "MIN", True),
    ):
        cases.append(("reduce_scatter", dtype, op, 20_000, tensor_api))
    for dtype in MOVE_DTYPES:
        for root in (0, 1, last):
            cases.append(("broadcast", dtype, 1001, root))
        cases.append(("broadcast", dtype, LARGE, last))
        cases.append(("all_gather", dtype, (7, 11), False))
        cases.append(("all_gather", dtype, (LARGE,), True))
        cases.append(("gather_scatter", dtype, 513, last))
        cases.append(("all_to_all", dtype, True))
    cases.append(("gather_scatter", torch.float32, 513, 0))
    cases.append(("all_to_all", torch.float32, False))
    for dtype in (torch.float32, torch.int16, torch.bool):
        cases.append(("p2p", dtype, 1001, False))
        cases.append(("p2p", dtype, 1001, True))
    cases.append(("p2p", torch.float64, LARGE, True))
    cases.append(("coalesced", torch.float32, "SUM"))
    cases.append(("coalesced", torch.bfloat16, "AVG"))
    cases.append(("coalesced", torch.int32, "MAX"))
    cases.append(("cpu_objects",))
    return cases


def run_cases(cases, base_seed, ctx) -> tuple[list[str], int]:
    failures = []
    done = 0
    for index, case in enumerate(cases):
        seed = case_seed(base_seed, index)
        try:
            dispatch(case, seed, ctx)
        except AssertionError as exc:
            failures.append(f"rank {ctx.rank} case #{index} {case!r} seed={seed}: {exc}"[:3000])
        except Exception:
            failures.append(
                f"rank {ctx.rank} case #{index} {case!r} seed={seed} RAISED (batch aborted):\n"
                + traceback.format_exc()[-4000:]
            )
            return failures, done
        done += 1
    return failures, done


# -- groups ------------------------------------------------------------------------------


def group_checks(ctx: Ctx, base_seed: int) -> list[str]:
    """new_group node-aligned / node-crossing and a 2-d DeviceMesh; only for 2 x 2."""
    from spyreccl_torch import ProcessGroupSpyreccl
    from spyreccl_torch.multinode import HierarchicalProcessGroup

    failures: list[str] = []
    w, r = ctx.world_size, ctx.rank
    aligned = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    crossing = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine_aligned = aligned[r // 2]
    mine_crossing = crossing[r % 2]
    kinds = {
        "aligned": type(mine_aligned._get_backend(torch.device("spyre"))).__name__,
        "crossing": type(mine_crossing).__name__,
    }
    if kinds["aligned"] != ProcessGroupSpyreccl.__name__:
        failures.append(
            f"rank {r}: node-aligned group got {kinds['aligned']}, expected the plain backend"
        )
    if not isinstance(mine_crossing, HierarchicalProcessGroup):
        failures.append(
            f"rank {r}: node-crossing group is {kinds['crossing']}, expected hierarchical"
        )
    for name, group, members in (
        ("aligned", mine_aligned, [0, 1] if r < 2 else [2, 3]),
        ("crossing", mine_crossing, [0, 2] if r % 2 == 0 else [1, 3]),
    ):
        seed = case_seed(base_seed, 10_000 + len(name))
        inputs = {
            g: random_tensor(999, torch.float32, "cpu", rank_seed(seed, g), nranks=2)
            for g in members
        }
        t = inputs[r].to(_dev(ctx))
        dist.all_reduce(t, group=group)
        try:
            check_result(
                t,
                reference_reduce([inputs[g] for g in members], "sum"),
                torch.float32,
                2,
                seed,
                f"{name} all_reduce",
            )
        except AssertionError as exc:
            failures.append(f"rank {r}: {exc}")
        b = t.clone() if r == members[-1] else poison_(torch.empty_like(t))
        dist.broadcast(b, src=members[-1], group=group)
        gathered = [poison_(torch.empty_like(t)) for _ in members]
        dist.all_gather(gathered, b, group=group)
        try:
            for g in gathered:
                check_exact(g, t.cpu(), seed, 2, f"{name} broadcast+all_gather")
        except AssertionError as exc:
            failures.append(f"rank {r}: {exc}")

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("spyre", (2, 2), mesh_dim_names=("node", "local"))
    seed = case_seed(base_seed, 20_000)
    inputs = [
        random_tensor(64, torch.float64, "cpu", rank_seed(seed, g), nranks=4) for g in range(w)
    ]
    for dim, peers in (("node", [r % 2, r % 2 + 2]), ("local", [r // 2 * 2, r // 2 * 2 + 1])):
        t = inputs[r].to(_dev(ctx))
        dist.all_reduce(t, group=mesh.get_group(dim))
        try:
            check_result(
                t,
                reference_reduce([inputs[p] for p in peers], "sum"),
                torch.float64,
                2,
                seed,
                f"mesh dim {dim}",
            )
        except AssertionError as exc:
            failures.append(f"rank {r}: {exc}")
    return failures


def _gloo_loops() -> int:
    """gloo's TCP event loop threads in this process (one per gloo transport device)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                count += comm.read().strip() == "gloo_tcp_loop"
        except OSError:
            pass
    return count


def gloo_device_check(ctx: Ctx, base_seed: int) -> list[str]:
    """The multi-node groups' gloo groups share one gloo device per process (gloo_groups.py):
    three more groups add no TCP event loop thread (each of their three or four gloo groups
    used to add one), and each computes its all_reduce exactly."""
    failures: list[str] = []
    r, world = ctx.rank, ctx.world_size
    before = _gloo_loops()
    groups = [dist.new_group(list(range(world))) for _ in range(3)]
    gen = torch.Generator().manual_seed(base_seed + 91)
    for i, group in enumerate(groups):
        values = torch.randint(-1000, 1000, (world, 6), generator=gen, dtype=torch.int64)
        t = values[r].to(torch.float32).to(_dev(ctx))
        dist.all_reduce(t, group=group)
        if not torch.equal(t.cpu().double(), values.sum(0).double()):
            failures.append(f"rank {r}: group {i}: all_reduce gave {t.cpu().tolist()}")
    after = _gloo_loops()
    if after != before:
        failures.append(
            f"rank {r}: {before} gloo event loops before three more multi-node groups and "
            f"{after} after; expected no new one"
        )
    for group in groups:
        dist.destroy_process_group(group)
    return failures


def async_check(ctx: Ctx, base_seed: int) -> list[str]:
    """async_op=True across nodes: a large all_reduce returns while it is still in flight,
    this rank computes meanwhile (polling is_completed()), and wait() gives the right sum;
    get_future() chains (what DDP comm hooks use); collectives issued back to back complete
    in issue order with the data of their predecessors (waited for in reverse order), on
    both routes."""
    failures: list[str] = []
    r, w = ctx.rank, ctx.world_size
    seed = case_seed(base_seed, 70_000)
    # 4 Mi float32 (16 MiB): the sharded route, hundreds of milliseconds here.
    inputs = rank_inputs(seed, 4 << 20, torch.float32, w)
    big = inputs[r].to(_dev(ctx))
    start = time.monotonic()
    work = dist.all_reduce(big, async_op=True)
    returned = time.monotonic() - start
    in_flight = not work.is_completed()
    a = torch.rand(128, 128, dtype=torch.float64)
    computed = 0
    while not work.is_completed():
        a = (a @ a).tanh_()
        computed += 1
    total = time.monotonic() - start
    work.wait()
    if not in_flight or computed == 0 or returned > total / 2:
        failures.append(
            f"rank {r}: async all_reduce did not overlap: returned after {returned:.3f} s of "
            f"{total:.3f} s, in flight at return: {in_flight}, {computed} compute steps"
        )
    try:
        want = reference_reduce(inputs, "sum", torch.float32)
        check_result(big, want, torch.float32, w, seed, "async all_reduce (16 MiB)")
    except AssertionError as exc:
        failures.append(f"rank {r}: {exc}")

    # get_future(): completed by the group's thread, chained without a wait on the Work.
    small = inputs[r][:1001].to(_dev(ctx))
    doubled = dist.all_reduce(small, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    try:
        want = reference_reduce([x[:1001] for x in inputs], "sum", torch.float32) * 2
        check_result(doubled.wait(), want, torch.float32, w, seed, "get_future().then")
    except AssertionError as exc:
        failures.append(f"rank {r}: {exc}")

    # A callback that issues a collective of the group and waits for it (DDP's PowerSGD hook
    # does): it runs on the group's thread, which runs the new collective nested instead of
    # waiting for itself. The other ranks join late, so that rank 0's callback runs there.
    seed3 = case_seed(base_seed, 70_002)
    zs = rank_inputs(seed3, 33, torch.float32, w)
    if r != 0:
        time.sleep(0.3)
    main = threading.get_ident()

    def issue_and_wait(done: torch.futures.Future) -> tuple[int, torch.Tensor]:
        again = dist.all_reduce(done.value()[0].clone(), async_op=True)
        return threading.get_ident(), again.get_future().wait()[0]

    first = dist.all_reduce(zs[r].to(_dev(ctx)), async_op=True)
    thread, twice = first.get_future().then(issue_and_wait).wait()
    if r == 0 and thread == main:
        failures.append("rank 0: the callback ran on the main thread: nothing nested")
    try:
        want = reference_reduce(zs, "sum", torch.float32) * w
        check_result(twice, want, torch.float32, w, seed3, "collective waited in a callback")
    except AssertionError as exc:
        failures.append(f"rank {r}: {exc}")

    # Ordering: each collective reads what the one before it wrote (exact, in int64).
    seed2 = case_seed(base_seed, 70_001)
    xs = rank_inputs(seed2, 7, torch.int64, w)  # leader route
    ys = rank_inputs(seed2, 30_001, torch.int64, w, salt=1)  # sharded route (240 KB)
    x, y = xs[r].to(_dev(ctx)), ys[r].to(_dev(ctx))
    gathered = torch.full((w * 7,), -7, dtype=torch.int64, device=_dev(ctx))
    works = [
        dist.all_reduce(x, async_op=True),
        dist.all_reduce(y, op=dist.ReduceOp.MAX, async_op=True),
        dist.all_reduce(x, async_op=True),  # every rank now holds w * sum
        dist.all_gather_into_tensor(gathered, x, async_op=True),
        dist.all_reduce(y, async_op=True),  # w * max
    ]
    for work in reversed(works):
        work.wait()
    sum_x = torch.stack(xs).sum(0)
    max_y = torch.stack(ys).max(0).values
    try:
        check_exact(x, sum_x * w, seed2, w, "async all_reduce after all_reduce")
        check_exact(gathered, (sum_x * w).repeat(w), seed2, w, "async all_gather after them")
        check_exact(y, max_y * w, seed2, w, "async all_reduce(SUM) after all_reduce(MAX)")
    except AssertionError as exc:
        failures.append(f"rank {r}: {exc}")
    return failures


def _staged_ops(ctx: Ctx, group: Any, seed: int) -> dict[str, torch.Tensor]:
    """Contiguous spyre operations through every kind of gloo stage of `group` (2 x 2): an
    all_reduce on the leader route (exchange between nodes) and on the sharded one (ring),
    all_gather_into_tensor on both routes, a broadcast, a reduce_scatter_tensor on the
    sharded route, all_to_all_single and a send/recv between nodes; returns the results."""
    r, w = ctx.rank, ctx.world_size
    dev = _dev(ctx)
    small = rank_inputs(seed, 1001, torch.float32, w)
    large = rank_inputs(seed, LARGE, torch.float32, w, salt=1)
    out: dict[str, torch.Tensor] = {}
    for name, inputs in (("leader", small), ("sharded", large)):
        t = inputs[r].to(dev)
        dist.all_reduce(t, group=group)
        out[f"all_reduce {name}"] = t
        gathered = poison_(torch.empty(w * inputs[r].numel(), dtype=torch.float32, device=dev))
        dist.all_gather_into_tensor(gathered, inputs[r].to(dev), group=group)
        out[f"all_gather {name}"] = gathered
    b = large[r].to(dev) if r == w - 1 else poison_(torch.empty(LARGE, device=dev))
    dist.broadcast(b, src=w - 1, group=group)
    out["broadcast"] = b
    rs = poison_(torch.empty(LARGE // w + 1, device=dev))
    dist.reduce_scatter_tensor(rs, torch.cat([large[r], large[r][: w - 1]]).to(dev), group=group)
    out["reduce_scatter"] = rs
    a2a = poison_(torch.empty(w * 5, device=dev))
    dist.all_to_all_single(a2a, small[r][: w * 5].to(dev), group=group)
    out["all_to_all"] = a2a
    peer = (r + 2) % w  # the same local index on the other node
    p2p = poison_(torch.empty(1001, device=dev))
    ops = [
        dist.P2POp(dist.isend, small[r].to(dev), peer, group),
        dist.P2POp(dist.irecv, p2p, peer, group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["send/recv"] = p2p
    return out


def staging_check(ctx: Ctx, base_seed: int) -> list[str]:
    """The gloo stages use the spyre tensors in place where spyre memory is host-addressable
    (the emulated device in its default host memory mode): the operations of _staged_ops
    copy nothing between spyre tensors and host buffers on the default group; where it is
    not (SPYRECCL_SPYRE_MEMORY=discrete) they must copy. On a group made with
    SPYRECCL_MULTINODE_ZERO_COPY=0 the same ones copy (so the count can see copies) and give
    the same bits."""
    from spyreccl_torch import _C
    from spyreccl_torch.multinode import HierarchicalProcessGroup

    failures: list[str] = []
    r = ctx.rank
    seed = case_seed(base_seed, 90_000)
    world = dist.group.WORLD
    copying = _group_with_env(ctx, {"SPYRECCL_MULTINODE_ZERO_COPY": "0"})
    if not isinstance(copying, HierarchicalProcessGroup):
        return [f"rank {r}: staging_check: group is {type(copying).__name__}"]
    # The gloo groups themselves (the data groups are wrapped to record their stages).
    gloo_groups = [
        weakref.ref(getattr(g, "_gloo", g))
        for g in (copying._cross, copying._flat, copying._check_group)
    ]
    routes_before = dict(world.route_counts)
    before = dict(world.staging_counts)
    in_place = _staged_ops(ctx, world, seed)
    addressable = _C._host_addressable("spyre")
    if addressable and world.staging_counts != before:
        failures.append(
            f"rank {r}: gloo stages copied spyre tensors on host-addressable memory: "
            f"{before} -> {world.staging_counts}"
        )
    if not addressable and world.staging_counts == before:
        failures.append(
            f"rank {r}: gloo stages copied nothing although spyre memory is not "
            f"host-addressable: {world.staging_counts}"
        )
    if not all(world.route_counts[k] > routes_before[k] for k in ("leader", "sharded")):
        failures.append(f"rank {r}: staging_check missed a route: {world.route_counts}")
    copied = _staged_ops(ctx, copying, seed)
    counts = copying.staging_counts
    if not (counts["to_host"] > 0 and counts["from_host"] > 0):
        failures.append(f"rank {r}: the copying group counted no copies: {counts}")
    for name, t in in_place.items():
        try:
            check_exact(t, copied[name].cpu(), seed, ctx.world_size, f"staging {name}")
        except AssertionError as exc:
            failures.append(f"rank {r}: in place vs copies: {exc}")
    # Against the references too (bit-identical results could both be wrong).
    w = ctx.world_size
    small = rank_inputs(seed, 1001, torch.float32, w)
    large = rank_inputs(seed, LARGE, torch.float32, w, salt=1)
    try:
        check_result(
            in_place["all_reduce sharded"],
            reference_reduce(large, "sum"),
            torch.float32,
            w,
            seed,
            "staging all_reduce sharded",
        )
        check_exact(in_place["all_gather leader"], torch.cat(small), seed, w, "staging all_gather")
        check_exact(in_place["broadcast"], large[w - 1], seed, w, "staging broadcast")
        check_exact(
            in_place["all_to_all"],
            torch.cat([small[s][r * 5 : (r + 1) * 5] for s in range(w)]),
            seed,
            w,
            "staging all_to_all",
        )
        check_exact(in_place["send/recv"], small[(r + 2) % w], seed, w, "staging send/recv")
    except AssertionError as exc:
        failures.append(f"rank {r}: {exc}")
    dist.destroy_process_group(copying)
    # Its shutdown dropped its gloo groups (while `copying` itself is still referenced here),
    # so their destructors ran and joined gloo's worker threads: none is left for interpreter
    # exit, where a worker releasing a stage's tensors would abort the process (see
    # HierarchicalProcessGroup.shutdown).
    alive = [ref() is not None for ref in gloo_groups]
    if any(alive):
        failures.append(f"rank {r}: gloo groups (cross, flat, check) alive after destroy: {alive}")
    return failures


PIPELINE_CHUNK = 16 * 1024


def pipeline_check(ctx: Ctx, base_seed: int) -> list[str]:
    """The sharded routes of large reductions, in every dtype with SUM and every valid op
    for float32, int32 and uint64 (gloo's sign-flipped MIN/MAX), against float64 / exact
    references: on a group made with 16 KiB chunks, all_reduce cut into chunks whose stages
    overlap (multinode/pipeline.py; odd lengths, so the node's padding is cut too) and
    reduce_scatter_tensor by node (nodes hold consecutive ranks); on the same kind of group
    told that its nodes do not (the general path: grouped blocks, chunks that straddle rank
    blocks), reduce_scatter_tensor and reduce_scatter (list). The chunk size is agreed by
    all ranks (one rank proposing 0 turns it off for the group)."""
    from spyreccl_torch.multinode import HierarchicalProcessGroup

    r, w = ctx.rank, ctx.world_size
    sharded = {"SPYRECCL_MULTINODE_SHARDED_MIN_BYTES": "4096"}
    env = {"SPYRECCL_MULTINODE_PIPELINE_CHUNK_BYTES": str(PIPELINE_CHUNK), **sharded}
    chunked = _group_with_env(ctx, env)
    regrouped = _group_with_env(ctx, env)
    regrouped._nodes_in_order = False  # as if the nodes held interleaved ranks
    mixed = _group_with_env(
        ctx, {**env, "SPYRECCL_MULTINODE_PIPELINE_CHUNK_BYTES": "0" if r == 1 else "4096"}
    )
    if not isinstance(chunked, HierarchicalProcessGroup):
        return [f"rank {r}: pipeline_check: group is {type(chunked).__name__}"]
    failures: list[str] = []
    if (chunked._chunk_bytes, mixed._chunk_bytes) != (PIPELINE_CHUNK, 0):
        failures.append(
            f"rank {r}: agreed chunk sizes {chunked._chunk_bytes}, {mixed._chunk_bytes} "
            f"(expected {PIPELINE_CHUNK}, 0)"
        )
    cases = [(dtype, "SUM") for dtype in DTYPES]
    cases += [(dtype, op) for dtype in (torch.float32, torch.int32) for op in REDUCE_OPS]
    cases += [(torch.uint64, "MIN"), (torch.uint64, "MAX"), (torch.uint64, "SUM")]
    n_ar, n_rs = 40_001, 10_001
    dev = _dev(ctx)
    for i, (dtype, op) in enumerate(cases):
        if not reduction_valid(dtype, op):
            continue
        seed = case_seed(base_seed, 95_000 + i)
        factor = premul_factor(seed) if op == "PREMUL_SUM" else None
        what = f"pipelined {op} {dtype_id(dtype)}"
        if dtype == torch.uint64:  # bit patterns on both sides of 2**63
            inputs = [x.view(dtype) for x in rank_inputs(seed, n_ar, torch.int64, w)]
            blocks = [x.view(dtype) for x in rank_inputs(seed, n_rs * w, torch.int64, w, 1)]
        else:
            inputs = rank_inputs(seed, n_ar, dtype, w)
            blocks = rank_inputs(seed, n_rs * w, dtype, w, salt=1)
        exact = dtype == torch.uint64
        try:
            t = inputs[r].to(dev)
            dist.all_reduce(t, op=dist_op(op, factor), group=chunked)
            expected = reference_reduce(inputs, reference_op(op, factor), dtype)
            if exact:
                check_exact(t, expected, seed, w, f"all_reduce {what}")
            else:
                check_result(t, expected, dtype, w, seed, f"all_reduce {what}")
            mine = blocks[r].to(dev)
            full = reference_reduce(blocks, reference_op(op, factor), dtype)
            expected = full[r * n_rs : (r + 1) * n_rs]
            for group, kind in ((chunked, "by node"), (regrouped, "regrouped"), (None, "list")):
                out = poison_(torch.empty(n_rs, dtype=dtype, device=dev))
                if group is None:  # the list form, on the general path
                    pieces = list(mine.chunk(w))
                    dist.reduce_scatter(out, pieces, op=dist_op(op, factor), group=regrouped)
                else:
                    dist.reduce_scatter_tensor(out, mine, op=dist_op(op, factor), group=group)
                label = f"reduce_scatter {kind} {what}"
                if exact:
                    check_exact(out, expected, seed, w, label)
                else:
                    check_result(out, expected, dtype, w, seed, label)
                check_untouched(mine, blocks[r], f"{label} (input)")
        except AssertionError as exc:
            failures.append(f"rank {r}: {exc}")
    # Every valid case's all_reduce, and its reduce_scatters on the general path, are cut:
    # each moves >= 40 KB per rank in its work dtype, at least two 16 KiB chunks.
    valid = sum(reduction_valid(dtype, op) for dtype, op in cases)
    for group, expected_ops in ((chunked, valid), (regrouped, 2 * valid)):
        counts = group.pipeline_counts
        if counts["operations"] != expected_ops or counts["chunks"] < 2 * expected_ops:
            failures.append(f"rank {r}: operations cut into chunks: {counts}, {expected_ops}")
    dtype = torch.float32
    seed = case_seed(base_seed, 96_000)
    inputs = rank_inputs(seed, n_ar, dtype, w)
    t = inputs[r].to(dev)
    dist.all_reduce(t, group=mixed)
    try:
        check_result(t, reference_reduce(inputs, "sum", dtype), dtype, w, seed, "unchunked")
    except AssertionError as exc:
        failures.append(f"rank {r}: {exc}")
    if mixed.pipeline_counts["operations"] or mixed.route_counts["sharded"] != 1:
        failures.append(
            f"rank {r}: the group that agreed on no chunks: {mixed.pipeline_counts}, "
            f"{mixed.route_counts}"
        )
    # The sharded route (30 011 elements per rank), and the leader route: 7 elements carried
    # in the check's exchange, 3001 (on a group without the sharded route) a gloo all_gather.
    failures += _gather_layouts(ctx, chunked, case_seed(base_seed, 97_000), (7, 30_011))
    leader = _group_with_env(ctx, {"SPYRECCL_MULTINODE_SHARDED_MIN_BYTES": str(1 << 30)})
    failures += _gather_layouts(ctx, leader, case_seed(base_seed, 97_100), (3_001,))
    # 4 dtypes x 3 layouts, every one a gloo all_gather on the leader route.
    if leader.route_counts["leader"] != 12 or leader.cross_counts["carried"]:
        failures.append(
            f"rank {r}: the 3001-element gathers: {leader.route_counts}, {leader.cross_counts}"
        )
    dist.destroy_process_group(leader)
    dist.destroy_process_group(chunked)
    dist.destroy_process_group(regrouped)
    dist.destroy_process_group(mixed)
    return failures


def _poisoned(numel: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A poisoned flat tensor (complex: through its float32 pairs)."""
    if dtype.is_complex:
        return poison_(torch.empty(2 * numel, dtype=torch.float32, device=dev)).view(dtype)
    return poison_(torch.empty(numel, dtype=dtype, device=dev))


def _gather_layouts(ctx: Ctx, group: Any, seed: int, sizes: tuple[int, ...]) -> list[str]:
    """all_gather_into_tensor of `sizes` elements per rank with the input already in its
    place in the output (FSDP's layout), the input in another rank's place (must be read
    before it is overwritten), and a non-contiguous output. The sharded route gathers in
    place; the leader route straight into a contiguous output too."""
    r, w = ctx.rank, ctx.world_size
    dev = _dev(ctx)
    failures: list[str] = []
    cases = [
        (n, i, dtype)
        for n in sizes
        for i, dtype in enumerate((torch.float32, torch.complex64, torch.uint8, torch.bfloat16))
    ]
    for n, i, dtype in cases:
        if dtype.is_complex:  # (real, imaginary) float32 pairs
            inputs = [x.view(dtype) for x in rank_inputs(seed + i, 2 * n, torch.float32, w)]
        else:
            inputs = rank_inputs(seed + i, n, dtype, w)
        want = torch.cat(inputs)
        what = f"all_gather_into_tensor {dtype_id(dtype)} x {n}"
        try:
            out = _poisoned(w * n, dtype, dev)
            out[r * n : (r + 1) * n].copy_(inputs[r])
            dist.all_gather_into_tensor(out, out[r * n : (r + 1) * n], group=group)
            check_exact(out, want, seed + i, w, f"{what}, input in its place")
            out = _poisoned(w * n, dtype, dev)
            other = (r + 1) % w
            out[other * n : (other + 1) * n].copy_(inputs[r])
            dist.all_gather_into_tensor(out, out[other * n : (other + 1) * n], group=group)
            check_exact(out, want, seed + i, w, f"{what}, input in rank {other}'s place")
            out_t = _poisoned(w * n, dtype, dev).view(n, w).t()
            dist.all_gather_into_tensor(out_t, inputs[r].to(dev), group=group)
            check_exact(out_t.reshape(-1), want, seed + i, w, f"{what}, non-contiguous output")
        except AssertionError as exc:
            failures.append(f"rank {r}: {exc}")
    return failures


def _rejected_within(
    call: Callable[[], Any], pattern: str, what: str, rank: int, limit_s: float = 10.0
) -> list[str]:
    """This rank's failures when `call` does not raise an error matching `pattern` (see
    expect_rejection), or takes more than `limit_s` seconds to do so."""
    failures = []
    start = time.monotonic()
    try:
        expect_rejection(call, pattern, what)
    except AssertionError as exc:
        failures.append(f"rank {rank}: {exc}")
    took = time.monotonic() - start
    if took > limit_s:
        failures.append(f"rank {rank}: {what} took {took:.1f} s to fail")
    return failures


def timeout_check(ctx: Ctx, base_seed: int) -> list[str]:
    """wait(timeout) on a Work whose peers never call: rank 0's wait raises within the
    given time, naming the operation and its sequence number, the group refuses later
    calls, and the process still exits cleanly (the abandoned gloo exchange is released
    by a thread of its own). The other ranks, calling the same all_reduce afterwards, fail
    within seconds (the group timeout is 60 s) on the failure rank 0 published: they wait
    in a gloo stage rank 0 will never enter."""
    failures: list[str] = []
    r = ctx.rank
    group = dist.new_group(list(range(ctx.world_size)))
    t = torch.ones(3, device=_dev(ctx))
    if r == 0:
        work = dist.all_reduce(t, group=group, async_op=True)
        start = time.monotonic()
        try:
            expect_rejection(
                lambda: work.wait(datetime.timedelta(seconds=1)),
                r"all_reduce seq 1 did not complete within 1 s",
                "wait(timeout) on a Work nobody else joins",
            )
            expect_rejection(lambda: dist.all_reduce(t, group=group), "failed earlier", "")
        except AssertionError as exc:
            failures.append(f"rank {r}: {exc}")
        if time.monotonic() - start > 6:
            failures.append(f"rank {r}: wait(1 s) took {time.monotonic() - start:.1f} s")
    dist.barrier()
    if r != 0:
        failures += _rejected_within(
            lambda: dist.all_reduce(t, group=group),
            r"all_reduce seq 1 failed on process group .*all_reduce seq 1 failed on rank 0 "
            r"\(node 0\): a wait\(\) ran out after 1 s",
            "an all_reduce whose rank 0 gave up on it",
            r,
        )
    dist.destroy_process_group(group)
    return failures


def mismatch_check(ctx: Ctx, base_seed: int) -> list[str]:
    """Checking is on by default: a group whose ranks call different collectives (rank 3 on
    node 1 broadcasts 8 elements while the others all-reduce 7; rank 2 on the same node
    waits for rank 3 in an on-node stage) fails on every rank within seconds, with a message
    naming the sequence number, what differs and each rank's call (no rank returns as if
    it had a result); the failed group refuses later calls.
    Then with SPYRECCL_MULTINODE_CHECK=0 matching calls still compute right; then a
    mismatch only the reduce op tells apart, and one on the chunked sharded route."""
    failures = []
    r = ctx.rank
    group = dist.new_group(list(range(ctx.world_size)))
    pattern = r"mismatched collectives .* at seq 1 \(operation, element count, reduce op, "
    pattern += r"root differ\): rank 0: all_reduce\(numel=7, torch.float32, "
    pattern += r"RedOpType.SUM\).*rank 3: broadcast\(numel=8, torch.float32, root=0\)"
    poison = torch.full((8 if r == 3 else 7,), float("nan"), device=_dev(ctx))
    if r == 3:
        call = lambda: dist.broadcast(poison, src=0, group=group)  # noqa: E731
    else:
        call = lambda: dist.all_reduce(poison, group=group)  # noqa: E731
    failures += _rejected_within(call, pattern, "mismatched collectives", r)
    try:
        expect_rejection(lambda: dist.all_reduce(poison, group=group), "failed earlier", "")
    except AssertionError as exc:
        failures.append(f"rank {r}: {exc}")
    unchecked = _group_with_env(ctx, {"SPYRECCL_MULTINODE_CHECK": "0"})
    if unchecked._check_calls:
        failures.append(f"rank {r}: SPYRECCL_MULTINODE_CHECK=0 left checking on")
    t = torch.full((5,), float(r), device=_dev(ctx))
    dist.all_reduce(t, group=unchecked)
    if t.cpu().tolist() != [6.0] * 5 or unchecked.route_counts["flat"] != 1:
        failures.append(
            f"rank {r}: all_reduce without checking gave {t.cpu().tolist()} "
            f"(routes {unchecked.route_counts})"
        )
    dist.destroy_process_group(unchecked)
    dist.destroy_process_group(group)

    # A mismatch that only the reduce op tells apart, on an operation large enough for
    # gloo stages: rank 3's node-local stage meets rank 2's (spyreccl stops both), node 0
    # goes as far as its first gloo stage, which waits for the fingerprints.
    group = dist.new_group(list(range(ctx.world_size)))
    big = torch.ones(100_000, device=_dev(ctx))
    op = dist.ReduceOp.MAX if r == 3 else dist.ReduceOp.SUM
    pattern = r"mismatched collectives .* at seq 1 \(reduce op differ\): rank 0: all_reduce"
    pattern += r"\(numel=100000, torch.float32, RedOpType.SUM\).*rank 3: all_reduce\(numel="
    pattern += r"100000, torch.float32, RedOpType.MAX\)"
    failures += _rejected_within(
        lambda: dist.all_reduce(big, op=op, group=group, async_op=True).wait(),
        pattern,
        "mismatched reduce op",
        r,
    )
    dist.destroy_process_group(group)

    # The same on the sharded route cut into overlapped chunks (pipeline.py), where every
    # chunk's on-node stage is queued before the first gloo stage waits for the
    # fingerprints: rank 3's element count gives its node different chunks.
    group = _group_with_env(ctx, ROUTE_ENV["chunked"])
    big = torch.ones(90_000 if r == 3 else 100_000, device=_dev(ctx))
    pattern = r"mismatched collectives .* at seq 1 \(element count differ\): rank 0: all_reduce"
    pattern += r"\(numel=100000, torch.float32, RedOpType.SUM\).*rank 3: all_reduce\(numel="
    pattern += r"90000, torch.float32, RedOpType.SUM\)"
    failures += _rejected_within(
        lambda: dist.all_reduce(big, group=group), pattern, "mismatched chunked all_reduce", r
    )
    dist.destroy_process_group(group)
    return failures


def node_check_check(ctx: Ctx, base_seed: int) -> list[str]:
    """The mismatch check node by node (node_check.py). Each node agrees within itself but
    the nodes call different collectives, so only the leaders' exchange sees it: on the
    leader route the other ranks post no gloo stage and learn it from their leader's
    outcome alone, on the flat route their first gloo stage waits for it, and on the sharded
    route they wait for it before their stage between nodes. Every rank fails within
    seconds with MismatchError naming both calls, and leaves its output as it was. Then a
    group with checking on runs matching calls of every kind, with arguments rejected on
    every rank in between: the node's control group stays in step and the results are right.
    """
    failures: list[str] = []
    r, world = ctx.rank, ctx.world_size
    topo = dist.group.WORLD.topology
    node = topo.node
    for route, numel in (("leader", 7), ("flat", 7), ("sharded", 4096)):
        group = _route_group(ctx, route)
        pg = group._get_backend(_dev(ctx))._pg
        kinds = (type(pg._check_local).__name__, pg._check_leaders is not None)
        expected_kinds = ("ProcessGroupSpyreccl", topo.local_rank == 0)
        if kinds != expected_kinds:
            failures.append(f"rank {r}: control groups {kinds}, expected {expected_kinds}")
        count = numel + node  # node 1 calls one element more
        poison = torch.full((count,), float("nan"), device=_dev(ctx))
        pattern = r"mismatched collectives .* at seq 1 \(element count differ\): rank 0: "
        pattern += rf"all_reduce\(numel={numel}, .*rank 3: all_reduce\(numel={numel + 1}, "
        failures += _rejected_within(
            lambda p=poison, g=group: dist.all_reduce(p, group=g),
            pattern,
            f"{route}: nodes differ",
            r,
        )
        if not bool(poison.isnan().all()):
            failures.append(f"rank {r}: {route}: the mismatched all_reduce wrote its output")
        dist.destroy_process_group(group)
    # A small broadcast travels in the leaders' check exchange too: here each node
    # broadcasts from a root of its own (rank 0 on node 0, rank 2 on node 1).
    group = dist.new_group(list(range(world)))
    src = 2 * node
    pattern = r"mismatched collectives .* at seq 1 \(root differ\): rank 0: broadcast\(numel=7, "
    pattern += r"torch.float32, root=0\).*rank 3: broadcast\(numel=7, torch.float32, root=2\)"
    payload = torch.full((7,), float(r), device=_dev(ctx))
    failures += _rejected_within(
        lambda: dist.broadcast(payload, src=src, group=group), pattern, "broadcast roots", r
    )
    dist.destroy_process_group(group)
    # A small broadcast whose root's node disagrees within itself: rank 0's node-mate
    # all-reduces instead. The node's check stops that node's stages at once, the root's
    # exchange carries the disagreement to the other node, and every rank fails naming both
    # calls, the receivers' outputs untouched.
    group = dist.new_group(list(range(world)))
    root_node_ranks = [q for q in range(world) if topo.node_of[q] == topo.node_of[0]]
    odd = root_node_ranks[1] if len(root_node_ranks) > 1 else None
    poison = torch.full((7,), float("nan"), device=_dev(ctx))
    data = poison if r != 0 else torch.arange(7, dtype=torch.float32, device=_dev(ctx))
    pattern = r"mismatched collectives .* at seq 1 .*rank 0: broadcast\(numel=7, torch.float32, "
    pattern += rf"root=0\).*rank {odd}: all_reduce\(numel=7, "
    if odd is not None:
        if r == odd:
            call = lambda: dist.all_reduce(data, group=group)  # noqa: E731
        else:
            call = lambda: dist.broadcast(data, src=0, group=group)  # noqa: E731
        failures += _rejected_within(call, pattern, "the root's node differs", r)
        if r != 0 and not bool(data.isnan().all()):
            failures.append(f"rank {r}: the mismatched broadcast wrote its output")
    dist.destroy_process_group(group)
    # A small all_to_all_single travels in the check as well: here node 1's ranks send
    # blocks of 3 elements where node 0's send 2.
    group = dist.new_group(list(range(world)))
    per = 2 + node
    sent = torch.arange(world * per, dtype=torch.float32, device=_dev(ctx))
    got = torch.full((world * per,), float("nan"), device=_dev(ctx))
    pattern = r"mismatched collectives .* at seq 1 \(element count differ\): rank 0: "
    pattern += (
        rf"all_to_all_single\(numel={world * 2}, .*rank 3: all_to_all_single\(numel={world * 3}, "
    )
    failures += _rejected_within(
        lambda: dist.all_to_all_single(got, sent, group=group), pattern, "all_to_all sizes", r
    )
    if not bool(got.isnan().all()):
        failures.append(f"rank {r}: the mismatched all_to_all_single wrote its output")
    dist.destroy_process_group(group)

    group = _route_group(ctx, "leader")
    gen = torch.Generator().manual_seed(base_seed + 77)
    for step in range(6):
        # A small broadcast (carried in the check's exchange) from a root on either node.
        values = torch.randn(9 + step, generator=gen, dtype=torch.float64)
        root = (step * 3) % world
        b = (values if r == root else torch.full_like(values, float("nan"))).to(_dev(ctx))
        dist.broadcast(b, src=root, group=group)
        if not torch.equal(b.cpu(), values):
            failures.append(f"rank {r}: step {step}: broadcast from rank {root} is wrong")
        values = torch.randn(world, 33, generator=gen, dtype=torch.float64)
        t = values[r].to(torch.float32).to(_dev(ctx))
        if step % 2:
            # Rejected on every rank before anything moves (an output of the wrong size).
            expect_rejection(
                lambda t=t: dist.all_gather_into_tensor(
                    torch.empty(5, device=_dev(ctx)), t, group=group
                ),
                "all_gather_into_tensor",
                "an output of the wrong size",
            )
        dist.all_reduce(t, group=group, async_op=step == 4)
        dist.barrier(group=group)
        expected = values.to(torch.float32).to(torch.float64).sum(0)
        if not torch.allclose(t.cpu().double(), expected, rtol=1e-5, atol=1e-5):
            failures.append(f"rank {r}: step {step}: all_reduce after the checks is wrong")
        out = torch.full((world * 33,), float("nan"), device=_dev(ctx))
        mine = values[r].to(torch.float32)
        dist.all_gather_into_tensor(out, mine.to(_dev(ctx)), group=group)
        if not torch.equal(out.cpu().view(world, 33), values.to(torch.float32)):
            failures.append(f"rank {r}: step {step}: all_gather after the checks is wrong")
        outs = [torch.full((33,), float("nan"), device=_dev(ctx)) for _ in range(world)]
        dist.all_gather(outs, mine.to(_dev(ctx)), group=group)
        if not torch.equal(torch.stack([o.cpu() for o in outs]), values.to(torch.float32)):
            failures.append(f"rank {r}: step {step}: all_gather (list) is wrong")
        # Small all_to_all_single (carried): split sizes as an MoE layer exchanges them
        # (counts[s][d]: what rank s sends rank d), and float64 blocks in place.
        counts = torch.randint(0, 1000, (world, world), generator=gen)
        got = torch.full((world,), -1, dtype=torch.int64, device=_dev(ctx))
        dist.all_to_all_single(got, counts[r].to(_dev(ctx)), group=group)
        if not torch.equal(got.cpu(), counts[:, r]):
            failures.append(f"rank {r}: step {step}: all_to_all_single of counts is wrong")
        per = step + 1
        blocks = torch.randn(world, world * per, generator=gen, dtype=torch.float64)
        x = blocks[r].to(_dev(ctx))
        dist.all_to_all_single(x, x, group=group)
        expected = torch.cat([blocks[s][r * per : (r + 1) * per] for s in range(world)])
        if not torch.equal(x.cpu(), expected):
            failures.append(f"rank {r}: step {step}: all_to_all_single in place is wrong")
    pg = group._get_backend(_dev(ctx))._pg
    carried = pg.cross_counts["carried"]
    # Per step on a leader: a broadcast, an all_reduce, two all_gathers and two
    # all_to_all_singles (the rejected all_gather_into_tensor posts its check alone).
    if carried != (6 * 6 if topo.local_rank == 0 else 0):
        failures.append(f"rank {r}: {carried} stages carried in the check, expected 36 on leaders")
    dist.destroy_process_group(group)

    # SPYRECCL_MULTINODE_YIELD_NS sets how long a rank other than the leader yields while it
    # waits for the outcome before its gloo stage (0: it sleeps at once); the node's groups
    # keep the core's default. An all_to_all_single with split sizes (which waits so) and an
    # all_reduce still compute exactly.
    group = _group_with_env(ctx, {"SPYRECCL_MULTINODE_YIELD_NS": "0"})
    pg = group._get_backend(_dev(ctx))._pg
    settings = (pg._checker.outcome_yield_ns, pg._local.options.yield_ns)
    if settings != (0, -1):
        failures.append(f"rank {r}: outcome / data group yield {settings}, expected (0, -1)")
    rows = torch.randint(1, 40, (world, world), generator=gen)  # rows[s][d]: s sends d
    sent = [torch.randn(int(rows[s].sum()), 3, generator=gen) for s in range(world)]
    offsets = [torch.cumsum(rows[s], 0) - rows[s] for s in range(world)]
    expected = torch.cat(
        [sent[s][int(offsets[s][r]) : int(offsets[s][r] + rows[s][r])] for s in range(world)]
    )
    got = torch.full((int(rows[:, r].sum()), 3), float("nan"), device=_dev(ctx))
    dist.all_to_all_single(
        got, sent[r].to(_dev(ctx)), rows[:, r].tolist(), rows[r].tolist(), group=group
    )
    if not torch.equal(got.cpu(), expected):
        failures.append(f"rank {r}: all_to_all_single with split sizes (yield_ns 0) is wrong")
    total = torch.full((5,), float(r + 1), device=_dev(ctx))
    dist.all_reduce(total, group=group)
    if total.cpu().tolist() != [float(sum(range(1, world + 1)))] * 5:
        failures.append(f"rank {r}: all_reduce (yield_ns 0) gave {total.cpu().tolist()}")
    dist.destroy_process_group(group)
    return failures


def failure_check(ctx: Ctx, base_seed: int) -> list[str]:
    """A stage that fails on one rank while every rank stays alive (no death for anybody's
    transport to notice): on each route at once (flat, leader, sharded, chunked: a group each), one
    rank of node 1 raises in its first stage between nodes. Node 0's ranks wait for it in a
    gloo stage it never enters, its node peer in an on-node stage: every rank must fail
    within seconds, naming the operation, its sequence number, the rank that failed and
    its error (and no silent rank: all are alive), and the groups refuse later calls."""
    import threading

    r = ctx.rank
    failures: list[str] = []
    # node 1's leader for the routes where it alone crosses or where all do; for the
    # sharded route node 1's second rank (its shard's stage between nodes).
    injected = {"flat": 2, "leader": 2, "sharded": 3, "chunked": 3}
    window = {"SPYRECCL_MULTINODE_FAILURE_WINDOW_S": "0.5"}
    groups = {route: _route_group(ctx, route, extra=window) for route in ROUTE_ENV}
    tensors = {route: torch.full((4096,), float(r), device=_dev(ctx)) for route in groups}
    for route, group in groups.items():
        dist.all_reduce(tensors[route], group=group)
        got = tensors[route].cpu()
        if not bool((got == 6.0).all()) or not _route_ok(group, route, 1):
            failures.append(
                f"rank {r}: {route}: {got[:3].tolist()}, {group.route_counts}, "
                f"{group.pipeline_counts}"
            )
        if r == injected[route]:

            def boom(post, route=route):
                raise RuntimeError(f"injected failure ({route})")

            group._post_gloo = boom
    results: dict[str, tuple] = {}

    def run(route: str) -> None:
        start = time.monotonic()
        try:
            dist.all_reduce(tensors[route], group=groups[route])
            results[route] = (None, time.monotonic() - start)
        except Exception as exc:
            results[route] = (exc, time.monotonic() - start)

    threads = [threading.Thread(target=run, args=(route,)) for route in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for route, (exc, seconds) in sorted(results.items()):
        where = f"rank {r}, {route} route"
        who = injected[route]
        text = str(exc)
        if exc is None:
            failures.append(f"{where}: the all_reduce returned although rank {who} failed")
            continue
        wanted = [
            "all_reduce seq 2 failed on process group",
            f"injected failure ({route})",
        ]
        if r != who:
            wanted.append(f"all_reduce seq 2 failed on rank {who} (node 1)")
        missing = [w for w in wanted if w not in text]
        if not isinstance(exc, dist.DistBackendError) or missing or "did not report" in text:
            failures.append(f"{where}: {type(exc).__name__} lacks {missing}: {text[:600]}")
        if seconds > 5.0:
            failures.append(f"{where}: failed after {seconds:.1f} s: {text[:300]}")
        try:
            expect_rejection(
                lambda route=route: dist.all_reduce(tensors[route], group=groups[route]),
                "failed earlier",
                f"{route}: a call on the failed group",
            )
        except AssertionError as err:
            failures.append(f"{where}: {err}")
    for group in groups.values():
        dist.destroy_process_group(group)
    return failures


def ddp_check(ctx: Ctx, base_seed: int) -> list[str]:
    """DDP across nodes: after one step the gradients are the average of every rank's, which
    this rank computes itself from every rank's batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(1234)
    model = torch.nn.Linear(8, 3, dtype=torch.float64)
    ref = torch.nn.Linear(8, 3, dtype=torch.float64)
    ref.load_state_dict(model.state_dict())
    ddp = DDP(model.to(_dev(ctx)))
    seed = case_seed(base_seed, 30_000)
    batches = [
        random_tensor((4, 8), torch.float64, "cpu", rank_seed(seed, g), nranks=4)
        for g in range(ctx.world_size)
    ]
    ddp(batches[ctx.rank].to(_dev(ctx))).square().sum().backward()
    ref(torch.cat(batches)).square().sum().div(ctx.world_size).backward()
    failures = []
    for (name, p), q in zip(ddp.module.named_parameters(), ref.parameters(), strict=True):
        try:
            assert_close_dtype(
                p.grad.cpu(),
                q.grad,
                torch.float64,
                ctx.world_size,
                seed=seed,
                what=f"DDP grad {name}",
            )
        except AssertionError as exc:
            failures.append(f"rank {ctx.rank}: {exc}")
    return failures


def hsdp_check(ctx: Ctx, base_seed: int) -> list[str]:
    """FSDP2 hybrid sharding: replicate across the nodes, shard within each node. After one
    step every rank's full gradients are the mean over the 4 ranks' batches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("spyre", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(4321)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 12, dtype=torch.float64),
        torch.nn.Tanh(),
        torch.nn.Linear(12, 4, dtype=torch.float64),
    )
    ref = torch.nn.Sequential(
        torch.nn.Linear(16, 12, dtype=torch.float64),
        torch.nn.Tanh(),
        torch.nn.Linear(12, 4, dtype=torch.float64),
    )
    ref.load_state_dict(model.state_dict())
    model.to(_dev(ctx))
    fully_shard(model, mesh=mesh)
    seed = case_seed(base_seed, 40_000)
    w = ctx.world_size
    batches = [
        random_tensor((3, 16), torch.float64, "cpu", rank_seed(seed, g), nranks=w) for g in range(w)
    ]
    model(batches[ctx.rank].to(_dev(ctx))).square().sum().backward()
    ref(torch.cat(batches)).square().sum().div(w).backward()
    failures = []
    for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters(), strict=True)):
        try:
            got = p.grad.full_tensor().cpu()
            assert_close_dtype(got, q.grad, torch.float64, w, seed=seed, what=f"HSDP grad {i}")
        except AssertionError as exc:
            failures.append(f"rank {ctx.rank}: {exc}")
    return failures


def funcol_check(ctx: Ctx, base_seed: int) -> list[str]:
    """Functional collectives (the C++ path DTensor and torch.compile use) on the
    hierarchical group."""
    import torch.distributed._functional_collectives as funcol

    seed = case_seed(base_seed, 50_000)
    w, r = ctx.world_size, ctx.rank
    inputs = rank_inputs(seed, 4 * w, torch.float32, w)
    mine = inputs[r].to(_dev(ctx))
    failures = []
    total = reference_reduce(inputs, "sum", torch.float32)
    checks = [
        ("funcol all_reduce", funcol.all_reduce(mine, "sum", dist.group.WORLD), total),
        (
            "funcol all_gather",
            funcol.all_gather_tensor(mine, 0, dist.group.WORLD),
            torch.cat(inputs),
        ),
        (
            "funcol reduce_scatter",
            funcol.reduce_scatter_tensor(mine, "sum", 0, dist.group.WORLD),
            total[r * 4 : (r + 1) * 4],
        ),
    ]
    for what, got, want in checks:
        try:
            check_result(got, want, torch.float32, w, seed, what)
        except AssertionError as exc:
            failures.append(f"rank {r}: {exc}")
    return failures


# -- modes -------------------------------------------------------------------------------


def split_check(ctx: Ctx, base_seed: int) -> list[str]:
    """split_group (the default group is bound to a device): first one group per node
    (plain spyreccl groups), then the node leaders together (across the nodes: a
    hierarchical group) and the remaining ranks together."""
    from spyreccl_torch.multinode import HierarchicalProcessGroup

    failures: list[str] = []
    r = ctx.rank
    nodes = [list(m) for m in dist.group.WORLD.topology.nodes]
    node_of = {g: k for k, m in enumerate(nodes) for g in m}
    leaders = [m[0] for m in nodes]
    others = [g for m in nodes for g in m[1:]]
    for n, layout in enumerate((nodes, [leaders, others] if others else [leaders])):
        group = dist.split_group(split_ranks=layout)
        members = next(m for m in layout if r in m)
        crossing = len({node_of[g] for g in members}) > 1
        if isinstance(group, HierarchicalProcessGroup) != crossing:
            failures.append(f"rank {r}: split {members} gave {type(group).__name__}")
        seed = case_seed(base_seed, 60_000 + n)
        inputs = {
            g: random_tensor(777, torch.float32, "cpu", rank_seed(seed, g), nranks=4)
            for g in members
        }
        t = inputs[r].to(_dev(ctx))
        dist.all_reduce(t, group=group)
        expected = reference_reduce([inputs[g] for g in members], "sum")
        try:
            check_result(t, expected, torch.float32, len(members), seed, f"split {members}")
        except AssertionError as exc:
            failures.append(f"rank {r}: {exc}")
    return failures


def _mapped_segments() -> list[str]:
    """The spyreccl shared-memory segments this process has mapped (its own groups')."""
    names = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip() if line.count(" ") >= 5 else ""
            if path.startswith("/dev/shm/spyreccl"):
                names.add(path.removesuffix(" (deleted)").removeprefix("/dev/shm/"))
    return sorted(names)


def _sockets() -> int:
    """Open sockets of this process."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _init() -> Ctx:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.spyre.set_device(local_rank)
    init_method = os.environ.get("SPYRECCL_MN_INIT")
    extra: dict = {}
    if os.environ.get("SPYRECCL_MN_DEVICE_ID") == "1":
        extra["device_id"] = torch.device("spyre", local_rank)
    if init_method:  # not under torchrun: rank and size from the environment
        extra |= {
            "init_method": init_method,
            "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"]),
        }
    dist.init_process_group(
        backend=os.environ.get("SPYRECCL_MN_BACKEND") or None,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
        **extra,
    )
    return Ctx()


def _base_report(ctx: Ctx) -> dict:
    pg = dist.group.WORLD
    topo = getattr(pg, "topology", None)
    return {
        "rank": ctx.rank,
        "hostname": socket.gethostname(),
        "node_env": os.environ.get("SPYRECCL_NODE_ID"),
        "group_type": type(pg).__name__,
        "nodes": [list(n) for n in topo.nodes] if topo else None,
        "shm": sorted(os.listdir("/dev/shm")),
    }


def mode_ops(full: bool) -> None:
    sockets_before = _sockets()
    ctx = _init()
    report = _base_report(ctx)
    base_seed = int(os.environ["SPYRECCL_MN_SEED"])
    start = time.monotonic()
    cases = op_cases(ctx.world_size, full)
    extras = (
        [group_checks, gloo_device_check, ddp_check, hsdp_check, funcol_check, async_check]
        + [mismatch_check]
        + [staging_check, pipeline_check, node_check_check, timeout_check, failure_check]
        if full
        else [split_check]
    )
    only = os.environ.get("SPYRECCL_MN_ONLY")  # while developing: these checks, no table
    if only:
        cases = []
        extras = [globals()[name] for name in only.split(",")]
    failures, done = run_cases(cases, base_seed, ctx)
    extras_run = []
    for check in extras:
        if failures:
            break  # a broken group would only add noise
        failures += check(ctx, base_seed)
        extras_run.append(check.__name__)
    routes = dict(getattr(dist.group.WORLD, "route_counts", {}))
    cross = dict(getattr(dist.group.WORLD, "cross_counts", {}))
    staging = dict(getattr(dist.group.WORLD, "staging_counts", {}))
    report.update(
        cases=len(cases),
        done=done,
        failures=failures,
        seconds=time.monotonic() - start,
        routes=routes,
        cross=cross,
        staging=staging,
        extras_run=extras_run,
    )
    report["segments"] = _mapped_segments()
    dist.destroy_process_group()
    gc.collect()
    # Every group's gloo connections and store clients are closed once the groups are gone.
    report["sockets"] = [sockets_before, _sockets()]
    _write(report)


# The route each group of the kill mode is forced onto (the variables are read when a group
# is created): 4096 float32 elements are 16 KiB.
ROUTE_ENV = {
    "flat": {"SPYRECCL_MULTINODE_FLAT_MAX_BYTES": str(1 << 20)},
    "leader": {
        "SPYRECCL_MULTINODE_FLAT_MAX_BYTES": "0",
        "SPYRECCL_MULTINODE_SHARDED_MIN_BYTES": str(1 << 30),
    },
    "sharded": {
        "SPYRECCL_MULTINODE_FLAT_MAX_BYTES": "0",
        "SPYRECCL_MULTINODE_SHARDED_MIN_BYTES": "4096",
    },
    # The sharded route cut into 4 KiB chunks whose stages overlap (pipeline.py).
    "chunked": {
        "SPYRECCL_MULTINODE_FLAT_MAX_BYTES": "0",
        "SPYRECCL_MULTINODE_SHARDED_MIN_BYTES": "4096",
        "SPYRECCL_MULTINODE_PIPELINE_CHUNK_BYTES": "4096",
    },
}
# The route_counts key each of them counts under.
COUNTED_AS = {"chunked": "sharded"}


def _route_ok(group: Any, route: str, times: int) -> bool:
    """Whether `group` (made with ROUTE_ENV[route]) took its route for `times` operations,
    every one cut into chunks for the chunked one."""
    counted = COUNTED_AS.get(route, route)
    if group.route_counts[counted] != times:
        return False
    chunked = group.pipeline_counts["operations"]
    return chunked == times if route == "chunked" else chunked == 0


def _group_with_env(ctx: Ctx, env: dict[str, str]):
    """A new group of every rank, created with `env` set (a group reads these variables when
    it is created); the environment is restored afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return dist.new_group(list(range(ctx.world_size)))
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _route_group(ctx: Ctx, route: str, check: str = "1", extra: dict[str, str] | None = None):
    env = {**ROUTE_ENV[route], "SPYRECCL_MULTINODE_CHECK": check, **(extra or {})}
    return _group_with_env(ctx, env)


def mode_kill() -> None:
    """Rank $SPYRECCL_MN_VICTIM dies (exit code $SPYRECCL_MN_VICTIM_EXIT: 0 keeps torchrun's
    agent from terminating the rest of its node) while every other rank has all_reduces in
    flight on several groups at once, one per route (flat, leader, sharded, chunked) and mismatch
    check setting ($SPYRECCL_MN_CHECKS, e.g. "1,0"; named "<route>" with the check and
    "<route>/nocheck" without): each group must fail on every surviving rank. Even ranks
    queue async_op=True Works, odd ranks make blocking calls (run on the caller's thread);
    a thread per group records when its error came and what it said."""
    import threading

    ctx = _init()
    victim = int(os.environ["SPYRECCL_MN_VICTIM"])
    exit_code = int(os.environ.get("SPYRECCL_MN_VICTIM_EXIT", "17"))
    checks = os.environ.get("SPYRECCL_MN_CHECKS", "1").split(",")
    report = _base_report(ctx)
    groups = {
        route + ("" if check == "1" else "/nocheck"): _route_group(ctx, route, check)
        for check in checks
        for route in ROUTE_ENV
    }
    tensors = {name: torch.ones(4096, device=_dev(ctx)) for name in groups}
    failures = []
    for name, group in groups.items():
        for _ in range(3):
            dist.all_reduce(tensors[name], group=group)
        want = float(ctx.world_size**3)
        got = tensors[name].cpu()
        route = name.split("/")[0]
        if not bool((got == want).all()) or not _route_ok(group, route, 3):
            failures.append(
                f"{name}: {got[:3].tolist()} != {want}, {group.route_counts}, "
                f"{group.pipeline_counts}"
            )
        if group._check_calls != (not name.endswith("/nocheck")):
            failures.append(f"{name}: checking is {group._check_calls}")
        tensors[name].fill_(1.0)
    dist.barrier()
    stamp = OUT / "death_time"
    if ctx.rank == victim:
        stamp.write_text(repr(time.time()))
        os._exit(exit_code)
    time.sleep(0.3)  # the victim is gone by now
    errors: dict[str, list] = {}

    def run(name: str) -> None:
        group, t = groups[name], tensors[name]
        error = None
        try:
            if ctx.rank % 2 == 0:
                works = []
                try:
                    for _ in range(50):
                        works.append(dist.all_reduce(t, group=group, async_op=True))
                finally:
                    # The group may fail while the Works are issued (a later call then
                    # raises "failed earlier"): the first Work's wait() names the cause.
                    for work in works:
                        work.wait()
            else:
                for _ in range(50):
                    dist.all_reduce(t, group=group)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        errors[name] = [error, time.time()]

    threads = [threading.Thread(target=run, args=(name,)) for name in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report.update(
        errors=errors,
        failures=failures,
        routes={name: dict(g.route_counts) for name, g in groups.items()},
        segments=_mapped_segments(),
    )
    _write(report)
    os._exit(0)  # the groups are broken: skip destroy (it would wait for the dead rank)


def mode_nojoin() -> None:
    report = {"rank": int(os.environ["RANK"])}
    start = time.monotonic()
    try:
        _init()
        report["error"] = None
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = time.monotonic() - start
    _write(report)
    os._exit(0)


def _checked_all_reduces(ctx, steps: int, first_numel: int) -> tuple[list[str], list[dict]]:
    """`steps` all_reduces on the world group, each checked against the float64 reference;
    returns the failures and the flight recorder's entries after them."""
    from spyreccl_torch import flight_recorder

    seed = int(os.environ.get("SPYRECCL_MN_SEED", "1"))
    failures = []
    for step in range(steps):
        inputs = [
            random_tensor(first_numel + step, torch.float32, seed=rank_seed(seed + step, r))
            for r in range(ctx.world_size)
        ]
        t = inputs[ctx.rank].to(_dev(ctx))
        dist.all_reduce(t)
        want = reference_reduce(inputs, "sum")
        if not torch.allclose(t.cpu(), want.to(torch.float32), rtol=1e-5, atol=1e-5):
            failures.append(f"all_reduce {step}: {t.cpu().tolist()} != {want.tolist()}")
    return failures, pickle.loads(flight_recorder.dump())["entries"]


def _next_world_seq(entries: list[dict]) -> int:
    """The collective sequence number the world group's next call will get."""
    name = dist.group.WORLD.group_name
    return 1 + max(e["collective_seq_id"] for e in entries if e["process_group"][0] == name)


def mode_skip() -> None:
    """Flight recorder: every rank runs checked all_reduces on the world group; rank
    $SPYRECCL_MN_SKIPPER then skips the next one and sleeps (outside any collective) until
    its dump ($TORCH_FR_DUMP_TEMP_FILE + rank) appears, while the others call it and fail."""
    ctx = _init()
    skipper = int(os.environ["SPYRECCL_MN_SKIPPER"])
    report = _base_report(ctx)
    failures, entries = _checked_all_reduces(ctx, steps=3, first_numel=11)
    report["missed"] = _next_world_seq(entries)
    # What the recorder holds of the healthy calls (the job-level group and its stages).
    report["healthy"] = [
        (
            e["process_group"][0],
            e["profiling_name"],
            e["state"],
            e["collective_seq_id"],
            e["time_discovered_started_ns"] is not None,
        )
        for e in entries
    ]
    start = time.monotonic()
    if ctx.rank == skipper:
        own = f"{os.environ['TORCH_FR_DUMP_TEMP_FILE']}{ctx.rank}"
        while not os.path.exists(own) and time.monotonic() < start + 2 * TIMEOUT_S + 30:
            time.sleep(0.1)
        report["error"] = None
        report["dumped"] = os.path.exists(own)
    else:
        try:
            dist.all_reduce(torch.ones(8, device=_dev(ctx)))
            report["error"] = None
        except Exception as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = time.monotonic() - start
    report["failures"] = failures
    _write(report)
    os._exit(0)  # the group is broken: skip destroy


def mode_mismatch_dump() -> None:
    """Flight recorder: checked all_reduces on the world group, then rank
    $SPYRECCL_MN_SKIPPER broadcasts where the others all-reduce; the check exchange finds the
    mismatch and every rank must fail with MismatchError and dump ($TORCH_FR_DUMP_TEMP_FILE +
    rank)."""
    ctx = _init()
    culprit = int(os.environ["SPYRECCL_MN_SKIPPER"])
    report = _base_report(ctx)
    failures, entries = _checked_all_reduces(ctx, steps=2, first_numel=9)
    report["missed"] = _next_world_seq(entries)
    t = _poisoned(8, torch.float32, _dev(ctx))
    start = time.monotonic()
    try:
        if ctx.rank == culprit:
            dist.broadcast(t, src=culprit)
        else:
            dist.all_reduce(t)
        report["error"] = None
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = time.monotonic() - start
    own = f"{os.environ['TORCH_FR_DUMP_TEMP_FILE']}{ctx.rank}"
    report["dumped"] = os.path.exists(own)  # written by the failing call itself, not later
    report["failures"] = failures
    _write(report)
    os._exit(0)  # the group is broken: skip destroy


if __name__ == "__main__":
    if os.environ.get("SPYRECCL_MN_DUMP"):  # while developing: stacks of a hung rank
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["SPYRECCL_MN_DUMP"]))
    mode = sys.argv[1]
    if mode == "ops":
        mode_ops(full=True)
    elif mode == "uneven":
        mode_ops(full=False)
    elif mode == "kill":
        mode_kill()
    elif mode == "nojoin":
        mode_nojoin()
    elif mode == "skip":
        mode_skip()
    elif mode == "mismatch_dump":
        mode_mismatch_dump()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
