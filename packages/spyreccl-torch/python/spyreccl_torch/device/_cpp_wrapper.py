"""Inductor's C++ wrapper (``torch._inductor.config.cpp_wrapper = True``) for spyre graphs.

With the C++ wrapper, a compiled graph's ``call()`` is C++: buffer allocation, kernel calls
and the collectives between them run without a Python frame per line. torch 2.13 knows a
fixed set of devices there (``DEVICE_TO_ATEN``, a ``cpp_wrapper/<device>.h`` header and a
generated C shim per device); spyre, a PrivateUse1 device, has none of them. Spyre memory is
host memory and spyre kernels are inductor's C++ kernels, so :class:`SpyreCppWrapperCodegen`
emits what the CPU wrapper emits, except where the device matters:

* buffers are allocated on ``PrivateUse1`` (``aoti_torch_device_type_privateuse1()``), so a
  graph's outputs are spyre tensors;
* the header is the CPU one (there is no ``cpp_wrapper/spyre.h``);
* fallback (non-generated) aten ops go through the dispatcher, as every other spyre op
  does, instead of a per-device C shim that does not exist for spyre; ``out=`` extern
  kernels (``mm_out``, ``addmm_out``, ...) write into spyre buffers that inductor allocated
  and take the CPU shim, whose kernels only see host pointers;
* in discrete memory mode (``SPYRECCL_SPYRE_MEMORY=discrete``) a spyre tensor's data
  pointer is a device address the host cannot read: the C++ kernels get host addresses
  (``spyreccl_host_pointer``) and the CPU shims of ``out=`` extern kernels host views
  (``spyreccl_host_arg``), both through the device's own operators;
* the collectives reach spyreccl's ``_c10d_functional`` kernels through the dispatcher.
  Inductor hard-codes CPU shims for ``all_reduce(_)`` that call c10d directly (skipping
  the PrivateUse1 kernels, so a small collective would take the queued asynchronous path
  instead of completing inline), and the other collectives' ``Any group_name`` argument
  is unsupported by the JIT wrapper's fallback paths; both are handled here.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch._inductor import ir
from torch._inductor.codegen import cpp_utils
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

from spyreccl_torch._torch_compat import (
    ATEN_DEVICE_TYPE_FROM_OVERRIDES_MINOR,
    CPP_WRAPPER_MINOR,
    TORCH_MINOR,
    require,
)
from spyreccl_torch.device._wait_placement import waited_at_once_or_none

_DEVICE = "spyre"
# Spyre's device type in C++ (a PrivateUse1 device).
ATEN_DEVICE_TYPE = "at::kPrivateUse1"

# The CPU shims inductor names for these collectives (ir._AllReduce_Kernel, _AllReduceKernel),
# mapped to functions of the same C signature that this wrapper defines in the generated
# source, under the names a spyre C shim would give them, and that call the op through the
# dispatcher.
_DISPATCHED_COLLECTIVE_SHIMS = {
    "aoti_torch_cpu__c10d_functional_all_reduce_": "all_reduce_",
    "aoti_torch_cpu__c10d_functional_all_reduce": "all_reduce",
}

_COLLECTIVE_HELPER = r"""
namespace {
// spyreccl: a _c10d_functional all_reduce on spyre tensors goes through the dispatcher, so
// that the PrivateUse1 kernel of spyreccl-torch runs it (inductor's CPU shim calls c10d
// directly). Same C signature as aoti_torch_cpu__c10d_functional_<op>.
//
// The _then_wait forms are for a collective whose wait the wrapper calls right after it
// (nothing of the graph in between): spyreccl may then run it on this thread like a
// synchronous call, above the functional inline bound. They set the thread's flag through
// spyreccl's dispatcher op, since this code cannot link against spyreccl's extension.
struct SpyrecclWaitFollows {
  static const c10::TypedOperatorHandle<bool(bool)>& op() {
    static const auto handle = c10::Dispatcher::singleton()
        .findSchemaOrThrow("spyreccl::_set_wait_follows", "").typed<bool(bool)>();
    return handle;
  }
  SpyrecclWaitFollows() : previous(op().call(true)) {}
  ~SpyrecclWaitFollows() { op().call(previous); }
  bool previous;
};
const c10::OperatorHandle& spyreccl_all_reduce_op(bool in_place) {
  static const auto in_place_op = c10::Dispatcher::singleton().findSchemaOrThrow(
      "_c10d_functional::all_reduce_", "");
  static const auto out_of_place_op = c10::Dispatcher::singleton().findSchemaOrThrow(
      "_c10d_functional::all_reduce", "");
  return in_place ? in_place_op : out_of_place_op;
}
AOTITorchError spyreccl_call_all_reduce(
    bool in_place, bool wait_follows, AtenTensorHandle inp, const char* reduce_op,
    const char* group_name, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    std::optional<SpyrecclWaitFollows> scope;
    if (wait_follows) scope.emplace();
    std::vector<c10::IValue> stack;
    stack.reserve(3);
    stack.emplace_back(*torch::aot_inductor::tensor_handle_to_tensor_pointer(inp));
    stack.emplace_back(std::string(reduce_op));
    stack.emplace_back(std::string(group_name));
    spyreccl_all_reduce_op(in_place).callBoxed(&stack);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(stack[0]).toTensor());
  });
}
#define SPYRECCL_ALL_REDUCE_SHIM(name, in_place, wait_follows)                           \
  AOTITorchError name(AtenTensorHandle inp, const char* reduce_op, const char* group_name, \
                      AtenTensorHandle* ret0) {                                            \
    return spyreccl_call_all_reduce(in_place, wait_follows, inp, reduce_op, group_name,    \
                                    ret0);                                                 \
  }
