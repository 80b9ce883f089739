"""Chunked, overlapped stages for the sharded routes of large reductions (reduction_routes.py).

A sharded all_reduce is three stages: reduce-scatter on the node (spyreccl), all_reduce of
each rank's shard between the nodes (gloo), all-gather on the node (spyreccl). Run one after
the other, the time is their sum. Cut into chunks, chunk i's stage between the nodes runs on
gloo's threads while chunk i + 1 is reduce-scattered on spyreccl's progress thread and chunk
i - 1 all-gathered, so the time approaches the slowest stage's. Every rank issues the
chunks' stages in the same order (all reduce-scatters, then each exchange and all-gather as
the previous chunk's exchange completes), which is what spyreccl and gloo match operations
by.

Measured on an idle 16-core machine, 2 simulated nodes x 2 ranks, float32, `spyreccl-bench
--nodes 2 --nproc 2`, two runs each (docs/notes/multinode-routes.md, "Pipelined sharded stages"): a
16 MiB all_reduce took 5.8-6.1 ms in 8 chunks against 7.9-8.4 ms in one (gloo alone
8.5-9.2 ms), 64 MiB 46 against 59-61 ms, 4 MiB 2.3-2.4 against 2.3-2.6 ms; at 1 MiB, two
chunks of 512 KiB were 7-9 % slower than one, and 1 MiB chunks slower than 2 MiB ones from
4 MiB up; hence no chunk below the target size. Overlap needs cores: with fewer than two
usable CPUs per rank of a node (2 simulated nodes x 2 ranks on a 2-vCPU machine) the chunks
only add hand-offs, so chunking is off by default there. The chunk size is agreed between all ranks
when a group is created: the smallest any rank proposes, 0 (off) if any rank lacks the cores.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

# Target bytes per chunk of a reduction's work buffer (the whole buffer, before it is
# sharded on the node); 0 turns chunking off. Read when a group is created; every rank of
# a group must agree, so the group takes the smallest value any rank proposes.
CHUNK_BYTES_ENV = "SPYRECCL_MULTINODE_PIPELINE_CHUNK_BYTES"
DEFAULT_CHUNK_BYTES = 2 << 20
# At most this many chunks (each costs a gloo and two spyreccl operations).
MAX_CHUNKS = 16
# Usable CPUs per rank of a node below which chunking is off by default.
MIN_CPUS_PER_RANK = 2

_KEY_PREFIX = "spyreccl/pipeline/"


def proposed_chunk_bytes(ranks_on_node: int) -> int:
    """This rank's proposal: the variable's value when set, else the default when this
    process may use at least MIN_CPUS_PER_RANK CPUs per rank of its node, else 0."""
    raw = os.environ.get(CHUNK_BYTES_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(
                f"spyreccl: {CHUNK_BYTES_ENV}={raw!r}: expected a number of bytes >= 0 "
                "(0 turns pipelining off)"
            )
        return value
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return DEFAULT_CHUNK_BYTES if cpus >= MIN_CPUS_PER_RANK * max(1, ranks_on_node) else 0


def agree_chunk_bytes(
    store: Any, rank: int, size: int, propose: Callable[[], int], timeout: datetime.timedelta
) -> int:
    """The smallest of the group's ranks' proposals (`propose()` on each), through the
    group's store (collective: every rank calls it once, when the group is created). A rank
    whose proposal raises ValueError (a malformed variable) publishes the error before it
    raises, so that every other rank raises too, naming it, instead of waiting for it."""
    keys = [f"{_KEY_PREFIX}{r}" for r in range(size)]
    try:
        proposal = propose()
    except ValueError as error:
        store.set(keys[rank], "error: " + str(error).removeprefix("spyreccl: "))
        raise
    store.set(keys[rank], str(proposal))
    store.wait(keys, timeout)
    values = [v.decode() if isinstance(v, bytes) else str(v) for v in store.multi_get(keys)]
    for r, value in enumerate(values):
        if value.startswith("error: "):
            raise ValueError(f"spyreccl: rank {r} of the new group: {value[len('error: ') :]}")
    return min(int(v) for v in values)


def chunk_bounds(numel: int, granule: int, element_size: int, chunk_bytes: int) -> list[int]:
    """Boundaries [0, b1, ..., numel] of the chunks of a buffer of `numel` elements (a
    multiple of `granule`, the node's size: every chunk is reduce-scattered on the node, so
    every boundary is a multiple of it too): as many chunks of at least `chunk_bytes` as fit,
    at most MAX_CHUNKS, of sizes within one granule of each other. One chunk when chunking is
    off or the buffer is smaller than two chunks."""
    if chunk_bytes <= 0 or numel == 0:
        return [0, numel]
    granules = numel // granule
    count = min(MAX_CHUNKS, numel * element_size // chunk_bytes, granules)
    if count < 2:
        return [0, numel]
    per, extra = divmod(granules, count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + (per + (1 if i < extra else 0)) * granule)
    return bounds
