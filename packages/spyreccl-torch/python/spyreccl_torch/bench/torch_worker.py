"""One rank of the torch levels: ``spyreccl`` (spyre tensors) and ``gloo`` (CPU tensors).

Started by ``launcher.RankJob`` in a spawn process; reports through ``args["conn"]``.
Both levels run exactly the same Python loop through the public ``torch.distributed`` API, so
their difference is the backend (and the device's dispatch), not the harness.
"""

from __future__ import annotations

import datetime
import os
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from . import timing
from .torch_env import LEVELS, init_level, torch_dtype

__all__ = ["run_rank"]


def _make_step(dist: Any, torch: Any, case: dict, dtype: Any, device: Any, rank: int,
               sync: Callable[[], None]) -> Callable[[], None] | None:
    """A closure performing one operation of ``case`` then synchronising the device."""
    op = case["op"]
    if op == "barrier":
        def barrier() -> None:
            dist.barrier()
            sync()
        return barrier

    def buffer(elems: int) -> Any:
        return torch.zeros(elems, dtype=dtype, device=device)

    send = buffer(case["send_elems"])
    recv = buffer(case["recv_elems"])
    # torch 2.13 deprecates the *_tensor spellings (a FutureWarning on every call, which
    # costs microseconds); the *_single functions are the same c10d operations.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    if op == "all_reduce":
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
            return None
    else:
        raise ValueError(f"torch bench rank: unknown operation {op!r}")
    return step


def run_rank(args: dict) -> None:
    """Entry point of a torch-level rank process (see launcher.RankJob)."""
    conn = args["conn"]
    rank, nranks, level = args["rank"], args["nranks"], args["level"]
    try:
        if level not in LEVELS:
            raise ValueError(f"torch bench rank: unknown level {level!r}; expected {LEVELS}")
        warnings.filterwarnings("ignore", category=FutureWarning)
        env = init_level(
            level,
            rank=rank,
            world_size=nranks,
            init_method=args["init_method"],
            timeout=datetime.timedelta(seconds=args["timeout_s"]),
        )
        torch, dist = env.torch, env.dist
        dtype = torch_dtype(torch, args["dtype"])
        conn.send(("ready", {"pid": os.getpid(), "torch": torch.__version__,
                             "device": str(env.device)}))
        policy = timing.LoopPolicy(**args["policy"])
        probe = torch.zeros(1, dtype=torch.float64, device=env.device)

        def agree_max(value: float) -> float:
            probe.fill_(value)
            dist.all_reduce(probe, op=dist.ReduceOp.MAX)
            return float(probe.cpu()[0])

        for case in args["cases"]:
            step = _make_step(dist, torch, case, dtype, env.device, rank, env.synchronize)
            idle = step is None
            samples = timing.measure(
                (lambda: None) if idle else step,
                dist.barrier,
                agree_max,
                warmup=timing.warmup_iters(case["nbytes"]),
                policy=policy,
            )
            conn.send(("case", case["index"], None if idle else samples))
            del step
        dist.destroy_process_group()
        conn.send(("done",))
    except BaseException:
        # The parent prints the report; exiting quietly avoids a second copy on stderr.
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        conn.close()