SPYRECCL_ALL_REDUCE_SHIM(aoti_torch_spyre__c10d_functional_all_reduce_, true, false)
SPYRECCL_ALL_REDUCE_SHIM(aoti_torch_spyre__c10d_functional_all_reduce, false, false)
SPYRECCL_ALL_REDUCE_SHIM(aoti_torch_spyre__c10d_functional_all_reduce__then_wait, true, true)
SPYRECCL_ALL_REDUCE_SHIM(aoti_torch_spyre__c10d_functional_all_reduce_then_wait, false, true)
#undef SPYRECCL_ALL_REDUCE_SHIM
}  // namespace
"""


_DISCRETE_MEMORY_HELPER = r"""
namespace {
// spyreccl, SPYRECCL_SPYRE_MEMORY=discrete: a spyre tensor's data pointer is a device address
// that faults when the host reads it. The device maps the same memory a second time; kernels
// take that accessible address, CPU shims a host view (spyreccl_device::host_view).
struct SpyrecclWindow {
  uintptr_t device_base;
  uintptr_t host_base;
  uintptr_t size;
};
const SpyrecclWindow& spyreccl_window() {
  static const SpyrecclWindow window = [] {
    std::vector<c10::IValue> stack;
    c10::Dispatcher::singleton()
        .findSchemaOrThrow("spyreccl_device::discrete_window", "")
        .callBoxed(&stack);
    const std::vector<int64_t> v = stack.at(0).toIntVector();
    return SpyrecclWindow{static_cast<uintptr_t>(v.at(0)), static_cast<uintptr_t>(v.at(1)),
                          static_cast<uintptr_t>(v.at(2))};
  }();
  return window;
}
struct SpyrecclHostPointer {
  void* pointer;
  void* data_ptr() const { return pointer; }
};
template <class T>
SpyrecclHostPointer spyreccl_host_pointer(const T& tensor) {
  const SpyrecclWindow& w = spyreccl_window();
  void* p = tensor.data_ptr();
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return {a - w.device_base < w.size ? reinterpret_cast<void*>(a - w.device_base + w.host_base)
                                     : p};
}
RAIIAtenTensorHandle spyreccl_host_view(AtenTensorHandle handle) {
  const at::Tensor& tensor = *torch::aot_inductor::tensor_handle_to_tensor_pointer(handle);
  if (tensor.device().type() != c10::DeviceType::PrivateUse1) {
    return RAIIAtenTensorHandle(torch::aot_inductor::new_tensor_handle(at::Tensor(tensor)));
  }
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("spyreccl_device::host_view", "")
      .typed<at::Tensor(const at::Tensor&)>();
  return RAIIAtenTensorHandle(torch::aot_inductor::new_tensor_handle(op.call(tensor)));
}
struct SpyrecclOptionalHostView {
  explicit SpyrecclOptionalHostView(AtenTensorHandle* given)
      : present(given != nullptr && *given != nullptr),
        view(present ? spyreccl_host_view(*given) : RAIIAtenTensorHandle()),
        raw(view.get()) {}
  operator AtenTensorHandle*() { return present ? &raw : nullptr; }
  bool present;
  RAIIAtenTensorHandle view;
  AtenTensorHandle raw;
};
template <class T>
decltype(auto) spyreccl_host_arg(T&& arg) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, RAIIAtenTensorHandle> || std::is_same_v<D, AtenTensorHandle>) {
    return spyreccl_host_view(static_cast<AtenTensorHandle>(arg));
  } else if constexpr (std::is_same_v<D, AtenTensorHandle*>) {
    return SpyrecclOptionalHostView(arg);
  } else {
    return std::forward<T>(arg);
  }
}
}  // namespace
"""


def _discrete_memory() -> bool:
    from spyreccl_torch.device._memory_mode import memory_mode

    return memory_mode() == "discrete"


def _is_spyre(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == _DEVICE
    return device == _DEVICE


def _with_name_arguments(op: torch._ops.OpOverload, raw_args: Any) -> Any:
    """``op``'s schema with each ``Any`` argument whose value is a string typed ``str``.

    The collectives take ``Any group_name`` (a name or a ProcessGroup). In a compiled graph
    it is always the group's name; typed as ``str``, the wrapper's boxed dispatcher call
    can pass it. The schema name is unchanged, so the dispatcher finds the real op.
    Returns None when no argument needs it.
    """
    schema = op._schema
    names = [
        arg.name
        for arg, value in zip(schema.arguments, raw_args)
        if isinstance(arg.real_type, torch.AnyType) and isinstance(value, str)
    ]
    if not names:
        return None
    text = str(schema)
    for name in names:
        text = text.replace(f"Any {name}", f"str {name}", 1)
    return types.SimpleNamespace(_schema=torch._C.parse_schema(text))


class SpyreCppWrapperCodegen(CppWrapperCpu):
    """C++ wrapper codegen for graphs on the emulated spyre device (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._collective_helpers_written = False
        self._spyre_waited_at_once: set[str] | None = None  # see _collectives_waited_at_once
        self._spyre_then_wait = False  # the collective being written is waited at once
        self._discrete_helpers_written = False
        self._spyre_host_args = False  # an out= extern kernel's CPU shim call is being written

    @staticmethod
    def create(
        is_subgraph: bool,
        subgraph_name: str | None,
        parent_wrapper: Any,
        partition_signatures: Any = None,
    ) -> SpyreCppWrapperCodegen:
        require(
            CPP_WRAPPER_MINOR,
            "inductor's C++ wrapper (torch._inductor.config.cpp_wrapper=True) for spyre "
            "graphs (the default Python wrapper works on every supported torch)",
        )
        # Like CppWrapperCpu.create: subgraphs (control flow) are generated inline by the
        # same class.
        return SpyreCppWrapperCodegen()

    @staticmethod
    def get_device_include_path_jit(device: str) -> str:
        return CppWrapperCpu.get_device_include_path_jit("cpu" if _is_spyre(device) else device)

    @staticmethod
    def get_device_include_path_aot(device: str) -> str:
        return CppWrapperCpu.get_device_include_path_aot("cpu" if _is_spyre(device) else device)

    def get_c_shim_func_name(self, kernel: str, device: str) -> str:  # type: ignore[override]
        if not _is_spyre(device):
            return CppWrapperCpu.get_c_shim_func_name(kernel, device)
        op = _DISPATCHED_COLLECTIVE_SHIMS.get(kernel)
        if op is not None:
            self._write_collective_helpers()
            suffix = "_then_wait" if self._spyre_then_wait else ""
            return f"aoti_torch_spyre__c10d_functional_{op}{suffix}"
        # out= extern kernels: inductor allocated the spyre output, the CPU kernel only
        # sees host pointers (fallback kernels never get here: generate_fallback_kernel).
        return CppWrapperCpu.get_c_shim_func_name(kernel, "cpu")

    def _write_discrete_memory_helpers(self) -> None:
        if self._discrete_helpers_written:
            return
        self._discrete_helpers_written = True
        self.include_extra_header("ATen/core/dispatch/Dispatcher.h")
        self.include_extra_header("torch/csrc/inductor/aoti_torch/utils.h")
        self.header.splice(_DISCRETE_MEMORY_HELPER)

    def _generate_kernel_call_helper(self, kernel_name: str, call_args: Any, **kwargs: Any) -> Any:
        # C++ kernels (not triton) take raw pointers: in discrete memory mode their host
        # addresses (the identity for CPU tensors).
        arg_types = kwargs.get("arg_types")
        if not kwargs.get("triton", True) and arg_types is not None and _discrete_memory():
            self._write_discrete_memory_helpers()
            call_args = [
                f"spyreccl_host_pointer({arg})" if isinstance(kind, str) and "*" in kind else arg
                for arg, kind in zip(call_args, arg_types, strict=True)
            ]
        return super()._generate_kernel_call_helper(kernel_name, call_args, **kwargs)

    def _generate_extern_kernel_out_helper(
        self,
        kernel: str,
        out: str,
        out_view: str | None,
        args: list[str],
        device: str,
        *rest: Any,
        **kwargs: Any,
    ) -> None:
        # out= extern kernels on spyre take the CPU shim (get_c_shim_func_name), whose kernel
        # reads the tensors' memory: in discrete memory mode it is given host views.
        self._spyre_host_args = _is_spyre(device) and _discrete_memory()
        try:
            super()._generate_extern_kernel_out_helper(
                kernel, out, out_view, args, device, *rest, **kwargs
            )
        finally:
            self._spyre_host_args = False

    def generate_c_shim_extern_kernel_call(
        self, kernel: str, args: list[str], device: str, **kwargs: Any
    ) -> None:
        if self._spyre_host_args:
            self._write_discrete_memory_helpers()
            kwargs.setdefault("debug_args", list(args))
            args = [f"spyreccl_host_arg({arg})" for arg in args]
        super().generate_c_shim_extern_kernel_call(kernel, args, device, **kwargs)

    def _generate_extern_kernel_alloc_helper(self, extern_kernel: Any, args: list[str]) -> None:
        # The all_reduce(_) shims above: a collective whose wait comes next takes the
        # _then_wait form (the Python wrapper's rule, spyreccl_torch.device._inductor).
        self._spyre_then_wait = extern_kernel.get_name() in self._collectives_waited_at_once()
        try:
            super()._generate_extern_kernel_alloc_helper(extern_kernel, args)
        finally:
            self._spyre_then_wait = False

    def _collectives_waited_at_once(self) -> set[str]:
        if self._spyre_waited_at_once is None:
            self._spyre_waited_at_once = waited_at_once_or_none(self.lines)
        return self._spyre_waited_at_once

    def _write_collective_helpers(self) -> None:
        if self._collective_helpers_written:
            return
        self._collective_helpers_written = True
        self.include_extra_header("ATen/core/dispatch/Dispatcher.h")
        self.include_extra_header("torch/csrc/inductor/aoti_torch/utils.h")
        self.header.splice(_COLLECTIVE_HELPER)

    def generate_fallback_kernel(self, node: ir.FallbackKernel) -> None:
        op = node.op_overload
        device = node.get_device()
        if (
            device is None
            or not _is_spyre(device)
            or not isinstance(op, torch._ops.OpOverload)
            or _aot_mode()
        ):
            super().generate_fallback_kernel(node)
            return
        # No C shim exists for spyre: look the op up in the dispatcher at run time, as
        # FallbackKernel.codegen does for ops without a shim.
        self.generate_fallback_kernel_with_runtime_lookup(
            node.get_name(),
            node.python_kernel_name,
            lambda: [*node.codegen_args(), *node.codegen_kwargs()],
            op,
            node.export_extern_kernel_node(),
            node.outputs if node.outputs else node.mutation_outputs,
        )

    def _generate_fallback_kernel_jit(
        self,
        buf_name: Any,
        python_kernel_name: Any,
        get_args: Any,
        op_overload: Any,
        raw_args: Any,
        output_args: Any,
        outputs: Any,
    ) -> None:
        if (
            isinstance(op_overload, torch._ops.OpOverload)
            and op_overload.namespace == "_c10d_functional"
            and (named := _with_name_arguments(op_overload, raw_args)) is not None
        ):
            self.generate_fallback_kernel_with_runtime_lookup_boxed(
                named, raw_args, output_args, outputs
            )
            return
        super()._generate_fallback_kernel_jit(
            buf_name, python_kernel_name, get_args, op_overload, raw_args, output_args, outputs
        )


def _aot_mode() -> bool:
    """Whether inductor is compiling for AOTInductor (not the JIT C++ wrapper)."""
    from torch._inductor.virtualized import V

    return bool(V.graph.aot_mode)


def register_device_name() -> None:
    """Lets the C++ wrapper name spyre's device type (``at::kPrivateUse1``): used for
    allocations (``cached_torch_device_type_privateuse1``) and device arguments. From torch
    2.15 inductor asks the device's op overrides instead
    (``SpyreDeviceOpOverrides.aten_device_type``), and the dict is gone."""
    if TORCH_MINOR < ATEN_DEVICE_TYPE_FROM_OVERRIDES_MINOR:
        cpp_utils.DEVICE_TO_ATEN.setdefault(_DEVICE, ATEN_DEVICE_TYPE)
