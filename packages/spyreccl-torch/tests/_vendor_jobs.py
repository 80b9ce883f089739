"""One rank of a job of tests/test_vendor_coexistence.py, run as a script:

    python _vendor_jobs.py JOB OUT_FILE
    (environment: RANK, WORLD_SIZE, JOB_STORE, JOB_SEED, JOB_INIT, JOB_SUB)

A fresh interpreter per rank, because what is tested happens at its ``import torch``: torch
calls the ``torch.backends`` entry points in the order ``sys.path`` (PYTHONPATH) gives. The
rank records what the registry looks like afterwards, runs the job's collectives on fresh
seeded inputs and saves inputs, outputs and which backend ran each call to OUT_FILE
(``torch.save``); the test computes the float64 references and checks everything.
"""

from __future__ import annotations

import collections
import os
import sys
import zlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

import torch  # autoload: the order under test happens here
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch_spyre

import spyreccl_torch
from spyreccl_testing.inputs import poison_, random_tensor
from spyreccl_testing.seeds import rank_seed

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
SEED = int(os.environ["JOB_SEED"])
N = 1001  # odd
SPYRE = torch.device("spyre")


def _inp(name: str, rank: int = RANK, n: int = N, dtype: torch.dtype = torch.float32):
    seed = rank_seed((SEED + zlib.crc32(name.encode())) % (1 << 62), rank)
    return random_tensor(n, dtype, "spyre", seed, nranks=WORLD)


