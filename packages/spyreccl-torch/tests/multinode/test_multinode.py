"""Jobs whose ranks span nodes, on simulated nodes of this machine (see _launch.py).

Each test is one job launch (a torchrun per node) that runs many cases inside, because every
rank and every torchrun agent pays the torch import: 2 nodes x 2 ranks run the full table
(every operation, reduce op and dtype against float64 / exact references, subgroups, a 2-d
DeviceMesh, DDP); 3 + 1 ranks run the reductions and data movement on uneven nodes. The
failure tests kill a rank on one node, and start a job whose second node never comes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from _launch import WORKER, VethPair, free_port, namespaces_usable, netns_usable, run_job

from spyreccl_testing.inputs import fresh_seed

JOB_TIMEOUT = 240.0


def _check_segments(result) -> None:
    """Every segment a rank mapped is gone after the job (on the host without namespaces;
    with namespaces each node's segments lived in its private /dev/shm, which this host
    must never see). Checked by name: other jobs on the machine create and remove their
    own segments meanwhile, so a before/after listing of /dev/shm would blame them."""
    mapped = {seg for report in result.reports.values() for seg in report.get("segments", [])}
    present = sorted(seg for seg in mapped if os.path.exists(f"/dev/shm/{seg}"))
    assert not present, f"segments of the job left in /dev/shm: {present}"


def _mode_note(result) -> str:
    if result.isolated:
        return "nodes isolated by namespaces"
    why = namespaces_usable() or "fallback chosen by the test"
    return f"no namespaces ({why}): nodes simulated with SPYRECCL_NODE_ID"


def _crashed_only_at_exit(result, world: int) -> bool:
    """Every rank reported without a failure, yet a process aborted at interpreter exit
    (the remaining exit defect described at its use)."""
    clean = sorted(result.reports) == list(range(world)) and not any(
        report["failures"] for report in result.reports.values()
    )
    aborted = any("terminate called without an active exception" in log for log in result.logs)
    return clean and aborted and any(code != 0 for code in result.returncodes)


def _check_job(result, nprocs: list[int], seed: int, extras: list[str]) -> None:
    world = sum(nprocs)
    context = f"seed {seed}; {_mode_note(result)}\n{result.describe()}"
    assert sorted(result.reports) == list(range(world)), f"missing rank reports; {context}"
    failures = [f for r in sorted(result.reports) for f in result.reports[r]["failures"]]
    assert not failures, (
        f"{len(failures)} failure(s), replay with SPYRECCL_TEST_SEED={seed}:\n"
        + "\n".join(failures[:20])
        + f"\n{context}"
    )
    expected_nodes, start = [], 0
    for n in nprocs:
        expected_nodes.append(list(range(start, start + n)))
        start += n
    for rank, report in result.reports.items():
        assert report["group_type"] == "HierarchicalProcessGroup", (rank, report)
        assert report["nodes"] == expected_nodes, (rank, report["nodes"])
        assert report["done"] == report["cases"], (rank, report)
        assert report["extras_run"] == extras, (rank, report["extras_run"])
        node = next(i for i, members in enumerate(expected_nodes) if rank in members)
        if result.isolated:
            # Its own hostname and /dev/shm: nothing but its own node's segments visible.
            assert report["hostname"] == f"simnode{node}", report["hostname"]
        else:
            assert report["node_env"] == f"simnode{node}"
    assert result.returncodes == [0] * len(nprocs), context
    _check_segments(result)
    for rank, report in result.reports.items():
        assert report["segments"], f"rank {rank} mapped no spyreccl segment: {report}"
        before, after = report["sockets"]
        # After DDP, torch itself keeps the default group referenced past
        # destroy_process_group (cached (op, group) tuples), so its sockets stay open
        # until the process ends; every other job must have closed all of them.
        if "ddp_check" not in extras:
            assert after <= before, f"rank {rank} kept {after - before} socket(s): {report}"


def test_two_nodes_two_ranks_every_operation(tmp_path):
    seed = fresh_seed()
    env = {
        "SPYRECCL_MN_SEED": str(seed),
        "SPYRECCL_MN_BACKEND": "cpu:gloo,spyre:spyreccl",
        # Every route of a reduction: the table's 1-element ones and the 1001-element ones
        # of 1-byte types take the flat route, the 1001-element ones of wider types the
        # leader route, its 65537-element ones (>= 64 KiB in every dtype they are reduced
        # in) the sharded route.
        "SPYRECCL_MULTINODE_SHARDED_MIN_BYTES": str(64 * 1024),
        "SPYRECCL_MULTINODE_FLAT_MAX_BYTES": "2048",
        # An abort at exit (below) then shows every Python thread's stack in the node's log.
        "PYTHONFAULTHANDLER": "1",
    }
    result = run_job([2, 2], "ops", tmp_path, timeout=JOB_TIMEOUT, env=env)
    if sorted(result.reports) != list(range(4)) or _crashed_only_at_exit(result, 4):
        # Once when a rank never reported (a hang or death mid-job, seen once in CI on
        # 2026-11-26, seed 1154898863679576560, not yet understood), or when, after every
        # rank wrote a clean report, a process aborted at interpreter exit ("terminate called
        # without an active exception"). Four causes of that abort were found and fixed
        # (tests/reliability/test_interpreter_exit.py); the last, gloo's worker destroying an
        # abandoned stage's Work while Python finalizes (seen in CI on a non-leader rank:
        # seed 7425886771883613736, and twice in a row with seed 4678332475074059141;
        # reproduced with a busy loop beside the job, and traced in a core dump), in
        # HierarchicalProcessGroup.shutdown. A second fault fails the test.
        print(f"2x2: a rank never reported or aborted at exit; rerunning\n{result.describe()}")
        result = run_job([2, 2], "ops", tmp_path / "rerun", timeout=JOB_TIMEOUT, env=env)
    _check_job(
        result,
        [2, 2],
        seed,
        [
            "group_checks",
            "gloo_device_check",
            "ddp_check",
            "hsdp_check",
            "funcol_check",
            "async_check",
            "mismatch_check",
            "staging_check",
            "pipeline_check",
            "node_check_check",
            "timeout_check",
            "failure_check",
        ],
    )
    for rank, report in result.reports.items():
        routes = report["routes"]
        assert all(routes[r] > 0 for r in ("flat", "leader", "sharded")), (rank, routes)
        # Every rank takes part in cross stages on the sharded route; the small ones (up to
        # 64 KiB per rank) are exchanges, the large ones gloo's ring.
        cross = report["cross"]
        assert cross["exchange"] > 0 and cross["ring"] > 0, (rank, cross)
        # The leaders' small leader-route reductions travel in the check's exchange
        # (node_check.py); the other ranks never carry.
        assert (cross["carried"] > 0) == (rank in (0, 2)), (rank, cross)
    report = result.reports[0]
    print(f"2x2: {report['cases']} cases in {report['seconds']:.1f} s; {_mode_note(result)}")


def test_uneven_nodes_three_plus_one(tmp_path):
    """Also the suite's run of the fallback: the nodes share this host and are told apart
    only by SPYRECCL_NODE_ID (what the tests do where namespaces are not allowed). The
    default group is bound to the rank's device (device_id=), and split_group is checked."""
    seed = fresh_seed()
    result = run_job(
        [3, 1],
        "uneven",
        tmp_path,
        timeout=JOB_TIMEOUT,
        env={
            "SPYRECCL_MN_SEED": str(seed),
            "SPYRECCL_MN_DEVICE_ID": "1",
            # 1001-element reductions of 1-byte types take the flat route, wider ones the
            # leader route (reduce to a root whose local index only node 0 has included).
            "SPYRECCL_MULTINODE_FLAT_MAX_BYTES": "2048",
        },
        isolate=False,
    )
    _check_job(result, [3, 1], seed, ["split_check"])
    for rank, report in result.reports.items():
        routes = report["routes"]
        assert routes["flat"] > 0 and routes["leader"] > 0 and not routes["sharded"], (rank, routes)


