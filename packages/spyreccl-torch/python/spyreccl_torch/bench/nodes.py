"""Simulated nodes for the benchmark (``spyreccl-bench --nodes N``).

The rank processes of a sweep all run on this machine; with ``--nodes N`` each one is told
its node through ``SPYRECCL_NODE_ID`` before it creates its process group (ranks split into
N contiguous, as equal as possible blocks, as torchrun numbers them). spyreccl then builds
its multi-node group: shared memory within each simulated node, gloo over loopback TCP
between them — the same code path as on real servers, with loopback standing in for the
network. The gloo baseline runs on the same ranks (CPU tensors over all ranks).
"""

from __future__ import annotations

import os

__all__ = ["node_of", "simulate_node"]


def node_of(rank: int, nranks: int, nodes: int) -> int:
    """The simulated node of `rank` (contiguous blocks, sizes differing by at most one)."""
    if not 1 <= nodes <= nranks:
        raise ValueError(f"--nodes must be between 1 and the world size {nranks}, got {nodes}")
    return rank * nodes // nranks


def simulate_node(rank: int, nranks: int, nodes: int) -> None:
    """Sets this rank process's SPYRECCL_NODE_ID (nothing for a single node)."""
    if nodes > 1:
        os.environ["SPYRECCL_NODE_ID"] = f"bench-node{node_of(rank, nranks, nodes)}"
