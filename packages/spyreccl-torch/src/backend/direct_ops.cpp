// direct_ops.cpp — `_direct_op`: a dispatcher operator called from inductor's generated
// Python wrappers without torch's Python operator layer.
//
// Inductor's Python wrapper calls every functional collective of a compiled graph as
// `torch.ops._c10d_functional.<op>.default(...)`: four attribute lookups, OpOverload's
// Python __call__, and torch's generic operator binding (argument matching against the
// schema through pybind11, a search for __torch_function__ overrides), ~0.8 us for a
// one-tensor wait_tensor and more for all_reduce_'s three arguments on a 2-vCPU machine,
// before the dispatcher is reached. For cpu and cuda graphs torch's C++ wrapper skips all of
// it through shims it hard-codes; the Python wrapper has nothing similar. A compiled graph's
// collective then costs about twice the eager call at 8 B, while its own work (the
// collective through spyreccl's PrivateUse1 kernels, see functional_kernels.cpp) is level
// with it.
//
// `_direct_op(overload)` returns a METH_FASTCALL C function bound to the overload's
// dispatcher handle and its schema's argument kinds, which spyre's wrapper codegen binds once
// per compiled module (spyreccl_torch.device._inductor). A call converts its Python arguments
// straight into the boxed stack and calls the same operator through the dispatcher: the
// kernels, profiler events, dispatch modes (the Python dispatcher key) and errors are those
// of torch's call. What it does not handle it hands to the OpOverload itself, so the result
// never differs: a __torch_function__ mode or a Tensor subclass (torch would consult their
// overrides), an argument of an unexpected type (torch raises its own error), unknown or
// repeated keyword arguments.
#include "backend/direct_ops.h"

#include <Python.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/function_schema.h>
#include <ATen/core/jit_type.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/python_numbers.h>

#include "backend/functional_scope.h"

namespace spyreccl_torch {
namespace {

// What a schema argument accepts on the direct path. `Any` arguments (the functional ops'
// group_name) take the str the wrapper passes; any other object goes to the OpOverload.
enum class ArgKind : uint8_t { kTensor, kTensorList, kString, kInt, kIntList, kAnyString };
enum class ResultKind : uint8_t { kNone, kTensor, kTensorList };

struct DirectOp {
  DirectOp(c10::OperatorHandle h, PyObject* o) : handle(std::move(h)), overload(o) {
    Py_INCREF(overload);
  }
  ~DirectOp() { Py_DECREF(overload); }  // the capsule's destructor runs with the GIL held
  DirectOp(const DirectOp&) = delete;
  DirectOp& operator=(const DirectOp&) = delete;

