"""Inductor support for the emulated spyre device.

Spyre memory is host memory, so inductor's C++ (CPU) backend can compile kernels for
spyre tensors unchanged: the generated code only sees data pointers (in discrete memory
mode, host addresses that the device translates: ``_memory_mode.install_inductor_translation``
for the Python wrapper's kernel calls, ``_cpp_wrapper`` for the C++ wrapper's). Three pieces tell
inductor so:

* ``register_backend_for_device("spyre", CppScheduling, <wrapper>)``, where the wrapper
  emits kernel calls for spyre exactly as for ``cpu`` (the stock wrapper refuses
  non-triton kernel calls on unknown devices);
* a dynamo ``DeviceInterface`` for spyre (not triton-capable, answers from ``torch.spyre``);
* ``DeviceOpOverrides`` whose device guards use ``torch.spyre.device``;
* two device-scoped adjustments where torch 2.13 hard-codes device names and offers no
  registration hook (see :func:`_install_backend_name` and
  :func:`_install_cpu_codegen_node_check`): spyre kernels are C++ kernels ("cpp"), and
  spyre scheduler nodes take the CPU path of the scheduler's loop optimisations;
* a do-nothing device pass whose ``uuid()`` names this code generation
  (:class:`CodegenIdentity`), so that inductor's caches never serve a graph that an
  older spyreccl-torch generated.

Imported by ``torch.spyre.__getattr__`` the first time inductor asks for its codegen
classes, so ``import torch`` never pays for importing inductor.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.device_interface import (
    CpuInterface,
    caching_worker_current_devices,
    register_interface_for_device,
)
from torch._inductor.codegen.common import (
    register_backend_for_device,
    register_device_op_overrides,
)
from torch._inductor.codegen.cpp import CppScheduling
from torch._inductor.codegen.cpu_device_op_overrides import CpuDeviceOpOverrides
from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SubgraphPythonWrapperCodegen
from torch._inductor.codegen.wrapper_fxir import WrapperFxCodegen
from torch._inductor.custom_graph_pass import CustomGraphModulePass, get_hash_for_files

from spyreccl_torch.device._cpp_wrapper import (
    ATEN_DEVICE_TYPE,
    SpyreCppWrapperCodegen,
    register_device_name,
)
from spyreccl_torch.device._wait_placement import waited_at_once_or_none

_DEVICE = "spyre"
_CPU = torch.device("cpu")


# The wrapper's allocation call for spyre buffers, and the header line that defines it.
_FAST_EMPTY = "empty_strided_spyre"
_FAST_EMPTY_IMPORT = f"from spyreccl_torch._C import _empty_strided_spyre as {_FAST_EMPTY}"
# What binds the functional collectives' operators for the wrapper's calls (see
# _HostKernelCallsMixin._direct_collective).
_DIRECT_OP = "_spyreccl_direct_op"
_DIRECT_OP_IMPORT = f"from spyreccl_torch._C import _direct_op as {_DIRECT_OP}"
_FUNCTIONAL_NAMESPACE = "_c10d_functional"
# Whether spyre's Python wrappers call the functional collectives through _direct_op (the
# default) or as torch.ops..._c10d_functional.<op>.default like the stock wrapper; read when
# a graph is compiled. Part of inductor's cache keys (CodegenIdentity), so a cached module is
# only served to the setting it was compiled with.
DIRECT_COLLECTIVE_CALLS = os.environ.get("SPYRECCL_INDUCTOR_DIRECT_CALLS", "1") != "0"


@functools.cache
def _fast_calls_available() -> bool:
    """Whether spyreccl_torch._C (the backend's extension, which holds the fast allocation
    and operator-call functions) loads; the generated wrappers import them."""
    try:
        from spyreccl_torch._C import _direct_op, _empty_strided_spyre  # noqa: F401
    except Exception:
        return False
    return True


class _HostKernelCallsMixin:
    """Emits calls of C++ (non-triton) kernels on spyre tensors like CPU kernel calls:
    both pass host pointers to the same compiled code. Two per-call costs of the stock
    Python wrapper are replaced by C functions of spyreccl_torch._C:

    * spyre buffers are allocated through ``_empty_strided_spyre``, spyre's counterpart of
      the C functions torch's wrapper calls for cpu and cuda buffers (~0.3 us instead of
      ~0.9 us for torch.empty_strided(..., device="spyre") per buffer;
      src/backend/fast_empty.cpp);
    * the functional collectives (``torch.ops._c10d_functional.<op>.default(...)``, two
      per collective with its wait_tensor) are called through functions that
      ``_direct_op`` binds once per module: the same dispatcher operator, without torch's
      Python operator layer (~0.2 us instead of ~0.8 us for a wait_tensor;
      src/backend/direct_ops.cpp)."""

    def _generate_kernel_call_helper(self, kernel_name: str, call_args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if not kwargs.get("triton", True) and device is not None and device.type == _DEVICE:
            kwargs["device"] = _CPU
        return super()._generate_kernel_call_helper(kernel_name, call_args, **kwargs)

    def _spyre_module_root(self) -> Any:
        """The outermost wrapper when it is spyre's and the C functions load (its header
        imports them, see write_header; subgraph wrappers write into its module), else
        None."""
        root: Any = self
        while getattr(root, "parent_wrapper", None) is not None:
            root = root.parent_wrapper
        if isinstance(root, SpyrePythonWrapperCodegen) and _fast_calls_available():
            return root
        return None

    def _direct_collective(self, node: Any) -> str | None:
        """The module-level name through which the wrapper calls the functional collective
        ``node`` (bound in the module's imports on first use), or None for the stock call.
        Any device: the bound function calls the same dispatcher operator as
        ``torch.ops...default`` would, so cpu collectives in a spyre graph keep torch's
        kernels."""
        from torch._inductor import config, ir

        if (
            not DIRECT_COLLECTIVE_CALLS
            or not isinstance(node, ir._CollectiveKernel)
            or config.generate_intermediate_hooks
        ):
            return None
        overload = node.op_overload
        if (
            not isinstance(overload, torch._ops.OpOverload)
            or overload.namespace != _FUNCTIONAL_NAMESPACE
        ):
            return None
        root = self._spyre_module_root()
        if root is None:
            return None
        opname, overloadname = overload._opname, overload._overloadname
        name = f"_spyreccl_{opname}_{overloadname}"
        target = f"torch.ops.{_FUNCTIONAL_NAMESPACE}.{opname}.{overloadname}"
        root.add_import_once(_DIRECT_OP_IMPORT)
        if node.get_name() in self._collectives_waited_at_once():
            name += "_then_wait"
            root.add_import_once(f"{name} = {_DIRECT_OP}({target}, wait_follows=True)")
        else:
            root.add_import_once(f"{name} = {_DIRECT_OP}({target})")
        return name

    def _collectives_waited_at_once(self) -> set[str]:
        """The collectives of this wrapper whose wait_tensor is its next line that does
        anything (computed once, when the first collective is written: the wrapper's lines
        are final by then)."""
        cached: set[str] | None = getattr(self, "_spyre_waited_at_once", None)
        if cached is None:
            cached = waited_at_once_or_none(self.lines)  # type: ignore[attr-defined]
            self._spyre_waited_at_once = cached
        return cached

    def _generate_extern_kernel_alloc_helper(self, extern_kernel: Any, args: list[str]) -> None:
        name = self._direct_collective(extern_kernel)
        if name is None:
            super()._generate_extern_kernel_alloc_helper(extern_kernel, args)  # type: ignore[misc]
            return
        from torch._inductor import ir

        # The stock helper's two forms, with the bound name in place of the kernel's
        # (intermediate hooks and memory planning's view_as_complex clone do not apply to
        # collectives; hooks take the stock helper above).
        call = f"{name}({', '.join(args)})"
        if isinstance(extern_kernel.layout, ir.NoneLayout):
            self.writeline(f"{self.declare}{call}{self.ending}")
        else:
            self.writeline(f"{self.declare}{extern_kernel.get_name()} = {call}{self.ending}")

    def make_allocation(
        self,
        name: str,
        device: torch.device,
        dtype: torch.dtype,
        shape: Any,
        stride: Any,
        allocation_shape: Any = None,
        is_pinned: bool = False,
    ) -> str:
        from torch._inductor import config

        if (
            device.type != _DEVICE
            or is_pinned
            or config.test_configs.track_memory_lifecycle
            or self._spyre_module_root() is None
        ):
            return super().make_allocation(
                name, device, dtype, shape, stride, allocation_shape, is_pinned
            )
        # Like the stock wrapper's cpu / cuda line: the current device (the wrapper's device
        # guard sets it), an extra as_strided when the allocation is larger than the view.
        shape_code = self.codegen_python_shape_tuple(shape)
        allocation_code = self.codegen_python_shape_tuple(
            shape if allocation_shape is None else allocation_shape
        )
        stride_code = self.codegen_python_shape_tuple(stride)
        line = f"{name} = {_FAST_EMPTY}({allocation_code}, {stride_code}, {dtype})"
        if shape_code != allocation_code:
            line += f".as_strided({shape_code}, {stride_code})"
        return line


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

    def write_header(self) -> None:
        super().write_header()
        if _fast_calls_available():
            # Subgraph wrappers write into this module: they find the name here too.
            self.header.writeline(_FAST_EMPTY_IMPORT)


class SpyreDeviceOpOverrides(CpuDeviceOpOverrides):
    """Device statements in generated Python code: spyre executes synchronously, so only
    the device guard does anything."""

    def set_device(self, device_idx: int) -> str:
        return f"torch.spyre.set_device({device_idx})"

    def synchronize(self) -> str:
        return "torch.spyre.synchronize()"

    def device_guard(self, device_idx: int) -> str:
        return f"torch.spyre.device({device_idx})"

    def aten_device_type(self) -> str:
        # Asked by torch >= 2.15's C++ code generation (older ones read
        # cpp_utils.DEVICE_TO_ATEN, see register_device_name); the CPU answer inherited
        # otherwise would put the C++ wrapper's buffers on the host device.
        return ATEN_DEVICE_TYPE


class SpyreInterface(CpuInterface):
    """Dynamo's view of the spyre runtime: host execution, no streams, no triton."""

    class Worker(CpuInterface.Worker):
        """Device queries for inductor's compile workers (``device="spyre"`` without an
        index resolves through ``Worker.current_device``). The device a worker was told
        to use is remembered, as for CUDA; otherwise the process's current device."""

        @staticmethod
        def set_device(device: int) -> None:
            caching_worker_current_devices[_DEVICE] = torch.spyre._device_index(
                device, optional=False
            )

        @staticmethod
        def current_device() -> int:
            if _DEVICE in caching_worker_current_devices:
                return caching_worker_current_devices[_DEVICE]
            return torch.spyre.current_device()

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
    "CppWrapperCodegen": SpyreCppWrapperCodegen,
    "WrapperFxCodegen": WrapperFxCodegen,
}

