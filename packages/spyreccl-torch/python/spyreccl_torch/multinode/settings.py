"""The settings of a hierarchical group (hierarchical.py): the environment variables it reads
when it is created, their defaults and why they are what they are.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

# Operations of at least this many bytes (a reduction's buffer after widening, a gather's
# output) take the sharded route when the nodes hold the same number of ranks; smaller ones
# the leader route.
SHARDED_MIN_BYTES_ENV = "SPYRECCL_MULTINODE_SHARDED_MIN_BYTES"
DEFAULT_SHARDED_MIN_BYTES = 256 * 1024

# Reductions of at most this many bytes (after widening) skip the hierarchy: one gloo
# all_reduce (or reduce, reduce_scatter) over every rank on host copies (the "flat" route).
# 0, the default, turns it off: reductions below the sharded bound take the leader route.
# Measured (docs/performance.md, "Multiple nodes: small-message routes and the check"): on
# an idle 16-core machine (a core per rank) the leader route took less time than the flat
# one at every size from 8 B to 64 KiB, with the mismatch check and without it (8 B: 711
# vs 830 us with it); with 4 ranks on a 2-core machine, spyreccl-bench --nodes 2
# --nproc 2 gave the leader route 1.4-1.7 ms (once 3.8) against the flat one's 2.3-9.2 ms
# from 8 B to 32 KiB (two interleaved runs each, load 4), and the interleaved latency
# harness gave mixed results within its noise. On real servers the leader route sends one
# message per node between nodes, the flat route one per rank. The flat route used to be
# the default up to 64 KiB (from the 2-CPU latency runs, and) because the leader route
# failed slowly: a leader that failed in an on-node stage left the other node's leader
# waiting in the cross-node stage until gloo's timeout. Failures now reach every stage
# within moments (failures.py), on every route.
FLAT_MAX_BYTES_ENV = "SPYRECCL_MULTINODE_FLAT_MAX_BYTES"
DEFAULT_FLAT_MAX_BYTES = 0

# Reductions between nodes of at most this many bytes (each rank's part; 0 turns it off)
# are done by an exchange: one gloo all_to_all gives every rank every part, which it
# combines in order (a direct exchange instead of gloo's ring all_reduce), between at most 8
# nodes. Read when a group is created.
EXCHANGE_MAX_BYTES_ENV = "SPYRECCL_MULTINODE_EXCHANGE_MAX_BYTES"
DEFAULT_EXCHANGE_MAX_BYTES = 64 * 1024

# "0" turns off the check that all ranks called the same collective (fingerprint.py); on by
# default. Read when a group is created.
CHECK_ENV = "SPYRECCL_MULTINODE_CHECK"

# How long a rank that saw an operation fail waits for the other ranks to say they saw it
# too, to name the ones that did not (see _who_failed).
FAILURE_WINDOW_ENV = "SPYRECCL_MULTINODE_FAILURE_WINDOW_S"

# How long a rank other than the leader yields the CPU before it sleeps (ns, the core's
# yield phase) while it waits for the outcome of the leaders' exchange before its own gloo
# stage (node_check.py): the leader may not have it before the leaders' whole round trip
# over gloo and the network, and yielding all that time keeps CPUs busy that gloo's threads
# and the leaders need when ranks share CPUs. Only that wait: the node's other waits are
# short rendezvous, where yielding hands a shared CPU to the peer about to arrive (a short
# phase for the whole control group made small leader-route operations up to 1.6x slower).
# With 2 x 2 ranks on 2 CPUs, 50000 made all_to_all with split sizes 1.3-1.5x faster and
# the sharded all_gather of 512 KiB 1.7x slower (the woken rank's gloo stage is on the
# critical path), so the default stays the group's own (the core's 2 ms): -1.
# docs/performance.md, "Ranks that wait for the outcome". Read when a group is created.
YIELD_NS_ENV = "SPYRECCL_MULTINODE_YIELD_NS"
DEFAULT_YIELD_NS = -1


def _yield_ns_from_env() -> int:
    """SPYRECCL_MULTINODE_YIELD_NS as a number of ns (or -1), checked when a group is
    created rather than at the first wait it applies to."""
    text = os.environ.get(YIELD_NS_ENV, "").strip()
    if not text:
        return DEFAULT_YIELD_NS
    try:
        value = int(text)
    except ValueError:
        value = -2
    if value < -1:
        raise ValueError(
            f"spyreccl: {YIELD_NS_ENV}={text!r}: expected a number of nanoseconds (>= 0), or "
            "-1 for the core's default"
        )
    return value


def _timeout_of(timeout: Any) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))
