"""The name and description of a process group written in Python that dispatches itself.

c10d keeps a group's name and description in its backends (``ProcessGroup.getGroupName``
asks the default backend). A ``dist.ProcessGroup`` subclass that registers no backend of its
own for every device and dispatches the operations itself — the multi-node group
(``multinode.hierarchical``) and the router to a vendor's backend (``routing``) — keeps
them itself and answers the getters that DeviceMesh, functional collectives and the group
registry call. Both answer to the backend name ``spyreccl``.
"""

from __future__ import annotations

__all__ = ["BACKEND_NAME", "SelfNamedGroup"]

BACKEND_NAME = "spyreccl"


class SelfNamedGroup:
    """Mixin placed before ``dist.ProcessGroup`` in a group's bases; the group sets
    ``self._name`` (its group name) and ``self._desc`` (its description, ``""`` at first)
    in its constructor."""

    _name: str
    _desc: str

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc
