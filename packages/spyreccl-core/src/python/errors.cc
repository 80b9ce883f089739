// errors.cc — the Python exception hierarchy and the C++ → Python translation.
#include "errors.h"

#include <array>

namespace spyreccl_py {
namespace {

// One Python class per result code, plus the common base. The objects are created once at
// import and intentionally leaked: exception classes must outlive every module that may
// still raise them during interpreter shutdown.
PyObject* g_base_error = nullptr;
std::array<PyObject*, spyrecclNumResults> g_error_classes{};
PyObject* g_result_enum = nullptr;

struct ErrorClassSpec {
  spyrecclResult_t code;
  const char* name;
  PyObject* builtin_base;  // extra builtin base so that idiomatic `except` clauses work
  const char* doc;
};

// Builds the spec table at call time: the PyExc_* globals are only valid once Python runs.
std::array<ErrorClassSpec, spyrecclNumResults - 1> error_class_specs() {
  return {{
      {spyrecclSystemError, "SystemError_", PyExc_OSError,
       "An operating-system call failed inside spyreccl (shm_open, mmap, futex, ...)."},
      {spyrecclInternalError, "InternalError", nullptr,
       "An internal inconsistency in spyreccl; please report it."},
      {spyrecclInvalidArgument, "InvalidArgumentError", PyExc_ValueError,
       "A bad argument (count, buffer, dtype, op, root, peer). Nothing was communicated "
       "and the communicator stays usable."},
      {spyrecclInvalidUsage, "InvalidUsageError", nullptr,
       "A call out of order: destroyed or failed communicator, unbalanced group, bad id."},
      {spyrecclRemoteError, "RemoteError", nullptr,
       "A peer died, left or aborted while this rank waited for it."},
      {spyrecclTimeout, "TimeoutError", PyExc_TimeoutError,
       "A wait exceeded the communicator's timeout."},
      {spyrecclAborted, "AbortedError", nullptr, "Communicator.abort() was called."},
      {spyrecclMismatch, "MismatchError", nullptr,
       "Ranks called different collectives or passed different arguments."},
      {spyrecclUnsupported, "UnsupportedError", nullptr,
       "A valid request that this implementation does not support."},
  }};
}

py::object make_class(const char* name, py::tuple bases, const char* doc, py::object code) {
  py::dict ns;
  // Exported (and pickled) as spyreccl_core.<name>: __init__.py re-exports every class.
  ns["__module__"] = "spyreccl_core";
  ns["__doc__"] = doc;
  ns["code"] = std::move(code);
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&PyType_Type))(name, bases,
                                                                                       ns);
}

py::object result_value(spyrecclResult_t code) {
  try {
    return py::reinterpret_borrow<py::object>(g_result_enum)(static_cast<int>(code));
  } catch (const py::error_already_set&) {
    // An out-of-range code from a newer library: keep the raw integer.
    return py::int_(static_cast<int>(code));
  }
}

void raise_python(spyrecclResult_t code, const char* message) {
  PyObject* cls = g_base_error;
  if (code > 0 && code < spyrecclNumResults && g_error_classes[code] != nullptr) {
    cls = g_error_classes[code];
  }
  try {
    py::object instance = py::reinterpret_borrow<py::object>(cls)(py::str(message));
    instance.attr("code") = result_value(code);
    PyErr_SetObject(cls, instance.ptr());
  } catch (py::error_already_set& e) {
    e.restore();  // building the exception failed: surface that error instead
  }
}

[[noreturn]] void throw_with_prefix(spyrecclResult_t code, const char* op,
                                    const std::string& message) {
  throw SpyrecclException(code, std::string(op) + ": " + message);
}

}  // namespace

void check_result(spyrecclResult_t result, spyrecclComm_t comm) {
  if (result == spyrecclSuccess) return;
  const char* detail = spyrecclGetLastError(comm);
  std::string message =
      (detail != nullptr && detail[0] != '\0') ? detail : spyrecclGetErrorString(result);
  throw SpyrecclException(result, std::move(message));
}

void throw_invalid_argument(const char* op, const std::string& message) {
  throw_with_prefix(spyrecclInvalidArgument, op, message);
}

void throw_invalid_usage(const char* op, const std::string& message) {
  throw_with_prefix(spyrecclInvalidUsage, op, message);
}

void throw_type_error(const char* op, const std::string& message) {
  throw py::type_error(std::string(op) + ": " + message);
}

void bind_errors(py::module_& m) {
  g_result_enum = py::object(m.attr("Result")).release().ptr();

  py::object base = make_class(
      "SpyrecclError", py::make_tuple(py::reinterpret_borrow<py::object>(PyExc_RuntimeError)),
      "Base class of every spyreccl failure. `code` is the library's Result code and the "
      "message is its detailed description (operation, argument, peers involved).",
      py::none());
  g_base_error = base.inc_ref().ptr();
  m.attr("SpyrecclError") = base;

  for (const ErrorClassSpec& spec : error_class_specs()) {
    py::tuple bases =
        spec.builtin_base != nullptr
            ? py::tuple(py::make_tuple(base, py::reinterpret_borrow<py::object>(spec.builtin_base)))
            : py::tuple(py::make_tuple(base));
    py::object cls = make_class(spec.name, bases, spec.doc, result_value(spec.code));
    g_error_classes[spec.code] = cls.inc_ref().ptr();
    m.attr(spec.name) = cls;
  }

  py::register_exception_translator([](std::exception_ptr pending) {
    try {
      if (pending) std::rethrow_exception(pending);
    } catch (const SpyrecclException& e) {
      raise_python(e.code(), e.what());
    }
  });
}

}  // namespace spyreccl_py
