"""Unit tests of the benchmark suite's pure-Python parts (no ranks started)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from spyreccl_torch.bench import ops, plan, report, stats, timing
from spyreccl_torch.bench.ibm import ibm_iterations, ibm_sizes_mb
from spyreccl_torch.bench.sweep import SweepConfig, level_groups
from spyreccl_torch.bench.threshold import crossover


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 7])
def test_bus_factors_match_nccl_tests(nranks):
    n = nranks
    for name in ("all_reduce", "all_reduce_inplace"):
        assert ops.OPS[name].bus_factor(n) == pytest.approx(2 * (n - 1) / n)
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        assert ops.OPS[name].bus_factor(n) == pytest.approx((n - 1) / n)
    assert ops.OPS["broadcast"].bus_factor(n) == 1.0
    assert ops.OPS["sendrecv"].bus_factor(n) == 1.0


@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_layouts_are_consistent(nranks, itemsize):
    rng = random.Random(1234 + nranks * 10 + itemsize)
    for _ in range(200):
        nbytes = rng.randrange(0, 1 << 22)
        for name in ops.op_names():
            lay = ops.layout(name, nbytes, itemsize, nranks)
            if name == "barrier":
                assert (lay.nbytes, lay.send_elems, lay.recv_elems) == (0, 0, 0)
                continue
            assert lay.unit >= 1
            # never more than asked for, except the one-element-per-block floor
            assert lay.nbytes <= max(
                nbytes, itemsize * (1 if lay.unit == lay.send_elems == lay.recv_elems else nranks)
            )
            if name in ("all_reduce", "all_reduce_inplace", "broadcast", "sendrecv"):
                assert lay.send_elems == lay.recv_elems == lay.unit
                assert lay.nbytes == lay.unit * itemsize
            elif name == "all_gather_into_tensor":
                assert (lay.send_elems, lay.recv_elems) == (lay.unit, lay.unit * nranks)
                assert lay.nbytes == lay.recv_elems * itemsize
            elif name == "reduce_scatter_tensor":
                assert (lay.send_elems, lay.recv_elems) == (lay.unit * nranks, lay.unit)
                assert lay.nbytes == lay.send_elems * itemsize
            else:
                assert lay.send_elems == lay.recv_elems == lay.unit * nranks
                assert lay.nbytes == lay.send_elems * itemsize


def test_layout_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown operation 'allreduce'"):
        ops.layout("allreduce", 8, 4, 2)
    with pytest.raises(ValueError, match="itemsize >= 1"):
        ops.layout("all_reduce", 8, 0, 2)


@pytest.mark.parametrize(
    ("levels", "paired", "groups"),
    [
        (
            ("core", "core-host", "spyreccl", "gloo"),
            True,
            [("core",), ("core-host",), ("spyreccl", "gloo")],
        ),
        (("gloo", "core", "spyreccl"), True, [("gloo", "spyreccl"), ("core",)]),
        (
            ("core", "core-host", "spyreccl", "gloo"),
            False,
            [("core",), ("core-host",), ("spyreccl",), ("gloo",)],
        ),
        (("spyreccl",), True, [("spyreccl",)]),
        (("gloo", "core-host"), True, [("gloo",), ("core-host",)]),
    ],
)
def test_torch_levels_share_one_job_unless_separated(levels, paired, groups):
    cfg = SweepConfig(
        nranks=2, ops=["all_reduce"], sizes=[8], levels=levels, pair_torch_levels=paired
    )
    assert level_groups(cfg) == groups


def test_odd_world_size_plan_rounds_and_dedups():
    cases = plan.build_plan(["all_gather_into_tensor"], [8, 16, 32, 64], 4, 3)
    # 8 B and 16 B both become one float per rank (12 B); 32 B -> 2 (24 B); 64 B -> 5
    assert [c.nbytes for c in cases] == [12, 24, 60]
    assert [c.index for c in cases] == [0, 1, 2]


def test_plan_drops_sendrecv_at_one_rank_and_measures_barrier_once():
    cases = plan.build_plan(["sendrecv", "barrier"], [8, 16], 4, 1)
    assert [(c.op, c.nbytes) for c in cases] == [("barrier", 0)]


def test_sizes_parse_and_series():
    assert plan.parse_size("8") == 8
    assert plan.parse_size("64K") == 64 << 10
    assert plan.parse_size("1MiB") == 1 << 20
    assert plan.parse_size("256m") == 256 << 20
    with pytest.raises(ValueError, match="expected a number"):
        plan.parse_size("12 parsecs")
    series = plan.pow2_sizes(8, 256 << 20, 2)
    assert series[0] == 8 and series[-1] == 256 << 20 and len(series) == 26
    assert plan.pow2_sizes(1000, 9000, 3) == [1000, 3000, 9000]
    with pytest.raises(ValueError, match="factor must be >= 2"):
        plan.pow2_sizes(8, 16, 1)


def test_combine_and_summarize_against_numpy():
    rng = np.random.default_rng()
    a = rng.integers(1_000, 50_000, size=101)
    b = rng.integers(1_000, 50_000, size=101)
    combined = stats.combine_ranks([a.tolist(), None, b.tolist()])
    np.testing.assert_allclose(combined, (a + b) / 2)
    s = stats.summarize(combined)
    ref = np.sort((a + b) / 2) / 1e3
    assert s.iters == 101
    assert s.median_us == pytest.approx(ref[50])
    assert s.min_us == pytest.approx(ref[0]) and s.max_us == pytest.approx(ref[-1])
    assert s.p10_us == pytest.approx(np.percentile(ref, 10))
    assert s.p90_us == pytest.approx(np.percentile(ref, 90))


def test_combine_rejects_unequal_iteration_counts():
    with pytest.raises(ValueError, match="different iteration counts"):
        stats.combine_ranks([[1, 2, 3], [1, 2]])
    with pytest.raises(ValueError, match="no rank reported"):
        stats.combine_ranks([None, None])


def test_bandwidths():
    algbw, busbw = stats.bandwidths(1 << 20, 100.0, 1.5)
    assert algbw == pytest.approx((1 << 20) / 100e-6 / 1e9)
    assert busbw == pytest.approx(algbw * 1.5)
    assert stats.bandwidths(0, 10.0, 1.0) == (0.0, 0.0)


def test_measure_agrees_on_iteration_count_and_aligns_batches():
    calls = {"step": 0, "barrier": 0, "agree": []}

    def step():
        calls["step"] += 1

    def barrier():
        calls["barrier"] += 1

    def agree(v):
        calls["agree"].append(v)
        return 0.01  # a slower peer: 10 ms per call

    policy = timing.LoopPolicy(target_s=0.5, min_iters=3, max_iters=1000)
    samples = timing.measure(step, barrier, agree, warmup=4, policy=policy)
    assert len(samples) == 50  # 0.5 s / 10 ms, decided by the agreed (max) estimate
    assert calls["step"] == 54
    assert calls["barrier"] == 1 + 20  # before warm-up, then before each of 20 batches
    assert len(calls["agree"]) == 1 and calls["agree"][0] >= 0
    assert all(s >= 0 for s in samples)


def test_loop_policy_bounds():
    p = timing.LoopPolicy(target_s=1.0, min_iters=10, max_iters=100, max_case_s=100.0)
    assert p.iterations(1.0) == 10
    assert p.iterations(1e-6) == 100
    assert p.iterations(0.02) == 50
    with pytest.raises(ValueError, match="min_iters <= max_iters"):
        timing.LoopPolicy(min_iters=5, max_iters=4)
    assert timing.warmup_iters(8) > timing.warmup_iters(256 << 20) >= 1


def test_ibm_sizes_and_iterations():
    sizes = ibm_sizes_mb(0.1, 100.0)
    assert sizes[:4] == [0.1, 0.125, 0.16, 0.2] and sizes[-1] == 100.0
    assert len(sizes) == 31  # 10 per decade, both ends included
    ratios = np.diff(np.log10(sizes))
    assert np.all(ratios > 0.05) and np.all(ratios < 0.15)
    assert ibm_iterations(100, 1) == 20 and ibm_iterations(1000, 2) == 20
    assert ibm_iterations(5000, 1) == 5


def test_crossover():
    sizes = [1, 2, 4, 8, 16]
    one = {1: 1.0, 2: 1.0, 4: 2.0, 8: 4.0, 16: 8.0}
    two = {1: 3.0, 2: 0.5, 4: 3.0, 8: 3.0, 16: 5.0}
    assert crossover(sizes, one, two) == 8  # 2 B is a blip, not a lasting crossover
    assert crossover(sizes, one, {s: 100.0 for s in sizes}) is None


def _row(level, op, nbytes, t, nranks=2):
    algbw, busbw = stats.bandwidths(nbytes, t, ops.OPS[op].bus_factor(nranks))
    return {
        "level": level,
        "nranks": nranks,
        "op": op,
        "dtype": "float32",
        "bytes": nbytes,
        "requested_bytes": nbytes,
        "count": nbytes // 4,
        "time_us": {
            "median_us": t,
            "p10_us": t * 0.9,
            "p90_us": t * 1.2,
            "min_us": t * 0.8,
            "max_us": t * 2,
            "mean_us": t,
            "iters": 10,
        },
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
    }


def test_tables_json_and_plot(tmp_path):
    from spyreccl_torch.bench.sweep import add_ratios

    rows = [
        _row(lv, "all_reduce", s, t)
        for lv, f in (("core", 1), ("spyreccl", 2), ("gloo", 40))
        for s, t in ((8, 2.0 * f), (1 << 20, 300.0 * f))
    ]
    rows.append(_row("gloo", "barrier", 0, 150.0))
    add_ratios(rows)
    by = {(r["level"], r["bytes"]): r for r in rows}
    assert by[("spyreccl", 8)]["speedup_vs_gloo"] == pytest.approx(20.0)
    assert by[("core", 1 << 20)]["speedup_vs_gloo"] == pytest.approx(40.0)
    text = report.format_sweep_tables(rows, memcpy_gbps=7.0)
    assert "# all_reduce  float32  2 ranks" in text and "1 MiB" in text
    assert "20.0x" in text and "# barrier" in text
    scaling = report.format_scaling_table(rows + [_row("core", "all_reduce", 8, 3.0, 3)])
    assert "n=2" in scaling and "n=3" in scaling
    path = tmp_path / "r.json"
    report.write_json(str(path), {"results": rows})
    assert json.loads(path.read_text())["results"][0]["level"] == "core"
    png = tmp_path / "r.png"
    report.plot_sweep(str(png), rows, 7.0, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_format_bytes():
    assert report.format_bytes(8) == "8 B"
    assert report.format_bytes(64 << 10) == "64 KiB"
    assert report.format_bytes(3 << 19) == "1.5 MiB"


_CHILD = """
import os, sys
def _run(a):
    conn, rank = a["conn"], a["rank"]
    conn.send(("ready", {"torch_loaded": "torch" in sys.modules}))
    if a["behaviour"] == "raise" and rank == 1:
        conn.send(("error", "Traceback: ValueError: rank 1 exploded"))
        raise SystemExit(1)
    if a["behaviour"] == "die" and rank == 1:
        os._exit(7)
    conn.send(("case", 0, [rank]))
    conn.send(("done",))
