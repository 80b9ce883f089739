"""Inductor support for the emulated spyre device.

Spyre memory is host memory, so inductor's C++ (CPU) backend can compile kernels for
spyre tensors unchanged: the generated code only sees data pointers. Three pieces tell
inductor so:

* ``register_backend_for_device("spyre", CppScheduling, <wrapper>)``, where the wrapper
  emits kernel calls for spyre exactly as for ``cpu`` (the stock wrapper refuses
  non-triton kernel calls on unknown devices);
* a dynamo ``DeviceInterface`` for spyre (not triton-capable, answers from ``torch.spyre``);
* ``DeviceOpOverrides`` whose device guards use ``torch.spyre.device``.

Imported by ``torch.spyre.__getattr__`` the first time inductor asks for its codegen
classes, so ``import torch`` never pays for importing inductor.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch._dynamo.device_interface import CpuInterface, register_interface_for_device
from torch._inductor.codegen.common import (
    register_backend_for_device,
    register_device_op_overrides,
)
from torch._inductor.codegen.cpp import CppScheduling
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch._inductor.codegen.cpu_device_op_overrides import CpuDeviceOpOverrides
from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SubgraphPythonWrapperCodegen
from torch._inductor.codegen.wrapper_fxir import WrapperFxCodegen

_DEVICE = "spyre"
_CPU = torch.device("cpu")


class _HostKernelCallsMixin:
    """Emits calls of C++ (non-triton) kernels on spyre tensors like CPU kernel calls:
    both pass host pointers to the same compiled code."""

    def _generate_kernel_call_helper(self, kernel_name: str, call_args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if not kwargs.get("triton", True) and device is not None and device.type == _DEVICE:
            kwargs["device"] = _CPU
        return super()._generate_kernel_call_helper(kernel_name, call_args, **kwargs)


class SpyreSubgraphWrapperCodegen(_HostKernelCallsMixin, SubgraphPythonWrapperCodegen):
    """Subgraph (e.g. control flow) wrapper for spyre graphs."""


class SpyrePythonWrapperCodegen(_HostKernelCallsMixin, PythonWrapperCodegen):
    """Python wrapper codegen for spyre graphs."""

    @staticmethod
    def create(
        is_subgraph: bool,
        subgraph_name: str | None,
        parent_wrapper: PythonWrapperCodegen | None,
        partition_signatures: Any = None,
    ) -> PythonWrapperCodegen:
        if is_subgraph:
            if subgraph_name is None or parent_wrapper is None:
                raise ValueError("a subgraph wrapper needs subgraph_name and parent_wrapper")
            return SpyreSubgraphWrapperCodegen(subgraph_name, parent_wrapper, partition_signatures)
        return SpyrePythonWrapperCodegen()


class SpyreDeviceOpOverrides(CpuDeviceOpOverrides):
    """Device statements in generated Python code: spyre executes synchronously, so only
    the device guard does anything."""

    def set_device(self, device_idx: int) -> str:
        return f"torch.spyre.set_device({device_idx})"

    def synchronize(self) -> str:
        return "torch.spyre.synchronize()"

    def device_guard(self, device_idx: int) -> str:
        return f"torch.spyre.device({device_idx})"


class SpyreInterface(CpuInterface):
    """Dynamo's view of the spyre runtime: host execution, no streams, no triton."""

    class device:  # lowercase: the name is fixed by DeviceInterface
        def __new__(cls, device: Any) -> Any:
            return torch.spyre.device(device)

    @staticmethod
    def is_available() -> bool:
        return torch.spyre.is_available()

    @staticmethod
    def device_count() -> int:
        return torch.spyre.device_count()

    @staticmethod
    def current_device() -> int:
        return torch.spyre.current_device()

    @staticmethod
    def set_device(device: Any) -> None:
        torch.spyre.set_device(device)

    @staticmethod
    def exchange_device(device: int) -> int:
        previous = torch.spyre.current_device()
        if device >= 0 and device != previous:
            torch.spyre.set_device(device)
        return previous

    @staticmethod
    def maybe_exchange_device(device: int) -> int:
        return SpyreInterface.exchange_device(device)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        torch.spyre.synchronize(device)

    @staticmethod
    def is_triton_capable(device: Any = None) -> bool:
        return False

    @staticmethod
    def raise_if_triton_unavailable(device: Any = None) -> None:
        raise RuntimeError("the emulated spyre device has no triton backend; inductor uses C++")


_ATTRIBUTES = {
    "Scheduling": CppScheduling,
    "PythonWrapperCodegen": SpyrePythonWrapperCodegen,
    # cpp_wrapper mode is not supported on spyre: the C++ wrapper would need its own
    # device mapping. Inductor requires the attribute; the stock class keeps errors
    # explicit ("device spyre" is unknown to the AOTI runtime).
    "CppWrapperCodegen": CppWrapperCpu,
    "WrapperFxCodegen": WrapperFxCodegen,
}

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Registers spyre with inductor and dynamo (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        register_backend_for_device(
            _DEVICE,
            CppScheduling,
            SpyrePythonWrapperCodegen,
            CppWrapperCpu,
            WrapperFxCodegen,
        )
        register_interface_for_device(_DEVICE, SpyreInterface)
        register_device_op_overrides(_DEVICE, SpyreDeviceOpOverrides())
        # Inductor re-indexes pointwise loops fused into reductions for every device but
        # "cpu", assuming a GPU-style kernel; spyre kernels come from CppScheduling, where
        # that pass fails ("can't multiply sequence by non-int of type 'tuple'"). The pass
        # is an optimisation only, so it is switched off once spyre joins inductor.
        import torch._inductor.config as inductor_config

        inductor_config.loop_reindexing_after_fusion = False
        _registered = True


def attribute(name: str) -> Any:
    """The inductor class ``torch.spyre.<name>``, registering spyre on first use."""
    register()
    return _ATTRIBUTES[name]
