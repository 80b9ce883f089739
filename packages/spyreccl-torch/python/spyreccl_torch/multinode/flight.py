"""Flight recorder entries of hierarchical (multi-node) groups.

The on-node stages of a hierarchical call are spyreccl groups, which record themselves (C++,
spyreccl_torch.flight_recorder). This module records the call itself in the same ring, under
the hierarchical group's own name, description and global ranks, so that torch's analyzer
sees every rank's view of the job-level collective: the call is recorded when it is issued
(state "scheduled"), started when its job starts running and completed with its Work; a call
that fails stays "started" (one queued behind a hung call: "scheduled"). A failure of the
group (failures.py, a mismatch: failure_handling.py) dumps the ring once and tells the other
ranks through the group's store, like the on-node groups do.

:func:`instrument` wraps the collective and point-to-point methods of the group class once;
the wrappers cost one C++ call per operation, nothing when recording is off
(``TORCH_FR_BUFFER_SIZE=0``).

The wrapper hands the call's record to the group's dispatch on the same thread
(:func:`take_issued`); the job that runs the call marks it started (:func:`enter`), and while
that job runs, the gloo stages it posts are recorded as its children (stage_flight.py).
"""

from __future__ import annotations

import datetime
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Attribute of a group holding its recorder id (-1: recording is off).
_ID_ATTR = "_flight_recorder_id"
# Attribute of a Work holding its record (see track).
RECORD_ATTR = "flight_record"

# Per thread: `issued`, the call a wrapper is issuing (its record and op name) until the
# group's dispatch takes it; `running`, the call whose job runs on this thread (the parent
# of the gloo stages it posts).
_calls = threading.local()


def _flat(lists: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for inner in lists for t in inner]


# method -> (analyzer op name, inputs(args), outputs(args), flatten inputs, flatten outputs).
# Names and flattening as NCCL records them (the analyzer checks sizes that way).
COLLECTIVES: dict[str, tuple[str, Callable, Callable, bool, bool]] = {
    "allreduce": ("all_reduce", lambda a: a[0], lambda a: a[0], False, False),
    "allreduce_coalesced": ("allreduce_coalesced", lambda a: a[0], lambda a: a[0], False, False),
    "reduce": ("reduce", lambda a: a[0], lambda a: a[0], False, False),
    "broadcast": ("broadcast", lambda a: a[0], lambda a: a[0], False, False),
    "allgather": ("all_gather", lambda a: a[1], lambda a: _flat(a[0]), False, True),
    "allgather_coalesced": (
        "ALLGATHER_coalesced",
        lambda a: a[1],
        lambda a: _flat(a[0]),
        False,
        False,
    ),
    "_allgather_base": ("_all_gather_base", lambda a: [a[1]], lambda a: [a[0]], False, False),
    "allgather_into_tensor_coalesced": (
        "all_gather_into_tensor_coalesced",
        lambda a: a[1],
        lambda a: a[0],
        False,
        False,
    ),
    "reduce_scatter": ("reduce_scatter", lambda a: _flat(a[1]), lambda a: a[0], True, False),
    "_reduce_scatter_base": (
        "_reduce_scatter_base",
        lambda a: [a[1]],
        lambda a: [a[0]],
        False,
        False,
    ),
    "reduce_scatter_tensor_coalesced": (
        "reduce_scatter_tensor_coalesced",
        lambda a: a[1],
        lambda a: a[0],
        False,
        False,
    ),
    "gather": ("gather", lambda a: a[1], lambda a: _flat(a[0]), False, False),
    "scatter": ("scatter", lambda a: _flat(a[1]), lambda a: a[0], False, False),
    "alltoall_base": ("all_to_all", lambda a: [a[1]], lambda a: [a[0]], False, False),
    "alltoall": ("all_to_all", lambda a: a[1], lambda a: a[0], False, False),
    "barrier": ("all_reduce_barrier", lambda a: [], lambda a: [], False, False),
}


def register(
    group: Any,
    name: str,
    rank: int,
    size: int,
    global_ranks: Sequence[int],
    timeout: datetime.timedelta,
    store: Any,
) -> None:
    """Makes `group` known to the recorder (pg_config: `name`, its description, ranks)."""
    from .. import _C

    desc = group.getGroupDesc() if hasattr(group, "getGroupDesc") else ""
    group_id = _C._fr_register_group(name, desc, rank, size, list(global_ranks), timeout, store)
    setattr(group, _ID_ATTR, group_id)
    if group_id >= 0:
        # The recorder holds the group's store (to tell the other ranks of a failure): let
        # it go with the group, or its connection to the store server outlives the job.
        weakref.finalize(group, _C._fr_unregister_group, group_id)