if __name__ == "spyreccl_bench_rank":
    _run(SPYRECCL_BENCH_ARGS)
"""


@pytest.mark.parametrize("behaviour", ["ok", "raise", "die"])
def test_launcher_reports_results_and_failures(tmp_path, behaviour):
    from spyreccl_torch.bench.launcher import BenchError, RankJob

    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    seen = []
    with RankJob("unit", 3, {"behaviour": behaviour}, script=str(script)) as job:
        if behaviour == "ok":
            seen = list(job.messages(stall_timeout_s=60))
        else:
            expected = "rank 1 exploded" if behaviour == "raise" else "exited with code 7"
            with pytest.raises(BenchError, match=expected):
                list(job.messages(stall_timeout_s=60))
    if behaviour == "ok":
        cases = sorted(m[2][0] for _, m in seen if m[0] == "case")
        assert cases == [0, 1, 2]
        # script ranks must not inherit torch (the core level is measured without it)
        assert not any(m[1]["torch_loaded"] for _, m in seen if m[0] == "ready")


def _simulate(op, inputs, nranks, unit):
    """Reference semantics (float64 numpy) of each op given every rank's input buffer."""
    if op in ("all_reduce", "all_reduce_inplace"):
        return [np.sum(inputs, axis=0) for _ in range(nranks)]
    if op == "reduce_scatter_tensor":
        total = np.sum(inputs, axis=0)
        return [total[r * unit : (r + 1) * unit] for r in range(nranks)]
    if op == "all_gather_into_tensor":
        return [np.concatenate(inputs) for _ in range(nranks)]
    if op == "broadcast":
        return [inputs[0].copy() for _ in range(nranks)]
    if op == "all_to_all_single":
        return [
            np.concatenate([inputs[q][r * unit : (r + 1) * unit] for q in range(nranks)])
            for r in range(nranks)
        ]
    if op == "sendrecv":
        return [inputs[1], inputs[0]] + [None] * (nranks - 2)
    raise AssertionError(op)


