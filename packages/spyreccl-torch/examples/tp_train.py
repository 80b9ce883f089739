"""Tensor-parallel training of a transformer block on the spyre device, over spyreccl.

    torchrun --standalone --nproc-per-node 2 packages/spyreccl-torch/examples/tp_train.py

No backend is named anywhere: ``import torch`` autoloads spyreccl-torch, which registers the
"spyre" device and makes spyreccl its default backend, so ``dist.init_process_group()`` routes
spyre tensors to spyreccl. The script

1. trains one pre-norm transformer block (attention + MLP) with Megatron-style tensor
   parallelism (``ColwiseParallel`` for q/k/v and the MLP's up projection, ``RowwiseParallel``
   for the output projections) on a 1-D ``DeviceMesh("spyre")`` for a few SGD steps;
2. has rank 0 train the same block, from the same initial weights and batches, alone and in
   float64, and fails (exit status 1) when the loss curve or the final weights differ by more
   than the tolerance;
3. times all_reduce / all_gather / reduce_scatter at a few sizes on spyreccl (spyre tensors)
   and on gloo (CPU tensors, a second process group from ``dist.new_group(backend="gloo")``)
   in the same run, and prints median microseconds and the ratio.

Everything is seeded: two runs print the same losses.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

# ----------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head self-attention written so that it runs unchanged on a TP shard: the number
    of heads is read from the (possibly sharded) projection output, never from a constant."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        attn = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.o((attn @ v).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


TP_PLAN = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.o": RowwiseParallel(),
    "mlp.up": ColwiseParallel(),
    "mlp.down": RowwiseParallel(),
}


# ----------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------


def make_batches(args: argparse.Namespace, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """The same batches on every rank (tensor parallelism replicates the activations)."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.batch, args.seq, args.dim)
    return [
        (torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device))
        for _ in range(args.steps)
    ]


def train(model: nn.Module, batches, lr: float, progress: Progress | None) -> list[float]:
    # foreach=False: the TP model mixes DTensor (sharded projections) and plain parameters
    # (layer norms), and torch's multi-tensor kernels refuse such mixed lists; on "spyre"
    # SGD would otherwise pick them by default.
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, foreach=False)
    losses = []
    for step, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        dtype = next(model.parameters()).dtype
        loss = F.mse_loss(model(x.to(dtype)), y.to(dtype))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress.update(step + 1, losses[-1], time.perf_counter() - t0)
    return losses


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full CPU float64 tensor (DTensor shards are gathered, which is a
    collective: every rank must call this)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().to("cpu", torch.float64)
    return out