_lock = threading.Lock()
_registered = False


def _is_spyre(device_type: str | None) -> bool:
    """Whether inductor's current device (or ``device_type``) is spyre."""
    if not device_type:
        from torch._inductor.virtualized import V

        device_type = V.graph.get_current_device_or_throw().type
    return device_type == _DEVICE


def _install_backend_name() -> None:
    """Makes ``get_current_backend()`` answer "cpp" for spyre.

    Inductor asks ``torch._inductor.utils.get_current_backend()`` which kernel language the
    current device's kernels are written in (CSE, dtype propagation and the compute-dtype
    upcast differ between "cpp" and "triton"). torch 2.13 hard-codes that map: cpu, mps,
    xpu and tpu are listed, every other device gets ``config.cuda_backend`` ("triton"), and
    ``register_backend_for_device`` has no parameter for it (its ``device_custom_config``
    only feeds cache keys). Spyre kernels come from ``CppScheduling``, so with "triton" the
    C++ codegen sees triton-style values and fails (``assert index.dtype is not None``).

    Setting ``config.cuda_backend = "cpp"`` would also switch CUDA devices of the same
    process to the C++ backend, so instead the function is wrapped: spyre answers "cpp",
    every other device reaches the original. Modules that imported the function by name
    are rebound to the wrapper.
    """
    import torch._inductor.utils as inductor_utils

    original = inductor_utils.get_current_backend
    if getattr(original, "_spyre_wrapped", False):
        return

    def get_current_backend(device_type: str | None = None) -> str:
        if _is_spyre(device_type):
            return "cpp"
        return original(device_type)

    get_current_backend._spyre_wrapped = True  # type: ignore[attr-defined]
    get_current_backend.__wrapped__ = original  # type: ignore[attr-defined]
    get_current_backend.__doc__ = original.__doc__
    for name, module in list(sys.modules.items()):
        if (name == "torch._inductor" or name.startswith("torch._inductor.")) and getattr(
            module, "get_current_backend", None
        ) is original:
            module.get_current_backend = get_current_backend  # type: ignore[attr-defined]


