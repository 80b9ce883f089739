"""``--mode decode``: per-token latency of tensor-parallel greedy decoding.

The model is :mod:`spyreccl_torch.models.llama` (``--layers`` blocks, head_dim 128, four
query heads per key/value head where the world size allows, Llama's SwiGLU width), sharded
Megatron-style with DTensor (two all_reduces of batch x width elements per block and token),
random weights made shard by shard. For every (world size, width, batch, dtype, form) the
same rank processes time, round by round in rotating order:

- ``spyreccl``: the model on spyre tensors (its collectives go to spyreccl);
- ``gloo``: the model on CPU tensors over gloo (the same default group, ``cpu:gloo``);
- ``floor spyreccl`` / ``floor gloo``: the compute floor, the same per-rank shards on the
  same device with the collectives skipped (``local_shard_model``: wrong numbers, right
  timing);
- ``manual spyreccl`` (eager only): the same shards with the same all_reduces issued by
  forward hooks, without DTensor (``manual_tensor_parallel``); ``spyreccl`` minus it is
  DTensor's eager dispatch, it minus the floor the collectives in the model's context;
- ``dtensor floor spyreccl``: the DTensor model itself, the same shards, on a mesh whose
  group moves nothing (``transferless_mesh``): the same step with only the transfers
  skipped. Eager it keeps DTensor's dispatch and the functional calls; compiled, the same
  generated code, collective calls included. ``spyreccl`` minus it is the
  communication in the step, it minus the floor what the step's structure costs beyond the
  bare shards (eager mostly DTensor's dispatch);

eager and ``torch.compile``d (each block compiled), and the all_reduce of one step alone
(eager: ``_c10d_functional.all_reduce`` + ``wait_tensor``, as DTensor issues it; compiled:
``dist.all_reduce``, which a collective waited at once in a compiled graph amounts to).
A step's time is the mean over the ranks of each rank's wall time of that step; the table
gives medians over all steps of all rounds, and ``comm`` = token - floor. The ratios to the
floors are also taken round by round (``vs_floor_rounds``, ``vs_dtensor_floor_rounds``; the
table prints the lowest and highest of the DTensor floor's): on a machine whose speed drifts,
their spread says how much one run's median ratio can be trusted.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
import warnings
from typing import Any

import numpy as np

from .launcher import RankJob, reporting_to
from .machine import command_line, describe_environment, timestamp
from .report import write_json
from .stats import combine_ranks, summarize

__all__ = ["FORMS", "decode_config", "run_decode"]

FORMS = ("eager", "compiled")
PROMPT_LENGTHS = (7, 12, 4, 9)  # cycled over the batch: prompts of different lengths
# Bytes streamed before each call of the cold "alone" timing: past any L3 of today's CPUs.
COLD_FLUSH_BYTES = 64 << 20


def decode_config(width: int, world_size: int, layers: int, vocab: int, max_seq: int):
    """The benchmark's model at ``width``: head_dim 128 (64 below width 1024), the most
    query heads per key/value head (4, 2 or 1) that leaves whole heads on every rank."""
    from ..models.llama import LlamaConfig

    head_dim = 128 if width >= 1024 else 64
    if width % head_dim:
        raise ValueError(f"decode: width {width} is not a multiple of head_dim {head_dim}")
    heads = width // head_dim
    for group in (4, 2, 1):
        kv = heads // group
        if heads % group == 0 and kv % world_size == 0:
            break
    else:
        raise ValueError(
            f"decode: width {width} has {heads} heads of {head_dim}, not divisible over "
            f"{world_size} ranks"
        )
    ffn = -(-(8 * width // 3) // (64 * world_size)) * 64 * world_size
    return LlamaConfig(
        vocab=vocab, dim=width, n_layers=layers, n_heads=heads, n_kv_heads=kv, hidden=ffn,
        max_seq=max_seq,
    )  # fmt: skip


def _cases(args: dict) -> list[dict]:
    return [
        {"width": w, "batch": b, "dtype": d, "form": f}
        for w in args["widths"]
        for d in args["dtypes"]
        for b in args["batches"]
        for f in args["forms"]
    ]


def decode_rank(args: dict) -> None:
    """One rank (started by launcher.RankJob): every case of the grid, in order."""
    from .torch_env import init_levels

    conn = args["conn"]
    with reporting_to(conn):
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning)
        envs = init_levels(
            ("spyreccl", "gloo"),
            rank=args["rank"],
            world_size=args["nranks"],
            init_method=args["init_method"],
            timeout=datetime.timedelta(seconds=args["timeout_s"]),
        )
        dtensor_floor_mesh = None
        if "spyreccl" in args["levels"]:
            from .decode_timing import transferless_mesh

            dtensor_floor_mesh = transferless_mesh(envs["spyreccl"].device.type, args["nranks"])
        conn.send(("ready", {"pid": os.getpid()}))
        for index, case in enumerate(_cases(args)):
            result = _run_case(envs, args, case, _heartbeat(conn), dtensor_floor_mesh)
            conn.send(("case", index, result))
        envs["spyreccl"].dist.destroy_process_group()
        conn.send(("done",))


def _heartbeat(conn: Any) -> Any:
    """A callback that tells the parent, at most once a second, that this rank is alive: a
    compiled case can run for minutes without finishing (its stall timeout is --timeout)."""
    last = [time.monotonic()]

    def beat() -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0:
            last[0] = now
            conn.send(("progress", "step"))

    return beat


def _run_case(
    envs: dict, args: dict, case: dict, heartbeat: Any, dtensor_floor_mesh: Any = None
) -> dict:
    import torch
    import torch._dynamo
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from ..models.generate import make_prompts
    from ..models.llama import (
        compile_blocks,
        local_shard_model,
        manual_tensor_parallel,
        random_tensor_parallel,
        rehome_tensor_parallel,
    )
    from .decode_timing import Variant, isolated_all_reduce_us, synchronizer, time_variants

    n = args["nranks"]
    try:
        cfg = decode_config(
            case["width"], n, args["layers"], args["vocab"],
            max(PROMPT_LENGTHS) + args["new_tokens"],
        )  # fmt: skip
    except ValueError as e:
        return {"skipped": str(e)}
    dtype = getattr(torch, case["dtype"])
    torch._dynamo.reset()  # a fresh cache per case (and no recompile limit reached)
    prompts = make_prompts(
        cfg.vocab, [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(case["batch"])], 1
    )
    variants = []
    manual_calls: list[tuple[int, int, int]] = []  # the manual variant's all_reduces
    for level in args["levels"]:
        device = envs[level].device
        mesh = DeviceMesh(device.type, list(range(n)))
        tp = random_tensor_parallel(cfg, mesh, device, dtype, seed=7)
        floor = local_shard_model(tp)
        compiled = case["form"] == "compiled"
        sync = synchronizer(device)
        variants.append(
            Variant(level, tp, compile_blocks(tp, dynamic=False) if compiled else tp, device, sync)
        )
        variants.append(
            Variant(f"floor {level}", floor,
                    compile_blocks(floor, dynamic=False) if compiled else floor, device, sync)
        )  # fmt: skip
        if level == "spyreccl" and dtensor_floor_mesh is not None:
            dt_floor = rehome_tensor_parallel(tp, dtensor_floor_mesh)
            variants.append(
                Variant("dtensor floor spyreccl", dt_floor,
                        compile_blocks(dt_floor, dynamic=False) if compiled else dt_floor,
                        device, sync)
            )  # fmt: skip
        if level == "spyreccl" and not compiled:
            manual = manual_tensor_parallel(tp, dist.group.WORLD.group_name, manual_calls)
            variants.append(Variant("manual spyreccl", manual, manual, device, sync))
    time_variants(
        variants, prompts, args["new_tokens"], args["rounds"], dtype, dist.group.WORLD,
        on_step=heartbeat,
    )  # fmt: skip
    alone = {}
    for level in args["levels"]:
        alone[level] = isolated_all_reduce_us(
            case["batch"] * cfg.dim, dtype, envs[level].device, dist.group.WORLD,
            "sync" if case["form"] == "compiled" else "functional", dist.group.WORLD,
        )  # fmt: skip
    # The hooks' all_reduces run right after a projection streamed its weights through the
    # caches: the same call alone, but after a 64 MiB pass, is what they compare with.
    alone_cold = {}
    if manual_calls:
        alone_cold["spyreccl"] = isolated_all_reduce_us(
            case["batch"] * cfg.dim, dtype, envs["spyreccl"].device, dist.group.WORLD,
            "functional", dist.group.WORLD, iters=60, flush_bytes=COLD_FLUSH_BYTES,
        )  # fmt: skip
    return {
        "config": cfg.to_dict(),
        "alone_cold_us": alone_cold,
        "steps_ns": {v.name: [int(s * 1e9) for s in v.step_s] for v in variants},
        "ttft_ns": {v.name: [int(s * 1e9) for s in v.ttft_s] for v in variants},
        "alone_us": alone,
        "manual_calls_ns": manual_calls,
    }


def _round_medians_ms(steps_ns: np.ndarray, rounds: int) -> list[float] | None:
    """The median step (ms) of each of ``rounds`` equal runs of ``steps_ns`` (a variant's
    steps, mean over ranks, round after round); None where they do not split evenly."""
    if rounds == 0 or steps_ns.size == 0 or steps_ns.size % rounds:
        return None
    return [float(m) / 1e6 for m in np.median(steps_ns.reshape(rounds, -1), axis=1)]


def _round_ratios(ours: list[float] | None, base: list[float] | None) -> list[float] | None:
    """A token over its floor, round by round. The variants of a round run back to back
    (time_variants), so a round's ratio sees one state of the machine: their spread is how
    far one run's median ratio can be trusted."""
    if ours is None or base is None or len(ours) != len(base):
        return None
    return [a / b for a, b in zip(ours, base)]


