"""The name and description that Python-written groups (the multi-node group and the router
to a vendor's backend) keep themselves, through one shared mixin: what torch's C++ getters
(group_name, group_desc) and the backend name read on such a group."""

from __future__ import annotations

import torch.distributed as dist

from spyreccl_torch._group_identity import BACKEND_NAME, SelfNamedGroup
from spyreccl_torch.multinode.hierarchical import HierarchicalProcessGroup
from spyreccl_torch.routing import RoutingProcessGroup


class _Group(SelfNamedGroup, dist.ProcessGroup):
    def __init__(self, name: str) -> None:
        super().__init__(0, 1)
        self._name = name
        self._desc = ""


def test_torch_reads_the_name_and_description_the_group_keeps():
    group = _Group("tp-7")
    # The C++ getters reach the mixin through torch's trampoline.
    assert group.group_name == "tp-7"
    assert group.group_desc == ""
    group.setGroupDesc("tensor parallel")
    group.setGroupName("tp-8")
    assert (group.group_name, group.group_desc) == ("tp-8", "tensor parallel")
    assert group.getGroupName() == "tp-8"
    assert group.name() == group.getBackendName() == BACKEND_NAME == "spyreccl"


def test_both_python_groups_share_it():
    for cls in (RoutingProcessGroup, HierarchicalProcessGroup):
        assert issubclass(cls, SelfNamedGroup)
        mro = cls.__mro__
        # Before torch's ProcessGroup, whose bound C++ getters would otherwise answer.
        assert mro.index(SelfNamedGroup) < mro.index(dist.ProcessGroup), cls
        for method in ("getGroupName", "setGroupName", "getGroupDesc", "setGroupDesc", "name"):
            assert getattr(cls, method) is getattr(SelfNamedGroup, method), (cls, method)
