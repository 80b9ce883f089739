// module.cc — the spyreccl_core._core extension module (pybind11, no torch).
//
// Thin by design: it binds the C API with argument checks and exceptions; the Python package
// spyreccl_core re-exports everything and adds the rendezvous helpers.
#include <pybind11/pybind11.h>
#include <spyreccl/spyreccl.h>

#include <cstdint>
#include <string>

#include "communicator.h"
#include "errors.h"
#include "memory.h"
#include "types.h"
#include "unique_id.h"

namespace py = pybind11;

namespace {

std::string version_text(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." +
         std::to_string(code % 100);
}

std::string library_version() {
  int code = 0;
  spyreccl_py::check_result(spyrecclGetVersion(&code), nullptr);
  return version_text(code);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "pybind11 bindings of the spyreccl C API (host shared-memory collectives).";
  m.attr("__version__") = version_text(SPYRECCL_VERSION_CODE);
  m.attr("UNIQUE_ID_BYTES") = SPYRECCL_UNIQUE_ID_BYTES;
  m.def("library_version", &library_version,
        "Version of the loaded libspyreccl (may differ from the headers _core was built with).");
  m.def(
      "error_string",
      [](spyrecclResult_t result) { return std::string(spyrecclGetErrorString(result)); },
      py::arg("result"), "Generic description of a Result code.");

  m.def(
      "set_thread_yield",
      [](int64_t ns) {
        if (ns < -1) {
          spyreccl_py::throw_invalid_argument(
              "set_thread_yield",
              "argument 'ns' must be >= -1 (-1 restores the communicators' "
              "own yield_ns), got " +
                  std::to_string(ns));
        }
        spyreccl_py::check_result(spyrecclSetThreadYield(ns), nullptr);
      },
      py::arg("ns"),
      "How long the waits of spyreccl calls made by this thread keep the CPU with sched_yield "
      "before they sleep, in ns, in place of their communicators' yield_ns; 0 sleeps right "
      "after the spin, -1 restores the communicators' own (spyrecclSetThreadYield). Waits "
      "of other threads are not affected.");

  spyreccl_py::bind_types(m);
  spyreccl_py::bind_errors(m);
  spyreccl_py::bind_unique_id(m);
  spyreccl_py::bind_communicator(m);
  spyreccl_py::bind_memory(m);
}