def _poisoned(n: int = N, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return poison_(torch.empty(n, dtype=dtype, device="spyre"))


def _creator(name: str) -> str | None:
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is None:
        return None
    fn = plugin.creator_fn
    return f"{fn.__module__}.{fn.__qualname__}"


def _kind(pg: Any) -> str:
    """Which backend a group runs on: the vendor's, ours, or our router over both."""
    if isinstance(pg, torch_spyre.StandinSpyreCCL):
        return "vendor"
    if isinstance(pg, spyreccl_torch.routing.RoutingProcessGroup):
        return "routing"
    if isinstance(pg._get_backend(SPYRE), spyreccl_torch.ProcessGroupSpyreccl):
        return "spyreccl"
    return type(pg._get_backend(SPYRE)).__name__


def registry() -> dict[str, Any]:
    return {
        "entry_points": [ep.name for ep in entry_points(group="torch.backends")],
        "vendor_saw_spyreccl_torch": torch_spyre.AUTOLOAD_SAW["spyreccl_torch_loaded"],
        "creators": {name: _creator(name) for name in ("spyreccl", "spyreccl_shm")},
        "default_spyre": dist.Backend.default_device_backend_map.get("spyre"),
        "backend_name": spyreccl_torch.backend_name(),
        "emulated_device": spyreccl_torch.device.is_registered(),
        "privateuse1": torch._C._get_privateuse1_backend_name(),
    }


def _init(backend: str | None) -> None:
    dist.init_process_group(
        backend=backend or None,
        init_method="file://" + os.environ["JOB_STORE"],
        rank=RANK,
        world_size=WORLD,
    )


def job_names() -> dict[str, Any]:
    """The default group through JOB_INIT, a sub-group through JOB_SUB: which backend each
    got, and an all_reduce (SUM) and a reduce_scatter on each."""
    _init(os.environ.get("JOB_INIT"))
    sub = dist.new_group(backend=os.environ["JOB_SUB"])
    out: dict[str, Any] = {}
    for label, group in (("init", dist.group.WORLD), ("sub", sub)):
        x = _inp(f"{label}/all_reduce")
        x_in = x.cpu()
        dist.all_reduce(x, group=group)
        out[label] = {"kind": _kind(group), "inputs": x_in, "output": x.cpu()}
        if out[label]["kind"] == "spyreccl":  # the vendor's backend has no reduce_scatter
            big = _inp(f"{label}/reduce_scatter", n=WORLD * 7)
            big_in = big.cpu()
            small = _poisoned(7)
            dist.reduce_scatter_tensor(small, big, group=group)
            out[label]["reduce_scatter"] = {"inputs": big_in, "output": small.cpu()}
    dist.barrier()
    dist.destroy_process_group()
    return out


def _routing_ops(pg: Any) -> dict[str, Callable[[], dict[str, Any]]]:
    """name -> a function running one operation; each returns what the test checks."""
    W, r = WORLD, RANK

    def all_reduce(op: Any, dtype: torch.dtype = torch.float32, n: int = N):
        def run() -> dict[str, Any]:
            x = _inp(f"all_reduce/{op}/{dtype}/{n}", n=n, dtype=dtype)
            x_in = x.cpu()
            dist.all_reduce(x, op=op)
            return {"inputs": x_in, "output": x.cpu()}

        return run

    def broadcast() -> dict[str, Any]:
        src = W - 1
        x = _inp("broadcast") if r == src else _poisoned()
        x_in = x.cpu()
        dist.broadcast(x, src=src)
        return {"inputs": x_in, "output": x.cpu(), "src": src}

    def all_gather() -> dict[str, Any]:
        x = _inp("all_gather")
        outs = [_poisoned() for _ in range(W)]
        dist.all_gather(outs, x)
        return {"inputs": x.cpu(), "output": torch.stack([o.cpu() for o in outs])}

    def gather() -> dict[str, Any]:
        x = _inp("gather")
        outs = [_poisoned() for _ in range(W)] if r == 0 else None
        dist.gather(x, outs, dst=0)
        result = torch.stack([o.cpu() for o in outs]) if outs else None
        return {"inputs": x.cpu(), "output": result}

    def reduce(op: Any, dst: int):
        def run() -> dict[str, Any]:
            x = _inp(f"reduce/{op}")
            x_in = x.cpu()
            dist.reduce(x, dst=dst, op=op)
            return {"inputs": x_in, "output": x.cpu(), "dst": dst}

        return run

    def send_recv() -> dict[str, Any]:
        # 0 -> 1, then 1 -> 0 (the others take no part).
        x = _inp("send_recv")
        got = _poisoned()
        if r == 0:
            dist.send(x, dst=1)
            dist.recv(got, src=1)
        elif r == 1:
            dist.recv(got, src=0)
            dist.send(x, dst=0)
        return {"inputs": x.cpu(), "output": got.cpu()}

    def barrier() -> dict[str, Any]:
        dist.barrier()
        return {}

    def scatter() -> dict[str, Any]:
        chunks = [_inp("scatter", rank=i) for i in range(W)] if r == 0 else None
        out = _poisoned()
        dist.scatter(out, chunks, src=0)
        sent = torch.stack([c.cpu() for c in chunks]) if chunks else None
        return {"inputs": sent, "output": out.cpu()}

    def reduce_scatter() -> dict[str, Any]:
        x = _inp("reduce_scatter", n=W * 333)
        out = _poisoned(333)
        dist.reduce_scatter_tensor(out, x)
        return {"inputs": x.cpu(), "output": out.cpu()}

    def all_gather_into_tensor() -> dict[str, Any]:
        x = _inp("all_gather_into_tensor")
        out = _poisoned(W * N)
        dist.all_gather_into_tensor(out, x)
        return {"inputs": x.cpu(), "output": out.cpu()}

    def all_to_all_single() -> dict[str, Any]:
        x = _inp("all_to_all_single", n=W * 5)
        out = _poisoned(W * 5)
        dist.all_to_all_single(out, x)
        return {"inputs": x.cpu(), "output": out.cpu()}

    def async_max_then_sum() -> dict[str, Any]:
        # MAX on ours, asynchronous and not waited for, then SUM on the vendor's over the
        # same tensor: the router must finish the first before the second starts.
        x = _inp("async")
        x_in = x.cpu()
        work = dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)
        dist.all_reduce(x)
        work.wait()
        return {"inputs": x_in, "output": x.cpu()}

    def funcol_all_reduce() -> dict[str, Any]:
        x = _inp("funcol_all_reduce")
        y = funcol.all_reduce(x, "sum", pg)
        return {"inputs": x.cpu(), "output": funcol.wait_tensor(y).cpu()}

    def funcol_reduce_scatter() -> dict[str, Any]:
        x = _inp("funcol_reduce_scatter", n=W * 11)
        y = funcol.reduce_scatter_tensor(x, "sum", 0, pg)
        return {"inputs": x.cpu(), "output": funcol.wait_tensor(y).cpu()}

    def cpu_all_reduce() -> dict[str, Any]:
        # "cpu:gloo,spyre:spyreccl_shm": torch hands CPU tensors to the routing group too.
        x = _inp("cpu_all_reduce").cpu()
        x_in = x.clone()
        dist.all_reduce(x)
        return {"inputs": x_in, "output": x}

    def funcol_all_gather() -> dict[str, Any]:
        x = _inp("funcol_all_gather", n=13)
        y = funcol.all_gather_tensor(x, 0, pg)
        return {"inputs": x.cpu(), "output": funcol.wait_tensor(y).cpu()}

    sum_, max_ = dist.ReduceOp.SUM, dist.ReduceOp.MAX
    return {
        "all_reduce_sum": all_reduce(sum_),
        "all_reduce_sum_int64": all_reduce(sum_, torch.int64),
        "all_reduce_sum_bfloat16": all_reduce(sum_, torch.bfloat16),
        "all_reduce_sum_empty": all_reduce(sum_, n=0),
        "all_reduce_max": all_reduce(max_),
        "all_reduce_avg": all_reduce(dist.ReduceOp.AVG),
        "all_reduce_product_int64": all_reduce(dist.ReduceOp.PRODUCT, torch.int64),
        "broadcast": broadcast,
        "all_gather": all_gather,
        "gather": gather,
        "reduce_sum": reduce(sum_, 0),
        "reduce_max": reduce(max_, W - 1),
        "send_recv": send_recv,
        "barrier": barrier,
        "scatter": scatter,
        "reduce_scatter": reduce_scatter,
        "all_gather_into_tensor": all_gather_into_tensor,
        "all_to_all_single": all_to_all_single,
        "async_max_then_sum": async_max_then_sum,
        "funcol_all_reduce": funcol_all_reduce,
        "funcol_reduce_scatter": funcol_reduce_scatter,
        "funcol_all_gather": funcol_all_gather,
        "cpu_all_reduce": cpu_all_reduce,
    }