def _row(case: dict, per_rank: list[dict], nranks: int) -> dict:
    from .decode_timing import in_call_costs

    first = per_rank[0]
    if "skipped" in first:
        return dict(case, nranks=nranks, skipped=first["skipped"])
    cfg = first["config"]
    row: dict[str, Any] = dict(case, nranks=nranks, layers=cfg["n_layers"], config=cfg)
    calls = 2 * cfg["n_layers"]
    nbytes = case["batch"] * cfg["dim"] * (2 if case["dtype"] in ("bfloat16", "float16") else 4)
    row["all_reduce_bytes"] = nbytes
    row["all_reduces_per_token"] = calls
    rounds: dict[str, list[float] | None] = {}  # per variant: its median step per round
    for name in first["steps_ns"]:
        steps = combine_ranks([r["steps_ns"][name] for r in per_rank])
        s = summarize(steps)
        t = summarize(combine_ranks([r["ttft_ns"][name] for r in per_rank]))
        rounds[name] = _round_medians_ms(steps, len(first["ttft_ns"][name]))  # a TTFT a round
        row[name] = {
            "token_ms": s.median_us / 1e3,
            "p90_ms": s.p90_us / 1e3,
            "ttft_ms": t.median_us / 1e3,
            "steps": s.iters,
        }
    for level in first["alone_us"]:
        alone = sum(r["alone_us"][level] for r in per_rank) / len(per_rank)
        tok, floor = row[level]["token_ms"], row[f"floor {level}"]["token_ms"]
        row[level]["alone_us"] = alone
        row[level]["vs_floor"] = tok / floor
        row[level]["comm_ms"] = tok - floor
        row[level]["comm_vs_alone"] = (tok - floor) * 1e3 / (calls * alone)
        row[level]["vs_floor_rounds"] = _round_ratios(rounds[level], rounds[f"floor {level}"])
        if f"dtensor floor {level}" in row:
            dt_floor = row[f"dtensor floor {level}"]["token_ms"]
            row[level]["dtensor_floor_ms"] = dt_floor
            row[level]["vs_dtensor_floor"] = tok / dt_floor
            row[level]["vs_dtensor_floor_rounds"] = _round_ratios(
                rounds[level], rounds[f"dtensor floor {level}"]
            )
            row[level]["dtensor_comm_ms"] = tok - dt_floor
            row[level]["dtensor_comm_vs_alone"] = (tok - dt_floor) * 1e3 / (calls * alone)
            row[level]["dtensor_dispatch_ms"] = dt_floor - floor
        if f"manual {level}" in row:
            manual = row[f"manual {level}"]["token_ms"]
            row[level]["dtensor_ms"] = tok - manual
            row[level]["manual_comm_vs_alone"] = (manual - floor) * 1e3 / (calls * alone)
            costs = in_call_costs(
                [r["manual_calls_ns"] for r in per_rank], case["batch"] * cfg["dim"]
            )
            cold = sum(r["alone_cold_us"][level] for r in per_rank) / len(per_rank)
            row[level]["in_call_us"] = costs.in_call_us
            row[level]["in_call_vs_alone"] = costs.in_call_us / alone
            row[level]["alone_cold_us"] = cold
            row[level]["in_call_vs_cold"] = costs.in_call_us / cold
            row[level]["wait_us"] = costs.wait_us
            row[level]["timed_calls"] = costs.calls
    if "gloo" in row and "spyreccl" in row:
        row["gloo_over_spyreccl"] = row["gloo"]["token_ms"] / row["spyreccl"]["token_ms"]
    return row


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'n':>2} {'width':>6} {'batch':>5} {'dtype':<9}{'form':<9}{'AR size':>8}"
        f"{'spyreccl':>10}{'floor':>9}{'x floor':>8}{'comm':>8}{'vs alone':>9}"
        f"{'gloo':>9}{'floor':>9}{'gloo/ours':>10}{'DTensor':>9}{'w/o DT':>8}"
        f"{'in-call':>9}{'/alone':>7}{'/cold':>6}{'wait':>8}"
        f"{'DT floor':>9}{'x DT fl':>8}{'rounds':>12}{'DT comm':>8}{'vs alone':>9}"
    )
    lines = [
        "# decode: ms per token (median over steps, mean over ranks); floor = same shards, "
        "no collectives; comm = token - floor; vs alone = comm / (all_reduces per token x "
        "one all_reduce timed alone); DTensor = token - the same all_reduces issued by hooks "
        "without DTensor (eager), w/o DT = that one's comm vs alone; in-call = us from the "
        "last rank's arrival to the return, per all_reduce of those hooks (median), /alone = "
        "that vs alone, /cold = vs alone after a 64 MiB pass through the caches (as the model "
        "leaves them), wait = us between the first and the last rank's arrival (rank skew); "
        "DT floor = the DTensor model on a group that moves nothing (the same step, eager "
        "or compiled, with only the transfers skipped), x DT fl = token vs it, rounds = "
        "the lowest and highest of that ratio taken round by round, DT comm = "
        "token - it, vs alone = that vs the all_reduces alone",
        head,
        "-" * len(head),
    ]
    for r in rows:
        prefix = f"{r['nranks']:>2} {r['width']:>6} {r['batch']:>5} {r['dtype']:<9}{r['form']:<9}"
        if "skipped" in r:
            lines.append(prefix + f"  skipped: {r['skipped']}")
            continue
        ours, gl = r.get("spyreccl"), r.get("gloo")
        size = r["all_reduce_bytes"]
        cells = f"{size / 1024:6.0f}Ki"
        if ours:
            cells += (
                f"{ours['token_ms']:10.2f}{r['floor spyreccl']['token_ms']:9.2f}"
                f"{ours['vs_floor']:8.3f}{ours['comm_ms']:8.2f}{ours['comm_vs_alone']:9.2f}"
            )
        else:
            cells += " " * 44
        if gl:
            cells += f"{gl['token_ms']:9.2f}{r['floor gloo']['token_ms']:9.2f}"
            if ours:
                cells += f"{r['gloo_over_spyreccl']:9.2f}x"
        if ours and "dtensor_ms" in ours:
            cells += f"{ours['dtensor_ms']:9.2f}{ours['manual_comm_vs_alone']:8.2f}"
            cells += (
                f"{ours['in_call_us']:9.1f}{ours['in_call_vs_alone']:7.2f}"
                f"{ours['in_call_vs_cold']:6.2f}{ours['wait_us']:8.1f}"
            )
        elif ours:
            cells += " " * 47  # compiled: no hook variant
        if ours and "dtensor_floor_ms" in ours:
            spread = ours.get("vs_dtensor_floor_rounds")
            spread_text = f"{min(spread):.3f}-{max(spread):.3f}" if spread else "-"
            cells += (
                f"{ours['dtensor_floor_ms']:9.2f}{ours['vs_dtensor_floor']:8.3f}"
                f"{spread_text:>12}"
                f"{ours['dtensor_comm_ms']:8.2f}{ours['dtensor_comm_vs_alone']:9.2f}"
            )
        lines.append(prefix + cells)
    return "\n".join(lines)