def _group_id(group: Any) -> int:
    """The group's recorder id, registering it with its first operation (c10d names and
    describes a group only after its creator returned it)."""
    group_id = getattr(group, _ID_ATTR, None)
    if group_id is None:
        topo = group._topo
        register(
            group,
            group._name,
            topo.rank,
            topo.size,
            group._global_ranks,
            group._timeout,
            group._store,
        )
        group_id = getattr(group, _ID_ATTR)
        # The on-node group of the mismatch check's exchange is plumbing, not a stage: its
        # all_reduces and sends between the same ranks would read as coalesced batches to
        # the analyzer (which then fails). The data stages stay recorded.
        control = getattr(group, "_check_local", None)
        if control is not None:
            control._disable_flight_recorder()
        # The on-node stage group's failures are this group's: one dump per failure.
        local = getattr(group, "_local", None)
        if local is not None and group_id >= 0:
            local._set_flight_parent(group_id)
        board = getattr(group, "_board", None)
        if board is not None and group_id >= 0:
            ref = weakref.ref(group)
            board.on_failure = lambda: failed(ref())
    return group_id


def failed(group: Any) -> None:
    """The group failed on this rank: dump (once per group) and tell the other ranks."""
    group_id = getattr(group, _ID_ATTR, -1) if group is not None else -1
    if group_id >= 0:
        from .. import _C

        _C._fr_group_failed(group_id)


def take_issued() -> tuple[tuple, str] | None:
    """The (record, op name) of the call this thread is issuing, once: the group's dispatch
    takes it when it queues the call's job (None: recording is off, or not a recorded call)."""
    call = getattr(_calls, "issued", None)
    if call is not None:
        _calls.issued = None
    return call


def enter(call: tuple[tuple, str] | None) -> tuple[tuple, str] | None:
    """The job of `call` (from take_issued) starts on this thread: its entry is started and
    the gloo stages posted until leave() are its children. Returns what leave() restores
    (a job may run nested inside another one's callback)."""
    previous = getattr(_calls, "running", None)
    _calls.running = call
    if call is not None:
        from .. import _C

        _C._fr_mark(call[0], False)
    return previous


def leave(previous: tuple[tuple, str] | None) -> None:
    _calls.running = previous


def running_call() -> str | None:
    """The recorded call whose job runs on this thread ("all_reduce seq 4"), if any."""
    call = getattr(_calls, "running", None)
    return None if call is None else f"{call[1]} seq {call[0][3]}"


def _issue(method: Callable, record: tuple, op_name: str, *args: Any, **kwargs: Any) -> Any:
    _calls.issued = (record, op_name)
    try:
        return method(*args, **kwargs)
    finally:
        _calls.issued = None


def completed(work: Any) -> None:
    """Called by a Work when it completed successfully."""
    record = getattr(work, RECORD_ATTR, None)
    if record is not None:
        from .. import _C

        _C._fr_mark(record, True)


def _track(work: Any, record: tuple) -> Any:
    try:
        setattr(work, RECORD_ATTR, record)
    except AttributeError:
        return work  # a Work of torch's (gloo's flat group): its completion is not seen
    # Completed before the record was attached (run inline): mark it now. Either this or
    # the Work's own completed() call sees the other's write.
    if work.is_completed() and getattr(work, "_error", None) is None:
        completed(work)
    return work


def _wrap_collective(method: Callable, spec: tuple) -> Callable:
    op_name, inputs_of, outputs_of, flatten_inputs, flatten_outputs = spec

    @functools.wraps(method)
    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        group_id = _group_id(self)
        if group_id < 0:
            return method(self, *args, **kwargs)
        from .. import _C

        record = _C._fr_record(
            group_id,
            op_name,
            False,
            flatten_inputs,
            flatten_outputs,
            list(inputs_of(args)),
            list(outputs_of(args)),
        )
        if record is None:
            return method(self, *args, **kwargs)
        return _track(_issue(method, record, op_name, self, *args, **kwargs), record)

    return recorded


def _wrap_p2p(method: Callable, sends: bool) -> Callable:
    @functools.wraps(method)
    def recorded(self: Any, tensors: list[torch.Tensor], peer: int, *args: Any, **kw: Any) -> Any:
        group_id = _group_id(self)
        if group_id < 0:
            return method(self, tensors, peer, *args, **kw)
        from .. import _C

        rank = self.rank()
        name = f"send {rank}->{peer}" if sends else f"recv {rank}<-{peer}"
        empty: list[torch.Tensor] = []
        record = _C._fr_record(
            group_id,
            name,
            True,
            False,
            False,
            list(tensors) if sends else empty,
            empty if sends else list(tensors),
        )
        if record is None:
            return method(self, tensors, peer, *args, **kw)
        return _track(_issue(method, record, name, self, tensors, peer, *args, **kw), record)

    return recorded


def instrument(cls: type) -> type:
    """Wraps the operations of the group class `cls` (once)."""
    if getattr(cls, "_flight_recorder_instrumented", False):
        return cls
    for method_name, spec in COLLECTIVES.items():
        method = getattr(cls, method_name, None)
        if method is not None:
            setattr(cls, method_name, _wrap_collective(method, spec))
    for method_name, sends in (("send", True), ("recv", False)):
        method = getattr(cls, method_name, None)
        if method is not None:
            setattr(cls, method_name, _wrap_p2p(method, sends))
    cls._flight_recorder_instrumented = True
    return cls
