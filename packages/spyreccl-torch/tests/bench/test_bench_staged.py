"""spyreccl-bench --memory host,discrete: the spyreccl level in both memory modes of the
emulated device and the staging-overhead table (harness only: tiny sizes, short loops)."""

from __future__ import annotations

import json

from spyreccl_torch.bench.cli import main
from spyreccl_torch.bench.staged import evaluate, format_staging_table

_FAST = ["--time-per-size", "0.005", "--min-iters", "3", "--max-iters", "50", "--no-progress"]


def test_sweep_in_both_memory_modes(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    ops = "all_reduce,all_gather_into_tensor,reduce_scatter_tensor,broadcast,sendrecv"
    rc = main(
        [
            *("--nproc", "2", "--levels", "spyreccl,gloo", "--ops", ops),
            *("--min", "64", "--max", "4M", "--factor", "256", "--memory", "host,discrete"),
            *("--json", str(out), "--no-plot", *_FAST),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    levels = {(r["level"], r.get("memory")) for r in doc["results"]}
    assert ("spyreccl", None) not in levels
    assert {("spyreccl", "host"), ("gloo", "host"), ("spyreccl-discrete", "discrete")} <= levels
    staging = doc["staging"]
    assert {s["op"] for s in staging} == set(ops.split(","))
    assert {s["bytes"] for s in staging if s["op"] == "all_reduce"} == {64, 16384, 4 << 20}
    for s in staging:
        assert s["host_us"] > 0 and s["staged_us"] > 0 and s["d2h_us"] > 0 and s["h2d_us"] > 0
        assert (s["target_us"] is None) == (64 << 10 < s["bytes"] < 4 << 20)
    text = capsys.readouterr().out
    assert "# staging overhead" in text and "spyreccl-discrete" in text


def test_staging_targets():
    def pair(nbytes, host, staged):
        row = {"nranks": 2, "op": "all_reduce", "dtype": "float32", "requested_bytes": nbytes}
        return {
            "host": {**row, "bytes": nbytes, "time_us": {"median_us": host}},
            "discrete": {**row, "bytes": nbytes, "time_us": {"median_us": staged}},
            "copy_bytes": (nbytes, nbytes),
        }

    copies = {8: (2.0, 3.0), 1 << 20: (50.0, 50.0), 8 << 20: (400.0, 400.0)}
    results = evaluate(
        [pair(8, 10.0, 15.0), pair(8, 10.0, 15.1), pair(1 << 20, 100.0, 500.0)]
        + [pair(8 << 20, 1000.0, 1300.0), pair(8 << 20, 1000.0, 1301.0)],
        copies,
    )
    assert [r["meets_target"] for r in results] == [True, False, None, True, False]
    assert results[3]["target_us"] == 1300.0 and results[0]["overhead_us"] == 5.0
    assert "NO" in format_staging_table(results)
