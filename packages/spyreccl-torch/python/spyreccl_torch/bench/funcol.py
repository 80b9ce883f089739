"""``--mode funcol``: what the functional-collective path costs next to the eager call.

DTensor, FSDP2, tensor parallelism and every ``torch.compile``d graph do not call
``dist.all_reduce``: they call the ``_c10d_functional`` ops and ``wait_tensor``. This mode
measures, per message size and for spyre+spyreccl and CPU+gloo in the same rank processes
(alternating case by case), the per-call time of each way to all-reduce one tensor:

- ``eager``: ``dist.all_reduce(t)``; ``async+wait``: ``dist.all_reduce(t, async_op=True).wait()``;
- ``op``: ``_c10d_functional.all_reduce`` + ``wait_tensor``; ``op_``: the in-place
  ``all_reduce_`` + ``wait_tensor`` that inductor emits; ``op_ torch-path``: the same with
  spyreccl's lean path switched off (``spyreccl_torch._C._set_lean_functional(False)``: the
  call goes through torch's implementation and c10d's ProcessGroup layer);
- ``funcol``: the Python API ``funcol.all_reduce(t, "sum", group).wait()``
  (torch's ``AsyncCollectiveTensor`` on top of ``op``);
- ``dtensor``: ``DTensor.from_local(t, mesh, [Partial()]).redistribute(mesh, [Replicate()])``;
- ``<backend>+``: how much longer a compiled graph ``all_reduce(t * 2) + 1`` takes than the
  same graph ``t * 2 + 1``, for ``aot_eager``, ``inductor`` and inductor with its C++ wrapper
  (``cpp_wrapper=True``), with the group given as the ``ProcessGroup`` and (``-name``) by
  its name; ``inductor-name-stock`` is ``inductor-name`` compiled with spyre's direct
  collective calls switched off (the wrapper calls ``torch.ops._c10d_functional...`` as
  the stock wrapper does, see ``spyreccl_torch.device._inductor``);

and, once per level, a tensor-parallel MLP block's forward+backward step (DTensor colwise /
rowwise sharding) next to the same block without tensor parallelism (and, when an inductor
graph row is asked for, the sharded block through ``torch.compile``), and how much of a
large functional all_reduce overlaps with computation placed between the call and its
wait.

Each number is the median over 15 batches of the mean per-call time of a batch (p10 / p90
over the batches are in the JSON), averaged over the ranks batch by batch; the ranks agree
on the batch length before each case.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from .launcher import RankJob, reporting_to
from .machine import command_line, describe_environment, timestamp
from .report import write_json
from .stats import combine_ranks, summarize

__all__ = ["CALLS", "GRAPH_BACKENDS", "run_funcol"]

CALLS = ("eager", "async+wait", "op", "op_", "op_ torch-path", "funcol", "dtensor")
# Rows timed with spyreccl's lean functional path switched off.
TORCH_PATH_SUFFIX = " torch-path"
GRAPH_BACKENDS = (
    "aot_eager",
    "inductor",
    "inductor-cpp",
    "inductor-name",
    "inductor-name-stock",
    "inductor-cpp-name",
)
# Graph backends compiled with spyre's direct collective calls switched off.
STOCK_CALLS_SUFFIX = "-stock"
BATCHES = 15
OVERLAP_BYTES = 16 << 20


def _calibrated_batch(dist: Any, torch: Any, fn: Callable[[], object], budget_s: float) -> int:
    """Calls per batch so that BATCHES batches take about budget_s; the same on every rank
    (the slowest rank's estimate wins, agreed through a CPU tensor, i.e. gloo)."""
    # A fixed number of calls: the calls are collectives, every rank must make as many.
    calls = 10
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    per_call = (time.perf_counter() - start) / calls
    estimate = torch.tensor([max(1, int(budget_s / BATCHES / per_call))], dtype=torch.int64)
    dist.all_reduce(estimate, op=dist.ReduceOp.MIN)
    return int(estimate.item())


def _time_batches(dist: Any, torch: Any, fn: Callable[[], object], budget_s: float) -> list[int]:
    """BATCHES samples (ns): the mean per-call time of each batch."""
    batch = _calibrated_batch(dist, torch, fn, budget_s)
    for _ in range(min(batch, 20)):
        fn()
    dist.barrier()
    samples = []
    for _ in range(BATCHES):
        start = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - start) // batch)
    return samples


