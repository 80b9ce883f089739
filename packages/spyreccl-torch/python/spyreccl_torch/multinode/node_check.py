"""The mismatch check node by node: shared memory within each node, gloo between leaders only.

The flat check (fingerprint.CallChecker) is one gloo all_reduce over every rank per operation. Its
round trip is the largest part of a small operation's time: an 8-byte all_reduce on 2 simulated
nodes x 2 ranks took 711 us with it and 388 us without on an idle 16-core machine, and 2.6-3.2 ms
against 1.1 ms on a 2-vCPU machine (docs/notes/multinode-small-messages.md). Most of those ranks
share a node, where agreeing costs microseconds. So, per operation:

1. The ranks of each node all_reduce (MAX) [d, -d], d the digest of their fingerprint, over a
   spyreccl communicator of the node's own (shared memory): every rank of the node then
   knows whether the node agrees.
2. Each node's leader (local rank 0) all_reduces (MAX) the node's pair with the other
   leaders over a gloo group of the leaders alone, posted without waiting: the operation's
   on-node stages run while it travels, as with the flat check.
3. A leader, when it verifies (before its first gloo stage, or at the end of the
   operation), sends the outcome to the other ranks of its node, which receive it when they
   verify.

A small all_reduce on the leader route (at most CARRY_MAX_BYTES between the nodes), and a
small broadcast or leader-route all_gather, would otherwise pay two round trips among the
leaders one after the other: the check's, then the data's. There the leader posts its
exchange only once its node's part is ready, and the part travels in it
(NodeChecker.carry): one round trip. Every exchange among the leaders sends one fixed-size
frame, carrying or not, so that the leaders' exchanges match in size whatever each of them
called.

What the flat check guarantees still holds: no rank posts a gloo data stage before it holds
the outcome (a non-leader's comes from its leader, after the leaders' exchange); an
operation completes only once every rank was seen to call the same collective; a
disagreement fails every rank with MismatchError naming each rank's call (the fingerprints
are gathered over the flat control group, as before). A disagreement within a node is known
to the whole node after step 1, which stops the node's data stages at once; one between
nodes is seen by the leaders' callback, which stops theirs (the abort reaches the node's
other ranks), and a rank whose stage was stopped learns why from the outcome.

Why the outcome is a send and not a broadcast: a leader verifies before its stage between
nodes, while the node's other ranks may already wait for it in the on-node stage after
that (the leader route's broadcast). A broadcast's root waits for every rank to arrive, so it
would wait for ranks that wait for it; a send of two words completes without its receiver.

Every step runs on the thread that runs the group's operations, in their order, so the
node's control communicator sees the same sequence of calls on every rank of the node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .fingerprint import CallChecker, MismatchError, PendingCheck, digest_of, fingerprint_row
from .staging import zero_copy_available

# Leaders that exchange frames with one all_to_all (see NodeChecker._post_exchange); with
# more, the leaders all_reduce their pairs and nothing travels with them.
EXCHANGE_MAX_LEADERS = 8
# The largest reduction (bytes) a leader's frame carries (NodeChecker.carry), and the frame:
# a header of three int64 (the node's pair, the bytes carried) and that many bytes. Every
# exchange sends a whole frame, whatever it carries, so that the leaders' exchanges have one
# size whatever each leader's operation is (gloo terminates a process that receives a
# message of another size than it expects: fingerprint.py). gloo's all_to_all of 16 or of
# 1024 float64 per rank between 2 ranks took the same time (docs/notes/multinode-small-messages.md).
CARRY_MAX_BYTES = 4096
_HEADER = 3
_FRAME = _HEADER + CARRY_MAX_BYTES // 8


def _max_opts(blocking: bool) -> Any:
    opts = c10d.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    opts.asyncOp = not blocking
    return opts


class _Words:
    """Two int64 on the device (the node's pair, an outcome), read and written through a
    numpy view of their memory where there is one (the emulated device): a torch operation per word
    (a few microseconds each) was a large part of the check's cost
    (docs/notes/multinode-small-messages.md, "The small path's Python cost"). Without a host view (a
    real Spyre runtime) through torch."""

    def __init__(self, device: torch.device) -> None:
        self.tensor = torch.empty(2, dtype=torch.int64, device=device)
        self._array: np.ndarray | None = None
        if zero_copy_available():
            from ..device import host_view

            self._array = host_view(self.tensor).numpy()

    def write(self, values: list[int]) -> None:
        if self._array is not None:
            self._array[:] = values
        else:
            self.tensor.copy_(torch.tensor(values, dtype=torch.int64))

    def read(self) -> list[int]:
        return (self._array if self._array is not None else self.tensor).tolist()


class NodePending(PendingCheck):
    """One operation's check in flight, node by node (NodeChecker)."""

    def __init__(self, pair: list[int], mine: list[int], digest: int, op_name: str) -> None:
        super().__init__(None, pair, mine, digest, op_name)
        self.pair = pair  # this node's pair
        self.sent = False  # a leader: the outcome went to the node's other ranks
        self.received = False  # a non-leader: the outcome came from the leader
        self.deferred = False  # a leader: the exchange waits for data to carry (carry)
        self.stopped = False  # the node's data stages were stopped for a mismatch
        self.frames: torch.Tensor | None = None  # a leader: every leader's frame, received
        self.counts: list[int] = []  # a leader: the bytes each leader's frame carried
        self.failure: BaseException | None = None  # the exchange or the receive failed


class NodeChecker:
    """See the module docstring. `flat` is the group's CallChecker over every rank: it names
    the calls of a mismatch and serves the exchanges that do not compare (barriers with
    checking off). `local`: the node's spyreccl control group (None when the node has one
    rank); `leaders`: the leaders' gloo group (on leaders only)."""

    def __init__(
        self,
        flat: CallChecker,
        local: Any,
        leaders: Any,
        local_rank: int,
        local_size: int,
        device: torch.device,
        on_mismatch: Callable[[PendingCheck], None],
        on_error: Callable[[PendingCheck, BaseException], None],
        wait: Callable[[Any], None],
        explain: Callable[[BaseException], BaseException | None],
    ) -> None:
        self._flat = flat
        self._local = local if local_size > 1 else None
        self._leaders = leaders
        self._leader = local_rank == 0
        self._others = range(1, local_size) if self._leader else range(0)
        self._on_mismatch = on_mismatch
        self._on_error = on_error
        self._wait = wait
        # A receive that failed: the failure another rank published, when there is one (the
        # leader aborted the node's control group because of it).
        self._explain = explain
        self._nleaders = leaders.size() if leaders is not None else 1
        # Whether a leader's frames can carry a reduction between the nodes (carry).
        self.carries = self._leader and 1 < self._nleaders <= EXCHANGE_MAX_LEADERS
        # How long a rank other than the leader yields while it waits for the outcome before
        # its gloo stage (ns; -1: its control group's own). Set by the group.
        self.outcome_yield_ns = -1
        from .. import _C  # the backend's extension, loaded by now (the node's groups)

        self._set_thread_yield = _C._set_thread_yield_ns
        # One buffer for the node's all_reduce, one for the outcome a non-leader receives and
        # one for the outcome a leader sends: each is read back (or sent) before the next
        # operation's check uses it.
        self._pair = _Words(device)
        self._outcome = _Words(device)
        self._outcome_sent = _Words(device)
        self._max_blocking = _max_opts(blocking=True)
        # The leaders' frames, sent and received. One exchange is in flight at a time (an
        # operation's check completes before the operation does, and the group runs its
        # operations one after the other), so one buffer serves every exchange's frames
        # sent, and one the frames received by exchanges that this thread reads itself
        # (deferred ones, see carry). An exchange read by its completion callback gets a
        # buffer of its own: the callback may run late (it needs the interpreter lock),
        # when the next operation's exchange already writes into the shared one.
        if self.carries:
            n = self._nleaders
            self._sent = torch.zeros(n * _FRAME, dtype=torch.int64)
            self._got = torch.zeros(n * _FRAME, dtype=torch.int64)
            self._sent_np = self._sent.numpy().reshape(n, _FRAME)
            self._sent_bytes = self._sent_np.view(np.uint8)  # n rows of _FRAME * 8 bytes
            raw = self._got.view(n, _FRAME).view(torch.uint8)[:, _HEADER * 8 :]
            self._got_parts = list(raw.unbind(0))  # each leader's carried bytes (a view)
            self._splits = [_FRAME] * n
            self._a2a_opts = c10d.AllToAllOptions()
        from .. import _C  # loaded before this package (spyreccl_torch/__init__.py)

        self._add_callback = _C._add_guarded_callback

    def post(
        self, op_name: str, seq: int, sig: Any, compare: bool = True, carry: bool = False
    ) -> PendingCheck:
        """Starts the check of an operation. `carry`: this leader will hand the operation's
        reduction between the nodes to carry(), and its exchange waits for it."""
        if not compare:
            return self._flat.post(op_name, seq, sig, False)
        row = fingerprint_row(op_name, seq, sig)
        digest = digest_of(row)
        pair = [digest, -digest]
        if self._local is not None:
            self._pair.write(pair)
            self._local.allreduce([self._pair.tensor], self._max_blocking).wait()
            pair = self._pair.read()
        pending = NodePending(pair, row, digest, op_name)
        node_differs = pair != [digest, -digest]
        if self._leader and self._leaders is not None:
            if carry and self.carries:
                pending.deferred = True
            else:
                self._post_exchange(pending)

                def received(failure: str | None) -> None:
                    if failure is not None:
                        pending.failure = RuntimeError(failure)
                        pending.done.set()
                        self._on_error(pending, pending.failure)
                        return
                    self._read_outcome(pending)
                    if pending.mismatched:
                        self._stop(pending)

                self._add_callback(pending.work, received)
        elif self._leader:
            pending.done.set()  # a group on one node: the node's outcome is everyone's
        if node_differs:
            # The whole node sees it now: stop its data stages (see the module docstring).
            pending.mismatched = True
            self._stop(pending)
        return pending

    def _stop(self, pending: NodePending) -> None:
        """Stops the node's data stages of a mismatched operation, once."""
        if not pending.stopped:
            pending.stopped = True
            self._on_mismatch(pending)

    def _post_exchange(self, pending: NodePending, payload: torch.Tensor | None = None) -> None:
        """Posts the leaders' exchange of this node's pair (and `payload`, flat uint8 on the
        host, at most CARRY_MAX_BYTES, see carry). Up to EXCHANGE_MAX_LEADERS leaders: one gloo
        all_to_all of frames gives every leader every frame (gloo's all_to_all is a direct exchange,
        its all_reduce a ring of 2 (n - 1) steps: between 2 ranks 90-118 us against 191-327 us on a
        2-vCPU machine, docs/notes/multinode-small-messages.md, "Multiple nodes: small-message
        routes and the check"); more leaders: gloo's all_reduce of the pairs."""
        n = self._nleaders
        if n > EXCHANGE_MAX_LEADERS:
            pending.sums = torch.tensor(pending.pair, dtype=torch.int64)
            pending.work = self._leaders.allreduce([pending.sums], _max_opts(blocking=False))
            return
        # The same frame to every leader. Bytes past those carried are left as they are:
        # a receiver reads the count in the header.
        nbytes = 0 if payload is None else payload.numel()
        self._sent_np[:, :_HEADER] = (pending.pair[0], pending.pair[1], nbytes)
        if nbytes:
            start = _HEADER * 8
            self._sent_bytes[:, start : start + nbytes] = payload.detach().numpy()
        # A deferred exchange is read on this thread (carry, _complete); the others by
        # their callback (post): see __init__.
        got = self._got if pending.deferred else torch.empty_like(self._got)
        pending.frames = got
        pending.work = self._leaders.alltoall_base(
            got, self._sent, self._splits, self._splits, self._a2a_opts
        )

    def _read_outcome(self, pending: NodePending) -> None:
        """The outcome over every node, once the leaders' exchange completed."""
        if pending.frames is not None:
            # Plain Python over a handful of words: numpy's reductions cost microseconds
            # each on arrays this small.
            headers = pending.frames.numpy().reshape(self._nleaders, _FRAME)[:, :_HEADER]
            headers = headers.tolist()
            pending.counts = [h[2] for h in headers]
            pending.sums = [max(h[0] for h in headers), max(h[1] for h in headers)]
        pending.mismatched = CallChecker._differs(pending)
        pending.done.set()

    def carry(
        self, pending: PendingCheck, payload: torch.Tensor | None
    ) -> list[torch.Tensor] | None:
        """On a leader whose operation deferred its exchange (post's `carry`): sends
        `payload` (flat uint8 on the host, at most CARRY_MAX_BYTES; None: nothing) in this
        operation's exchange and, once every rank was seen to call the same collective,
        returns every leader's payload in node order (views of the received frames): the
        leaders' check and their data stage in one round trip instead of two. Raises
        MismatchError as verify does; None (nothing done): the exchange was not deferred."""
        if not self.waiting_to_carry(pending):
            return None
        self._post_exchange(pending, payload)  # deferred: into self._got
        self.verify(pending)
        return [part[:n] for part, n in zip(self._got_parts, pending.counts, strict=True)]

    @staticmethod
    def waiting_to_carry(pending: PendingCheck | None) -> bool:
        """Whether `pending`'s exchange was deferred for data to carry (post's `carry`) and
        is not posted yet."""
        return isinstance(pending, NodePending) and pending.deferred and pending.work is None

    def _send_outcome(self, pending: NodePending) -> None:
        if pending.sent or self._local is None:
            return
        pending.sent = True
        sums = pending.sums if isinstance(pending.sums, list) else pending.sums.tolist()
        self._outcome_sent.write(sums)
        for p in self._others:
            self._local.send([self._outcome_sent.tensor], p, 0).wait()

    def _receive_outcome(self, pending: NodePending, waits_long: bool = False) -> None:
        """Receives the leader's outcome. `waits_long`: before this rank's own gloo stage,
        where the leader may not have it before the leaders' whole round trip; that wait
        sleeps after outcome_yield_ns of yielding instead of the group's (see
        settings.YIELD_NS_ENV)."""
        if pending.failure is not None:
            raise pending.failure
        if pending.received:
            return
        sleepy = waits_long and self.outcome_yield_ns >= 0
        try:
            if sleepy:
                # The receive is driven by this thread (its wait() right away), so a thread
                # setting reaches it and no other wait.
                self._set_thread_yield(self.outcome_yield_ns)
            try:
                self._local.recv([self._outcome.tensor], 0, 0).wait()
            finally:
                if sleepy:
                    self._set_thread_yield(-1)
        except Exception as error:
            pending.failure = self._explain(error) or error
            pending.done.set()
            raise pending.failure from error
        pending.sums = self._outcome.read()
        pending.received = True
        pending.mismatched = CallChecker._differs(pending)
        pending.done.set()

    def _complete(self, pending: NodePending, waits_long: bool = False) -> None:
        """This rank's part of the check: a leader waits for the leaders' exchange (posting
        it first when it was deferred and nothing came to carry) and sends the outcome to its
        node, another rank receives it (`waits_long`: see _receive_outcome)."""
        if self._leader:
            if pending.deferred and pending.work is None:
                self._post_exchange(pending)
            if pending.work is not None:
                self._wait(pending.work)  # gloo's error, or a failure another rank published
                if not pending.done.is_set():
                    self._read_outcome(pending)
            self._send_outcome(pending)
        else:
            self._receive_outcome(pending, waits_long)

    def verify(self, pending: PendingCheck, before_stage: bool = False) -> None:
        """As CallChecker.verify: raises MismatchError when the fingerprints disagreed.
        `before_stage`: called before this rank's first gloo stage (see _receive_outcome)."""
        if not isinstance(pending, NodePending):
            self._flat.verify(pending)
            return
        self._complete(pending, before_stage)
        if not CallChecker._differs(pending):
            return
        pending.mismatched = True
        # Unless the exchange's callback or the node's disagreement did (a carrying exchange
        # has no callback): stop the node's data stages before gathering the calls, for
        # which every rank must come out of them.
        self._stop(pending)
        if pending.message is None:
            pending.message = self._flat.describe(pending)
        raise MismatchError(pending.message)

    def settle(self, pending: PendingCheck, wait_s: float) -> bool:
        """As CallChecker.settle. A leader whose exchange completed also sends the outcome,
        so that its node's ranks learn it; a non-leader receives it (its leader sends it, or
        fails, which aborts the node's control group and ends the receive). A leader whose
        exchange was deferred and never posted knows its node's outcome only."""
        if not isinstance(pending, NodePending):
            return self._flat.settle(pending, wait_s)
        if self._leader:
            if pending.work is not None:
                pending.done.wait(wait_s)
            if pending.done.is_set() and pending.failure is None:
                try:
                    self._send_outcome(pending)
                except Exception:
                    pass  # the node's control group failed: its ranks see that instead
        elif not pending.mismatched:
            try:
                self._receive_outcome(pending)
            except Exception:
                pass
        return pending.mismatched

    def finish(self, pending: PendingCheck) -> None:
        """As CallChecker.finish; here the leaders' exchange must be waited for and the
        outcome sent and received, so that the node's control group stays in step."""
        if not isinstance(pending, NodePending):
            self._flat.finish(pending)
            return
        try:
            self._complete(pending)
        except Exception:
            pass
