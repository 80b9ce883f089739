"""End-to-end runs of spyreccl-bench with real rank processes (tiny sizes, short loops).

They check the harness (launching, result checks, aggregation, documents), not speed.
"""

from __future__ import annotations

import json

import pytest

from spyreccl_torch.bench.cli import main

_FAST = ["--time-per-size", "0.005", "--min-iters", "3", "--max-iters", "50", "--no-progress"]


def _load(path):
    return json.loads(path.read_text())


def test_sweep_all_levels_odd_world_size(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    rc = main(
        ["--nproc", "3", "--min", "4", "--max", "4K", "--factor", "32", "--json", str(out), *_FAST]
    )
    assert rc == 0
    doc = _load(out)
    rows = doc["results"]
    assert doc["mode"] == "sweep" and doc["memcpy"]["median_gbps"] > 0
    sizes_by = {}
    for r in rows:
        sizes_by.setdefault((r["level"], r["op"]), []).append(r["bytes"])
        t = r["time_us"]
        assert 0 < t["min_us"] <= t["p10_us"] <= t["median_us"] <= t["p90_us"] <= t["max_us"]
        assert r["nranks"] == 3 and t["iters"] >= 3
    for level in ("core", "core-host", "spyreccl", "gloo"):
        assert sizes_by[(level, "barrier")] == [0]
        # 4 B all-gather at 3 ranks rounds up to one float per rank (12 B); 128 B -> 120 B
        assert sizes_by[(level, "all_gather_into_tensor")] == [12, 120, 4092]
        assert sizes_by[(level, "all_reduce")] == [4, 128, 4096]
        assert sizes_by[(level, "sendrecv")] == [4, 128, 4096]
    spy = [r for r in rows if r["level"] == "spyreccl"]
    assert all(r["speedup_vs_gloo"] > 0 for r in spy)
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "# all_to_all_single  float32  3 ranks" in text


def test_sweep_direct_transfers_are_checked(tmp_path):
    """512 KiB: above the direct-transfer threshold, so the core level (arena buffers) and
    spyre tensors (arena-allocated) take the direct path; every result is verified."""
    out = tmp_path / "direct.json"
    rc = main(
        [
            "--nproc",
            "2",
            "--min",
            "512K",
            "--max",
            "512K",
            "--ops",
            "all_reduce,all_gather_into_tensor,reduce_scatter_tensor,broadcast,all_to_all_single",
            "--levels",
            "core,spyreccl",
            "--json",
            str(out),
            "--no-plot",
            *_FAST,
        ]
    )
    assert rc == 0
    rows = _load(out)["results"]
    assert {(r["level"], r["op"]) for r in rows} == {
        (lv, op)
        for lv in ("core", "spyreccl")
        for op in (
            "all_reduce",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "broadcast",
            "all_to_all_single",
        )
    }


def test_threshold_mode(tmp_path):
    out = tmp_path / "th.json"
    rc = main(
        [
            "--mode",
            "threshold",
            "--nproc",
            "2",
            "--min",
            "1K",
            "--max",
            "64K",
            "--factor",
            "8",
            "--json",
            str(out),
            "--no-plot",
            *_FAST,
        ]
    )
    assert rc == 0
    doc = _load(out)
    values = {r["oneshot_max"] for r in doc["results"]}
    assert values == {0, 1 << 20, None}
    assert {r["bytes"] for r in doc["results"]} == {1024, 8192, 65536}


@pytest.mark.parametrize("level", ["spyreccl", "gloo"])
def test_ddp_mode(tmp_path, level):
    out = tmp_path / "ddp.json"
    rc = main(
        [
            "--mode",
            "ddp",
            "--levels",
            level,
            "--steps",
            "3",
            "--warmup-steps",
            "1",
            "--batch-size",
            "4",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    (row,) = _load(out)["results"]
    assert row["level"] == level and row["ddp_step_ms"]["median"] > 0
    assert row["params"] > 1_000_000


def test_ibm_mode_self_launches_under_torchrun(tmp_path):
    out = tmp_path / "ibm.json"
    rc = main(
        [
            "--mode",
            "ibm",
            "--max-mb",
            "0.13",
            "--ibm-ops",
            "allreduce,reducescatter",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    rows = _load(out)["results"]
    assert {(r["level"], r["op"]) for r in rows} == {
        (lv, op) for lv in ("spyreccl", "gloo") for op in ("allreduce", "reducescatter")
    }
    for r in rows:
        assert r["size_mb"] in (0.1, 0.125)
        assert r["tmin_us"] <= r["tavg_us"] <= r["tmax_us"] * (1 + 1e-9)
        assert r["minbw_gbps"] <= r["avgbw_gbps"] <= r["maxbw_gbps"]


def _funcol_run(tmp_path, sizes: str, graph_backends: str) -> dict:
    """spyreccl-bench --mode funcol on 2 ranks, briefly; its JSON document."""
    out = tmp_path / "funcol.json"
    args = ["--mode", "funcol", "--nproc", "2", "--sizes", sizes]
    args += ["--graph-backends", graph_backends, "--time-per-size", "0.01", "--json", str(out)]
    assert main(args) == 0
    doc = _load(out)
    assert doc["mode"] == "funcol"
    return doc


def test_funcol_mode(tmp_path, capsys):
    """Every row at two sizes with one compiled-graph backend: the ranks agree on the batch
    lengths, the compiled graphs' results are checked inside, and the table and document
    carry every row for both levels."""
    doc = _funcol_run(tmp_path, "8,4K", "aot_eager")
    for level in ("spyreccl", "gloo"):
        result = doc["results"][level]
        assert sorted(result["sizes"]) == ["4096", "8"]
        for rows in result["sizes"].values():
            for row in ("eager", "async+wait", "op", "op_", "op_ torch-path", "funcol", "dtensor"):
                r = rows[row]
                assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"], (level, row, r)
            assert "graph_with_us" in rows["aot_eager+"], rows["aot_eager+"]
        step = result["tp_mlp_step"]
        assert step["tp"]["median_us"] > 0 and step["local"]["median_us"] > 0
        assert "tp_compiled" not in step  # only with an inductor graph row
        assert result["overlap"]["both"] > 0
    text = capsys.readouterr().out
    assert "aot_eager+" in text and "tensor-parallel MLP block" in text


def test_funcol_mode_with_inductor_times_the_compiled_tensor_parallel_step(tmp_path, capsys):
    """With an inductor graph row, the run also compiles the tensor-parallel block (forward
    and backward graphs with functional collectives), checks it against the eager block
    inside, and reports its step next to the eager one, on both levels."""
    doc = _funcol_run(tmp_path, "8", "inductor-name")
    for level in ("spyreccl", "gloo"):
        result = doc["results"][level]
        assert "error" not in result["sizes"]["8"]["inductor-name+"], result["sizes"]["8"]
        step = result["tp_mlp_step"]
        assert step["tp_compiled"]["median_us"] > 0, step
    assert "tp compiled" in capsys.readouterr().out


def test_decode_mode_tiny_model(tmp_path, capsys):
    """Every (dtype, batch) case of a tiny grid: spyreccl, gloo and both floors timed, the
    derived ratios consistent with the medians they come from."""
    out = tmp_path / "decode.json"
    rc = main(
        [
            "--mode", "decode", "--nproc", "2", "--widths", "128", "--batches", "1,3",
            "--dtypes", "bfloat16,float32", "--forms", "eager", "--layers", "1",
            "--new-tokens", "3", "--rounds", "2", "--json", str(out), "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    doc = _load(out)
    assert doc["mode"] == "decode"
    rows = doc["results"]
    assert [(r["dtype"], r["batch"]) for r in rows] == [
        ("bfloat16", 1), ("bfloat16", 3), ("float32", 1), ("float32", 3),
    ]  # fmt: skip
    for r in rows:
        assert r["nranks"] == 2 and r["width"] == 128 and r["form"] == "eager"
        itemsize = 2 if r["dtype"] == "bfloat16" else 4
        assert r["all_reduce_bytes"] == r["batch"] * 128 * itemsize
        assert r["all_reduces_per_token"] == 2
        for name in ("spyreccl", "gloo", "floor spyreccl", "floor gloo"):
            v = r[name]
            # 2 rounds x (3 - 1) decode steps
            assert v["steps"] == 4 and 0 < v["token_ms"] <= v["p90_ms"] and v["ttft_ms"] > 0
        for level in ("spyreccl", "gloo"):
            v, floor = r[level], r[f"floor {level}"]
            assert v["vs_floor"] == pytest.approx(v["token_ms"] / floor["token_ms"])
            assert v["comm_ms"] == pytest.approx(v["token_ms"] - floor["token_ms"])
            assert v["alone_us"] > 0
        assert r["gloo_over_spyreccl"] == pytest.approx(
            r["gloo"]["token_ms"] / r["spyreccl"]["token_ms"]
        )
        # Eager: the same all_reduces without DTensor, and DTensor's share derived from it.
        manual, ours = r["manual spyreccl"], r["spyreccl"]
        assert manual["steps"] == 4 and 0 < manual["token_ms"] <= manual["p90_ms"]
        assert ours["dtensor_ms"] == pytest.approx(ours["token_ms"] - manual["token_ms"])
        assert ours["manual_comm_vs_alone"] == pytest.approx(
            (manual["token_ms"] - r["floor spyreccl"]["token_ms"])
            * 1e3
            / (r["all_reduces_per_token"] * ours["alone_us"])
        )
        # The hooks' calls split into transfer and wait: 3 generations (one untimed) x 2
        # decode steps x 2 all_reduces, each rank's in the same order.
        assert ours["timed_calls"] == 12
        assert ours["in_call_us"] > 0 and ours["wait_us"] >= 0
        assert ours["in_call_vs_alone"] == pytest.approx(ours["in_call_us"] / ours["alone_us"])
        assert ours["alone_cold_us"] > 0
        assert ours["in_call_vs_cold"] == pytest.approx(ours["in_call_us"] / ours["alone_cold_us"])
        # Eager: the DTensor model on a group that moves nothing, and what derives from it.
        dt_floor = r["dtensor floor spyreccl"]
        assert dt_floor["steps"] == 4 and 0 < dt_floor["token_ms"] <= dt_floor["p90_ms"]
        assert ours["dtensor_floor_ms"] == dt_floor["token_ms"]
        assert ours["vs_dtensor_floor"] == pytest.approx(ours["token_ms"] / dt_floor["token_ms"])
        assert ours["dtensor_comm_ms"] == pytest.approx(ours["token_ms"] - dt_floor["token_ms"])
        assert ours["dtensor_comm_vs_alone"] == pytest.approx(
            ours["dtensor_comm_ms"] * 1e3 / (r["all_reduces_per_token"] * ours["alone_us"])
        )
        assert ours["dtensor_dispatch_ms"] == pytest.approx(
            dt_floor["token_ms"] - r["floor spyreccl"]["token_ms"]
        )
        # The ratios to both floors round by round: one per round.
        for key in ("vs_floor_rounds", "vs_dtensor_floor_rounds"):
            assert len(ours[key]) == 2 and all(x > 0 for x in ours[key]), (key, ours[key])
    assert (tmp_path / "decode.png").stat().st_size > 10_000
    assert "# decode: ms per token" in capsys.readouterr().out


def test_without_matplotlib_says_so_first_and_writes_tables_and_json(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "sweep.json"
    args = ["--levels", "core", "--ops", "all_reduce", "--min", "8", "--max", "8"]
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # import matplotlib raises ImportError\n"
        "from spyreccl_torch.bench.cli import main\n"
        f"sys.exit(main({[*args, '--json', str(out), *_FAST]!r}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Said first, before anything of the run.
    assert result.stdout.startswith("spyreccl-bench: matplotlib is not installed"), result.stdout
    assert "spyreccl-torch[bench]" in result.stdout.splitlines()[0]
    assert _load(out)["results"] and (tmp_path / "sweep.md").is_file()
    assert not (tmp_path / "sweep.png").exists()
    assert "results:" in result.stdout and "plot:" not in result.stdout
