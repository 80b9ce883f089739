"""Host buffers of a hierarchical group's gloo stages (see hierarchical.py).

gloo moves and reduces CPU tensors. When spyre memory is host-addressable (the backend's
capability ``_C._host_addressable("spyre")``, which spyreccl's emulated device declares in its
default ``host`` memory mode), :func:`spyreccl_torch.device.host_view` gives gloo a CPU
tensor over it, so a stage reads and writes the spyre tensor in place. Otherwise (a real
runtime such as torch_spyre owns the device, the emulated device runs with
``SPYRECCL_SPYRE_MEMORY=discrete``, or ``SPYRECCL_MULTINODE_ZERO_COPY=0``) a stage works on a
host copy made with the device's own copies and copies its result back. A stage that needs
a contiguous buffer that the tensor is not, makes one copy.

:attr:`HostStaging.counts` counts the copies between spyre tensors and host buffers that the
stages make (tests and the benchmark read it through the group's ``staging_counts``).
"""

from __future__ import annotations

import os

import torch

# "0" makes the gloo stages copy spyre tensors to host buffers and back even where the
# emulated device would let them work in place (to compare, or to rule the views out). Read
# when a group is created.
ZERO_COPY_ENV = "SPYRECCL_MULTINODE_ZERO_COPY"

_SPYRE = "spyre"


def zero_copy_available() -> bool:
    """Whether spyre tensors are host memory that gloo may use in place: the emulated device
    is active in this process (it steps aside for a real runtime, see
    spyreccl_torch.device) and declared spyre memory host-addressable, and
    SPYRECCL_MULTINODE_ZERO_COPY is not 0."""
    from .. import _C, device

    if os.environ.get(ZERO_COPY_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return device.is_registered() and bool(_C._host_addressable(_SPYRE))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `b` is `a`'s own memory: the same start and the same number of bytes (`a`
    itself, a view of it such as HostStaging's, or a slice of the same storage). Views keep
    the data pointer, so comparing it (and the size) tells."""
    same_size = a.numel() * a.element_size() == b.numel() * b.element_size()
    return same_size and a.data_ptr() == b.data_ptr()


class HostStaging:
    """Gives the gloo stages host tensors for spyre tensors (see the module docstring)."""

    def __init__(self, zero_copy: bool) -> None:
        self.zero_copy = zero_copy
        self._host_view = None
        if zero_copy:
            # The op itself: the public host_view's checks (a tensor, the device active) hold
            # here already, and resolving the op's overload per call costs microseconds.
            self._host_view = torch.ops.spyreccl_device.host_view.default
        # "to_host": a spyre tensor's elements copied into a host buffer; "from_host": a
        # host buffer copied into a spyre tensor.
        self.counts = {"to_host": 0, "from_host": 0}

    def _view(self, t: torch.Tensor) -> torch.Tensor | None:
        """A CPU view of spyre `t`'s memory, or None where the stage must copy. Conjugate
        and negative views keep their lazy bit, which gloo would not see: they are copied
        (the copy resolves the bit), as before the views existed."""
        if self._host_view is None or t.is_conj() or t.is_neg():
            return None
        return self._host_view(t.detach())

    def host(self, t: torch.Tensor, fill: bool = True) -> torch.Tensor:
        """A contiguous host tensor of `t`'s shape and dtype for a gloo stage: `t` itself (a
        contiguous CPU tensor), a view of `t`'s memory (spyre, contiguous, zero-copy), else a
        new host buffer, holding a copy of `t`'s elements when `fill`. Whatever the stage
        writes into it reaches `t` through :meth:`commit`."""
        if t.device.type != _SPYRE:
            if t.is_contiguous():
                return t
            return t.contiguous() if fill else torch.empty(t.shape, dtype=t.dtype)
        view = self._view(t)
        if view is not None and view.is_contiguous():
            return view
        if not fill:
            return torch.empty(t.shape, dtype=t.dtype)
        self.counts["to_host"] += 1
        # One copy: from the view where there is one, else spyre -> host directly
        # (contiguous(memory_format=...) on spyre first would be a second one).
        source = view if view is not None else t.detach()
        return source.to("cpu", memory_format=torch.contiguous_format, copy=view is not None)

    def host_bytes(self, t: torch.Tensor, fill: bool = True) -> torch.Tensor:
        """:meth:`host` as flat uint8 (gloo moves every dtype as bytes)."""
        return _as_bytes(self.host(t, fill))

    def padded_bytes(self, t: torch.Tensor, nbytes: int) -> torch.Tensor:
        """`t`'s elements as `nbytes` (at least t's size) flat uint8, zero-padded at the end:
        :meth:`host_bytes` when no padding is needed, else one copy into a padded buffer."""
        size = t.numel() * t.element_size()
        if size == nbytes:
            return self.host_bytes(t)
        padded = torch.zeros(nbytes, dtype=torch.uint8)
        self._copy_into(padded[:size], t)
        return padded

    def concat_bytes(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors' elements, one after the other, as flat uint8: one copy of each."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        out = torch.empty(sum(sizes), dtype=torch.uint8)
        offset = 0
        for t, size in zip(tensors, sizes, strict=True):
            self._copy_into(out[offset : offset + size], t)
            offset += size
        return out

    def _copy_into(self, dest: torch.Tensor, t: torch.Tensor) -> None:
        """Copies `t`'s elements into the flat uint8 host slice `dest` (one copy)."""
        if t.device.type == _SPYRE:
            self.counts["to_host"] += 1
            view = self._view(t)
            if view is None:
                # Copy mode: spyre -> host in one transfer, then bytes into place.
                dest.copy_(_as_bytes(t.detach().to("cpu", memory_format=torch.contiguous_format)))
                return
            t = view
        if t.numel() == 0:
            return
        if t.is_contiguous() or dest.storage_offset() % t.element_size():
            # Contiguous: the bytes are a view, one copy. Otherwise a slice that the dtype
            # cannot view (after tensors of an odd size) takes a second copy; rare.
            dest.copy_(_as_bytes(t.contiguous()))
        else:
            dest.view(t.dtype).view(t.shape).copy_(t)

    def commit(self, t: torch.Tensor, host: torch.Tensor) -> None:
        """Makes `t` hold `host`'s elements (same number of bytes; `host` from :meth:`host`
        or :meth:`host_bytes`, or a result computed on the host): nothing when `host` is
        `t`'s own memory, else one copy, through a view of `t` where there is one."""
        if same_memory(t, host):
            return
        values = host.view(t.dtype) if host.dtype != t.dtype else host
        values = values.reshape(t.shape)
        if t.device.type != _SPYRE:
            t.copy_(values)
            return
        self.counts["from_host"] += 1
        view = self._view(t)
        (view if view is not None else t).copy_(values)
