"""What both exit scripts (_exit_scenarios.py and _exit_abandoned_stage.py) set up; imported
by them from this directory.

- abandon_a_stage: a multi-node group whose gloo stage rank 0 abandoned. The two ranks call
  themselves nodes of their own, so the group is hierarchical (gloo between them), and its
  all_reduce takes the flat route: one gloo all_reduce over every rank on a host view of the
  spyre tensor, a tensor with a Python object. Rank 1 fails just before its gloo stage; rank
  0, waiting in its own stage for rank 1, gives up on rank 1's published failure and leaves
  the stage pending in gloo (gloo cannot cancel it).
- delete_during_finalization: an object whose deletion happens once finalization has begun.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import spyreccl_torch


def abandon_a_stage(directory: Path, rank: int, name: str, timeout: Any = None) -> Any:
    """Makes the group, runs the all_reduce that fails, and returns the group (failed).
    Writes `nodes_type<rank>` (the group's class) and `<name><rank>` (the error the
    all_reduce raised, or "returned") in `directory`."""
    os.environ["SPYRECCL_NODE_ID"] = f"{name}-node{rank}"
    os.environ["SPYRECCL_MULTINODE_FLAT_MAX_BYTES"] = str(1 << 20)
    spyreccl_torch.multinode.topology.forget()  # the nodes learnt at init: one
    kwargs = {} if timeout is None else {"timeout": timeout}
    nodes = dist.new_group(backend="spyreccl", **kwargs)
    del os.environ["SPYRECCL_NODE_ID"], os.environ["SPYRECCL_MULTINODE_FLAT_MAX_BYTES"]
    spyreccl_torch.multinode.topology.forget()
    (directory / f"nodes_type{rank}").write_text(type(nodes).__name__)
    if rank == 1:

        def _fail_before_stage(post: Any) -> Any:
            raise RuntimeError("injected: rank 1 fails before its gloo stage")

        nodes._post_gloo = _fail_before_stage
    gen = torch.Generator().manual_seed(4321 + rank)
    try:
        dist.all_reduce(torch.randn(257, generator=gen).to("spyre"), group=nodes)
        (directory / f"{name}{rank}").write_text("returned")
    except Exception as error:
        (directory / f"{name}{rank}").write_text(str(error))
    return nodes


def delete_during_finalization(name: str, obj: object) -> None:
    """Keeps `obj` in a module of its own (`name`) that nothing else refers to: it is deleted
    when finalization empties sys.modules, after every exit function. (Not a global of the
    calling script: callbacks that refer to the script's globals outlive finalization.)"""
    holder = types.ModuleType(name)
    holder.obj = obj  # type: ignore[attr-defined]
    sys.modules[name] = holder