def test_nodes_with_own_network_over_a_veth_pair(tmp_path):
    """Each node in its own network namespace (plus its own hostname and /dev/shm), the two
    joined by a veth pair this test creates and removes: the rendezvous and gloo go over
    that link (GLOO_SOCKET_IFNAME), as between servers."""
    reason = netns_usable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable here: {reason}")
    veth = VethPair()
    try:
        seed = fresh_seed()
        env = {"SPYRECCL_MN_SEED": str(seed), "SPYRECCL_MN_DEVICE_ID": "1"}
        result = run_job([2, 2], "uneven", tmp_path, timeout=JOB_TIMEOUT, env=env, veth=veth)
    finally:
        veth.close()
    assert not veth.leftovers(), veth.leftovers()
    assert result.isolated
    _check_job(result, [2, 2], seed, ["split_check"])


# The target: every rank on every node raises within 5 s of a death. Measured here
# (2 CPUs for 4 ranks and their agents): 2.3-3 s, most of it the 2 s in which the ranks wait
# for each other's reports to name the silent ones; the margin is for a loaded machine.
KILL_DELAY_LIMIT_S = 7.0


@pytest.mark.parametrize(
    ("victim", "victim_exit", "survivors", "checks"),
    [
        # Node 1's second rank dies with exit code 0, so torchrun's agent leaves rank 2 (node
        # 1's leader) alive: rank 2 fails in its on-node stage and never enters the stages
        # between nodes, where node 0's ranks wait for it (the leader route's hazard). With
        # the mismatch check and without it (no control exchange, whose error callback
        # would otherwise publish the failure first: rank 2's failed stage does).
        pytest.param(3, 0, {0, 1, 2}, "1,0", id="non-leader-dies-node-mates-alive"),
        # Node 1's leader dies and its agent terminates rank 3: node 1 is gone and nobody
        # there reports anything; the failure is seen only on node 0 (gloo errors, the
        # exchange, node 0's own on-node stages) and must still reach both of its ranks.
        # (Three groups: every group a job creates costs ~1.5 s here.)
        pytest.param(2, 17, {0, 1}, "1", id="leader-dies-node-gone"),
    ],
)
def test_rank_killed_on_one_node_fails_every_rank(tmp_path, victim, victim_exit, survivors, checks):
    """Every surviving rank fails on each of the groups, one per route (flat, leader,
    sharded, sharded in overlapped chunks) and mismatch-check setting, all in flight when
    the rank dies, quickly, naming the operation, its sequence number and the dead rank; no
    shared-memory segment is left behind."""
    pg_timeout = 20.0
    result = run_job(
        [2, 2],
        "kill",
        tmp_path,
        timeout=JOB_TIMEOUT,
        env={
            "SPYRECCL_MN_VICTIM": str(victim),
            "SPYRECCL_MN_VICTIM_EXIT": str(victim_exit),
            "SPYRECCL_MN_PG_TIMEOUT": str(pg_timeout),
            "SPYRECCL_MN_CHECKS": checks,
        },
        stop_after_reports=len(survivors),
    )
    context = f"{_mode_note(result)}\n{result.describe()}"
    death = float((tmp_path / "death_time").read_text())
    others = set(range(4)) - {victim}
    assert survivors <= set(result.reports) <= others, context
    _check_segments(result)
    for rank in sorted(result.reports):
        report = result.reports[rank]
        assert not report["failures"], (rank, report["failures"])
        names = [
            route + ("" if check == "1" else "/nocheck")
            for check in checks.split(",")
            for route in ("flat", "leader", "sharded", "chunked")
        ]
        assert sorted(report["errors"]) == sorted(names), (rank, report)
        for route, (error, when) in sorted(report["errors"].items()):
            where = f"rank {rank}, {route} route"
            assert error, f"{where}: no error after rank {victim} died; {context}"
            assert "DistBackendError" in error, f"{where}: {error}"
            assert re.search(r"all_reduce seq \d+ failed on process group", error), (where, error)
            assert f"rank {victim} (node 1)" in error, (
                f"{where}: does not name rank {victim}: {error}"
            )
            delay = when - death
            # Well inside the group timeout (20 s): the failure travels, it is not waited out.
            assert delay <= KILL_DELAY_LIMIT_S, f"{where}: failed {delay:.1f} s after: {error}"
        print(
            f"rank {rank}: "
            + ", ".join(
                f"{route} {when - death:.2f} s"
                for route, (_, when) in sorted(report["errors"].items())
            )
        )


