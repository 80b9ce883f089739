"""The reductions of a hierarchical group (hierarchical.py): all_reduce, reduce and
reduce_scatter by their three routes (flat, leader, sharded; see hierarchical.py's module
docstring), the choice between them, and the sharded routes' in-place, chunked stages.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .fingerprint import signature as _sig
from .node_check import CARRY_MAX_BYTES
from .pipeline import chunk_bounds
from .reduction import Plan as _Plan
from .reduction import combine_in_order as _combine_in_order
from .reduction import exchange_ok as _exchange_ok
from .reduction import op_kind as _op_kind
from .stages import _SIGN_BIT, _gloo_view, _RedOp, _Stage


def _own_slice(
    part: torch.Tensor, local_rank: int, local_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(part, this rank's slice of it): the in-place layout of an on-node reduce-scatter
    and all-gather of `part` (numel a multiple of local_size)."""
    size = part.numel() // local_size
    return part, part[local_rank * size : (local_rank + 1) * size]


def _block_group_slices(
    flat: torch.Tensor, members: Sequence[int], n: int, start: int, end: int
) -> list[torch.Tensor]:
    """Elements [start, end) of the blocks of `members` (n elements each, rank r's at r * n
    in `flat`) laid one after the other: the slices of `flat` that hold them."""
    pieces = []
    for k in range(start // n if n else 0, len(members)):
        lo, hi = max(start, k * n), min(end, (k + 1) * n)
        if lo >= hi:
            break
        r = members[k]
        pieces.append(flat[r * n + lo - k * n : r * n + hi - k * n])
    return pieces


class ReductionRoutes:
    """The reduction routes of HierarchicalProcessGroup (a mixin of it: built from its stages,
    stages.py)."""

    def _plan(self, op: Any, dtype: torch.dtype) -> _Plan:
        """The reduction plan of `op` on `dtype` (reduction.Plan; raises ValueError for what
        spyreccl does not define). Plans depend on the op's kind and the dtype only, except
        PREMUL_SUM's (its factor), so the others are made once per group."""
        kind = _op_kind(op)
        if kind == _RedOp.PREMUL_SUM:
            return _Plan(op, dtype, self._topo.size)
        plan = self._plans.get((kind, dtype))
        if plan is None:
            plan = self._plans[(kind, dtype)] = _Plan(op, dtype, self._topo.size)
        return plan

    def _flat_ok(self, nbytes: int, plan: _Plan) -> bool:
        """Whether a reduction of `nbytes` takes the flat route (one gloo all_reduce over
        every rank). Not for PREMUL_SUM: gloo has no kernel for it."""
        return nbytes <= self._flat_max_bytes and plan.kind != _RedOp.PREMUL_SUM

    def _reduction_route(self, nbytes: int, plan: _Plan) -> str:
        """The route of an all_reduce of `nbytes` (after widening): flat, sharded or leader."""
        if self._flat_ok(nbytes, plan):
            return "flat"
        return "sharded" if self._sharded_ok(nbytes) else "leader"

    def _sharded_ok(self, nbytes: int) -> bool:
        """Whether an operation of `nbytes` takes the sharded route (see the module doc)."""
        topo = self._topo
        return topo.uniform and len(topo.local_ranks) > 1 and nbytes >= self._sharded_min_bytes

    def _all_reduce_work(self, work: torch.Tensor, plan: _Plan) -> None:
        """All-reduces `work` (contiguous, the plan's work dtype) in place over the group."""
        topo = self._topo
        local_size = len(topo.local_ranks)
        nbytes = work.numel() * work.element_size()
        route = self._reduction_route(nbytes, plan)
        if route == "flat":
            self.route_counts["flat"] += 1
            self._host_reduce(self._flat, work, plan.local_op)
            return
        if route == "sharded":
            self.route_counts["sharded"] += 1
            flat, padded = self._padded_for_node(work)
            bounds = chunk_bounds(
                padded.numel(), local_size, padded.element_size(), self._chunk_bytes
            )
            # In place: each chunk is reduce-scattered into this rank's slice of it, and
            # all-gathered from there (the core's in-place layouts), so no shard buffer is
            # allocated per call (memory traffic, and page faults for blocks beyond what
            # the device's arena keeps resident: docs/performance.md, "In-place sharded
            # stages").
            chunks = [
                _own_slice(padded[a:b], topo.local_rank, local_size)
                for a, b in itertools.pairwise(bounds)
            ]
            self._sharded_stages(chunks, plan, gather=True)
            if padded is not flat:
                flat.copy_(padded[: flat.numel()])
            return
        self.route_counts["leader"] += 1
        self._local_reduce_to_leader(work, plan.local_op)
        if topo.local_rank == 0 and not self._carry_cross(work, plan.cross_op):
            self._cross_all_reduce(work, plan.cross_op)
        self._local_broadcast(work, 0)

    def _carries(self, tensors: Sequence[torch.Tensor], op: Any = None) -> bool:
        """Whether this leader's stage between the nodes of an all_reduce (`op` given) or a
        broadcast of `tensors` travels in the check's exchange (node_check.py,
        NodeChecker.carry): an all_reduce on the leader route, or a broadcast, of at most
        CARRY_MAX_BYTES between the nodes. The same answer on every leader for the same call:
        it depends on the call and the group's settings only."""
        if not self._carry_capable(tensors):
            return False
        t = tensors[0]
        if op is None:
            return 0 < t.numel() * t.element_size() <= CARRY_MAX_BYTES
        kind = _op_kind(op)
        key = (t.numel(), t.dtype, kind)
        carried = self._carried_calls.get(key)
        if carried is None:
            try:
                plan = self._plan(op, t.dtype)
            except ValueError:
                return False  # rejected in the operation itself
            nbytes = t.numel() * plan.work_dtype.itemsize
            carried = (
                0 < nbytes <= min(CARRY_MAX_BYTES, self._exchange_max_bytes)
                and self._reduction_route(nbytes, plan) == "leader"
                and _exchange_ok(plan.work_dtype, plan.cross_op)
            )
            if len(self._carried_calls) < 256:  # a training loop repeats a few shapes
                self._carried_calls[key] = carried
        return carried

    def _carry_cross(self, work: torch.Tensor, op: Any) -> bool:
        """The leaders' reduction of `work` in this operation's check exchange (_carry),
        reduced in node order on every leader (the same bits everywhere); False: nothing
        done."""
        if not self._carrying():
            return False
        host = self._staging.host(work)
        flat = host.reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        parts = self._carry(flat.view(torch.uint8), "all_reduce", [nbytes] * len(self._topo.nodes))
        _combine_in_order([part.view(flat.dtype) for part in parts], op, out=flat)
        self._staging.commit(work, host)
        return True

    def _padded_for_node(self, work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`work` flattened, and the same zero-padded to a multiple of the node's size (the
        same tensor when no padding is needed), for an on-node reduce-scatter."""
        local_size = len(self._topo.local_ranks)
        flat = work.reshape(-1)
        shard = -(-flat.numel() // local_size)
        padded = flat
        if shard * local_size != flat.numel():
            padded = torch.zeros(shard * local_size, dtype=work.dtype, device=work.device)
            padded[: flat.numel()].copy_(flat)
        return flat, padded

    def _reduce_scatter_on_node(
        self, work: torch.Tensor, plan: _Plan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sharded routes' first stage: `work` (zero-padded to a multiple of the node's
        size when needed) is reduce-scattered on the node. Returns `work` flattened, the
        padded buffer (the same tensor when no padding was needed) and this rank's reduced
        shard."""
        flat, padded = self._padded_for_node(work)
        mine = torch.empty(
            padded.numel() // len(self._topo.local_ranks), dtype=work.dtype, device=work.device
        )
        rs = self._rs_opts(plan.local_op, blocking=True)
        self._wait(self._local._reduce_scatter_base(mine, padded, rs))
        return flat, padded, mine

    def _sharded_stages(
        self, chunks: list[tuple[torch.Tensor, torch.Tensor]], plan: _Plan, gather: bool
    ) -> None:
        """For each (part, shard): reduce-scatters `part` on the node into this rank's
        `shard` (a buffer of its own, or this rank's slice of `part`: in place), all-reduces
        `shard` between the nodes and, with `gather`, all-gathers the node's shards back
        into `part`. One chunk: one stage after the other. Several: the stages of different
        chunks overlap (pipeline.py); every rank issues them in the same order: every
        reduce-scatter, then per chunk, as its exchange between nodes completes, its
        all-gather."""
        if len(chunks) == 1:
            part, shard = chunks[0]
            self._wait(
                self._local._reduce_scatter_base(
                    shard, part, self._rs_opts(plan.local_op, blocking=True)
                )
            )
            self._cross_all_reduce(shard, plan.cross_op)
            if gather:
                self._wait(self._local._allgather_base(part, shard, self._ag_opts(blocking=True)))
            return
        self.pipeline_counts["operations"] += 1
        self.pipeline_counts["chunks"] += len(chunks)
        scatters = [
            self._local._reduce_scatter_base(shard, part, self._rs_opts(plan.local_op, False))
            for part, shard in chunks
        ]
        stages: list[_Stage] = []
        try:
            for (_, shard), scattered in zip(chunks, scatters, strict=True):
                self._wait(scattered)
                stages.append(self._start_cross_all_reduce(shard, plan.cross_op))
            gathers = []
            for (part, shard), stage in zip(chunks, stages, strict=True):
                self._finish_stage(stage)
                if gather:
                    gathers.append(self._local._allgather_base(part, shard, self._ag_opts(False)))
            for gathered in gathers:
                self._wait(gathered)
        except BaseException:
            self._abandon_stages(stages)
            raise

    def _reduce_work(self, work: torch.Tensor, plan: _Plan, root: int) -> None:
        """Reduces `work` (contiguous, the plan's work dtype) to group rank `root`; only the
        root's `work` holds the result. Each node's partial result crosses to the root's node
        once (an all_reduce would also send the total back to every node)."""
        topo = self._topo
        root_node, root_local = topo.node_of[root], topo.local_rank_of[root]
        nbytes = work.numel() * work.element_size()
        if self._flat_ok(nbytes, plan):
            self.route_counts["flat"] += 1
            self._host_reduce(self._flat, work, plan.local_op, root=root)
            return
        if self._sharded_ok(nbytes):
            # Reduce-scatter on each node; local index j's shards are reduced between nodes
            # to the root's node (all indexes at once); the root's node gathers them.
            self.route_counts["sharded"] += 1
            flat, padded, mine = self._reduce_scatter_on_node(work, plan)
            self._host_reduce(self._cross, mine, plan.cross_op, root=root_node)
            if topo.node == root_node:
                self._wait(self._local._allgather_base(padded, mine, self._ag_opts(blocking=True)))
                if padded is not flat and topo.rank == root:
                    flat.copy_(padded[: flat.numel()])
            return
        self.route_counts["leader"] += 1
        # Reduce on every node to the root's local index when every node has one (then
        # that index's cross group reduces straight to the root), else to the leaders, and
        # the root's node passes the total on.
        via = root_local if len(topo.cross_ranks(root_local)) == len(topo.nodes) else 0
        self._local_reduce_to_leader(work, plan.local_op, via)
        if topo.local_rank == via and self._cross is not None:
            self._host_reduce(self._cross, work, plan.cross_op, root=root_node)
        if via != root_local and topo.node == root_node:
            self._local_broadcast(work, via)

    def _all_reduce_into(self, t: torch.Tensor, op: Any) -> None:
        plan = self._plan(op, t.dtype)
        work = plan.prepare(t, always_copy=not t.is_contiguous())
        self._all_reduce_work(work, plan)
        result = plan.finish(work)
        if result is not t:
            t.copy_(result)

    def _reduce_scatter_flat(
        self, flat: torch.Tensor, op: Any, out: torch.Tensor, owned: bool
    ) -> None:
        """`flat` (contiguous) holds world_size equal blocks; `out` receives the reduction of
        this rank's. `owned`: `flat` is this call's own buffer, which the routes that reduce
        in place may overwrite (else they copy it first; the sharded routes only read it)."""
        topo = self._topo
        n = out.numel()
        plan = self._plan(op, flat.dtype)
        if self._sharded_ok(flat.numel() * flat.element_size()):
            if self._reduce_scatter_by_node(flat, plan, out):
                return
            # Nodes of equal size in another order: local rank j reduces, on its node, the
            # blocks of the ranks with local index j on every node; those ranks then
            # all-reduce them between the nodes (all local indexes at once), and each keeps
            # its own block.
            self.route_counts["sharded"] += 1
            nodes, local_size = len(topo.nodes), len(topo.local_ranks)
            # Chunk c of `mine` (elements [s, e) of this rank's nodes * n) is reduce-scattered
            # from elements [s, e) of every local index's group of blocks: `grouped` holds
            # those chunk after chunk (one chunk: the groups one after the other).
            bounds = chunk_bounds(
                nodes * n,
                1,
                flat.element_size() * local_size,
                self._chunk_bytes,
            )
            pieces = []
            for s, e in itertools.pairwise(bounds):
                for j in range(local_size):
                    members = [m[j] for m in topo.nodes]
                    pieces.extend(_block_group_slices(flat, members, n, s, e))
            grouped = torch.cat(pieces) if pieces else flat[:0]
            work = plan.prepare(grouped, always_copy=False)
            # In place (see _all_reduce_work): chunk c's result, elements [s, e) of this
            # rank's nodes * n, lands in this rank's slice of the chunk.
            chunks = [
                _own_slice(work[s * local_size : e * local_size], topo.local_rank, local_size)
                for s, e in itertools.pairwise(bounds)
            ]
            self._sharded_stages(chunks, plan, gather=False)
            # This rank's block is elements [k n, (k + 1) n) of its nodes * n: the pieces of
            # the chunks' slices that hold them.
            lo, hi = topo.node * n, (topo.node + 1) * n
            pieces = [
                shard[max(s, lo) - s : min(e, hi) - s]
                for (s, e), (_, shard) in zip(itertools.pairwise(bounds), chunks, strict=True)
                if max(s, lo) < min(e, hi)
            ]
            result = pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces else flat[:0]
            out.copy_(plan.finish(result).reshape(out.shape))
            return
        work_bytes = flat.numel() * torch.empty((), dtype=plan.work_dtype).element_size()
        if self._flat_ok(work_bytes, plan):
            # One gloo reduce_scatter over every rank: each rank receives only its block.
            self.route_counts["flat"] += 1
            if n == 0:
                return
            # gloo may flip the input's sign bits (uint64 MIN/MAX): a buffer of this call's.
            host_in = self._staging.host(plan.prepare(flat, always_copy=not owned))
            # In place into `out` when the reduction's dtype is out's (then finish() returns
            # its argument, or a new tensor for AVG, copied in by commit).
            host_out = (
                self._staging.host(out, fill=False).view(-1)
                if plan.work_dtype == out.dtype
                else torch.empty(n, dtype=plan.work_dtype)
            )
            view_in, flip = _gloo_view(host_in, plan.local_op)
            view_out = torch.view_as_real(host_out) if host_out.is_complex() else host_out
            if host_out.dtype == torch.uint64:
                view_out = host_out.view(torch.int64)
            rs = c10d.ReduceScatterOptions()
            rs.reduceOp = plan.local_op
            self._gloo(lambda: self._flat._reduce_scatter_base(view_out, view_in, rs))
            if flip:
                view_out.bitwise_xor_(_SIGN_BIT)
            self._staging.commit(out, plan.finish(host_out))
            return
        if not owned:
            flat = flat.clone()
        self._all_reduce_into(flat, op)
        r = self._topo.rank
        out.copy_(flat[r * n : (r + 1) * n].reshape(out.shape))

    def _reduce_scatter_by_node(self, flat: torch.Tensor, plan: _Plan, out: torch.Tensor) -> bool:
        """The sharded reduce_scatter on nodes that hold consecutive ranks (False, nothing
        done, otherwise): node k's ranks' blocks are contiguous in `flat`, so every node
        reduce-scatters that region straight from the input, which leaves local rank j with
        its node's partial sum of rank k L + j's block; then the ranks of each local index
        reduce those partials between the nodes to node k's (one gloo reduce per node,
        posted as soon as its region's on-node stage is done). Each block crosses between
        nodes once, to where it is needed, and the input is not regrouped (the general
        path below copies it and all-reduces twice the bytes between the nodes)."""
        topo = self._topo
        if not self._nodes_in_order or self._cross is None:
            return False
        self.route_counts["sharded"] += 1
        n, width, nodes = out.numel(), len(topo.local_ranks), len(topo.nodes)
        work = plan.prepare(flat, always_copy=False)  # only read: no copy unless widened
        mine = torch.empty(nodes * n, dtype=work.dtype, device=work.device)
        parts = [mine[k * n : (k + 1) * n] for k in range(nodes)]
        # Every region's on-node stage is queued at once (spyreccl's progress thread runs them
        # back to back) while gloo's thread reduces the regions done. Running them on this
        # thread instead was 8 % slower at 16 MiB on a 2-core machine (two alternated runs).
        scatters = [
            self._local._reduce_scatter_base(
                parts[k],
                work[k * width * n : (k + 1) * width * n],
                self._rs_opts(plan.local_op, False),
            )
            for k in range(nodes)
        ]
        stages: list[_Stage] = []
        try:
            for k in range(nodes):
                self._wait(scatters[k])
                stages.append(self._start_host_reduce(self._cross, parts[k], plan.cross_op, k))
            for stage in stages:
                self._finish_stage(stage)
        except BaseException:
            self._abandon_stages(stages)
            raise
        out.copy_(plan.finish(parts[topo.node]).reshape(out.shape))
        return True

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllreduceOptions()
        if not self._on_spyre(tensors):
            return self._flat.allreduce(tensors, opts)

        def body() -> list[torch.Tensor]:
            for t in tensors:
                self._all_reduce_into(t, opts.reduceOp)
            return tensors

        carry = self._carries(tensors, opts.reduceOp)
        return self._run("all_reduce", body, _sig(tensors, opts.reduceOp), opts, carry=carry)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllreduceCoalescedOptions()
        if not self._on_spyre(tensors):
            return self._flat.allreduce_coalesced(tensors, opts)

        def body() -> list[torch.Tensor]:
            # One reduction per dtype over the concatenation: one pass through every stage.
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                self._all_reduce_into(flat, opts.reduceOp)
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].reshape(t.shape))
                    offset += t.numel()
            return tensors

        return self._run("all_reduce_coalesced", body, _sig(tensors, opts.reduceOp), opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceOptions()
        if not self._on_spyre(tensors):
            return self._flat.reduce(tensors, opts)

        def body() -> list[torch.Tensor]:
            t = tensors[0]
            plan = self._plan(opts.reduceOp, t.dtype)
            # Only the root's tensor changes: everyone reduces a copy.
            work = plan.prepare(t, always_copy=True).contiguous()
            self._reduce_work(work, plan, opts.rootRank)
            if self._topo.rank == opts.rootRank:
                t.copy_(plan.finish(work))
            return tensors

        return self._run("reduce", body, _sig(tensors, opts.reduceOp, opts.rootRank), opts)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        if not self._on_spyre(outputs):
            return self._flat.reduce_scatter(outputs, input_lists, opts)

        def body() -> list[torch.Tensor]:
            out = outputs[0]
            ins = input_lists[0]
            self._check_list("reduce_scatter", "input_list", ins, out)
            flat = torch.cat([t.detach().reshape(-1) for t in ins])
            self._reduce_scatter_flat(flat, opts.reduceOp, out, owned=True)
            return outputs

        return self._run("reduce_scatter", body, _sig(outputs, opts.reduceOp), opts)

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None):
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        if not self._on_spyre([output]):
            return self._flat._reduce_scatter_base(output, inp, opts)

        def body() -> list[torch.Tensor]:
            self._check_numel("reduce_scatter_tensor", inp, output.numel() * self._topo.size)
            flat = inp.detach().contiguous().view(-1)
            self._reduce_scatter_flat(flat, opts.reduceOp, output, owned=False)
            return [output]

        return self._run("reduce_scatter_tensor", body, _sig([output], opts.reduceOp), opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        if not self._on_spyre(outputs):
            return self._flat.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

        def body() -> list[torch.Tensor]:
            for out, inp in zip(outputs, inputs, strict=True):
                self._check_numel("reduce_scatter_tensor", inp, out.numel() * self._topo.size)
                flat = inp.detach().contiguous().view(-1)
                self._reduce_scatter_flat(flat, opts.reduceOp, out, owned=False)
            return outputs

        return self._run(
            "reduce_scatter_tensor_coalesced", body, _sig(outputs, opts.reduceOp), opts
        )

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