def _calls(env: Any, t: Any) -> dict[str, Callable[[], object]]:
    torch, dist = env["torch"], env["dist"]
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor, Partial, Replicate

    group = dist.group.WORLD
    name = group.group_name
    functional = torch.ops._c10d_functional
    mesh = env["mesh"]

    def funcol_api() -> object:
        out = funcol.all_reduce(t, "sum", group)
        return out.wait() if hasattr(out, "wait") else out

    def dtensor() -> object:
        partial = DTensor.from_local(t, mesh, [Partial()], run_check=False)
        return partial.redistribute(mesh, [Replicate()]).to_local()

    return {
        "eager": lambda: dist.all_reduce(t),
        "async+wait": lambda: dist.all_reduce(t, async_op=True).wait(),
        "op": lambda: functional.wait_tensor(functional.all_reduce(t, "sum", name)),
        "op_": lambda: functional.wait_tensor(functional.all_reduce_(t, "sum", name)),
        "op_ torch-path": lambda: functional.wait_tensor(functional.all_reduce_(t, "sum", name)),
        "funcol": funcol_api,
        "dtensor": dtensor,
    }


def _compiled_pair(env: Any, backend: str) -> tuple[Any, Any]:
    """(graph with the collective, the same graph without it), compiled afresh. A
    ``-name`` backend passes the group by name (as DTensor does): dynamo then guards on a
    string instead of the ProcessGroup object."""
    torch, dist = env["torch"], env["dist"]
    import torch.distributed._functional_collectives as funcol

    by_name = backend.removesuffix(STOCK_CALLS_SUFFIX).endswith("-name")
    group = dist.group.WORLD.group_name if by_name else dist.group.WORLD

    def with_collective(t: Any) -> Any:
        return funcol.all_reduce(t * 2, "sum", group) + 1

    def without(t: Any) -> Any:
        return t * 2 + 1

    compile_backend = "inductor" if backend.startswith("inductor") else backend
    return (
        torch.compile(with_collective, backend=compile_backend, fullgraph=True, dynamic=False),
        torch.compile(without, backend=compile_backend, fullgraph=True, dynamic=False),
    )


def _graph_samples(env: Any, backend: str, t: Any, budget_s: float) -> dict[str, Any]:
    torch, dist = env["torch"], env["dist"]
    cpp = backend.startswith("inductor-cpp")
    import torch._inductor.config as inductor_config
    from torch._dynamo import reset as reset_dynamo

    # Dynamo caches compiled code per code object, and its guards do not cover inductor's
    # config: without a reset, the C++-wrapper rows would reuse the Python-wrapper graphs.
    reset_dynamo()
    stock = backend.endswith(STOCK_CALLS_SUFFIX)
    try:
        # The compile caches tell the stock calls from the direct ones (spyre's cache
        # identity, spyreccl_torch.device._inductor.CodegenIdentity).
        with (
            inductor_config.patch(cpp_wrapper=cpp),
            _direct_collective_calls(not stock),
        ):
            coll, plain = _compiled_pair(env, backend)
            expected = (t * 2).cpu() * dist.get_world_size()
            got = coll(t)  # compiles (collectively: every rank compiles the same graph)
            plain(t)
        # The graphs must also compute the right thing: every rank holds the same t.
        torch.testing.assert_close(got.cpu(), expected + 1)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    # Every rank must agree on whether this backend works before timing collectives.
    failed = torch.tensor([1 if error else 0], dtype=torch.int64)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        return {"error": error or "failed on another rank"}
    return {
        "with": _time_batches(dist, torch, lambda: coll(t), budget_s),
        "without": _time_batches(dist, torch, lambda: plain(t), budget_s),
    }