def _install_cpu_codegen_node_check() -> None:
    """Counts spyre scheduler nodes as CPU-generated in ``BaseSchedulerNode.is_cpu``.

    The scheduler uses ``is_cpu()`` only to keep GPU-style loop reordering, pointwise
    reindexing and index inversion away from nodes whose kernels ``CppScheduling`` writes
    ("not validated for CPU codegen"); on spyre nodes the reindexing pass fails (``can't
    multiply sequence by non-int of type 'tuple'``: C++ node groups are size tuples, not
    SIMD numels). Spyre nodes are generated by the same C++ scheduling, so they take the
    CPU path. Switching the passes off in ``torch._inductor.config`` would change every
    device's compilation; this changes spyre nodes only.
    """
    from torch._inductor.scheduler import BaseSchedulerNode

    original = BaseSchedulerNode.is_cpu
    if getattr(original, "_spyre_wrapped", False):
        return

    def is_cpu(self: BaseSchedulerNode) -> bool:
        device = self.get_device()
        return (device is not None and device.type == _DEVICE) or original(self)

    is_cpu._spyre_wrapped = True  # type: ignore[attr-defined]
    is_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    is_cpu.__doc__ = original.__doc__
    BaseSchedulerNode.is_cpu = is_cpu  # type: ignore[method-assign]