def job_routing() -> dict[str, Any]:
    """Every operation through a routing group; per operation, what each backend ran."""
    _init(os.environ.get("JOB_INIT"))
    pg = dist.group.WORLD
    out: dict[str, Any] = {"kind": _kind(pg)}
    for name, run in _routing_ops(pg).items():
        calls_before = len(torch_spyre.CALLS)
        routes_before = collections.Counter(pg.route_counts)
        result = run()
        result["vendor_calls"] = [op for op, _ in torch_spyre.CALLS[calls_before:]]
        result["routes"] = dict(pg.route_counts - routes_before)
        out[name] = result
    # A sub-group of the same backend: built through the creator again, routing too.
    sub = dist.new_group(backend="spyreccl_shm")
    x = _inp("sub")
    x_in = x.cpu()
    calls_before = len(torch_spyre.CALLS)
    dist.all_reduce(x, group=sub)
    out["sub"] = {
        "kind": _kind(sub),
        "inputs": x_in,
        "output": x.cpu(),
        "vendor_calls": [op for op, _ in torch_spyre.CALLS[calls_before:]],
        "routes": dict(sub.route_counts),
    }
    dist.destroy_process_group()
    return out


def main() -> None:
    job, out_file = sys.argv[1], sys.argv[2]
    result = {"registry": registry(), "job": {"names": job_names, "routing": job_routing}[job]()}
    torch.save(result, out_file)


if __name__ == "__main__":
    main()
