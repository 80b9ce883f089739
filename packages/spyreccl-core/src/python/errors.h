// errors.h — how result codes and argument problems become Python exceptions.
//
// The C API never throws; it returns a spyrecclResult_t and keeps a detailed message that
// spyrecclGetLastError() hands out. This binding layer is the only place where result codes
// turn into exceptions. Code that runs with the GIL released must not touch Python objects,
// so it throws the plain C++ SpyrecclException below; a translator registered by
// bind_errors() maps it to the matching Python class (InvalidArgumentError, TimeoutError, ...)
// once the GIL is held again.
#pragma once

#include <pybind11/pybind11.h>
#include <spyreccl/spyreccl.h>

#include <exception>
#include <string>

namespace spyreccl_py {

namespace py = pybind11;

// A failed call (or a binding-level argument check) carrying the library's result code.
class SpyrecclException : public std::exception {
 public:
  SpyrecclException(spyrecclResult_t code, std::string message)
      : code_(code), message_(std::move(message)) {}
  spyrecclResult_t code() const noexcept { return code_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  spyrecclResult_t code_;
  std::string message_;
};

// Throws SpyrecclException for `result` unless it is spyrecclSuccess. The message is the
// library's detailed last error on `comm` (or on the calling thread when comm is NULL),
// falling back to the generic spyrecclGetErrorString text. Safe without the GIL; it must run
// on the thread that made the failed call because the NULL-comm last error is per thread.
void check_result(spyrecclResult_t result, spyrecclComm_t comm);

// Binding-level argument errors. The message is prefixed with "<op>: ".
// InvalidArgumentError (a ValueError) for bad values: counts, roots, read-only outputs, ...
[[noreturn]] void throw_invalid_argument(const char* op, const std::string& message);
// InvalidUsageError for calls out of order (destroyed communicator, unbalanced group, ...).
[[noreturn]] void throw_invalid_usage(const char* op, const std::string& message);
// Builtin TypeError for arguments of the wrong kind (not a buffer, mismatched dtypes, ...).
[[noreturn]] void throw_type_error(const char* op, const std::string& message);

// Creates SpyrecclError and one subclass per result code in `m` and registers the
// SpyrecclException translator. Must run after the Result enum is bound.
void bind_errors(py::module_& m);

}  // namespace spyreccl_py
