"""Flight recorder entries of the gloo stages between nodes, as children of their call.

A hierarchical call's part between the nodes runs on gloo groups (the ranks of one local
index across the nodes, or every rank), whose own records torch keeps in a recorder that
spyreccl's dumps cannot include. :class:`RecordedGloo` wraps such a group: a collective
posted while a recorded call's job runs on this thread (flight.enter) becomes an entry of
its own group, ``<group name>/cross<local index>`` or ``<group name>/flat`` with the gloo
group's global ranks, named ``<op> (stage of <call> seq <n>)``. torch's analyzer matches
entries by group and collective sequence number, and every member posts the stages of one
group in the same order, so it pairs them across ranks like any collective; it reads only
the first word of a collective's name, so the rest names, in its report, the call a hung
stage belongs to. A stage is started when posted and completed when its wait returns
(stages.py); one that fails or is abandoned stays started.

Calls outside a recorded job (CPU tensors handed to gloo as they are) and point-to-point
transfers (the call's own entry names both ends) are not recorded here; the check exchange
is plumbing and is not wrapped.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from . import flight

# gloo Work -> its stage's record, from posting until its wait returns (or it is abandoned):
# gloo's Works take no attributes. Weak keys: a Work nobody waits for takes its entry along.
_PENDING: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()


def _pop(work: Any) -> tuple | None:
    try:
        return _PENDING.pop(work, None)
    except TypeError:  # not a Work that can be a key (the check exchange waits for others)
        return None


def completed(work: Any) -> None:
    """The stage `work` (any Work) completed: its entry, if it has one, too."""
    record = _pop(work)
    if record is not None:
        from .. import _C

        _C._fr_mark(record, True)


def forget(work: Any) -> None:
    """This rank no longer waits for `work`: its entry stays started."""
    _pop(work)


class RecordedGloo:
    """A gloo group of a hierarchical group (`owner`) whose collective stages are recorded
    (see the module docstring); everything else is the gloo group's own."""

    def __init__(self, gloo: Any, owner: Any, suffix: str, global_ranks: Sequence[int]) -> None:
        self._gloo = gloo
        self._owner = weakref.ref(owner)  # not a strong one: the owner holds this object
        self._suffix = suffix
        self._global_ranks = list(global_ranks)
        self._id: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gloo, name)

    def _group_id(self) -> int:
        """The recorder id of this stage group (-1: recording is off), registered with its
        first stage, when c10d has named and described the owner."""
        if self._id is None:
            from .. import _C

            owner = self._owner()
            if owner is None:
                return -1
            self._id = _C._fr_register_group(
                f"{owner._name}/{self._suffix}",
                owner.getGroupDesc(),
                self._gloo.rank(),
                self._gloo.size(),
                self._global_ranks,
                owner._timeout,
                None,  # the owner's entry tells the other ranks of a failure
            )
            if self._id >= 0:
                weakref.finalize(self, _C._fr_unregister_group, self._id)
        return self._id


def _recorded(method_name: str, spec: tuple) -> Callable:
    op_name, inputs_of, outputs_of, flatten_inputs, flatten_outputs = spec

    def call(self: RecordedGloo, *args: Any) -> Any:
        method = getattr(self._gloo, method_name)
        parent = flight.running_call()
        if parent is None:
            return method(*args)
        group_id = self._group_id()
        if group_id < 0:
            return method(*args)
        from .. import _C

        record = _C._fr_record(
            group_id,
            f"{op_name} (stage of {parent})",
            False,
            flatten_inputs,
            flatten_outputs,
            list(inputs_of(args)),
            list(outputs_of(args)),
        )
        work = method(*args)
        if record is not None:
            _C._fr_mark(record, False)  # posted: gloo runs it from here on
            _PENDING[work] = record
        return work

    call.__name__ = method_name
    return call


for _name, _spec in flight.COLLECTIVES.items():
    if _name != "barrier":  # the stages are data movements
        setattr(RecordedGloo, _name, _recorded(_name, _spec))