def test_node_that_never_joins_fails_init_everywhere(tmp_path):
    """A 4-rank job whose second node never starts: the first node's ranks must fail in
    init_process_group within the timeout, naming the ranks that never came."""
    timeout = 6.0
    store = tmp_path / "store"
    procs = []
    env = {
        **os.environ,
        "SPYRECCL_MN_OUT": str(tmp_path),
        "SPYRECCL_MN_PG_TIMEOUT": str(timeout),
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "SPYRECCL_NODE_ID": "simnode0",
    }
    start = time.monotonic()
    for rank in (0, 1):
        env_r = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        # A FileStore: the rendezvous itself does not wait for all ranks (a TCPStore would
        # fail before the backend), so the backend's own node exchange is what must time out.
        env_r["SPYRECCL_MN_INIT"] = f"file://{store}"
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "nojoin"], env=env_r))
    for p in procs:
        p.wait(timeout=120)
    elapsed = time.monotonic() - start
    reports = {
        int(p.stem.removeprefix("rank")): json.loads(p.read_text())
        for p in tmp_path.glob("rank*.json")
    }
    assert sorted(reports) == [0, 1]
    for rank, report in reports.items():
        error = report["error"]
        assert error and "never published" in error and "[2, 3]" in error, (rank, error)
        assert report["seconds"] <= timeout + 10, (rank, report["seconds"])
    assert elapsed < 120


def test_topology_from_node_ids():
    from spyreccl_torch.multinode import Topology

    topo = Topology.from_node_ids(2, ["b", "a", "b", "b"])
    assert topo.nodes == ((0, 2, 3), (1,))
    assert (topo.node, topo.local_rank, topo.uniform, topo.single_node) == (0, 1, False, False)
    assert topo.cross_ranks(0) == (0, 1) and topo.cross_ranks(1) == (2,)
    one = Topology.from_node_ids(0, ["x", "x"])
    assert one.single_node and one.uniform and one.local_ranks == (0, 1)


def test_yield_setting_is_checked_when_a_group_is_created(monkeypatch):
    """SPYRECCL_MULTINODE_YIELD_NS: unset means the core's default (-1); a malformed value
    fails the group's creation with a message naming the variable, not a later wait."""
    from spyreccl_torch.multinode import hierarchical

    env = hierarchical.YIELD_NS_ENV
    monkeypatch.delenv(env, raising=False)
    assert hierarchical._yield_ns_from_env() == -1
    for text, value in (("50000", 50_000), (" 0 ", 0), ("-1", -1)):
        monkeypatch.setenv(env, text)
        assert hierarchical._yield_ns_from_env() == value
    for text in ("-2", "fast", "1e5"):
        monkeypatch.setenv(env, text)
        with pytest.raises(ValueError, match=f"{env}='{text}': expected a number of nano"):
            hierarchical._yield_ns_from_env()
