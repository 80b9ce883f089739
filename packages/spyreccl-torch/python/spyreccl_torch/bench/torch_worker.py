"""One rank of the torch levels: ``spyreccl`` (spyre tensors) and ``gloo`` (CPU tensors).

Started by ``launcher.RankJob`` in a spawn process; reports through ``args["conn"]``.
Both levels run exactly the same Python loop through the public ``torch.distributed`` API, so
their difference is the backend (and the device's dispatch), not the harness.

``args["levels"]`` names one level or both. With both, one process group serves them and every
case is measured on each level in turn (the order alternating from case to case), so that the
spyreccl/gloo ratio of a case compares measurements taken seconds apart: on a shared machine
whose speed drifts over minutes, levels run one after the other would compare different
machines.
"""

from __future__ import annotations

import datetime
import os
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from . import check, timing
from .nodes import simulate_node
from .torch_env import init_levels, torch_dtype

__all__ = ["run_rank"]


class _Case:
    """Buffers and the one-operation closure (with device synchronisation) of a case."""

    def __init__(
        self,
        dist: Any,
        torch: Any,
        case: dict,
        dtype: Any,
        device: Any,
        rank: int,
        sync: Callable[[], None],
    ) -> None:
        self.op = op = case["op"]
        self.send = self.recv = None
        self.step: Callable[[], None] | None = None
        if op == "barrier":
            # Name the device: in a group that also has gloo (both levels in one process),
            # c10d runs a barrier without device_ids on the CPU, i.e. through gloo.
            device_ids = None if device.type == "cpu" else [device.index]

            def barrier() -> None:
                dist.barrier(device_ids=device_ids)
                sync()

            self.step = barrier
            return
        send = self.send = torch.zeros(case["send_elems"], dtype=dtype, device=device)
        recv = self.recv = torch.zeros(case["recv_elems"], dtype=dtype, device=device)
        # torch 2.13 deprecates the *_tensor spellings (a FutureWarning on every call, which
        # costs microseconds); the *_single functions are the same c10d operations.
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        if op in ("all_reduce", "all_reduce_inplace"):
            # In place, as torch's API is; zeros keep the values (and their speed) constant.
            def step() -> None:
                dist.all_reduce(send)
                sync()
        elif op == "all_gather_into_tensor":

            def step() -> None:
                all_gather(recv, send)
                sync()
        elif op == "reduce_scatter_tensor":

            def step() -> None:
                reduce_scatter(recv, send)
                sync()
        elif op == "broadcast":

            def step() -> None:
                dist.broadcast(send, 0)
                sync()
        elif op == "all_to_all_single":

            def step() -> None:
                dist.all_to_all_single(recv, send)
                sync()
        elif op == "sendrecv":
            if rank == 0:

                def step() -> None:
                    dist.send(send, 1)
                    dist.recv(recv, 1)
                    sync()
            elif rank == 1:

                def step() -> None:
                    dist.recv(recv, 0)
                    dist.send(send, 0)
                    sync()
            else:
                return
        else:
            raise ValueError(f"torch bench rank: unknown operation {op!r}")
        self.step = step


