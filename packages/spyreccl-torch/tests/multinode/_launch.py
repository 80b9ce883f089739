"""Launching a job on simulated nodes of this machine.

Each node is one ``torchrun --nnodes N --node-rank i`` (its agent and its ranks) against one
static rendezvous on 127.0.0.1. Where the machine allows it (root, or unprivileged user
namespaces), each node runs in its own mount and UTS namespaces, with its own hostname and a
private tmpfs on /dev/shm: shared memory between nodes is then impossible, as between real
servers, and the backend finds the nodes by itself (hostname + boot id). Elsewhere the nodes
share the host and ``SPYRECCL_NODE_ID`` tells every rank its node; the report says which.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKER = Path(__file__).with_name("_node_worker.py")
SHM_SIZE = "512m"


@functools.cache
def namespaces_usable() -> str | None:
    """None when `unshare --mount --uts` with a private /dev/shm works here, else why not."""
    probe = (
        "mount -t tmpfs -o size=1m tmpfs /dev/shm && hostname spyreccl-probe && "
        'test "$(hostname)" = spyreccl-probe'
    )
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--uts", "--propagation", "private", "--", "sh", "-c", probe],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unshare unavailable: {error}"
    if done.returncode != 0:
        return f"unshare --mount --uts failed: {done.stderr.strip() or done.returncode}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def netns_usable() -> str | None:
    """None when network namespaces and veth pairs can be created here, else why not."""
    name = f"spyreccl-probe-{os.getpid()}"
    try:
        done = subprocess.run(
            ["ip", "netns", "add", name], capture_output=True, text=True, timeout=20
        )
        if done.returncode != 0:
            return f"ip netns add failed: {done.stderr.strip() or done.returncode}"
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"ip unavailable: {error}"
    return namespaces_usable()


class VethPair:
    """Two network namespaces joined by a veth pair (10.213.<k>.1 and .2), created by the
    test and removed by close(): each simulated node then has its own network stack, and
    the nodes talk over the pair as over a wire. Nothing is routed outside."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.namespaces = [f"spyreccl-mn{tag}-0", f"spyreccl-mn{tag}-1"]
        self.interfaces = [f"smn{tag}a", f"smn{tag}b"]
        subnet = 1 + os.getpid() % 250
        self.addresses = [f"10.213.{subnet}.1", f"10.213.{subnet}.2"]
        try:
            for ns in self.namespaces:
                self._ip("netns", "add", ns)
            self._ip(
                "link",
                "add",
                self.interfaces[0],
                "type",
                "veth",
                "peer",
                "name",
                self.interfaces[1],
            )
            for ns, dev, addr in zip(self.namespaces, self.interfaces, self.addresses, strict=True):
                self._ip("link", "set", dev, "netns", ns)
                self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)

    def close(self) -> None:
        # Deleting a namespace destroys the veth end inside it, and so the pair.
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)

    def leftovers(self) -> list[str]:
        listed = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, timeout=20
        ).stdout
        return [ns for ns in self.namespaces if ns in listed]


@dataclass
class JobResult:
    isolated: bool  # True: namespaces; False: SPYRECCL_NODE_ID on a shared host
    returncodes: list[int]
    logs: list[str]
    reports: dict[int, dict] = field(default_factory=dict)
    elapsed: float = 0.0

    def describe(self) -> str:
        mode = "namespaces" if self.isolated else "SPYRECCL_NODE_ID override (no namespaces)"
        text = [f"simulated nodes via {mode}; return codes {self.returncodes}"]
        for i, log in enumerate(self.logs):
            text.append(f"--- node {i} log (tail) ---\n{log[-6000:]}")
        return "\n".join(text)


def run_job(
    nprocs: list[int],
    mode: str,
    out_dir: Path,
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    stop_after_reports: int | None = None,
    isolate: bool = True,
    veth: VethPair | None = None,
) -> JobResult:
    """Runs `_node_worker.py <mode>` on len(nprocs) simulated nodes, node i with nprocs[i]
    ranks; returns when every node's torchrun has exited (or kills them after `timeout`).

    stop_after_reports: once that many ranks wrote their report, give the rest 3 s and kill
    what still runs (after a rank died, torchrun's agents on other nodes wait minutes in
    their exit barrier for the agent that gave up).
    isolate=False: simulate the nodes with SPYRECCL_NODE_ID even where namespaces work (so
    that the suite always exercises that fallback too).
    veth: run node i in veth.namespaces[i] (2 nodes), the rendezvous on node 0's address and
    gloo bound to the node's veth interface."""
    out_dir.mkdir(parents=True, exist_ok=True)
    isolated = isolate and namespaces_usable() is None
    port = 29500 if veth is not None else free_port()
    master = veth.addresses[0] if veth is not None else "127.0.0.1"
    procs = []
    logs = []
    start = time.monotonic()
    for node, nproc in enumerate(nprocs):
        log_path = out_dir / f"node{node}.log"
        logs.append(log_path)
        node_env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "SPYRECCL_MN_OUT": str(out_dir),
            "PYTHONUNBUFFERED": "1",
            # torchrun's agents must not wait long for a node that is gone.
            "TORCHELASTIC_MAX_RESTARTS": "0",
            **(env or {}),
        }
        if not isolated:
            node_env["SPYRECCL_NODE_ID"] = f"simnode{node}"
        if veth is not None:
            node_env["GLOO_SOCKET_IFNAME"] = veth.interfaces[node]
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={len(nprocs)}",
            f"--node-rank={node}",
            f"--nproc-per-node={nproc}",
            f"--master-addr={master}",
            f"--master-port={port}",
            "--max-restarts=0",
            "--monitor-interval=0.2",
            str(WORKER),
            mode,
        ]
        if isolated:
            setup = (
                f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && "
                f'hostname simnode{node} && exec "$@"'
            )
            cmd = ["unshare", "--mount", "--uts", "--propagation", "private", "--"]
            cmd += ["sh", "-c", setup, "sh", *torchrun]
        else:
            cmd = torchrun
        if veth is not None:
            cmd = ["ip", "netns", "exec", veth.namespaces[node], *cmd]
        log = open(log_path, "w")  # noqa: SIM115  (closed below)
        procs.append(
            (
                subprocess.Popen(
                    cmd,
                    env=node_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                ),
                log,
            )
        )
    deadline = start + timeout
    reported_at = None
    while any(proc.poll() is None for proc, _ in procs) and time.monotonic() < deadline:
        if (
            stop_after_reports is not None
            and reported_at is None
            and len(list(out_dir.glob("rank*.json"))) >= stop_after_reports
        ):
            reported_at = time.monotonic()
            deadline = min(deadline, reported_at + 3.0)
        time.sleep(0.2)
    codes = []
    for proc, log in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        codes.append(proc.wait())
        log.close()
    result = JobResult(isolated, codes, [p.read_text(errors="replace") for p in logs])
    result.elapsed = time.monotonic() - start
    for path in out_dir.glob("rank*.json"):
        report = json.loads(path.read_text())
        result.reports[int(report["rank"])] = report
    return result
