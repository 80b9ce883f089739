// fast_empty.cpp — `_empty_strided_spyre`, the allocation call of inductor's generated Python
// wrappers for spyre tensors.
//
// Inductor's Python wrapper allocates every intermediate buffer of a compiled graph in
// Python. For cpu / cuda / xpu it calls a C function of torch's
// (torch._C._dynamo.guards._empty_strided_<device>, ~0.3 us); for any other device it calls
// torch.empty_strided(..., device="spyre", dtype=...), whose argument parsing and dispatch
// cost ~0.9 us per buffer here. This is spyre's counterpart of torch's fast functions: a
// METH_FASTCALL C function that takes the wrapper's literal tuples and dtype and allocates
// straight from the spyre allocator, as the device's empty_strided kernel does (the current
// spyre device, deterministic fill when torch asks for it).
#include "backend/fast_empty.h"

#include <Python.h>

#include <cstdint>
#include <vector>

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/TensorFactories.h>
#include <c10/core/Allocator.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/python_numbers.h>

namespace spyreccl_torch {
namespace {

std::vector<int64_t> intTuple(PyObject* obj, const char* what) {
  TORCH_CHECK_TYPE(PyTuple_Check(obj), "_empty_strided_spyre: argument '", what,
                   "' must be a tuple of ints, got ", Py_TYPE(obj)->tp_name);
  const Py_ssize_t n = PyTuple_GET_SIZE(obj);
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(obj, i);
    TORCH_CHECK_TYPE(THPUtils_checkLong(item), "_empty_strided_spyre: argument '", what,
                     "' must be a tuple of ints, got an element of type ", Py_TYPE(item)->tp_name);
    out[static_cast<size_t>(i)] = THPUtils_unpackLong(item);
  }
  return out;
}

PyObject* emptyStridedSpyre(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 3, "_empty_strided_spyre(size, stride, dtype) takes 3 arguments, got ",
                   nargs);
  const std::vector<int64_t> size = intTuple(args[0], "size");
  const std::vector<int64_t> stride = intTuple(args[1], "stride");
  TORCH_CHECK_VALUE(size.size() == stride.size(), "_empty_strided_spyre: size has ", size.size(),
                    " dimensions but stride has ", stride.size());
  TORCH_CHECK_TYPE(THPDtype_Check(args[2]),
                   "_empty_strided_spyre: argument 'dtype' must be a "
                   "torch.dtype, got ",
                   Py_TYPE(args[2])->tp_name);
  const auto dtype = reinterpret_cast<THPDtype*>(args[2])->scalar_type;
  // With the GIL held, as torch's own fast allocation functions: releasing and taking it
  // back would cost a third of the call.
  at::Tensor result = at::detail::empty_strided_generic(
      size, stride, c10::GetAllocator(c10::DeviceType::PrivateUse1),
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype);
  const auto& ctx = at::globalContext();
  if (C10_UNLIKELY(ctx.deterministicAlgorithms() && ctx.deterministicFillUninitializedMemory())) {
    at::native::fill_empty_deterministic_(result);
  }
  return THPVariable_Wrap(std::move(result));
  END_HANDLE_TH_ERRORS
}

PyMethodDef kFastEmpty = {
    "_empty_strided_spyre",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&emptyStridedSpyre)), METH_FASTCALL,
    "_empty_strided_spyre(size, stride, dtype): an uninitialised spyre tensor on the current "
    "spyre device (the allocation call of inductor's generated wrappers for spyre)."};

}  // namespace

void addFastEmpty(pybind11::module_& module) {
  PyObject* fn = PyCFunction_NewEx(&kFastEmpty, nullptr, module.attr("__name__").ptr());
  if (fn == nullptr) throw pybind11::error_already_set();
  module.add_object("_empty_strided_spyre", pybind11::reinterpret_steal<pybind11::object>(fn));
}

}  // namespace spyreccl_torch
