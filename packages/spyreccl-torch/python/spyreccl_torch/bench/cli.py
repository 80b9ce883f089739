"""Command line of the benchmark suite: ``spyreccl-bench`` / ``python -m spyreccl_torch.bench``.

Modes:

``sweep`` (default)
    nccl-tests-style size sweep of every operation at the ``core``, ``spyreccl`` and ``gloo``
    levels; table, JSON and PNG. ``--nproc 2,3,4`` repeats it per world size and adds a
    scaling table.
``threshold``
    core all_reduce under several values of SPYRECCL_ALLREDUCE_ONESHOT_MAX (one-shot vs
    two-phase crossover).
``ibm``
    IBM pytorch-communication-benchmarks loop methodology (allreduce/allgather/reduce-scatter),
    one rank per process, meant to be launched by torchrun (launches itself otherwise).
``ddp``
    DistributedDataParallel step time: spyre+spyreccl against CPU+gloo.
``overhead``
    per-call cost of each layer (core, device sync, backend, torch.distributed) at one rank.
``funcol``
    the functional-collective path (DTensor, FSDP2, compiled graphs) next to the eager call.
``decode``
    per-token latency of tensor-parallel greedy decoding of a Llama-style model: spyreccl,
    gloo and the compute floor, eager and compiled, over widths, batches, dtypes.

The PNGs need matplotlib and the progress bar tqdm (``pip install 'spyreccl-torch[bench]'``);
without matplotlib the run says so first and writes its tables and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from .funcol import GRAPH_BACKENDS
from .launcher import BenchError
from .machine import command_line, describe_environment, timestamp
from .ops import op_names
from .options import matplotlib_missing, plot_path, policy_from, sizes_from
from .plan import DTYPES, parse_size

__all__ = ["build_parser", "main"]

MODES = ("sweep", "threshold", "ibm", "ddp", "overhead", "funcol", "decode")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _name_list(choices: Sequence[str]):
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown name(s) {bad or text!r}; expected a comma-separated subset of "
                f"{', '.join(choices)}"
            )
        return names

    return parse


def build_parser() -> argparse.ArgumentParser:
    from .sweep import ALL_LEVELS, DEFAULT_LEVELS

    p = argparse.ArgumentParser(
        prog="spyreccl-bench",
        description="Benchmarks of spyreccl: nccl-tests-style sweeps (core library, torch "
        "backend, gloo baseline), IBM loop methodology, DDP step time.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--mode", choices=MODES, default="sweep", help="what to run")
    p.add_argument(
        "--nproc",
        type=_int_list,
        default=[2],
        help="world size(s), comma separated (e.g. 2,3,4 for a scaling run); ranks "
        "may exceed the cores (oversubscription)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="sweep: simulate this many nodes with --nproc ranks each (told apart by "
        "SPYRECCL_NODE_ID): spyreccl within a node, gloo between nodes; torch levels only "
        "(the core levels are dropped)",
    )
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument(
        "--levels",
        type=_name_list(ALL_LEVELS),
        default=list(DEFAULT_LEVELS),
        help="sweep/threshold: which levels (mpi: Open MPI interleaved with spyreccl_core "
        "on numpy arrays, needs mpi4py and mpirun; not in the default); ibm/ddp: spyreccl "
        "and/or gloo",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="result document (default: bench-results/<mode>-<timestamp>.json)",
    )
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="PNG plot (default: the JSON path with .png); sweep, threshold and decode",
    )
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--no-check",
        action="store_true",
        help="skip the one-off result check that precedes every timed case",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="bound on any collective wait and on a silent job, seconds",
    )

    s = p.add_argument_group("sweep and threshold")
    s.add_argument(
        "--separate-levels",
        action="store_true",
        help="sweep: run spyreccl and gloo in separate rank processes, one level after the "
        "other (default: they share rank processes and alternate case by case, so that each "
        "ratio compares measurements taken seconds apart)",
    )
    s.add_argument(
        "--min",
        dest="min_bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="smallest size, e.g. 8, 4K, 1M (default: sweep 8, threshold 256)",
    )
    s.add_argument(
        "--max",
        dest="max_bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="largest size (default: sweep 256M, threshold 4M)",
    )
    s.add_argument("--factor", type=int, default=2, help="size multiplication factor")
    s.add_argument(
        "--ops", type=_name_list(op_names()), default=op_names(), help="operations, comma separated"
    )
    s.add_argument(
        "--time-per-size",
        type=float,
        default=0.2,
        metavar="S",
        help="target wall time of the timed iterations of one case (sweep, funcol)",
    )
    s.add_argument(
        "--memory",
        type=_name_list(("host", "discrete")),
        default=["host"],
        help="sweep: memory modes of the emulated spyre device (SPYRECCL_SPYRE_MEMORY); "
        "discrete adds the level spyreccl-discrete (the staged path) and, beside host, a "
        "staging-overhead table",
    )
    s.add_argument("--min-iters", type=int, default=10)
    s.add_argument("--max-iters", type=int, default=2000)
    s.add_argument(
        "--oneshot-values",
        type=_name_list_sizes,
        default=None,
        metavar="LIST",
        help="threshold: SPYRECCL_ALLREDUCE_ONESHOT_MAX values to compare "
        "(default: 0 and 1G, i.e. always two-phase vs always one-shot, plus "
        "the library default)",
    )

    i = p.add_argument_group("ibm")
    i.add_argument(
        "--multiplier",
        "-m",
        type=int,
        default=1,
        help="multiplies the iteration counts (as in IBM's scripts)",
    )
    i.add_argument("--min-mb", type=float, default=0.1, help="smallest global size, MB (1e6 B)")
    i.add_argument("--max-mb", type=float, default=100.0, help="largest global size, MB")
    i.add_argument(
        "--ibm-ops",
        type=_name_list(("allreduce", "allgather", "reducescatter")),
        default=["allreduce", "allgather", "reducescatter"],
    )

    f = p.add_argument_group("funcol")
    f.add_argument(
        "--sizes",
        type=_name_list_sizes,
        default=[8, 4096, 65536, 1 << 20],
        metavar="LIST",
        help="funcol: message sizes, comma separated (default 8,4K,64K,1M)",
    )
    f.add_argument(
        "--graph-backends",
        type=_name_list(GRAPH_BACKENDS),
        default=list(GRAPH_BACKENDS),
        help="funcol: torch.compile backends of the graph rows (inductor-cpp: inductor "
        "with cpp_wrapper=True; -name: the graph passes the group's name instead of the "
        "ProcessGroup)",
    )

    dc = p.add_argument_group("decode")
    dc.add_argument(
        "--widths",
        type=_int_list,
        default=[1024, 2048, 4096, 8192],
        help="decode: model widths (hidden size)",
    )
    dc.add_argument(
        "--batches", type=_int_list, default=[1, 8, 32], help="decode: sequences per batch"
    )
    dc.add_argument(
        "--dtypes",
        type=_name_list(("bfloat16", "float16", "float32")),
        default=["bfloat16", "float32"],
        help="decode: model dtypes",
    )
    dc.add_argument(
        "--forms",
        type=_name_list(("eager", "compiled")),
        default=["eager", "compiled"],
        help="decode: eager and/or torch.compile'd blocks",
    )
    dc.add_argument("--layers", type=int, default=2, help="decode: transformer blocks")
    dc.add_argument("--vocab", type=int, default=512, help="decode: vocabulary size")
    dc.add_argument("--new-tokens", type=int, default=16, help="decode: tokens generated per round")
    dc.add_argument("--rounds", type=int, default=3, help="decode: timed rounds per variant")

    d = p.add_argument_group("ddp")
    d.add_argument("--model", choices=("mlp", "convnet"), default="mlp")
    d.add_argument("--steps", type=int, default=30, help="timed steps per backend")
    d.add_argument("--warmup-steps", type=int, default=5)
    d.add_argument("--batch-size", type=int, default=32)
    return p


def _name_list_sizes(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        part = part.strip()
        if part:
            values.append(_size(part))
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes, got {text!r}")
    return values


def _default_json(mode: str) -> str:
    return os.path.join("bench-results", f"{mode}-{timestamp()}.json")


def _run_sweep(args: argparse.Namespace) -> int:
    from .memcpy import measure_memcpy
    from .report import (
        format_markdown,
        format_routes,
        format_scaling_table,
        format_sweep_tables,
        plot_sweep,
        write_json,
    )
    from .staged import label_memory, memory_configs, staging_report
    from .sweep import TORCH_LEVELS, SweepConfig, plan_for, progress_bar, run_sweep

    sizes = sizes_from(args, 8, 256 << 20)
    levels = tuple(args.levels)
    if args.nodes > 1:
        # Across simulated nodes --nproc counts ranks per node (as torchrun's
        # --nproc-per-node); the core levels connect one node only.
        levels = tuple(lv for lv in levels if lv in TORCH_LEVELS)
    configs = [
        SweepConfig(
            nranks=n * args.nodes,
            ops=args.ops,
            sizes=sizes,
            dtype=args.dtype,
            levels=levels,
            policy=policy_from(args),
            timeout_s=args.timeout,
            check=not args.no_check,
            pair_torch_levels=not args.separate_levels,
            nodes=args.nodes,
        )
        for n in args.nproc
    ]
    configs = memory_configs(configs, args.memory)
    machine_at_start = describe_environment()
    memcpy = measure_memcpy()
    print(
        f"single-thread memcpy bandwidth: {memcpy.median_gbps:.2f} GB/s "
        f"(p10 {memcpy.p10_gbps:.2f}, p90 {memcpy.p90_gbps:.2f}; {memcpy.nbytes >> 20} MiB); "
        f"load average {os.getloadavg()[0]:.2f} on {machine_at_start['usable_cpus']} cpus",
        flush=True,
    )
    total = sum(len(plan_for(cfg)) * len(cfg.levels) for cfg, _ in configs)
    rows: list[dict] = []
    ranks_info: dict[str, dict] = {}
    with progress_bar(total, enabled=not args.no_progress) as bar:
        for cfg, memory in configs:
            # Each world size's rows carry their own gloo ratios (add_ratios keys on nranks).
            cfg_rows, info = run_sweep(cfg, bar)
            label_memory(cfg_rows, memory)
            if memory == "discrete":
                info = {f"{level}-discrete": ready for level, ready in info.items()}
            rows.extend(cfg_rows)
            ranks_info.update({f"{level} x{cfg.nranks}": ready for level, ready in info.items()})
    for r in rows:
        r["busbw_frac_memcpy"] = r["busbw_gbps"] / memcpy.median_gbps if r["bytes"] else None

    print(format_sweep_tables(rows, memcpy.median_gbps))
    if args.nodes > 1:
        print(format_routes(rows))
    if len(args.nproc) > 1:
        print(format_scaling_table(rows))
    staging = staging_report(rows, args.dtype)
    if staging:
        print(staging[0])
    json_path = args.json or _default_json("sweep")
    document = {
        "schema": "spyreccl-bench/1",
        "mode": "sweep",
        "command": command_line(args),
        "timestamp": timestamp(),
        "machine": machine_at_start,
        "loadavg_at_end": list(os.getloadavg()),
        "ranks": ranks_info,
        "config": {
            "nproc": args.nproc,
            "nodes": args.nodes,
            "dtype": args.dtype,
            "levels": args.levels,
            "ops": args.ops,
            "sizes": sizes,
            "policy": vars(policy_from(args)),
            "paired_torch_levels": not args.separate_levels,
            "memory": args.memory,
        },
        "memcpy": memcpy.to_dict(),
        "results": rows,
    }
    if staging:
        document["staging"] = staging[1]
    write_json(json_path, document)
    md_path = os.path.splitext(json_path)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(f"Command: `{document['command']}`\n\n")
        f.write(format_markdown(rows, memcpy.median_gbps))
    print(f"results: {json_path} (tables in Markdown: {md_path})")
    plot = plot_path(args, json_path)
    if plot:
        machine = document["machine"]
        plot_sweep(
            plot,
            rows,
            memcpy.median_gbps,
            f"spyreccl-bench sweep, {args.dtype}, nproc {args.nproc} "
            f"({machine['cpu_model']}, {machine['usable_cpus']} cpus)",
        )
        print(f"plot: {plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        # Ranks started by `--mode ibm` under torchrun get their options this way (ibm.py).
        forwarded = os.environ.get("SPYRECCL_BENCH_FORWARDED_ARGS")
        if forwarded and "RANK" in os.environ:
            argv = list(argv) + json.loads(forwarded)
    args = build_parser().parse_args(argv)
    args.argv = list(argv)  # recorded in the result documents, forwarded by --mode ibm
    if args.mode in ("sweep", "threshold", "decode") and not args.no_plot and matplotlib_missing():
        # Said before the run starts (not after it, when the PNG would be drawn).
        print(
            "spyreccl-bench: matplotlib is not installed: no PNG this run, tables and JSON "
            "only (pip install 'spyreccl-torch[bench]')",
            flush=True,
        )
        args.no_plot = True
    try:
        if args.mode == "sweep":
            return _run_sweep(args)
        if args.mode == "threshold":
            from .threshold import run_threshold

            return run_threshold(args)
        if args.mode == "ibm":
            from .ibm import run_ibm

            return run_ibm(args)
        if args.mode == "overhead":
            from .overhead import run_overhead

            return run_overhead(args)
        if args.mode == "funcol":
            from .funcol import run_funcol

            return run_funcol(args)
        if args.mode == "decode":
            from .decode import run_decode

            return run_decode(args)
        from .ddp import run_ddp

        return run_ddp(args)
    except BenchError as e:
        print(f"spyreccl-bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("spyreccl-bench: interrupted", file=sys.stderr)
        return 130
