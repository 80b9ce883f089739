"""send and recv of a hierarchical group (hierarchical.py): through the node's spyreccl
group when the peer is on this node, else through gloo on host bytes; posted through the
group's executor so that they reach their sub-group in issue order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import flight
from .works import AsyncWork, ThenWork


class PointToPoint:
    """The point-to-point operations of HierarchicalProcessGroup (a mixin of it)."""

    def _is_local(self, peer: int) -> bool:
        return self._topo.node_of[peer] == self._topo.node

    def _p2p_error(self, what: str) -> Callable[[BaseException], BaseException]:
        def describe(error: BaseException) -> BaseException:
            self._failed = what
            return RuntimeError(f"spyreccl: {what} failed on {self._label()}: {error}")

        return describe

    def _post(self, what: str, post: Callable[[], Any]) -> tuple[AsyncWork, Callable[[], list]]:
        """Posts a point-to-point transfer through the executor, so that it reaches its
        sub-group after every collective issued before it (the peer issues them in the same
        order); posting does not wait for the transfer. Returns the posting's Work and a
        getter for the posted Work."""
        posted: list[Any] = []
        work = AsyncWork(what, self._p2p_seq, self._timeout, self._timed_out)
        call = flight.take_issued()  # the transfer's flight recorder entry, if recorded

        def job() -> None:
            previous = flight.enter(call)  # started when posted to its sub-group
            try:
                posted.append(post())
            except Exception as error:
                work.fail(error)
                return
            finally:
                flight.leave(previous)
            work.complete(None)

        self._executor.submit(job, inline_ok=True)
        return work, lambda: posted

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        if not self._on_spyre(tensors):
            return self._flat.send(tensors, dst, tag)
        self._p2p_seq += 1
        keep: list[torch.Tensor] = []
        if self._is_local(dst):
            where = "on the node"

            def post() -> Any:
                return self._local.send(tensors, self._topo.local_rank_of[dst], tag)
        else:
            where = "between nodes"

            def post() -> Any:
                # gloo reads it until the send completes (a view keeps the spyre memory).
                keep.append(self._staging.host_bytes(tensors[0]))
                return self._flat.send(keep[-1:], dst, tag)

        what = f"send seq {self._p2p_seq} to rank {dst} (tag {tag}, {where})"
        posting, posted = self._post(what, post)
        work = ThenWork(
            posted, None, tensors, keep=keep, describe=self._p2p_error(what), before=[posting]
        )
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        if not self._on_spyre(tensors):
            return self._flat.recv(tensors, src, tag)
        self._p2p_seq += 1
        t = tensors[0]
        after: Callable[[], None] | None = None
        host: torch.Tensor | None = None
        if self._is_local(src):
            where = "on the node"

            def post() -> Any:
                return self._local.recv(tensors, self._topo.local_rank_of[src], tag)
        else:
            where = "between nodes"
            host = self._staging.host_bytes(t, fill=False)

            def post() -> Any:
                return self._flat.recv([host], src, tag)

            def after() -> None:
                self._staging.commit(t, host)

        what = f"recv seq {self._p2p_seq} from rank {src} (tag {tag}, {where})"
        posting, posted = self._post(what, post)
        work = ThenWork(
            posted, after, tensors, keep=host, describe=self._p2p_error(what), before=[posting]
        )
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        raise RuntimeError(
            f"spyreccl: recv from any source (dist.recv without src) is not supported on "
            f"{self._label()}, whose ranks span several nodes; name the sender"
        )