def codegen_files() -> tuple[str, ...]:
    """The files whose contents decide the code a spyre graph compiles to, or what that
    code calls: this package's Python modules of the device (the wrapper code generators,
    the functions their code imports) and its extension modules (the direct collective
    calls, the fast allocation, the kernels behind the dispatcher ops the C++ wrapper
    names)."""
    package = Path(__file__).resolve().parent.parent
    device = sorted((package / "device").glob("*.py"))
    extensions = sorted(package.glob("*.so"))
    return tuple(str(path) for path in (*device, *extensions))


@functools.cache
def codegen_uuid() -> bytes:
    """A digest of :func:`codegen_files` and the package version (hashed once per
    process: about 2 MB)."""
    from spyreccl_torch import __version__

    return get_hash_for_files(codegen_files(), extra=f"spyreccl-torch {__version__}")


class CodegenIdentity(CustomGraphModulePass):
    """Spyre's device pass: it leaves the graph as it is, and identifies spyre's code
    generation in inductor's cache keys.

    Inductor's FX graph cache (on by default) keys a compiled graph on torch's sources, its
    configuration and the ``uuid()`` of every device's custom pass, but not on the wrapper
    code generators a device registers. Without this, a graph compiled by an earlier
    spyreccl-torch was served from the cache after an upgrade: its wrapper code, generated
    by the old classes, calling what the old package offered (seen: a graph kept the
    generic collective calls after spyre's wrapper had learnt to mark the collectives it
    waits for at once). A pass is the only registration hook whose identity reaches the key
    (``register_backend_for_device(device_custom_pass=...)``); its ``__call__`` does
    nothing. The key also tells :data:`DIRECT_COLLECTIVE_CALLS` and the memory mode
    (``SPYRECCL_SPYRE_MEMORY``) apart."""

    def __call__(self, gm: torch.fx.GraphModule) -> None:
        return None

    def uuid(self) -> bytes:
        # The settings that change the generated code are part of it too: a graph compiled
        # with the stock collective calls must not be served to one that wants the direct
        # calls, or the other way round.
        # The memory mode too: the C++ wrapper translates pointers only in discrete mode.
        from spyreccl_torch.device._memory_mode import memory_mode

        return (
            codegen_uuid()
            + (b"direct" if DIRECT_COLLECTIVE_CALLS else b"stock")
            + memory_mode().encode()
        )


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
            SpyreCppWrapperCodegen,
            WrapperFxCodegen,
            device_custom_pass=CodegenIdentity(),
        )
        register_device_name()
        register_interface_for_device(_DEVICE, SpyreInterface)
        register_device_op_overrides(_DEVICE, SpyreDeviceOpOverrides())
        _install_backend_name()
        _install_cpu_codegen_node_check()
        _registered = True


def attribute(name: str) -> Any:
    """The inductor class ``torch.spyre.<name>``, registering spyre on first use."""
    register()
    return _ATTRIBUTES[name]
