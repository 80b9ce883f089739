"""Tensor-parallel serving and training of a small Llama-style decoder on the spyre device,
over spyreccl.

    torchrun --standalone --nproc-per-node 2 packages/spyreccl-torch/examples/tp_llama.py

No backend is named for the model: ``import torch`` autoloads spyreccl-torch, which registers
the "spyre" device and makes spyreccl its default backend, so ``dist.init_process_group()``
routes spyre tensors to spyreccl (a second group, ``dist.new_group(backend="gloo")``, runs
the same model on CPU tensors for comparison). The model (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU; :mod:`spyreccl_torch.models.llama`) is made from a seed:
nothing is downloaded. The script

1. *serves*: shards the model Megatron-style with DTensor's ``parallelize_module``
   (``ColwiseParallel`` q/k/v/w1/w3, ``RowwiseParallel`` wo/w2: two all_reduces per layer
   and token), prefills a batch of prompts of different lengths and decodes greedily with a
   KV cache, eager and ``torch.compile``d, and checks that the tokens equal a
   single-process reference's, token for token; then times it: time to first token and
   per-token latency (median, p90) over spyreccl, over gloo, and the *compute floor* (the
   same per-rank shards with the collectives skipped), and the share of a token spent in
   collectives next to the same all_reduces timed alone; eager, also the same shards with the
   same all_reduces issued by hooks, without DTensor, which tells DTensor's eager dispatch
   apart from communication;
2. *trains* the same model family tensor-parallel for a few SGD steps and checks the loss
   curve and the final weights against a single-process float64 reference;
3. draws the loss curves and the latency bars into a PNG (``--plot``).

It exits with status 1 when a check fails. Seeds are fixed: two runs generate the same
tokens and print the same losses.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from spyreccl_torch.bench.decode_timing import (
    Variant,
    isolated_all_reduce_us,
    mean_over_ranks,
    percentile,
    synchronizer,
    time_variants,
    transferless_mesh,
)
from spyreccl_torch.models.generate import compare_tokens, generate, make_prompts
from spyreccl_torch.models.llama import (
    Llama,
    LlamaConfig,
    compile_blocks,
    local_shard_model,
    manual_tensor_parallel,
    rehome_tensor_parallel,
    tensor_parallel,
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6, help="query heads (3 per rank on 2 ranks)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--prompt-lengths", default="5,17,9,12", help="one prompt per length")
    p.add_argument("--new-tokens", type=int, default=24)
    # 10 rounds x 23 steps per variant: two runs' medians agree within ~20 % on a loaded
    # 2-core machine (5 rounds did not, for the time to first token: one sample a round).
    p.add_argument("--rounds", type=int, default=10, help="timed generations per variant")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--no-timing", action="store_true", help="check the tokens, time nothing")
    p.add_argument("--train-steps", type=int, default=6)
    p.add_argument("--train-seq", type=int, default=16)
    p.add_argument("--train-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--tol", type=float, default=1e-4, help="training: max abs diff vs float64")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--plot", default="bench-results/tp_llama.png", help="PNG path ('' for none)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


class Say:
    """Prints on rank 0 only; a tqdm bar there when tqdm is installed."""

    def __init__(self, rank: int, progress: bool) -> None:
        self.rank = rank
        self.tqdm = None
        if rank == 0 and progress:
            try:
                from tqdm import tqdm

                self.tqdm = tqdm
            except ImportError:
                pass

    def __call__(self, *args, **kwargs) -> None:
        if self.rank == 0:
            print(*args, **kwargs, flush=True)

    def bar(self, total: int, desc: str):
        if self.tqdm is None:
            return nullcontext(None)
        return self.tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


# ----------------------------------------------------------------------------------------
# serving
# ----------------------------------------------------------------------------------------


def _compiled(model: Llama):
    return compile_blocks(model, dynamic=False)


def serve(args, cfg, say: Say, device, meshes, gloo) -> tuple[bool, dict]:
    prompts = make_prompts(cfg.vocab, [int(n) for n in args.prompt_lengths.split(",")], args.seed)
    base = Llama.from_seed(cfg, args.seed).requires_grad_(False)
    say(
        f"\nserving: {cfg.n_layers} layers, width {cfg.dim}, {cfg.n_heads} query / "
        f"{cfg.n_kv_heads} kv heads ({cfg.n_heads // meshes['spyreccl'].size()} / "
        f"{cfg.n_kv_heads // meshes['spyreccl'].size()} per rank), vocab {cfg.vocab}, float32; "
        f"{len(prompts)} prompts of {args.prompt_lengths} tokens, {args.new_tokens} new tokens"
    )
    reference = generate(
        copy.deepcopy(base), prompts, args.new_tokens, device="cpu", dtype=torch.float32,
        margins=True,
    )  # fmt: skip
    models = {}
    for level, dev in (("spyreccl", device), ("gloo", torch.device("cpu"))):
        tp = tensor_parallel(copy.deepcopy(base).to(dev), meshes[level])
        models[level] = (tp, local_shard_model(tp), dev)
    forms = ["eager"] if args.no_compile else ["eager", "compiled"]
    steps = {}
    for level, (tp, floor, _) in models.items():
        for form in forms:
            steps[(level, form)] = tp if form == "eager" else _compiled(tp)
            steps[(f"floor {level}", form)] = floor if form == "eager" else _compiled(floor)

    ok = True
    for level, form in (("spyreccl", f) for f in forms):
        tp, _, dev = models[level]
        t0 = time.perf_counter()
        got = generate(
            tp, prompts, args.new_tokens, device=dev, dtype=torch.float32,
            step=steps[(level, form)], synchronize=synchronizer(dev),
        )  # fmt: skip
        check = compare_tokens(got.tokens, reference, tie_tolerance=1e-4)
        ok &= check.ok
        say(
            f"  {level} {form:<8} tokens vs single-process reference: {check.message} -> "
            f"{'OK' if check.ok else 'FAIL'} ({time.perf_counter() - t0:.1f} s"
            f"{', compiling' if form == 'compiled' else ''})"
        )
    say(f"  first generated tokens of prompt 0: {reference.tokens[0, :12].tolist()}")
    if args.no_timing:
        return ok, {}

    variants = [
        Variant(f"{name} {form}", models[level][0 if name == level else 1], steps[(name, form)],
                models[level][2], synchronizer(models[level][2]))
        for form in forms
        for level in ("spyreccl", "gloo")
        for name in (level, f"floor {level}")
    ]  # fmt: skip
    # The same shards and all_reduces without DTensor (hooks): what DTensor's eager
    # dispatch adds to a token, apart from communication.
    manual = manual_tensor_parallel(models["spyreccl"][0], dist.group.WORLD.group_name)
    variants.append(Variant("spyreccl manual eager", manual, manual, device, synchronizer(device)))
    # The DTensor model itself on a group that moves nothing: the eager step with only the
    # transfers skipped (DTensor's dispatch kept), the floor its collectives compare with.
    floor_mesh = transferless_mesh(device.type, dist.get_world_size())
    if floor_mesh is not None:
        dt_floor = rehome_tensor_parallel(models["spyreccl"][0], floor_mesh)
        variants.append(
            Variant("spyreccl dtensor-floor eager", dt_floor, dt_floor, device,
                    synchronizer(device))
        )  # fmt: skip
    # Every variant generates once untimed (compiling, warming caches), then once per round.
    total = len(variants) * (args.rounds + 1) * (args.new_tokens - 1)
    t0 = time.perf_counter()
    with say.bar(total, "timing decode") as bar:
        time_variants(
            variants, prompts, args.new_tokens, args.rounds, torch.float32, gloo,
            on_step=(lambda: bar.update(1)) if bar is not None else None,
        )  # fmt: skip
    seconds = time.perf_counter() - t0
    say(f"  timed {len(variants)} variants x {args.rounds} rounds in {seconds:.0f} s")
    numel = len(prompts) * cfg.dim
    alone = {}
    for level, dev, group in (
        ("spyreccl", device, dist.group.WORLD),
        ("gloo", torch.device("cpu"), gloo),
    ):
        for form in ("functional", "sync"):
            us = isolated_all_reduce_us(numel, torch.float32, dev, group, form, gloo)
            alone[(level, form)] = mean_over_ranks([us], gloo)[0]
    stats = {}
    for v in variants:
        steps_ms = [s * 1e3 for s in mean_over_ranks(v.step_s, gloo)]
        ttft_ms = [s * 1e3 for s in mean_over_ranks(v.ttft_s, gloo)]
        stats[v.name] = {
            "ttft": percentile(ttft_ms, 0.5),
            "median": percentile(steps_ms, 0.5),
            "p90": percentile(steps_ms, 0.9),
        }
    _print_latency(say, stats, alone, forms, cfg, numel)
    return ok, stats


def _print_latency(say, stats, alone, forms, cfg, numel) -> None:
    calls = 2 * cfg.n_layers
    say(
        "\ndecode latency, ms (mean over ranks of each step; "
        "median / p90 over the steps of all rounds); collectives = token - floor"
    )
    head = (
        f"{'':<20}{'TTFT':>8}{'token':>8}{'p90':>8}{'floor':>8}"
        f"{'in collectives':>16}{'vs alone':>10}"
    )
    say(head)
    say("-" * len(head))
    for form in forms:
        for level in ("spyreccl", "gloo"):
            s, f = stats[f"{level} {form}"], stats[f"floor {level} {form}"]
            comm = s["median"] - f["median"]
            # Alone: the call each form issues (docs: eager DTensor -> functional op + wait;
            # a compiled graph's collective waited at once -> a synchronous call).
            one = alone[(level, "functional" if form == "eager" else "sync")]
            say(
                f"{level + ' ' + form:<20}{s['ttft']:8.2f}{s['median']:8.2f}{s['p90']:8.2f}"
                f"{f['median']:8.2f}{comm:9.3f} ({100 * comm / s['median']:3.0f}%)"
                f"{comm * 1e3 / (calls * one):9.2f}x"
            )
    say(
        f"token = one decode step of the batch; floor = the same shards without collectives "
        f"(its own device); {calls} all_reduces of {numel * 4 // 1024} KiB per token; "
        f"'vs alone' = (token - floor) / {calls} x the same all_reduce timed alone "
        f"(spyreccl {alone[('spyreccl', 'functional')]:.1f} µs functional, "
        f"{alone[('spyreccl', 'sync')]:.1f} µs sync; gloo {alone[('gloo', 'functional')]:.1f} "
        f"/ {alone[('gloo', 'sync')]:.1f} µs)"
    )
    for form in forms:
        r = stats[f"gloo {form}"]["median"] / stats[f"spyreccl {form}"]["median"]
        say(f"gloo / spyreccl per token, {form}: {r:.2f}x")
    manual = stats["spyreccl manual eager"]["median"]
    ours, floor = stats["spyreccl eager"]["median"], stats["floor spyreccl eager"]["median"]
    vs_alone = (manual - floor) * 1e3 / (calls * alone[("spyreccl", "functional")])
    say(
        f"spyreccl eager without DTensor (the same all_reduces issued by hooks): "
        f"{manual:.2f} ms per token, collectives {manual - floor:.3f} ms ({vs_alone:.2f}x "
        f"alone); DTensor's eager dispatch: {ours - manual:.2f} ms of the token"
    )
    if "spyreccl dtensor-floor eager" in stats:
        dt_floor = stats["spyreccl dtensor-floor eager"]["median"]
        dt_alone = (ours - dt_floor) * 1e3 / (calls * alone[("spyreccl", "functional")])
        say(
            f"spyreccl eager against the same DTensor step on a group that moves nothing "
            f"({dt_floor:.2f} ms): {ours / dt_floor:.3f}x, collectives {ours - dt_floor:.3f} ms "
            f"({dt_alone:.2f}x alone)"
        )


# ----------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------


def _batches(args, cfg) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    out = []
    for _ in range(args.train_steps):
        seq = torch.randint(0, cfg.vocab, (args.train_batch, args.train_seq + 1), generator=gen)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _train(model, batches, lr, device, bar) -> list[float]:
    # foreach=False: the norms' weights stay plain tensors next to DTensor weights, and
    # torch's foreach kernels refuse such mixed lists.
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, foreach=False)
    losses = []
    for tokens, targets in batches:
        opt.zero_grad(set_to_none=True)
        logits = model(tokens.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1).double(), targets.to(device).flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
    return losses


def train(args, cfg, say: Say, device, mesh) -> tuple[bool, list[float], list[float]]:
    say(
        f"\ntraining: tensor-parallel ({mesh.size()}-way, float32), {args.train_steps} SGD "
        f"steps of {args.train_batch} x {args.train_seq} tokens, against float64 on one process"
    )
    base = Llama.from_seed(cfg, args.seed)
    batches = _batches(args, cfg)
    tp = tensor_parallel(copy.deepcopy(base).to(device), mesh)
    with say.bar(args.train_steps, "tp train") as bar:
        tp_losses = _train(tp, batches, args.lr, device, bar)
    with say.bar(args.train_steps, "float64 ref") as bar:
        ref = copy.deepcopy(base).double()
        ref_losses = _train(ref, batches, args.lr, "cpu", bar)
    state = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().double()
        for n, p in tp.named_parameters()
    }
    loss_diff = max(abs(a - b) for a, b in zip(tp_losses, ref_losses))
    param_diff = max((state[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    ok = loss_diff <= args.tol and param_diff <= args.tol
    say("  step  " + "".join(f"{i:>10}" for i in range(len(tp_losses))))
    say("  tp    " + "".join(f"{x:10.5f}" for x in tp_losses))
    say("  fp64  " + "".join(f"{x:10.5f}" for x in ref_losses))
    say(
        f"  max abs diff vs float64: loss {loss_diff:.2e}, parameters {param_diff:.2e} "
        f"(tolerance {args.tol:g}) -> {'OK' if ok else 'FAIL'}"
    )
    return ok, tp_losses, ref_losses


# ----------------------------------------------------------------------------------------
# picture
# ----------------------------------------------------------------------------------------


def plot(path: str, stats: dict, tp_losses, ref_losses, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.2))
    steps = range(1, len(tp_losses) + 1)
    ax_loss.plot(steps, ref_losses, "k-", linewidth=3, alpha=0.3, label="float64 reference")
    ax_loss.plot(steps, tp_losses, "o--", color="tab:blue", label="tensor parallel (spyreccl)")
    ax_loss.set_xlabel("SGD step")
    ax_loss.set_ylabel("cross-entropy loss")
    ax_loss.set_title("training")
    ax_loss.legend()
    if stats:
        names = list(stats)
        med = [stats[n]["median"] for n in names]
        err = [[0] * len(names), [stats[n]["p90"] - stats[n]["median"] for n in names]]
        colors = [
            "tab:gray" if n.startswith("floor") else "tab:blue" if "spyreccl" in n else "tab:red"
            for n in names
        ]
        ax_lat.barh(names, med, xerr=err, color=colors, capsize=3)
        ax_lat.invert_yaxis()
        ax_lat.set_xlabel("ms per decode step (median, whisker to p90)")
        ax_lat.set_title("serving: per-token latency")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    dist.init_process_group()  # no backend: spyre tensors go to spyreccl by default
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.accelerator.set_device_index(
        int(os.environ.get("LOCAL_RANK", rank)) % torch.accelerator.device_count()
    )
    device = torch.device("spyre", torch.accelerator.current_device_index())
    gloo = dist.new_group(backend="gloo")  # CPU tensors, for the comparison
    say = Say(rank, not args.no_progress)
    cfg = LlamaConfig(
        vocab=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        max_seq=max(args.train_seq, max(map(int, args.prompt_lengths.split(",")))
                    + args.new_tokens),
    )  # fmt: skip
    cfg.check_world_size(ws)
    meshes = {
        "spyreccl": init_device_mesh("spyre", (ws,), mesh_dim_names=("tp",)),
        "gloo": DeviceMesh.from_group(gloo, "cpu", mesh_dim_names=("tp",)),
    }
    say(
        f"tp_llama: {ws} ranks, spyre tensors over {dist.get_backend_config()}, CPU tensors "
        f"over gloo; {torch.get_num_threads()} thread(s) per rank, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus"
    )
    with warnings.catch_warnings():
        # torch.compile of DTensor code warns about its own internals on some torch builds.
        warnings.filterwarnings("ignore", category=FutureWarning)
        serve_ok, stats = serve(args, cfg, say, device, meshes, gloo)
    train_ok, tp_losses, ref_losses = train(args, cfg, say, device, meshes["spyreccl"])

    if rank == 0 and args.plot:
        title = (
            f"tp_llama: {ws} ranks, width {cfg.dim}, {cfg.n_layers} layers "
            f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus)"
        )
        if plot(args.plot, stats, tp_losses, ref_losses, title):
            say(f"\npicture: {os.path.abspath(args.plot)}")
        else:
            say("\npicture: skipped (matplotlib is not installed: pip install matplotlib)")
    dist.barrier(group=gloo)
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()
    ok = serve_ok and train_ok
    say(f"tp_llama: {'OK' if ok else 'FAILED'} in {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