@contextlib.contextmanager
def _direct_collective_calls(enabled: bool) -> Iterator[None]:
    """Whether spyre's inductor wrappers compiled meanwhile call the functional collectives
    through spyreccl_torch._C._direct_op (the default) or as the stock wrapper does."""
    from spyreccl_torch.device import _inductor

    saved = _inductor.DIRECT_COLLECTIVE_CALLS
    _inductor.DIRECT_COLLECTIVE_CALLS = enabled
    try:
        yield
    finally:
        _inductor.DIRECT_COLLECTIVE_CALLS = saved


def _tp_mlp_step(env: Any, device: Any, budget_s: float, compiled: bool) -> dict[str, Any]:
    """Forward+backward of a Megatron-style MLP block (colwise then rowwise linear) sharded
    over the world, and of the same block unsharded on this rank; with ``compiled``, also
    the sharded block through ``torch.compile`` (inductor: its collectives are functional
    ones in the compiled forward and backward graphs), checked against the eager block."""
    torch, dist = env["torch"], env["dist"]
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    hidden = 256

    def block() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(hidden, 4 * hidden),
            torch.nn.GELU(),
            torch.nn.Linear(4 * hidden, hidden),
        ).to(device)

    x = torch.randn(8, hidden, generator=torch.Generator().manual_seed(1)).to(device)
    tp = parallelize_module(block(), env["mesh"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    local = block()

    def step(model: Any) -> Callable[[], object]:
        def run() -> object:
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
            return None

        return run

    result = {
        "tp": _time_batches(dist, torch, step(tp), budget_s),
        "local": _time_batches(dist, torch, step(local), budget_s),
    }
    if compiled:
        from torch._dynamo import reset as reset_dynamo

        reset_dynamo()
        tp_compiled = parallelize_module(
            block(), env["mesh"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
        )
        forward = torch.compile(tp_compiled)

        def compiled_run() -> object:
            tp_compiled.zero_grad(set_to_none=True)
            forward(x).sum().backward()
            return None

        compiled_run()  # compiles the forward and backward graphs (every rank alike)
        # One eager call, used: an output never used would leave its collective unwaited
        # (DTensor's AsyncCollectiveTensor waits when it is read), which torch reports at exit.
        expected = tp(x)
        expected = expected.full_tensor() if hasattr(expected, "full_tensor") else expected
        got = forward(x)
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        result["tp_compiled"] = _time_batches(dist, torch, compiled_run, budget_s)
    return result


def _overlap(env: Any, device: Any, budget_s: float) -> dict[str, float]:
    """A large functional all_reduce_, computation that does not depend on it, then its
    wait: (collective alone, computation alone, both) per call, and how much of the shorter
    one was hidden."""
    torch, dist = env["torch"], env["dist"]
    functional = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name
    t = torch.ones(OVERLAP_BYTES // 4, device=device)
    a = torch.randn(192, 192, device=device)

    def collective() -> None:
        functional.wait_tensor(functional.all_reduce_(t, "sum", name))

    def compute() -> None:
        b = a
        for _ in range(4):
            b = torch.tanh(b @ a)

    def both() -> None:
        functional.all_reduce_(t, "sum", name)
        compute()
        functional.wait_tensor(t)

    times = {}
    for label, fn in (("collective", collective), ("compute", compute), ("both", both)):
        samples = _time_batches(dist, torch, fn, budget_s)
        times[label] = float(sorted(samples)[len(samples) // 2]) / 1e3
    hidden = times["collective"] + times["compute"] - times["both"]
    times["hidden_fraction"] = hidden / min(times["collective"], times["compute"])
    return times


def funcol_rank(args: dict) -> None:
    """One rank (started by launcher.RankJob)."""
    from .torch_env import init_levels

    conn = args["conn"]
    rank = args["rank"]
    with reporting_to(conn):
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning)
        envs = init_levels(
            ("spyreccl", "gloo"),
            rank=rank,
            world_size=args["nranks"],
            init_method=args["init_method"],
            timeout=datetime.timedelta(seconds=args["timeout_s"]),
        )
        torch, dist = envs["spyreccl"].torch, envs["spyreccl"].dist
        from torch._dynamo import config as dynamo_config
        from torch.distributed.device_mesh import DeviceMesh

        # Every (level, size, backend) compiles two fresh graphs.
        dynamo_config.cache_size_limit = 256
        conn.send(("ready", {"pid": os.getpid()}))
        per_level = {}
        for level, env in envs.items():
            per_level[level] = {
                "torch": torch,
                "dist": dist,
                "device": env.device,
                "mesh": DeviceMesh(env.device.type, list(range(args["nranks"]))),
            }
        budget = args["time_per_case"]
        results: dict[str, Any] = {}
        for index, nbytes in enumerate(args["sizes"]):
            # Which level goes first alternates, as in the sweep.
            for level in ("spyreccl", "gloo") if index % 2 == 0 else ("gloo", "spyreccl"):
                env = per_level[level]
                # Every rank holds the same values, so the graphs' results can be checked.
                t = torch.rand(max(1, nbytes // 4), generator=torch.Generator().manual_seed(3))
                t = t.to(env["device"])
                for call, fn in _calls(env, t.clone()).items():
                    lean = not call.endswith(TORCH_PATH_SUFFIX)
                    _set_lean(lean)
                    try:
                        results[f"{level}/{nbytes}/{call}"] = _time_batches(dist, torch, fn, budget)
                    finally:
                        _set_lean(True)
                for backend in args["graph_backends"]:
                    results[f"{level}/{nbytes}/graph/{backend}"] = _graph_samples(
                        env, backend, t, budget
                    )
                conn.send(("progress", f"{level} {nbytes} B"))
        for level, env in per_level.items():
            results[f"{level}/tp_mlp"] = _tp_mlp_step(
                env, env["device"], budget * 2, _compiles_tp(args["graph_backends"])
            )
            results[f"{level}/overlap"] = _overlap(env, env["device"], budget * 2)
        conn.send(("case", 0, results))
        dist.destroy_process_group()
        conn.send(("done",))


def _compiles_tp(graph_backends: list[str]) -> bool:
    """Whether the run times the compiled tensor-parallel step (with an inductor graph row:
    its compilation is what costs)."""
    return any(b.startswith("inductor") for b in graph_backends)


def _set_lean(enabled: bool) -> None:
    """Switches spyreccl's lean functional path (src/backend/functional_kernels.cpp)."""
    from spyreccl_torch import _C

    _C._set_lean_functional(enabled)


def _summary(samples: list[list[int]]) -> dict[str, float]:
    s = summarize(combine_ranks(samples))
    return {"median_us": s.median_us, "p10_us": s.p10_us, "p90_us": s.p90_us}


def _rows(per_rank: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    """Combines the ranks' samples into {level: {size: {row: summary}}} and extras."""
    table: dict[str, Any] = {}
    first = per_rank[0]
    for level in ("spyreccl", "gloo"):
        sizes: dict[str, Any] = {}
        for nbytes in args.sizes:
            rows: dict[str, Any] = {}
            for call in CALLS:
                rows[call] = _summary([r[f"{level}/{nbytes}/{call}"] for r in per_rank])
            for backend in args.graph_backends:
                key = f"{level}/{nbytes}/graph/{backend}"
                if "error" in first[key]:
                    rows[f"{backend}+"] = {"error": first[key]["error"]}
                    continue
                with_c = _summary([r[key]["with"] for r in per_rank])
                without = _summary([r[key]["without"] for r in per_rank])
                rows[f"{backend}+"] = {
                    "median_us": with_c["median_us"] - without["median_us"],
                    "graph_with_us": with_c,
                    "graph_without_us": without,
                }
            sizes[str(nbytes)] = rows
        table[level] = {
            "sizes": sizes,
            "tp_mlp_step": {
                kind: _summary([r[f"{level}/tp_mlp"][kind] for r in per_rank])
                for kind in ("tp", "local", "tp_compiled")
                if kind in first[f"{level}/tp_mlp"]
            },
            "overlap": {
                k: sum(r[f"{level}/overlap"][k] for r in per_rank) / len(per_rank)
                for k in first[f"{level}/overlap"]
            },
        }
    return table


def _format(table: dict[str, Any], args: argparse.Namespace) -> str:
    rows = [*CALLS, *(f"{b}+" for b in args.graph_backends)]
    lines = [
        "# functional collectives: median us per call (x = ratio to the eager call of the "
        "same level and size); <backend>+ = graph with the all_reduce minus the graph without"
    ]
    width = max(14, *(len(row) + 1 for row in rows))
    for level in ("spyreccl", "gloo"):
        sizes = table[level]["sizes"]
        head = f"{level:<{width}}" + "".join(f"{_size_label(int(n)):>19}" for n in sizes)
        lines += ["", head, "-" * len(head)]
        for row in rows:
            cells = []
            for rows_at in sizes.values():
                r = rows_at[row]
                if "error" in r:
                    cells.append(f"{'n/a':>19}")
                    continue
                ratio = r["median_us"] / rows_at["eager"]["median_us"]
                cells.append(f"{r['median_us']:10.1f} ({ratio:4.2f}x)")
            lines.append(f"{row:<{width}}" + "".join(cells))
        errors = {
            row: rows_at[row]["error"]
            for rows_at in sizes.values()
            for row in rows
            if "error" in rows_at[row]
        }
        for row, error in errors.items():
            lines.append(f"  {row} n/a: {error}")
    lines += ["", "# tensor-parallel MLP block, forward+backward step (ms, median)"]
    for level in ("spyreccl", "gloo"):
        step = table[level]["tp_mlp_step"]
        tp_ms, local_ms = step["tp"]["median_us"] / 1e3, step["local"]["median_us"] / 1e3
        line = (
            f"{level:<9} tp {tp_ms:8.3f}   local {local_ms:8.3f}   tp-local {tp_ms - local_ms:8.3f}"
        )
        if "tp_compiled" in step:
            line += f"   tp compiled {step['tp_compiled']['median_us'] / 1e3:8.3f}"
        lines.append(line)
    lines += [
        "",
        f"# overlap: functional all_reduce_ of {_size_label(OVERLAP_BYTES)}, independent "
        "compute, wait (us)",
    ]
    for level in ("spyreccl", "gloo"):
        o = table[level]["overlap"]
        lines.append(
            f"{level:<9} collective {o['collective']:9.1f}  compute {o['compute']:9.1f}  "
            f"both {o['both']:9.1f}  hidden {100 * o['hidden_fraction']:5.1f}% of the shorter"
        )
    return "\n".join(lines)


def _size_label(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def run_funcol(args: argparse.Namespace) -> int:
    if len(args.nproc) != 1:
        raise SystemExit("spyreccl-bench --mode funcol: give one --nproc")
    n = args.nproc[0]
    per_rank: list[Any] = [None] * n
    with tempfile.TemporaryDirectory(prefix="spyreccl-bench-funcol-") as workdir:
        job_args = {
            "nranks": n,
            "sizes": args.sizes,
            "graph_backends": args.graph_backends,
            "time_per_case": args.time_per_size,
            "timeout_s": args.timeout,
            "init_method": f"file://{os.path.join(workdir, 'store')}",
        }
        print(f"funcol: {n} ranks, sizes {args.sizes} ...", flush=True)
        with RankJob(f"funcol x{n}", n, job_args, target=funcol_rank) as job:
            for rank, msg in job.messages(stall_timeout_s=args.timeout):
                if msg[0] == "case":
                    per_rank[rank] = msg[2]
                elif msg[0] == "progress" and rank == 0:
                    print(f"  done: {msg[1]}", flush=True)
    table = _rows(per_rank, args)
    print(_format(table, args))
    path = args.json or os.path.join("bench-results", f"funcol-{timestamp()}.json")
    write_json(
        path,
        {
            "schema": "spyreccl-bench/1",
            "mode": "funcol",
            "command": command_line(args),
            "timestamp": timestamp(),
            "machine": describe_environment(),
            "config": {
                "nproc": n,
                "sizes": args.sizes,
                "graph_backends": args.graph_backends,
                "time_per_case": args.time_per_size,
            },
            "results": table,
        },
    )
    print(f"results: {path}")
    return 0