  c10::OperatorHandle handle;
  PyObject* overload;  // the OpOverload: every call the direct path does not handle
  std::vector<ArgKind> kinds;
  std::vector<std::string> names;
  std::vector<std::optional<c10::IValue>> defaults;
  ResultKind result = ResultKind::kNone;
  // The wrapper calls wait_tensor on the result next (WaitFollowsScope).
  bool waitFollows = false;
};

constexpr const char* kCapsuleName = "spyreccl_torch.DirectOp";

std::optional<ArgKind> kindOf(const c10::Argument& argument) {
  // type() is the argument's static type (SymInt reads as int), what the boxed call accepts.
  const c10::TypePtr& type = argument.type();
  switch (type->kind()) {
    case c10::TypeKind::TensorType:
      return ArgKind::kTensor;
    case c10::TypeKind::StringType:
      return ArgKind::kString;
    case c10::TypeKind::IntType:
      return ArgKind::kInt;
    case c10::TypeKind::AnyType:
      return ArgKind::kAnyString;
    case c10::TypeKind::ListType: {
      const auto element = type->expectRef<c10::ListType>().getElementType()->kind();
      if (element == c10::TypeKind::TensorType) return ArgKind::kTensorList;
      if (element == c10::TypeKind::IntType) return ArgKind::kIntList;
      return std::nullopt;
    }
    default:
      return std::nullopt;
  }
}

std::optional<ResultKind> resultOf(const c10::FunctionSchema& schema) {
  const auto& returns = schema.returns();
  if (returns.empty()) return ResultKind::kNone;
  if (returns.size() != 1) return std::nullopt;
  const c10::TypePtr& type = returns[0].type();
  if (type->kind() == c10::TypeKind::TensorType) return ResultKind::kTensor;
  if (type->kind() == c10::TypeKind::ListType &&
      type->expectRef<c10::ListType>().getElementType()->kind() == c10::TypeKind::TensorType) {
    return ResultKind::kTensorList;
  }
  return std::nullopt;
}

bool plainTensor(PyObject* obj) { return THPVariable_CheckExact(obj); }

bool sequence(PyObject* obj) { return PyList_Check(obj) || PyTuple_Check(obj); }

// Appends `obj` converted for `kind` to `stack`; false when the direct path cannot convert it.
bool push(ArgKind kind, PyObject* obj, torch::jit::Stack& stack) {
  switch (kind) {
    case ArgKind::kTensor:
      if (!plainTensor(obj)) return false;
      stack.emplace_back(THPVariable_Unpack(obj));
      return true;
    case ArgKind::kTensorList: {
      if (!sequence(obj)) return false;  // PySequence_Fast_* read lists and tuples in place
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
      c10::List<at::Tensor> tensors;
      tensors.reserve(static_cast<size_t>(n));
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* item = PySequence_Fast_GET_ITEM(obj, i);
        if (!plainTensor(item)) return false;
        tensors.push_back(THPVariable_Unpack(item));
      }
      stack.emplace_back(std::move(tensors));
      return true;
    }
    case ArgKind::kString:
    case ArgKind::kAnyString: {
      if (!PyUnicode_Check(obj)) return false;
      Py_ssize_t size = 0;
      const char* data = PyUnicode_AsUTF8AndSize(obj, &size);
      if (data == nullptr) {
        PyErr_Clear();  // e.g. lone surrogates: torch's call reports it
        return false;
      }
      stack.emplace_back(std::string(data, static_cast<size_t>(size)));
      return true;
    }
    case ArgKind::kInt:
      if (!THPUtils_checkLongExact(obj)) return false;
      stack.emplace_back(static_cast<int64_t>(THPUtils_unpackLong(obj)));
      return true;
    case ArgKind::kIntList: {
      if (!sequence(obj)) return false;
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
      std::vector<int64_t> values(static_cast<size_t>(n));
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* item = PySequence_Fast_GET_ITEM(obj, i);
        if (!THPUtils_checkLongExact(item)) return false;
        values[static_cast<size_t>(i)] = THPUtils_unpackLong(item);
      }
      stack.emplace_back(std::move(values));
      return true;
    }
  }
  return false;
}

// The boxed stack for one call, or nullopt when the call goes to the OpOverload.
std::optional<torch::jit::Stack> stackFor(const DirectOp& op, PyObject* const* args,
                                          Py_ssize_t nargs, PyObject* kwnames) {
  const size_t count = op.kinds.size();
  if (static_cast<size_t>(nargs) > count) return std::nullopt;
  std::vector<PyObject*> given(count, nullptr);
  for (Py_ssize_t i = 0; i < nargs; ++i) given[static_cast<size_t>(i)] = args[i];
  if (kwnames != nullptr) {
    const Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; ++k) {
      const char* key = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
      if (key == nullptr) {
        PyErr_Clear();
        return std::nullopt;
      }
      size_t index = count;
      for (size_t i = 0; i < count; ++i) {
        if (op.names[i] == key) index = i;
      }
      if (index == count || given[index] != nullptr) return std::nullopt;
      given[index] = args[nargs + k];
    }
  }
  torch::jit::Stack stack;
  stack.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    if (given[i] == nullptr) {
      if (!op.defaults[i].has_value()) return std::nullopt;
      stack.push_back(*op.defaults[i]);
    } else if (!push(op.kinds[i], given[i], stack)) {
      return std::nullopt;
    }
  }
  return stack;
}

