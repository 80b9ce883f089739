"""One rank of the ``mpi`` level: Open MPI (mpi4py) and spyreccl_core, interleaved.

Started by ``mpirun`` (see ``mpi_level.py``), one process per rank, never imported as part of
``spyreccl_torch`` (that would import torch). Every rank creates a spyreccl_core communicator
over the same processes (rank 0's unique id travels through MPI) and then measures each case
twice, on ordinary numpy arrays: once with spyreccl_core (reported as level
``core-host-vs-mpi``) and once with Open MPI (level ``mpi``), alternating which goes first
from case to case, so that both see the same machine state. Timing is the shared loop of
``timing.py`` (per-call samples after warm-up, batches aligned by each level's own barrier).

Usage: ``python mpi_worker.py ARGS_JSON OUT_JSON``. ARGS_JSON holds ``cases`` (list of
plan.Case dicts), ``policy`` (timing.LoopPolicy fields), ``numpy_dtype``, ``check`` and
``timeout_s``, optionally ``variants`` (list of ``{"level": name, "env": {VAR: value}}``: one
spyreccl_core communicator per variant, created with those environment variables set, each
measured as its own level; default one, ``core-host-vs-mpi``); rank 0 writes OUT_JSON:
``{"info": {...}, "results": [{"level", "index", "samples": [per rank: ns list or None]}]}``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

LEVEL_CORE = "core-host-vs-mpi"
LEVEL_MPI = "mpi"


def mpi_step(MPI: Any, comm: Any, op: str, send: Any, recv: Any, rank: int) -> Any:
    """The Open MPI call of one case (None: this rank idles, as in the core level)."""
    if op == "barrier":
        return comm.Barrier
    if op == "all_reduce":
        return lambda: comm.Allreduce(send, recv, op=MPI.SUM)
    if op == "all_reduce_inplace":
        return lambda: comm.Allreduce(MPI.IN_PLACE, send, op=MPI.SUM)
    if op == "all_gather_into_tensor":
        return lambda: comm.Allgather(send, recv)
    if op == "reduce_scatter_tensor":
        return lambda: comm.Reduce_scatter_block(send, recv, op=MPI.SUM)
    if op == "broadcast":
        return lambda: comm.Bcast(send, root=0)
    if op == "all_to_all_single":
        return lambda: comm.Alltoall(send, recv)
    if op == "sendrecv":
        if rank == 0:

            def ping() -> None:
                comm.Send(send, dest=1)
                comm.Recv(recv, source=1)

            return ping
        if rank == 1:

            def pong() -> None:
                comm.Recv(recv, source=0)
                comm.Send(send, dest=0)

            return pong
        return None
    raise ValueError(f"mpi bench rank: unknown operation {op!r}")


def main(args_path: str, out_path: str) -> None:
    # Run as a script, so its own folder leads sys.path: core_worker imports as a top-level
    # module, and its loader brings the other siblings.
    import core_worker as worker
    import numpy as np
    from mpi4py import MPI

    import spyreccl_core as core

    timing = worker._load_sibling("timing")
    with open(args_path) as f:
        args = json.load(f)
    world = MPI.COMM_WORLD
    rank, nranks = world.Get_rank(), world.Get_size()
    variants = args.get("variants") or [{"level": LEVEL_CORE, "env": {}}]
    comms = []
    for v in variants:
        saved = {k: os.environ.get(k) for k in v["env"]}
        os.environ.update(v["env"])  # read by the core when the communicator is created
        uid = world.bcast(core.UniqueId().to_bytes() if rank == 0 else None, root=0)
        comms.append(
            core.Communicator(
                rank, nranks, core.UniqueId.from_bytes(uid), timeout=args["timeout_s"]
            )
        )
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old
    policy = timing.LoopPolicy(**args["policy"])
    np_dtype = args["numpy_dtype"]
    probe = np.zeros(1, dtype=np.float64)

    def sc_max(sc: Any, value: float) -> float:
        probe[0] = value
        sc.all_reduce(probe, op=core.ReduceOp.MAX)
        return float(probe[0])

    def mpi_max(value: float) -> float:
        return float(world.allreduce(value, op=MPI.MAX))

    def run_core(sc: Any, case: dict) -> Any:
        c = worker._Case(core, sc, case, None, np_dtype, rank, "host")
        return timing.measure_case(
            c.step, sc.barrier, lambda v: sc_max(sc, v), nbytes=case["nbytes"], policy=policy
        )

    def run_mpi(case: dict) -> Any:
        # Written once, like the core level's buffers (core_worker._Case): np.zeros maps the
        # shared zero page, which single-copy reads would copy from the cache, not memory.
        send = np.empty(case["send_elems"], dtype=np_dtype)
        recv = np.empty(case["recv_elems"], dtype=np_dtype)
        send.fill(0)
        recv.fill(0)
        step = mpi_step(MPI, world, case["op"], send, recv, rank)
        return timing.measure_case(
            step, world.Barrier, mpi_max, nbytes=case["nbytes"], policy=policy
        )

    results = []
    for case in args["cases"]:
        order = [(v["level"], lambda c, sc=sc: run_core(sc, c)) for v, sc in zip(variants, comms)]
        order.append((LEVEL_MPI, run_mpi))
        if case["index"] % 2:
            order.reverse()
        for level, run in order:
            samples = run(case)
            gathered = world.gather(samples, root=0)
            if rank == 0:
                results.append({"level": level, "index": case["index"], "samples": gathered})
    for sc in comms:
        sc.destroy()
    if rank == 0:
        lib = MPI.Get_library_version().strip().strip("\x00").splitlines()[0].strip("\x00")
        info = {"mpi_library": lib, "mpi4py": __import__("mpi4py").__version__}
        with open(out_path, "w") as f:
            json.dump({"info": info, "results": results}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
