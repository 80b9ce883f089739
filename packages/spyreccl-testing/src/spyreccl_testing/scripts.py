"""Ranks as whole Python processes, for tests of what happens when a process ends.

RankPool workers and forked groups (spyreccl_testing.forked) skip interpreter finalization on
purpose; a test of exit behaviour (atexit hooks, threads still running while Python
finalizes, a hang at exit) needs the real thing: one fresh interpreter per rank, run to
its end. Each costs a torch import (seconds), so use them sparingly.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass
class RankExit:
    rank: int
    returncode: int  # negative: killed by that signal (-9 when it hung past the timeout)
    output: str  # stdout and stderr, interleaved
    hung: bool  # still running at the timeout (then killed)


def run_rank_scripts(
    argv: Sequence[str],
    world_size: int,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> list[RankExit]:
    """Runs `python *argv` once per rank, all at once, and waits for every one to exit.

    Each gets RANK, LOCAL_RANK, WORLD_SIZE and a MASTER_ADDR/MASTER_PORT of a free local port
    (for init_process_group's env:// rendezvous) on top of os.environ and `env`. A rank still
    running `timeout` seconds after the start is killed, as are all the others then."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            **(env or {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    exits = []
    for rank, proc in enumerate(procs):
        hung = False
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung = True
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
        exits.append(RankExit(rank, proc.returncode, out, hung))
    return exits