def plot_decode(path: str, rows: list[dict], title: str) -> None:
    """Per-token latency bars (log scale) of every variant with a row-level figure, and below
    them, where the DTensor floor was timed, spyreccl's token over it: the median ratio, the
    lowest and highest round as an error bar, and the 1.05 target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "skipped" not in r]
    labels = [f"n{r['nranks']} w{r['width']} b{r['batch']} {r['dtype'][:4]} {r['form'][:4]}"
              for r in rows]  # fmt: skip
    ratios = [
        (j, r["spyreccl"]) for j, r in enumerate(rows)
        if "spyreccl" in r and "vs_dtensor_floor" in r["spyreccl"]
    ]  # fmt: skip
    panels = 2 if ratios else 1
    fig, axes = plt.subplots(
        panels, 1, figsize=(max(8, 0.6 * len(rows) + 2), 4.5 + 2.5 * (panels - 1)),
        sharex=True, squeeze=False, gridspec_kw={"height_ratios": [2, 1][:panels]},
    )  # fmt: skip
    ax = axes[0][0]
    series = [
        ("floor spyreccl", "tab:gray"),
        ("dtensor floor spyreccl", "silver"),
        ("spyreccl", "tab:blue"),
        ("gloo", "tab:red"),
    ]
    series = [(n, c) for n, c in series if any(n in r for r in rows)]
    width = 0.8 / len(series)
    for i, (name, color) in enumerate(series):
        offset = (i - (len(series) - 1) / 2) * width
        xs = [j + offset for j in range(len(rows)) if name in rows[j]]
        ys = [r[name]["token_ms"] for r in rows if name in r]
        ax.bar(xs, ys, width, label=name, color=color)
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode token (median)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    if ratios:
        low = axes[1][0]
        xs = [j for j, _ in ratios]
        mid = [v["vs_dtensor_floor"] for _, v in ratios]
        spans = [v.get("vs_dtensor_floor_rounds") or [m] for (_, v), m in zip(ratios, mid)]
        # The median over all steps need not lie between the rounds' own ratios: clamp.
        err = [[max(0.0, m - min(sp)) for m, sp in zip(mid, spans)],
               [max(0.0, max(sp) - m) for m, sp in zip(mid, spans)]]  # fmt: skip
        label = "spyreccl / DTensor floor (median; lowest and highest round)"
        low.errorbar(xs, mid, yerr=err, fmt="o", color="tab:blue", capsize=3, label=label)
        low.axhline(1.05, color="tab:green", linestyle="--", linewidth=1, label="1.05")
        low.axhline(1.0, color="black", linewidth=0.5)
        low.set_ylabel("token / DTensor floor")
        low.legend(fontsize=8)
    bottom = axes[-1][0]
    bottom.set_xticks(range(len(rows)))
    bottom.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_decode(args: argparse.Namespace) -> int:
    from .options import plot_path
    from .sweep import progress_bar

    rows: list[dict] = []
    for n in args.nproc:
        job_args = {
            "nranks": n,
            "widths": args.widths,
            "batches": args.batches,
            "dtypes": args.dtypes,
            "forms": args.forms,
            "levels": [lv for lv in ("spyreccl", "gloo") if lv in args.levels] or ["spyreccl"],
            "layers": args.layers,
            "vocab": args.vocab,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "timeout_s": args.timeout,
        }
        cases = _cases(job_args)
        per_case: list[list[Any]] = [[None] * n for _ in cases]
        with tempfile.TemporaryDirectory(prefix="spyreccl-bench-decode-") as workdir:
            job_args["init_method"] = f"file://{os.path.join(workdir, 'store')}"
            with (
                RankJob(f"decode x{n}", n, job_args, target=decode_rank) as job,
                progress_bar(len(cases), enabled=not args.no_progress) as bar,
            ):
                for rank, msg in job.messages(stall_timeout_s=args.timeout):
                    if msg[0] == "case":
                        per_case[msg[1]][rank] = msg[2]
                        if rank == 0:
                            c = cases[msg[1]]
                            bar.describe(f"n{n} w{c['width']} b{c['batch']} {c['dtype']}")
                            bar.advance()
        rows.extend(_row(c, results, n) for c, results in zip(cases, per_case))
    print(format_table(rows))
    json_path = args.json or os.path.join("bench-results", f"decode-{timestamp()}.json")
    machine = describe_environment()
    write_json(
        json_path,
        {
            "schema": "spyreccl-bench/1",
            "mode": "decode",
            "command": command_line(args),
            "timestamp": timestamp(),
            "machine": machine,
            "loadavg_at_end": list(os.getloadavg()),
            "results": rows,
        },
    )
    print(f"results: {json_path}")
    plot = plot_path(args, json_path)
    if plot:
        plot_decode(
            plot,
            rows,
            f"spyreccl-bench decode ({machine['cpu_model']}, {machine['usable_cpus']} cpus, "
            f"load average at end {os.getloadavg()[0]:.1f})",
        )
        print(f"plot: {plot}")
    return 0
