"""spyreccl-bench --nodes: the sweep on simulated nodes, spyreccl (hierarchical) and gloo on
the same ranks. Checks the harness and that every case's result was verified, not speed."""

from __future__ import annotations

import json

from spyreccl_torch.bench.cli import main

_FAST = ["--time-per-size", "0.005", "--min-iters", "3", "--max-iters", "30", "--no-progress"]


def test_sweep_two_nodes_two_ranks(tmp_path):
    out = tmp_path / "sweep.json"
    ops = "all_reduce,all_gather_into_tensor,reduce_scatter_tensor,broadcast,sendrecv"
    argv = ["--nodes", "2", "--nproc", "2", "--ops", ops, "--min", "4", "--max", "512K"]
    rc = main([*argv, "--factor", "128", "--json", str(out), "--no-plot", *_FAST])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["nodes"] == 2
    # The result check ran before every timed case (a wrong result fails the run), on a
    # group that really spans the simulated nodes.
    assert doc["ranks"]["spyreccl x4"]["group"] == "HierarchicalProcessGroup"
    levels = {r["level"] for r in doc["results"]}
    assert levels == {"spyreccl", "gloo"}
    for r in doc["results"]:
        assert r["nranks"] == 4 and r["nodes"] == 2 and r["time_us"]["iters"] >= 3
    sizes = sorted({r["bytes"] for r in doc["results"] if r["op"] == "all_reduce"})
    assert sizes == [4, 512, 65536]
    spy = [r for r in doc["results"] if r["level"] == "spyreccl" and r["bytes"]]
    assert spy and all(r["speedup_vs_gloo"] > 0 for r in spy)
    # The route each case took on the multi-node group (default: leader below 256 KiB, its
    # stage between the nodes carried in the mismatch check's exchange up to 4 KiB); gloo's
    # rows have none.
    routes = {r["bytes"]: r.get("route") for r in spy if r["op"] == "all_reduce"}
    carried = "leader (carried in the check)"
    assert routes == {4: carried, 512: carried, 65536: "leader"}, routes
    assert not any("route" in r for r in doc["results"] if r["level"] == "gloo")


def test_sweep_reports_chunked_stages(tmp_path, monkeypatch):
    # The rank processes inherit the variable: 512 KiB all_reduces in 64 KiB chunks.
    monkeypatch.setenv("SPYRECCL_MULTINODE_PIPELINE_CHUNK_BYTES", "65536")
    out = tmp_path / "sweep.json"
    argv = ["--nodes", "2", "--nproc", "2", "--ops", "all_reduce", "--min", "512K"]
    rc = main([*argv, "--max", "512K", "--json", str(out), "--no-plot", *_FAST])
    assert rc == 0
    doc = json.loads(out.read_text())
    routes = [r.get("route") for r in doc["results"] if r["level"] == "spyreccl"]
    assert routes == ["sharded (8 chunks)"], routes


def test_sweep_reports_stages_carried_in_the_check(tmp_path):
    # Small all_reduces on the leader route travel in the leaders' check exchange
    # (node_check.py); 64 KiB ones (above its 4 KiB frame) take a stage of their own. So do
    # small all_to_all_singles (1 KiB: each node sends the other 1 KiB), which have no
    # route of their own; at 64 KiB they take the flat gloo group, also without one.
    out = tmp_path / "sweep.json"
    ops = "all_reduce,all_to_all_single"
    argv = ["--nodes", "2", "--nproc", "2", "--ops", ops, "--min", "1K"]
    rc = main([*argv, "--max", "64K", "--factor", "64", "--json", str(out), "--no-plot", *_FAST])
    assert rc == 0
    doc = json.loads(out.read_text())
    spy = [r for r in doc["results"] if r["level"] == "spyreccl"]
    routes = [r.get("route") for r in spy if r["op"] == "all_reduce"]
    assert routes == ["leader (carried in the check)", "leader"], routes
    routes = [r.get("route") for r in spy if r["op"] == "all_to_all_single"]
    assert routes == ["carried in the check", None], routes
