"""``--mode ddp``: DistributedDataParallel training-step time, spyre+spyreccl vs CPU+gloo.

In the style of PyTorch's benchmarks/distributed/ddp/benchmark.py: a fixed model and a fixed
random batch per rank, a few warm-up steps, then timed steps (zero_grad, forward, loss,
backward with DDP's bucketed gradient all-reduces, optimizer step, device synchronisation),
reported as median / p10 / p90 step time and samples per second.

To separate communication from computation, every rank also times the same steps on a
non-distributed copy of the model on the same device ("local"); both ranks do so at the
same time so the CPU contention matches. ``ddp - local`` approximates what gradient
synchronisation costs (not overlapped with the backward pass).
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
import warnings
from typing import Any

from .launcher import RankJob, reporting_to
from .machine import command_line, describe_environment, timestamp
from .report import write_json
from .stats import combine_ranks, summarize

__all__ = ["run_ddp"]


def _build_model(torch: Any, name: str) -> tuple[Any, tuple[int, ...], int]:
    """(model, input shape without batch, number of classes)."""
    nn = torch.nn
    if name == "mlp":
        width, depth = 1024, 4
        layers: list[Any] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers), (width,), 10

    class Block(nn.Module):
        """Basic residual block (two 3x3 convolutions), as in ResNet-18."""

        def __init__(self, channels: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(channels)
            self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(channels)

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(x + self.bn2(self.conv2(y)))

    # Small on purpose: the host-emulated device computes on the same few CPU cores.
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        Block(16),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        Block(32),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    return model, (3, 16, 16), 10


def _time_steps(
    torch: Any, model: Any, x: Any, y: Any, sync: Any, warmup: int, steps: int
) -> list[int]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    samples = []
    for i in range(warmup + steps):
        t0 = time.perf_counter_ns()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        sync()
        if i >= warmup:
            samples.append(time.perf_counter_ns() - t0)
    return samples


def ddp_rank(args: dict) -> None:
    """One rank of a DDP job (started by launcher.RankJob)."""
    from .torch_env import init_level

    conn = args["conn"]
    rank = args["rank"]
    with reporting_to(conn):
        warnings.filterwarnings("ignore", category=FutureWarning)
        env = init_level(
            args["level"],
            rank=rank,
            world_size=args["nranks"],
            init_method=args["init_method"],
            timeout=datetime.timedelta(seconds=args["timeout_s"]),
        )
        torch, dist = env.torch, env.dist
        conn.send(("ready", {"pid": os.getpid(), "device": str(env.device)}))
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)  # same initial weights everywhere (DDP broadcasts them anyway)
        model, shape, classes = _build_model(torch, args["model"])
        torch.manual_seed(1000 + rank)  # a different batch per rank, as in data parallelism
        x = torch.randn(args["batch_size"], *shape).to(env.device)
        y = torch.randint(0, classes, (args["batch_size"],)).to(env.device)
        nparams = sum(p.numel() for p in model.parameters())

        local = _build_model(torch, args["model"])[0].to(env.device)
        dist.barrier()
        local_samples = _time_steps(
            torch, local, x, y, env.synchronize, args["warmup_steps"], args["steps"]
        )
        del local
        ddp = DistributedDataParallel(model.to(env.device))
        dist.barrier()
        ddp_samples = _time_steps(
            torch, ddp, x, y, env.synchronize, args["warmup_steps"], args["steps"]
        )
        conn.send(("case", 0, {"ddp": ddp_samples, "local": local_samples, "params": nparams}))
        dist.destroy_process_group()
        conn.send(("done",))


def run_ddp(args: argparse.Namespace) -> int:
    levels = [lv for lv in args.levels if lv in ("spyreccl", "gloo")]
    if not levels:
        raise SystemExit("spyreccl-bench --mode ddp: --levels must include spyreccl and/or gloo")
    rows = []
    for n in args.nproc:
        for level in levels:
            per_rank: list[Any] = [None] * n
            with tempfile.TemporaryDirectory(prefix="spyreccl-bench-ddp-") as workdir:
                job_args = {
                    "level": level,
                    "nranks": n,
                    "model": args.model,
                    "batch_size": args.batch_size,
                    "steps": args.steps,
                    "warmup_steps": args.warmup_steps,
                    "timeout_s": args.timeout,
                    "init_method": f"file://{os.path.join(workdir, 'store')}",
                }
                print(f"ddp: {args.model}, {level}, {n} ranks ...", flush=True)
                with RankJob(f"ddp {level} x{n}", n, job_args, target=ddp_rank) as job:
                    for rank, msg in job.messages(stall_timeout_s=args.timeout):
                        if msg[0] == "case":
                            per_rank[rank] = msg[2]
            ddp = summarize(combine_ranks([r["ddp"] for r in per_rank]))
            local = summarize(combine_ranks([r["local"] for r in per_rank]))
            rows.append(
                {
                    "level": level,
                    "nranks": n,
                    "model": args.model,
                    "params": per_rank[0]["params"],
                    "batch_size": args.batch_size,
                    "ddp_step_ms": _in_ms(ddp),
                    "local_step_ms": _in_ms(local),
                    "samples_per_s": args.batch_size * n / (ddp.median_us * 1e-6),
                    "comm_overhead_ms": (ddp.median_us - local.median_us) / 1e3,
                }
            )
    print(_format(rows))
    path = args.json or os.path.join("bench-results", f"ddp-{timestamp()}.json")
    write_json(
        path,
        {
            "schema": "spyreccl-bench/1",
            "mode": "ddp",
            "command": command_line(args),
            "timestamp": timestamp(),
            "machine": describe_environment(),
            "config": {
                "nproc": args.nproc,
                "model": args.model,
                "batch_size": args.batch_size,
                "steps": args.steps,
                "warmup_steps": args.warmup_steps,
            },
            "results": rows,
        },
    )
    print(f"results: {path}")
    return 0


def _in_ms(summary: Any) -> dict[str, float]:
    return {
        "steps": summary.iters,
        "median": summary.median_us / 1e3,
        "p10": summary.p10_us / 1e3,
        "p90": summary.p90_us / 1e3,
        "min": summary.min_us / 1e3,
        "max": summary.max_us / 1e3,
    }


def _format(rows: list[dict]) -> str:
    head = (
        f"{'model':<8} {'level':<9} {'n':>2} {'params':>9} | {'step median':>11} "
        f"{'p10':>8} {'p90':>8} (ms) | {'local':>8} {'ddp-local':>9} (ms) | "
        f"{'samples/s':>9}"
    )
    lines = ["# DDP step time (median over steps of the mean over ranks)", head, "-" * len(head)]
    for r in rows:
        d, lo = r["ddp_step_ms"], r["local_step_ms"]
        lines.append(
            f"{r['model']:<8} {r['level']:<9} {r['nranks']:>2} {r['params']:>9} | "
            f"{d['median']:11.2f} {d['p10']:8.2f} {d['p90']:8.2f}      | "
            f"{lo['median']:8.2f} {r['comm_overhead_ms']:9.2f}      | "
            f"{r['samples_per_s']:9.1f}"
        )
    return "\n".join(lines)
