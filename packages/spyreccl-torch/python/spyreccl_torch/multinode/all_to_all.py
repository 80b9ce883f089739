"""all_to_all of a hierarchical group (hierarchical.py): one gloo all_to_all over every rank
on host bytes, or, for small equal blocks with checking on, carried in the leaders' check
exchange (_carried_all_to_all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .fingerprint import signature as _sig
from .node_check import CARRY_MAX_BYTES, EXCHANGE_MAX_LEADERS, NodeChecker
from .topology import Topology


class _A2ALayout:
    """The block layout of a carried all_to_all_single (_carried_all_to_all), from a topology:

    - remote_of_mine: the ranks outside this rank's node, in rank order (the receivers of
      what the node sends in the leaders' exchange, after each local sender's blocks);
    - other_nodes: the other nodes, in order (their parts, concatenated, are what the leader
      broadcasts on its node);
    - local_senders: this node's ranks (their blocks come from the node's all-gather);
    - remote_senders / remote_slots: every rank on another node, and where its block for this
      rank sits in the broadcast buffer, counted in blocks."""

    def __init__(self, topo: Topology) -> None:
        world, me = topo.size, topo.rank
        self.remote_of_mine = [r for r in range(world) if topo.node_of[r] != topo.node]
        self.other_nodes = [k for k in range(len(topo.nodes)) if k != topo.node]
        self.local_senders = list(topo.local_ranks)
        self.remote_senders: list[int] = []
        self.remote_slots: list[int] = []
        offset = 0
        for k in self.other_nodes:
            members = topo.nodes[k]
            receivers = [r for r in range(world) if topo.node_of[r] != k]
            where = receivers.index(me)
            for i, sender in enumerate(members):
                self.remote_senders.append(sender)
                self.remote_slots.append(offset + i * len(receivers) + where)
            offset += len(members) * len(receivers)
        self.received_blocks = offset


class AllToAllRoutes:
    """The all_to_all routes of HierarchicalProcessGroup (a mixin of it: built from its
    stages, stages.py)."""

    def alltoall_base(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        if not self._on_spyre([output, inp]):
            return self._flat.alltoall_base(
                output, inp, output_split_sizes, input_split_sizes, opts
            )
        if self._a2a_carried(output, inp, output_split_sizes, input_split_sizes):
            return self._carried_all_to_all(output, inp, opts)

        def body() -> list[torch.Tensor]:
            # gloo on host bytes: splits count rows (dim 0), scaled to bytes per row.
            def byte_splits(t: torch.Tensor, splits: list[int]) -> list[int]:
                if not splits:
                    return []
                row = (t.numel() // t.shape[0] if t.dim() and t.shape[0] else 0) * t.element_size()
                return [int(s) * row for s in splits]

            host_in = self._staging.host_bytes(inp)
            # gloo must not write the output over input it has not sent yet.
            in_place = output.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr()
            host_out = (
                torch.empty(output.numel() * output.element_size(), dtype=torch.uint8)
                if in_place and output.numel()
                else self._staging.host_bytes(output, fill=False)
            )
            self._gloo(
                lambda: self._flat.alltoall_base(
                    host_out,
                    host_in,
                    byte_splits(output, list(output_split_sizes)),
                    byte_splits(inp, list(input_split_sizes)),
                    c10d.AllToAllOptions(),
                )
            )
            self._staging.commit(output, host_out)
            return [output]

        return self._run("all_to_all_single", body, _sig([], None, -1, inp.dtype), opts)

    all_to_all_single = alltoall_base

    def _a2a_carried(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> bool:
        """Whether an all_to_all_single travels in the check (_carried_all_to_all): checking
        on, 2 to EXCHANGE_MAX_LEADERS nodes, no split sizes (equal blocks), and what a node
        sends to the others at most CARRY_MAX_BYTES on every node. Decided alike on every rank
        from the call and the topology."""
        if not isinstance(self._checker, NodeChecker) or output_split_sizes or input_split_sizes:
            return False
        topo = self._topo
        if not 1 < len(topo.nodes) <= EXCHANGE_MAX_LEADERS:
            return False
        if output.dtype != inp.dtype or output.numel() != inp.numel():
            return False  # gloo's own error on the usual path names it
        world = topo.size
        nbytes = inp.numel() * inp.element_size()
        if nbytes == 0 or nbytes % world:
            return False
        widest = max(len(m) * (world - len(m)) for m in topo.nodes)
        return widest * (nbytes // world) <= CARRY_MAX_BYTES

    def _carried_all_to_all(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
        """A small all_to_all_single between nodes in the check's exchange: the node's ranks
        all-gather their inputs in shared memory (each then holds its blocks from its own
        node), the leaders exchange what their node sends to the others in the check's frame
        (_carry), and each leader broadcasts what its node received. Otherwise the check's
        round trip among the leaders and the outcome come first, then one gloo all_to_all
        over every rank (on a 2-core machine 2.8 ms against gloo's 1.2 ms for 8 bytes a pair:
        docs/performance.md, "Small all_to_all in the check")."""
        topo = self._topo
        world, me = topo.size, topo.rank
        members = topo.local_ranks
        width = len(members)
        plan = self._a2a_layout()

        def body() -> list[torch.Tensor]:
            flat_in = inp.detach().reshape(-1).view(torch.uint8)
            block = flat_in.numel() // world
            if width > 1:
                node_in = torch.empty(width * world * block, dtype=torch.uint8, device=inp.device)
                self._wait(
                    self._local._allgather_base(node_in, flat_in, self._ag_opts(blocking=True))
                )
            else:
                node_in = flat_in
            rows = self._staging.host_bytes(node_in).view(width, world, block)
            received = torch.empty(
                plan.received_blocks * block, dtype=torch.uint8, device=inp.device
            )
            leader = topo.local_rank == 0
            if leader:
                # What this node sends to the other nodes' ranks: sender by sender (local
                # order), receivers in rank order. Taken before the output is written (the
                # output may be the input).
                expected = [len(m) * (world - len(m)) * block for m in topo.nodes]
                payload = rows[:, plan.remote_of_mine, :].reshape(-1)
                parts = self._carry(payload, "all_to_all_single", expected)
                received_host = self._staging.host_bytes(received, fill=False)
                torch.cat([parts[k] for k in plan.other_nodes], out=received_host)
                self._staging.commit(received, received_host)
            if width > 1:
                self._local_broadcast(received, 0)
                if not leader:
                    received_host = self._staging.host_bytes(received)
            out = self._staging.host_bytes(output, fill=False).view(world, block)
            out[plan.local_senders] = rows[:, me, :]
            out[plan.remote_senders] = received_host.view(-1, block)[plan.remote_slots]
            self._staging.commit(output, out.reshape(-1))
            return [output]

        # The element count is part of what the ranks must agree on here (equal blocks): a
        # rank that passed split sizes while another did not is a mismatch on this path.
        sig = _sig([inp], None, -1, inp.dtype)
        return self._run("all_to_all_single", body, sig, opts, carry=True)

    def _a2a_layout(self) -> _A2ALayout:
        """Where a carried all_to_all's blocks go (_carried_all_to_all); the group's topology
        alone decides it, so it is worked out once."""
        if self._a2a_plan is None:
            self._a2a_plan = _A2ALayout(self._topo)
        return self._a2a_plan

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        if not self._on_spyre(outputs + inputs):
            return self._flat.alltoall(outputs, inputs, opts)

        def body() -> list[torch.Tensor]:
            host_in = self._staging.concat_bytes(inputs)
            out_sizes = [t.numel() * t.element_size() for t in outputs]
            in_sizes = [t.numel() * t.element_size() for t in inputs]
            host_out = torch.empty(sum(out_sizes), dtype=torch.uint8)
            self._gloo(
                lambda: self._flat.alltoall_base(
                    host_out, host_in, out_sizes, in_sizes, c10d.AllToAllOptions()
                )
            )
            offset = 0
            for t, size in zip(outputs, out_sizes, strict=True):
                self._staging.commit(t, host_out[offset : offset + size])
                offset += size
            return outputs

        return self._run(
            "all_to_all", body, _sig([], None, -1, inputs[0].dtype if inputs else None), opts
        )
