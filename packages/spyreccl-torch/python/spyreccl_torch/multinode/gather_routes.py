"""The data movement of a hierarchical group (hierarchical.py) other than all_to_all:
broadcast, all_gather (leader route, sharded route, in place into the output) and gather and
scatter (one gloo operation over every rank: each block travels once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .fingerprint import signature as _sig
from .node_check import CARRY_MAX_BYTES
from .stages import _Stage
from .staging import same_memory


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of contiguous `a` and `b` overlaps."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class GatherRoutes:
    """The broadcast, gather and scatter routes of HierarchicalProcessGroup (a mixin of it:
    built from its stages, stages.py)."""

    def _broadcast_into(self, t: torch.Tensor, root: int) -> None:
        """Hierarchical broadcast of `t` from group rank `root`."""
        topo = self._topo
        root_node = topo.node_of[root]
        buf = t if t.is_contiguous() else t.contiguous()
        if topo.node == root_node:
            self._local_broadcast(buf, topo.local_rank_of[root])
        if topo.local_rank == 0 and self._cross is not None:
            host = self._staging.host_bytes(buf, fill=topo.node == root_node)
            if self._carrying():
                # The leaders' exchange lists the nodes in order.
                parts = self._carry(host if topo.node == root_node else None, "broadcast")
                if topo.node != root_node:
                    host.copy_(parts[root_node])
            else:
                opts = c10d.BroadcastOptions()
                opts.rootRank = root_node  # the leaders' group lists the nodes in order
                opts.rootTensor = 0
                self._gloo(lambda: self._cross.broadcast([host], opts))
            if topo.node != root_node:
                self._staging.commit(buf, host)
        if topo.node != root_node:
            self._local_broadcast(buf, 0)
        if buf is not t:
            t.copy_(buf)

    def _all_gather_blocks(
        self, inp: torch.Tensor, into: torch.Tensor | None = None
    ) -> Callable[[int], torch.Tensor]:
        """All-gathers `inp` (same numel and dtype on every rank); returns block(r), rank r's
        elements as a flat tensor on `inp`'s device. `into` (flat, contiguous, world size
        times `inp`'s elements on its device, or None): where the leader route gathers, so
        that its blocks need no copy; it may hold `inp` (read before `into` is written)."""
        topo = self._topo
        n = inp.numel()
        flat_in = inp.detach().contiguous().reshape(-1)
        local_size = len(topo.local_ranks)
        if self._sharded_ok(topo.size * n * inp.element_size()):
            return self._all_gather_sharded(flat_in)
        self.route_counts["leader"] += 1
        node_buf = torch.empty(local_size * n, dtype=inp.dtype, device=inp.device)
        self._wait(self._local._allgather_base(node_buf, flat_in, self._ag_opts(blocking=True)))
        full = (
            into
            if into is not None
            else torch.empty(topo.size * n, dtype=inp.dtype, device=inp.device)
        )
        if topo.local_rank == 0:
            # Leaders exchange whole nodes, padded to the largest node (gloo gathers equal
            # sizes), then place every rank's block at its position. Nodes of equal size
            # holding consecutive ranks in order (the usual launch) need neither step: gloo
            # reads the node's blocks and writes the gathered ones in place.
            widest = max(len(m) for m in topo.nodes)
            block = n * inp.element_size()
            full_bytes = self._staging.host_bytes(full, fill=False)
            if self._carry_gather(node_buf, block, full_bytes):
                self._staging.commit(full, full_bytes)
                self._local_broadcast(full, 0)
                return lambda r: full[r * n : (r + 1) * n]
            mine = self._staging.padded_bytes(node_buf, widest * block)
            gathered = (
                full_bytes
                if self._nodes_in_order
                else torch.empty(len(topo.nodes) * widest * block, dtype=torch.uint8)
            )
            self._gloo(lambda: self._cross._allgather_base(gathered, mine, c10d.AllgatherOptions()))
            if gathered is not full_bytes:
                for node, members in enumerate(topo.nodes):
                    for i, r in enumerate(members):
                        start = (node * widest + i) * block
                        full_bytes[r * block : (r + 1) * block].copy_(
                            gathered[start : start + block]
                        )
            self._staging.commit(full, full_bytes)
        self._local_broadcast(full, 0)
        return lambda r: full[r * n : (r + 1) * n]

    def _carry_gather(self, node_buf: torch.Tensor, block: int, full_bytes: torch.Tensor) -> bool:
        """The leaders' all-gather of whole nodes in this operation's check exchange (_carry):
        every rank's `block` bytes to its place in `full_bytes`; False: nothing done (the
        exchange was not deferred for it)."""
        if not self._carrying():
            return False
        nodes = self._topo.nodes
        expected = [len(members) * block for members in nodes]
        parts = self._carry(self._staging.host_bytes(node_buf), "all_gather", expected)
        for node, members in enumerate(nodes):
            for i, r in enumerate(members):
                full_bytes[r * block : (r + 1) * block].copy_(
                    parts[node][i * block : (i + 1) * block]
                )
        return True

    def _carries_gather(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether this leader's stage between the nodes of an all_gather of `inputs` travels
        in the check's exchange (node_check.py): the leader route, the widest node's blocks
        at most CARRY_MAX_BYTES. The same answer on every leader for the same call."""
        if not self._carry_capable(inputs):
            return False
        block = inputs[0].numel() * inputs[0].element_size()
        widest = max(len(m) for m in self._topo.nodes)
        return 0 < widest * block <= CARRY_MAX_BYTES and not self._sharded_ok(
            self._topo.size * block
        )

    def _all_gather_into(
        self, inp: torch.Tensor, outs: Sequence[torch.Tensor], into: torch.Tensor | None = None
    ) -> None:
        """All-gathers `inp` into one output per rank (`into`: see _all_gather_blocks; the
        outputs that are already its blocks are not copied)."""
        block = self._all_gather_blocks(inp, into)
        for r, out in enumerate(outs):
            got = block(r)
            if got.data_ptr() != out.data_ptr() or got.numel() != out.numel():
                out.copy_(got.reshape(out.shape))

    def _all_gather_into_tensor(self, inp: torch.Tensor, output: torch.Tensor) -> None:
        """All-gathers `inp` into `output` (world size times its elements, rank order)."""
        n = inp.numel()
        if self._all_gather_in_place(inp, output):
            return
        direct = output.is_contiguous()
        flat = (
            output.view(-1)
            if direct
            else torch.empty(output.numel(), dtype=output.dtype, device=output.device)
        )
        # The leader route gathers straight into `flat` (the output itself when contiguous,
        # as the sharded route does): no gathered buffer of its own, no copy of each block.
        same = output.dtype == inp.dtype and output.device == inp.device
        self._all_gather_into(
            inp,
            [flat[r * n : (r + 1) * n] for r in range(self._topo.size)],
            into=flat if same else None,
        )
        if not direct:
            output.copy_(flat.reshape(output.shape))

    def _all_gather_in_place(self, inp: torch.Tensor, output: torch.Tensor) -> bool:
        """The sharded all-gather written straight into a contiguous `output`, for nodes of
        equal size that hold consecutive ranks (the usual launch); False (nothing done)
        otherwise. This rank's block goes to its place in `output` (unless `inp` is already
        there, FSDP's layout); then, at the same time, the node all-gathers its ranks'
        blocks in place (spyreccl) and the ranks of this local index gather theirs between
        the nodes (gloo), each straight into its place; last, for every other node, the
        node all-gathers in place the blocks that crossed. No gathered buffer, and no copy
        of the result into `output` (the general path below makes both)."""
        topo = self._topo
        n, local_size = inp.numel(), len(topo.local_ranks)
        out = output.view(-1) if output.is_contiguous() else None
        if (
            out is None
            or self._cross is None
            or not self._nodes_in_order
            or not self._sharded_ok(output.numel() * output.element_size())
            or not inp.is_contiguous()
        ):
            return False
        j = topo.local_rank
        own = out[topo.rank * n : (topo.rank + 1) * n]
        src = inp.detach().reshape(-1)
        if src.dtype != own.dtype or not same_memory(own, src):
            if _overlaps(src, out):
                return False  # another rank's place: the general path reads it first
            own.copy_(src)
        self.route_counts["sharded"] += 1
        places = [
            out[(k * local_size + j) * n : (k * local_size + j + 1) * n]
            for k in range(len(topo.nodes))
        ]
        # As bytes: gloo's all-gather moves any dtype so (complex, float8, unsigned).
        hosts = [self._staging.host_bytes(p, fill=k == topo.node) for k, p in enumerate(places)]
        sent = hosts[topo.node]

        def after() -> None:
            for k, (place, host) in enumerate(zip(places, hosts, strict=True)):
                if k != topo.node:
                    self._staging.commit(place, host)

        gloo_opts = c10d.AllgatherOptions()
        stage = _Stage(
            self._post_gloo(lambda: self._cross.allgather([hosts], [sent], gloo_opts)), after
        )
        node_blocks = [
            out[k * local_size * n : (k + 1) * local_size * n] for k in range(len(topo.nodes))
        ]
        # The on-node stages run on this thread (blocking calls) while gloo's thread moves
        # the blocks between the nodes: 5-22 % less time at 1-16 MiB than handing them to
        # spyreccl's progress thread, on a 2-core machine (two alternated runs).
        opts = self._ag_opts(blocking=True)
        try:
            self._wait(self._local._allgather_base(node_blocks[topo.node], own, opts))
            self._finish_stage(stage)
        except BaseException:
            self._abandon_stages([stage])
            raise
        for k in range(len(topo.nodes)):
            if k != topo.node:
                self._wait(self._local._allgather_base(node_blocks[k], places[k], opts))
        return True

    def _all_gather_sharded(self, flat_in: torch.Tensor) -> Callable[[int], torch.Tensor]:
        """All-gather on nodes of equal size: the ranks of each local index gather their
        blocks between the nodes (all local indexes at once, each rank sending its block
        once), then every node all-gathers those; blocks are then put in rank order."""
        topo = self._topo
        self.route_counts["sharded"] += 1
        n, nodes = flat_in.numel(), len(topo.nodes)
        across_dev = torch.empty(nodes * n, dtype=flat_in.dtype, device=flat_in.device)
        across = self._staging.host_bytes(across_dev, fill=False)
        sent = self._staging.host_bytes(flat_in)
        self._gloo(lambda: self._cross._allgather_base(across, sent, c10d.AllgatherOptions()))
        self._staging.commit(across_dev, across)
        node_buf = torch.empty(
            len(topo.local_ranks) * nodes * n, dtype=flat_in.dtype, device=flat_in.device
        )
        self._wait(self._local._allgather_base(node_buf, across_dev, self._ag_opts(blocking=True)))

        # node_buf holds, for local index j and node k, the block of rank nodes[k][j]: the
        # callers copy each block to its destination (no reordering pass).
        def block(r: int) -> torch.Tensor:
            src = (topo.local_rank_of[r] * nodes + topo.node_of[r]) * n
            return node_buf[src : src + n]

        return block

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.BroadcastOptions()
        if not self._on_spyre(tensors):
            return self._flat.broadcast(tensors, opts)

        def body() -> list[torch.Tensor]:
            self._broadcast_into(tensors[0], opts.rootRank)
            return tensors

        carry = self._carries(tensors)
        return self._run("broadcast", body, _sig(tensors, None, opts.rootRank), opts, carry=carry)

    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if not self._on_spyre(inputs):
            return self._flat.allgather(output_lists, inputs, opts)

        def body() -> list[torch.Tensor]:
            outs = output_lists[0]
            inp = inputs[0]
            self._check_list("all_gather", "tensor_list", outs, inp)
            self._all_gather_into(inp, outs)
            return outs

        carry = self._carries_gather(inputs)
        return self._run("all_gather", body, _sig(inputs), opts, carry=carry)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()

        def body() -> list[torch.Tensor]:
            for outs, inp in zip(output_lists, inputs, strict=True):
                self._check_list("all_gather_coalesced", "output_tensor_lists", outs, inp)
                self._all_gather_into(inp, outs)
            return [t for outs in output_lists for t in outs]

        return self._run("all_gather_coalesced", body, _sig(inputs), opts)

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if not self._on_spyre([inp]):
            return self._flat._allgather_base(output, inp, opts)

        def body() -> list[torch.Tensor]:
            self._check_numel("all_gather_into_tensor", output, inp.numel() * self._topo.size)
            self._all_gather_into_tensor(inp, output)
            return [output]

        carry = self._carries_gather([inp])
        return self._run("all_gather_into_tensor", body, _sig([inp]), opts, carry=carry)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if not self._on_spyre(inputs):
            return self._flat.allgather_into_tensor_coalesced(outputs, inputs, opts)

        def body() -> list[torch.Tensor]:
            for out, inp in zip(outputs, inputs, strict=True):
                self._check_numel("all_gather_into_tensor", out, inp.numel() * self._topo.size)
                self._all_gather_into_tensor(inp, out)
            return outputs

        return self._run("all_gather_into_tensor_coalesced", body, _sig(inputs), opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.GatherOptions()
        if not self._on_spyre(inputs):
            return self._flat.gather(output_lists, inputs, opts)

        def body() -> list[torch.Tensor]:
            # One gloo gather over every rank on host bytes: each block travels once, to the
            # root (a hierarchical all-gather would send every block to every node).
            inp = inputs[0]
            is_root = self._topo.rank == opts.rootRank
            if is_root:
                self._check_list("gather", "gather_list", output_lists[0], inp)
            host_in = self._staging.host_bytes(inp)
            host_outs = (
                [self._staging.host_bytes(out, fill=False) for out in output_lists[0]]
                if is_root
                else []
            )
            gopts = c10d.GatherOptions()
            gopts.rootRank = opts.rootRank
            self.route_counts["flat"] += 1
            self._gloo(lambda: self._flat.gather([host_outs] if is_root else [], [host_in], gopts))
            if not is_root:
                return []
            for out, host in zip(output_lists[0], host_outs, strict=True):
                self._staging.commit(out, host)
            return output_lists[0]

        return self._run("gather", body, _sig(inputs, None, opts.rootRank), opts)

    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.ScatterOptions()
        if not self._on_spyre(outputs):
            return self._flat.scatter(outputs, input_lists, opts)

        def body() -> list[torch.Tensor]:
            # One gloo scatter over every rank on host bytes: each rank's block travels once,
            # from the root (a broadcast of the whole list would send all of it everywhere).
            out = outputs[0]
            is_root = self._topo.rank == opts.rootRank
            host_ins: list[torch.Tensor] = []
            if is_root:
                self._check_list("scatter", "scatter_list", input_lists[0], out)
                host_ins = [self._staging.host_bytes(t) for t in input_lists[0]]
            host_out = self._staging.host_bytes(out, fill=False)
            sopts = c10d.ScatterOptions()
            sopts.rootRank = opts.rootRank
            self.route_counts["flat"] += 1
            self._gloo(lambda: self._flat.scatter([host_out], [host_ins] if is_root else [], sopts))
            self._staging.commit(out, host_out)
            return outputs

        return self._run("scatter", body, _sig(outputs, None, opts.rootRank), opts)
