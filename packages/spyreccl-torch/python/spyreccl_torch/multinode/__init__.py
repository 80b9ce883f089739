"""Process groups whose ranks span several nodes (servers).

spyreccl connects the ranks of one node through shared memory. When a group's ranks are on
more than one node, the backend creator (spyreccl_torch._registration) builds a
:class:`HierarchicalProcessGroup` instead: spyreccl on every node, gloo (shipped with torch)
between the nodes. :func:`topology.discover` tells the two cases apart at group creation.
"""

from __future__ import annotations

from . import flight
from .fingerprint import MismatchError
from .hierarchical import HierarchicalProcessGroup
from .topology import NODE_ID_ENV, Topology, discover, local_node_id

flight.instrument(HierarchicalProcessGroup)  # its calls in the flight recorder

__all__ = [
    "NODE_ID_ENV",
    "HierarchicalProcessGroup",
    "MismatchError",
    "Topology",
    "discover",
    "local_node_id",
]