PyObject* resultObject(ResultKind kind, torch::jit::Stack& stack) {
  switch (kind) {
    case ResultKind::kNone:
      Py_RETURN_NONE;
    case ResultKind::kTensor:
      return THPVariable_Wrap(std::move(stack.back()).toTensor());
    case ResultKind::kTensorList: {
      const c10::List<at::Tensor> tensors = std::move(stack.back()).toTensorList();
      PyObject* list = PyList_New(static_cast<Py_ssize_t>(tensors.size()));
      if (list == nullptr) return nullptr;
      for (size_t i = 0; i < tensors.size(); ++i) {
        PyObject* item = THPVariable_Wrap(tensors.get(i));
        if (item == nullptr) {
          Py_DECREF(list);
          return nullptr;
        }
        PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
      }
      return list;
    }
  }
  Py_RETURN_NONE;
}

PyObject* callDirect(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  const auto* op = static_cast<const DirectOp*>(PyCapsule_GetPointer(self, kCapsuleName));
  if (op == nullptr) return nullptr;
  std::optional<torch::jit::Stack> stack;
  if (!at::impl::torch_function_mode_enabled()) stack = stackFor(*op, args, nargs, kwnames);
  if (!stack.has_value()) {
    return PyObject_Vectorcall(op->overload, args, static_cast<size_t>(nargs), kwnames);
  }
  {
    // As torch's operator call: a collective may wait for its peers.
    pybind11::gil_scoped_release released;
    if (op->waitFollows) {
      WaitFollowsScope scope;
      op->handle.callBoxed(*stack);
    } else {
      op->handle.callBoxed(*stack);
    }
  }
  return resultObject(op->result, *stack);
  END_HANDLE_TH_ERRORS
}

PyMethodDef kDirectCall = {
    "direct_op", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&callDirect)),
    METH_FASTCALL | METH_KEYWORDS,
    "Calls the bound dispatcher operator (see spyreccl_torch._C._direct_op)."};

void destroyCapsule(PyObject* capsule) {
  delete static_cast<DirectOp*>(PyCapsule_GetPointer(capsule, kCapsuleName));
}

pybind11::object directOp(const pybind11::object& overload, bool waitFollows) {
  const pybind11::object schema_object = overload.attr("_schema");
  const auto name = schema_object.attr("name").cast<std::string>();
  const auto overload_name = schema_object.attr("overload_name").cast<std::string>();
  const auto handle = c10::Dispatcher::singleton().findSchema({name, overload_name});
  if (!handle.has_value()) return overload;
  const c10::FunctionSchema& schema = handle->schema();
  if (schema.is_vararg() || schema.is_varret()) return overload;
  const auto result = resultOf(schema);
  if (!result.has_value()) return overload;

  auto op = std::make_unique<DirectOp>(*handle, overload.ptr());
  op->result = *result;
  op->waitFollows = waitFollows;
  for (const c10::Argument& argument : schema.arguments()) {
    const auto kind = kindOf(argument);
    if (!kind.has_value()) return overload;
    op->kinds.push_back(*kind);
    op->names.push_back(argument.name());
    op->defaults.push_back(argument.default_value());
  }
  PyObject* capsule = PyCapsule_New(op.get(), kCapsuleName, &destroyCapsule);
  if (capsule == nullptr) throw pybind11::error_already_set();
  op.release();  // owned by the capsule now
  const auto owner = pybind11::reinterpret_steal<pybind11::object>(capsule);
  PyObject* fn = PyCFunction_NewEx(&kDirectCall, owner.ptr(), nullptr);
  if (fn == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(fn);
}

}  // namespace

void addDirectOps(pybind11::module_& module) {
  module.def("_direct_op", &directOp, pybind11::arg("overload"),
             pybind11::arg("wait_follows") = false,
             "A C function that calls the OpOverload's dispatcher operator with its Python "
             "arguments, without torch's Python operator layer; what it cannot convert goes "
             "to the overload itself. Returns the overload unchanged when its schema has "
             "argument or return types the direct path does not convert. Bound once per "
             "module by spyre's inductor wrappers for the functional collectives. "
             "wait_follows=True: the caller waits for the collective's result right after the "
             "call, so spyreccl runs it on the calling thread up to the bound of synchronous "
             "calls (SPYRECCL_INLINE_MAX_BYTES) instead of the functional one.");
}

}  // namespace spyreccl_torch