def _check(
    torch: Any, c: _Case, case: dict, level: str, rank: int, nranks: int, dtype: Any
) -> None:
    """Runs the case once on known inputs and raises if this rank's result is wrong."""
    if c.send is None or c.step is None:
        return
    inputs = check.input_blocks(c.op, rank, nranks)
    c.send.copy_(torch.tensor(inputs, dtype=dtype).repeat_interleave(c.send.numel() // len(inputs)))
    result = c.send if check.result_is_send(c.op, level) else c.recv
    if result is not c.send:
        result.fill_(check.POISON)
    c.step()
    expected = check.expected_blocks(c.op, rank, nranks)
    if expected is not None:
        got = result.cpu()
        want = torch.tensor(expected, dtype=dtype).repeat_interleave(got.numel() // len(expected))
        if not torch.equal(got, want):
            bad = (got != want).nonzero().flatten()
            i = int(bad[0])
            raise AssertionError(
                f"{level} {c.op} of {case['nbytes']} B at {nranks} ranks: rank {rank} has "
                f"{bad.numel()} wrong element(s) of {got.numel()}; first at index {i}: "
                f"{got[i].item()!r}, expected {want[i].item()!r}"
            )
    c.send.zero_()
    c.recv.zero_()


def _route_probe(dist, step):
    """`step`, wrapped to record which routes its first call took on a multi-node group
    (HierarchicalProcessGroup.route_counts; "sharded (<n> chunks)" when its sharded stages
    were cut into chunks: pipeline_counts; "leader (carried in the check)" when the leaders'
    stage travelled in the mismatch check's exchange, "carried in the check" for an operation
    without routes whose exchange between nodes did (a small broadcast or all_to_all_single):
    cross_counts, as seen from rank 0, a leader; nothing for other groups). Later calls go
    straight to `step`, so the timing loop is not slowed."""
    world = dist.group.WORLD
    counts = getattr(world, "route_counts", None)
    chunking = getattr(world, "pipeline_counts", {})
    cross = getattr(world, "cross_counts", {})
    routes: set[str] = set()
    if step is None or counts is None:
        return step, routes
    first = [True]

    def probed():
        if not first[0]:
            return step()
        first[0] = False
        before, chunks_before = dict(counts), chunking.get("chunks", 0)
        carried_before = cross.get("carried", 0)
        result = step()
        routes.update(k for k, v in counts.items() if v != before.get(k))
        chunks = chunking.get("chunks", 0) - chunks_before
        if chunks and "sharded" in routes:
            routes.discard("sharded")
            routes.add(f"sharded ({chunks} chunks)")
        if cross.get("carried", 0) != carried_before:
            if "leader" in routes:
                routes.discard("leader")
                routes.add("leader (carried in the check)")
            elif not routes:  # an operation without routes: a small broadcast, all_to_all
                routes.add("carried in the check")
        return result

    return probed, routes


def run_rank(args: dict) -> None:
    """Entry point of a torch-level rank process (see launcher.RankJob)."""
    conn = args["conn"]
    rank, nranks, levels = args["rank"], args["nranks"], list(args["levels"])
    try:
        warnings.filterwarnings("ignore", category=FutureWarning)
        simulate_node(rank, nranks, args.get("nodes", 1))
        envs = init_levels(
            levels,
            rank=rank,
            world_size=nranks,
            init_method=args["init_method"],
            timeout=datetime.timedelta(seconds=args["timeout_s"]),
        )
        first = envs[levels[0]]
        torch, dist = first.torch, first.dist
        dtype = torch_dtype(torch, args["dtype"])
        conn.send(
            (
                "ready",
                {
                    "pid": os.getpid(),
                    "torch": torch.__version__,
                    "device": ",".join(str(envs[lv].device) for lv in levels),
                    # HierarchicalProcessGroup when the ranks span (simulated) nodes
                    "group": type(dist.group.WORLD).__name__,
                },
            )
        )
        policy = timing.LoopPolicy(**args["policy"])
        probe = torch.zeros(1, dtype=torch.float64, device=first.device)

        def agree_max(value: float) -> float:
            probe.fill_(value)
            dist.all_reduce(probe, op=dist.ReduceOp.MAX)
            return float(probe.cpu()[0])

        for case in args["cases"]:
            order = levels if case["index"] % 2 == 0 else levels[::-1]
            for level in order:
                env = envs[level]
                c = _Case(dist, torch, case, dtype, env.device, rank, env.synchronize)
                if args["check"]:
                    _check(torch, c, case, level, rank, nranks, dtype)
                step, routes = _route_probe(dist, c.step)
                samples = timing.measure_case(
                    step, dist.barrier, agree_max, nbytes=case["nbytes"], policy=policy
                )
                conn.send(("case", case["index"], samples, level, sorted(routes)))
                del c
        dist.destroy_process_group()
        conn.send(("done",))
    except BaseException:
        # The parent prints the report; exiting quietly avoids a second copy on stderr.
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        conn.close()