class Progress:
    """One line per step: a bar, the loss and the step time (rank 0 only)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label

    def update(self, step: int, loss: float, seconds: float) -> None:
        width = 24
        done = round(width * step / self.total)
        bar = "#" * done + "." * (width - done)
        print(
            f"  {self.label} [{bar}] step {step:>2}/{self.total}  loss {loss:.6f}  "
            f"{seconds * 1e3:7.1f} ms",
            flush=True,
        )


# ----------------------------------------------------------------------------------------
# collective timings
# ----------------------------------------------------------------------------------------


def _median_us(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _collective_call(op: str, form: str, dev: torch.device, numel: int, group):
    """One blocking collective of `op` on `dev`: `form` "eager" is the torch.distributed call,
    "functional" the _c10d_functional op + wait_tensor that DTensor, FSDP2 and compiled
    graphs issue (the in-place / out= forms inductor emits)."""
    ws = dist.get_world_size()
    per_rank = numel // ws  # reduce_scatter output / all_gather input
    full = torch.randn(numel, device=dev)
    part = torch.randn(per_rank, device=dev)
    gathered = torch.empty(per_rank * ws, device=dev)
    functional = torch.ops._c10d_functional
    name = (group or dist.group.WORLD).group_name
    if form == "eager":
        if op == "all_reduce":
            return lambda: dist.all_reduce(full, group=group)
        if op == "all_gather":
            return lambda: dist.all_gather_single(gathered, part, group=group)
        return lambda: dist.reduce_scatter_single(part, gathered, group=group)
    if op == "all_reduce":
        return lambda: functional.wait_tensor(functional.all_reduce_(full, "sum", name))
    if op == "all_gather":
        return lambda: functional.wait_tensor(
            functional.all_gather_into_tensor_out(part, ws, name, out=gathered)
        )
    return lambda: functional.wait_tensor(
        functional.reduce_scatter_tensor_out(gathered, "sum", ws, name, out=part)
    )


def time_collectives(
    sizes: list[int], gloo, warmup: int, iters: int, device: torch.device
) -> list[tuple[str, int, dict[str, float]]]:
    """Median latency of each blocking collective, eager and functional, spyreccl (spyre
    tensors, default group) against gloo (CPU tensors, `gloo` group), same sizes in the same
    run. A size is the float32 element count of the full buffer (all_reduce buffer, all_gather
    output, reduce_scatter input). Ranks line up on a gloo barrier before every measurement."""
    rows = []
    for numel in sizes:
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            medians = {}
            for who, dev, group in (("ours", device, None), ("gloo", torch.device("cpu"), gloo)):
                for form in ("eager", "functional"):
                    fn = _collective_call(op, form, dev, numel, group)
                    dist.barrier(group=gloo)
                    medians[f"{who} {form}"] = _median_us(fn, warmup, iters)
            rows.append((op, numel * 4, medians))
    return rows


def print_table(rows: list[tuple[str, int, dict[str, float]]], ws: int, ours: str) -> None:
    print(
        f"\ncollective timings, {ws} ranks, float32, median µs of the iterations (rank 0's clock);"
        "\nsize = the all_reduce buffer = the all_gather output = the reduce_scatter input;"
        "\neager = torch.distributed call, functional = _c10d_functional op + wait_tensor"
        " (DTensor, FSDP2, compiled graphs)"
    )
    header = (
        f"{'op':<15}{'size':>9}{ours + ' eager':>16}{'functional':>12}"
        f"{'gloo eager':>12}{'functional':>12}{'gloo/' + ours:>15}{'(functional)':>14}"
    )
    print(header)
    print("-" * len(header))
    for op, nbytes, m in rows:
        size = f"{nbytes // 1024} KiB" if nbytes < 1024 * 1024 else f"{nbytes // (1024 * 1024)} MiB"
        print(
            f"{op:<15}{size:>9}{m['ours eager']:>16.1f}{m['ours functional']:>12.1f}"
            f"{m['gloo eager']:>12.1f}{m['gloo functional']:>12.1f}"
            f"{m['gloo eager'] / m['ours eager']:>14.2f}x"
            f"{m['gloo functional'] / m['ours functional']:>13.2f}x"
        )


# ----------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device",
        default="spyre",
        help="device type to train on (cpu runs the same script over gloo)",
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--tol",
        type=float,
        default=1e-4,
        help="max abs difference allowed between TP (float32) and the float64 reference",
    )
    p.add_argument(
        "--sizes",
        type=str,
        default="1024,65536,1048576",
        help="comma-separated float32 element counts for the timing table",
    )
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-bench", action="store_true", help="skip the timing table")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    dist.init_process_group()  # no backend: spyre tensors go to spyreccl by default
    rank, ws = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.heads % ws or args.hidden % ws:
        raise SystemExit(
            f"--heads ({args.heads}) and --hidden ({args.hidden}) must be "
            f"divisible by the world size ({ws})"
        )
    if args.device == "cpu":
        device = torch.device("cpu")
    else:
        # One spyre device per local rank (the emulated device has several).
        torch.accelerator.set_device_index(local_rank % torch.accelerator.device_count())
        device = torch.device(args.device, torch.accelerator.current_device_index())
    backend = dist.get_default_backend_for_device(args.device)
    gloo = dist.new_group(backend="gloo")  # CPU group, used for the timing comparison
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"tp_train: {ws} ranks, device {device.type}, backend {backend} "
        f"(default group: {dist.get_backend_config()})"
    )

    # Same initial weights everywhere; parallelize_module shards them over the mesh.
    torch.manual_seed(args.seed)
    base = Block(args.dim, args.heads, args.hidden)
    reference = copy.deepcopy(base) if rank == 0 else None
    mesh = init_device_mesh(args.device, (ws,), mesh_dim_names=("tp",))
    tp_model = parallelize_module(base.to(device), mesh, TP_PLAN)
    batches = make_batches(args, device)

    say(f"tensor-parallel training ({ws}-way, float32):")
    t0 = time.perf_counter()
    tp_losses = train(
        tp_model, batches, args.lr, Progress(args.steps, "tp ") if rank == 0 else None
    )
    tp_state = full_state(tp_model)
    tp_seconds = time.perf_counter() - t0

    failed = False
    if rank == 0:
        say("single-process reference (rank 0, float64):")
        reference = reference.to(device, torch.float64)
        ref_losses = train(reference, batches, args.lr, Progress(args.steps, "ref"))
        ref_state = full_state(reference)
        loss_diff = max(abs(a - b) for a, b in zip(tp_losses, ref_losses))
        param_diff = max((tp_state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        failed = not (loss_diff <= args.tol and param_diff <= args.tol)
        say(
            f"max abs diff vs reference: loss {loss_diff:.3e}, parameters {param_diff:.3e} "
            f"(tolerance {args.tol:g}) -> {'FAIL' if failed else 'OK'}"
        )
        say(f"tp training took {tp_seconds:.2f} s")
    # Every rank learns the verdict, so every rank exits with the same status.
    verdict = torch.tensor([1.0 if failed else 0.0], device=device)
    dist.broadcast(verdict, src=0)
    failed = bool(verdict.item())

    if not args.no_bench:
        sizes = [int(s) for s in args.sizes.split(",")]
        rows = time_collectives(sizes, gloo, args.warmup, args.iters, device)
        if rank == 0:
            print_table(rows, ws, backend)

    # Line up before tearing down (over gloo: a plain barrier() on the default group would
    # have to guess its device).
    dist.barrier(group=gloo)
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()
    if failed:
        say("tp_train: FAILED (tensor-parallel result differs from the reference)", file=sys.stderr)
        return 1
    say("tp_train: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
