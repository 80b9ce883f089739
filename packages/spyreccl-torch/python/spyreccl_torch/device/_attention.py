"""Tensor-parallel attention on spyre: a plain attention mask next to DTensor q/k/v.

Spyre runs ``F.scaled_dot_product_attention`` through
``aten::_scaled_dot_product_efficient_attention`` (src/device/attention.cc), for which
DTensor has sharding rules (heads or batch sharded). One gap remains: SDPA turns a user's
``attn_mask`` into the op's ``attn_bias`` with plain tensor ops, so with DTensor q/k/v the
op receives a plain bias and DTensor refuses the mix. The mask is a regular (non-DTensor)
tensor of an SPMD program, i.e. the same on every rank -- the premise of DTensor's own
``implicit_replication()`` -- so for spyre meshes the bias is wrapped as a replicated
DTensor and the op takes DTensor's normal path (which slices the bias to each rank's heads
locally, without communication).

DTensor is not imported by ``import torch``, and importing it costs ~0.5 s, so the handlers
are installed when something else imports ``torch.distributed.tensor``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

__all__ = ["install"]

_DTENSOR_MODULE = "torch.distributed.tensor"
_lock = threading.RLock()


def _replicated(bias: torch.Tensor, like: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    mesh = like.device_mesh
    spec = DTensorSpec(
        mesh,
        (Replicate(),) * mesh.ndim,
        tensor_meta=TensorMeta(shape=bias.shape, stride=bias.stride(), dtype=bias.dtype),
    )
    return DTensor(bias, spec, requires_grad=bias.requires_grad)


def _bias_replicating_handler(query_index: int, bias_index: int) -> Callable[..., object]:
    def handler(op_call: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
        from torch.distributed.tensor import DTensor

        query, bias = args[query_index], args[bias_index]
        if (
            isinstance(query, DTensor)
            and query.device_mesh.device_type == "spyre"
            and isinstance(bias, torch.Tensor)
            and not isinstance(bias, DTensor)
        ):
            args = (*args[:bias_index], _replicated(bias, query), *args[bias_index + 1 :])
        # Run the op through DTensor's ordinary dispatch: without this handler for the
        # duration of the call (the lock keeps other threads from seeing it missing).
        handlers = DTensor._op_dispatcher._custom_op_handlers
        with _lock:
            me = handlers.pop(op_call)
            try:
                return op_call(*args, **kwargs)
            finally:
                handlers[op_call] = me

    return handler


def _register_handlers() -> None:
    try:
        _register_handlers_unchecked()
    except Exception as error:  # runs inside an import, which must not break
        warnings.warn(
            f"spyreccl: tensor-parallel attention with a mask on spyre is unavailable: {error}",
            RuntimeWarning,
            stacklevel=2,
        )


def _register_handlers_unchecked() -> None:
    from torch.distributed.tensor import DTensor

    aten = torch.ops.aten
    handlers = DTensor._op_dispatcher._custom_op_handlers
    # (op, index of query, index of attn_bias) in the op's arguments
    for op, query_index, bias_index in (
        (aten._scaled_dot_product_efficient_attention.default, 0, 3),
        (aten._scaled_dot_product_efficient_attention_backward.default, 1, 4),
    ):
        handlers.setdefault(op, _bias_replicating_handler(query_index, bias_index))


class _ChainedLoader(importlib.abc.Loader):
    """Runs the real loader, then ``callback``."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        module.__spec__.loader = self._loader  # the module is loaded: hide this wrapper
        module.__loader__ = self._loader
        self._callback()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Meta path finder that runs ``callback`` once ``name`` has been imported."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self._name = name
        self._callback = callback

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)  # one shot; the other finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ChainedLoader(spec.loader, self._callback)
        return spec


def install() -> None:
    """Installs the DTensor handlers now if DTensor is loaded, else when it loads."""
    if _DTENSOR_MODULE in sys.modules:
        _register_handlers()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_DTENSOR_MODULE, _register_handlers))