@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("op", [o for o in ops.op_names() if o != "barrier"])
def test_check_expectations_match_reference_semantics(op, nranks):
    from spyreccl_torch.bench import check

    unit = random.randint(1, 7)
    lay = ops.layout(
        op,
        unit
        * 4
        * (1 if op in ("all_reduce", "all_reduce_inplace", "broadcast", "sendrecv") else nranks),
        4,
        nranks,
    )
    inputs = []
    for r in range(nranks):
        blocks = check.input_blocks(op, r, nranks)
        inputs.append(
            np.repeat(np.asarray(blocks, dtype=np.float64), lay.send_elems // len(blocks))
        )
    results = _simulate(op, inputs, nranks, lay.unit)
    for r in range(nranks):
        expected = check.expected_blocks(op, r, nranks)
        if results[r] is None:
            assert expected is None
            continue
        want = np.repeat(np.asarray(expected, dtype=np.float64), results[r].size // len(expected))
        np.testing.assert_array_equal(results[r], want)
        assert check.POISON not in want  # a skipped write can never look right
        assert max(expected) <= 127  # exact in int8 and in bfloat16's 8-bit mantissa


def test_loop_policy_caps_very_slow_cases():
    p = timing.LoopPolicy(target_s=0.2, min_iters=10, max_iters=100, max_case_s=2.0)
    assert p.iterations(0.1) == 10  # 1 s for min_iters: within the cap
    assert p.iterations(0.5) == 5  # 10 x 0.5 s would exceed 2 s: the floor of 5 applies
    assert p.iterations(0.25) == 8  # 2 s / 0.25 s


def test_tables_show_median_p90_and_mean_for_every_level():
    rows = [_row(lv, "all_reduce", 8, t) for lv, t in (("core-host-vs-mpi", 1.25), ("mpi", 2.5))]
    rows[0]["time_us"].update(p90_us=1.75, mean_us=4.3)
    text = report.format_sweep_tables(rows, memcpy_gbps=None)
    header = next(line for line in text.splitlines() if "median" in line)
    assert header.count("median") == 2 and header.count("mean") == 2
    assert header.count("p90") == 2
    line = next(line for line in text.splitlines() if line.strip().startswith("8 B"))
    assert "1.75" in line and "4.30" in line and "2.50" in line
    md = report.format_markdown(rows, memcpy_gbps=None)
    assert "mpi µs median (p10-p90), mean" in md and ", 4.3 |" in md


def test_mpi_level_is_optional_and_skipped_with_a_reason(monkeypatch, capsys):
    from spyreccl_torch.bench import mpi_level, sweep

    monkeypatch.setattr(mpi_level.importlib.util, "find_spec", lambda name: None)
    assert "mpi4py is not importable" in mpi_level.unavailable()
    assert "mpi" in sweep.ALL_LEVELS and "mpi" not in sweep.DEFAULT_LEVELS
    cfg = SweepConfig(nranks=2, ops=["all_reduce"], sizes=[8], levels=("mpi",))
    assert level_groups(cfg) == [("mpi",)]
    rows, info = sweep.run_sweep(cfg, sweep._Progress(1, enabled=False))
    assert rows == [] and "mpi4py is not importable" in info["mpi"]["skipped"]
    assert "skipping the mpi level" in capsys.readouterr().out
    with pytest.raises(ValueError, match="one node only"):
        SweepConfig(nranks=4, ops=["all_reduce"], sizes=[8], levels=("mpi",), nodes=2)


def test_mpi_level_command_and_rows_from_a_report():
    from spyreccl_torch.bench import mpi_level
    from spyreccl_torch.bench.sweep import _row as sweep_row

    cmd = mpi_level.mpirun_command(3, "a.json", "o.json", as_root=True)
    assert cmd[:3] == ["mpirun", "-n", "3"] and "--allow-run-as-root" in cmd
    assert cmd[cmd.index("--bind-to") + 1] == "none"
    assert "btl_vader_single_copy_mechanism" in cmd and cmd[cmd.index("btl") + 1] == "self,vader"
    assert "--allow-run-as-root" not in mpi_level.mpirun_command(2, "a", "o", as_root=False)
    cfg = SweepConfig(nranks=2, ops=["sendrecv", "all_reduce"], sizes=[1024], levels=("mpi",))
    cases = plan.build_plan(cfg.ops, cfg.sizes, 4, 2)
    report_doc = {
        "results": [
            {"level": "core-host-vs-mpi", "index": 0, "samples": [[2000, 4000], [2000, 4000]]},
            {"level": "mpi", "index": 0, "samples": [[3000, 3000], [3000, 3000]]},
            {"level": "mpi", "index": 1, "samples": [[1000, 3000], [1000, 3000]]},
        ]
    }
    rows = mpi_level.rows_from_report(
        report_doc, cases, lambda lv, case, per_rank: sweep_row(lv, cfg, case, per_rank)
    )
    assert [(r["level"], r["op"]) for r in rows] == [
        ("core-host-vs-mpi", "sendrecv"),
        ("mpi", "sendrecv"),
        ("mpi", "all_reduce"),
    ]
    # sendrecv samples are round trips: half of (2, 4) us -> mean 1.5 us.
    assert rows[0]["time_us"]["mean_us"] == pytest.approx(1.5)
    assert rows[2]["time_us"]["p90_us"] == pytest.approx(2.8)


def test_in_call_costs_split_the_transfer_from_the_wait_for_a_late_rank():
    """Two ranks, three calls of 8 elements (a prefill call of 40 between them is ignored):
    the time after the last arrival is the transfer, the arrivals' spread the wait."""
    from spyreccl_torch.bench.decode_timing import in_call_costs

    rng = random.Random(5)
    expected_in_call, expected_wait, ranks = [], [], [[], []]
    t = 1_000_000
    for call in range(3):
        early = t + rng.randrange(0, 50_000)
        late = early + rng.randrange(1_000, 900_000)
        done = [late + rng.randrange(2_000, 9_000) for _ in range(2)]
        order = [early, late] if call % 2 == 0 else [late, early]  # either rank may be late
        for r in range(2):
            ranks[r].append((order[r], done[r], 8))
            ranks[r].append((done[r] + 100, done[r] + 60_000, 40))  # not a decode call
        expected_in_call.append((done[0] - late + done[1] - late) / 2 / 1e3)
        expected_wait.append((late - early) / 1e3)
        t = max(done) + 1_000_000
    costs = in_call_costs(ranks, 8)
    assert costs.calls == 3
    assert costs.in_call_us == pytest.approx(sorted(expected_in_call)[1])
    assert costs.wait_us == pytest.approx(sorted(expected_wait)[1])
    with pytest.raises(ValueError, match="same number on every rank"):
        in_call_costs([ranks[0], ranks[1][:-2]], 8)
    with pytest.raises(ValueError, match="no call of 16 elements"):
        in_call_costs(ranks, 16)


def test_decode_row_derives_the_floors_ratios_and_the_table_aligns_them():
    """A compiled case from two ranks' step times (random, one per rank and step): medians
    over the steps of the mean over ranks, the ratios to both floors, and the table's DT
    floor cells under their own headings although the compiled row has no hook variant."""
    from spyreccl_torch.bench.decode import _row, format_table

    rng = random.Random(11)
    names = ("spyreccl", "floor spyreccl", "dtensor floor spyreccl", "gloo", "floor gloo")
    base = {"spyreccl": 9.0, "floor spyreccl": 8.0, "dtensor floor spyreccl": 8.5,
            "gloo": 14.0, "floor gloo": 7.5}  # fmt: skip
    per_rank = []
    for _ in range(2):
        steps = {
            n: [int((base[n] + rng.uniform(-0.2, 0.2)) * 1e6) for _ in range(9)] for n in names
        }
        per_rank.append({
            "config": {"n_layers": 2, "dim": 256}, "steps_ns": steps,
            "ttft_ns": {n: [int(3e7)] * 3 for n in names},  # 3 rounds of 3 steps
            "alone_us": {"spyreccl": rng.uniform(5, 20), "gloo": rng.uniform(50, 200)},
            "alone_cold_us": {}, "manual_calls_ns": [],
        })  # fmt: skip
    case = {"width": 256, "batch": 2, "dtype": "float32", "form": "compiled"}
    row = _row(case, per_rank, 2)

    def median_ms(name: str) -> float:
        means = [(a + b) / 2 for a, b in zip(*(r["steps_ns"][name] for r in per_rank))]
        return sorted(means)[len(means) // 2] / 1e6

    ours = row["spyreccl"]
    tok, floor, dt = (
        median_ms(n) for n in ("spyreccl", "floor spyreccl", "dtensor floor spyreccl")
    )
    alone = sum(r["alone_us"]["spyreccl"] for r in per_rank) / 2
    assert ours["token_ms"] == pytest.approx(tok) and ours["dtensor_floor_ms"] == pytest.approx(dt)
    assert ours["vs_floor"] == pytest.approx(tok / floor)
    assert ours["vs_dtensor_floor"] == pytest.approx(tok / dt)
    assert ours["dtensor_comm_ms"] == pytest.approx(tok - dt)
    assert ours["dtensor_comm_vs_alone"] == pytest.approx((tok - dt) * 1e3 / (4 * alone))
    assert ours["dtensor_dispatch_ms"] == pytest.approx(dt - floor)
    assert "dtensor_ms" not in ours  # compiled: no hook variant

    def round_medians(name: str) -> list[float]:
        means = [(a + b) / 2 for a, b in zip(*(r["steps_ns"][name] for r in per_rank))]
        return [sorted(means[i : i + 3])[1] for i in range(0, 9, 3)]

    expected = [
        a / b for a, b in zip(round_medians("spyreccl"), round_medians("dtensor floor spyreccl"))
    ]
    assert ours["vs_dtensor_floor_rounds"] == pytest.approx(expected)
    assert ours["vs_floor_rounds"] == pytest.approx(
        [a / b for a, b in zip(round_medians("spyreccl"), round_medians("floor spyreccl"))]
    )
    lines = format_table([row]).splitlines()
    head, cells = lines[1], lines[3]
    for heading, value in (
        ("DT floor", ours["dtensor_floor_ms"]),
        ("x DT fl", ours["vs_dtensor_floor"]),
    ):
        end = head.index(heading) + len(heading)
        text = f"{value:.2f}" if heading == "DT floor" else f"{value:.3f}"
        assert cells[:end].endswith(text), (heading, head, cells)
    end = head.index("rounds") + len("rounds")
    assert cells[:end].endswith(f"{min(expected):.3f}-{max(expected):.3f}"), (head, cells)
