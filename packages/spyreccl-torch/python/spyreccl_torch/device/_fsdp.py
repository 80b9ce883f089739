"""FSDP on modules built on the CPU: moving their states to spyre.

``fully_shard`` (FSDP2) moves a module's parameters and buffers to the mesh's device, and
``FullyShardedDataParallel(module, device_id=...)`` (FSDP1) to ``device_id``, with
``tensor.data = tensor.to(device)``. torch allows that assignment only between tensor types
it lists as compatible (``TensorImpl::has_compatible_shallow_copy_type``: CPU, CUDA, MPS,
HIP, XPU, HPU and MTIA), which leaves out every PrivateUse1 device: both failed on spyre for
a module still on the CPU with "Attempted to call ``variable.set_data(tensor)``, but
``variable`` and ``tensor`` have incompatible tensor type", where CUDA moves it.

``nn.Module.to`` meets the same restriction by swapping in new tensors; this does what FSDP2
does for tensor subclasses: ``torch.utils.swap_tensors`` with the moved tensor (and its
gradient), so that the objects the module and the caller hold stay the same, now on spyre.
FSDP1's ``CPUOffload`` moves its flat parameters between the CPU and the device later with
``.data =`` too, and stays unsupported.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ._import_hooks import after_import

__all__ = ["install"]

# The modules whose _move_states_to_device(params, buffers, device) moves states: FSDP2's
# and FSDP1's (whose device may be None: nothing to move).
_FSDP_INITS = (
    "torch.distributed.fsdp._fully_shard._fsdp_init",
    "torch.distributed.fsdp._init_utils",
)


def _swap_onto(device: torch.device, tensors: Any) -> None:
    """Moves each plain tensor or Parameter of `tensors` that lies on another device type
    than `device` (meta excepted) onto `device`, in place (swap_tensors)."""
    for tensor in tensors:
        if type(tensor) not in (torch.Tensor, nn.Parameter):
            continue  # DTensor and other subclasses: FSDP2's own handling
        if tensor.device.type in (device.type, "meta"):
            continue
        with torch.no_grad():
            moved = tensor.to(device)
            if isinstance(tensor, nn.Parameter):
                moved = nn.Parameter(moved, requires_grad=tensor.requires_grad)
                if tensor.grad is not None:
                    moved.grad = tensor.grad.to(device)
        torch.utils.swap_tensors(tensor, moved)


def _wrap(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def move_states_to_device(params: Any, buffers: Any, device: torch.device | None) -> None:
        if device is not None and device.type == torch._C._get_privateuse1_backend_name():
            params, buffers = list(params), list(buffers)
            _swap_onto(device, itertools.chain(params, buffers))
        original(params, buffers, device)

    move_states_to_device.__spyreccl_wrapped__ = True  # type: ignore[attr-defined]
    return move_states_to_device


def _patch(name: str) -> None:
    import importlib

    module = importlib.import_module(name)
    original = module._move_states_to_device
    if not getattr(original, "__spyreccl_wrapped__", False):
        module._move_states_to_device = _wrap(original)


def install() -> None:
    """Wraps FSDP2's and FSDP1's state moves once their modules are loaded (now, if they
    are)."""
    for name in _FSDP_INITS:
        after_import(name, functools.partial(_patch, name), "FSDP of a module built on the CPU")
