// python_module.cpp — the `spyreccl_torch._C` extension: Python bindings of
// ProcessGroupSpyreccl and its Options.
//
// Built with torch's bundled pybind11 headers so that our classes can derive from the
// c10d::Backend / Backend.Options types torch registered (pip's pybind11 has another
// internals ABI and would not see them). Nothing here exchanges pybind11 objects with
// spyreccl_core's own extension: the backend only talks to libspyreccl's C API.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <spyreccl/spyreccl.h>

#include "backend/direct_ops.h"
#include "backend/exit_guard.h"
#include "backend/fast_empty.h"
#include "backend/flight_recorder.h"
#include "backend/functional_scope.h"
#include "backend/process_group_spyreccl.hpp"
#include "backend/staging_bindings.h"

namespace py = pybind11;

namespace spyreccl_torch {
namespace {

using Options = ProcessGroupSpyreccl::Options;

constexpr const char* kBackendDoc = R"(c10d backend "spyreccl" for tensors on the spyre device.

Usually created by torch.distributed through the registered creator (see
spyreccl_torch.register); construct it directly only for tests or custom groups:

    ProcessGroupSpyreccl(store, rank, size, options=None)

The constructor is collective over the `size` ranks: rank 0 publishes the communicator
id in `store`, and all ranks then join the communicator.)";

constexpr const char* kOptionsDoc = R"(Options of a spyreccl process group.

timeout          datetime.timedelta bounding every wait of the group (default 30 min)
chunk_bytes      staging bytes per rank and pipeline slot; 0 = SPYRECCL_CHUNK_BYTES or 1 MiB
p2p_chunk_bytes  staging bytes per rank pair for send/recv; 0 = SPYRECCL_P2P_CHUNK_BYTES
                 or 256 KiB
yield_ns         how long a wait yields the CPU before it sleeps on a futex, in ns; -1 =
                 SPYRECCL_YIELD_NS or 2 ms)";

}  // namespace
}  // namespace spyreccl_torch

PYBIND11_MODULE(_C, module) {
  using spyreccl_torch::Options;
  using spyreccl_torch::ProcessGroupSpyreccl;

  // Registers c10d::Store, c10d::Backend and Backend.Options with pybind11, which our
  // classes derive from / accept.
  py::module_::import("torch.distributed");

  module.doc() = "spyreccl c10d backend (C++ part of spyreccl_torch)";

  auto backend =
      py::class_<ProcessGroupSpyreccl, c10d::Backend, c10::intrusive_ptr<ProcessGroupSpyreccl>>(
          module, "ProcessGroupSpyreccl", spyreccl_torch::kBackendDoc);

  py::class_<Options, c10d::Backend::Options, c10::intrusive_ptr<Options>>(
      backend, "Options", spyreccl_torch::kOptionsDoc)
      .def(py::init([](std::chrono::milliseconds timeout) { return Options::create(timeout); }),
           py::arg("timeout") = kBackendDefaultTimeout)
      .def_property(
          "timeout", [](const Options& self) { return self.timeout; },
          [](Options& self, std::chrono::milliseconds timeout) { self.timeout = timeout; })
      .def_readwrite("chunk_bytes", &Options::chunk_bytes)
      .def_readwrite("p2p_chunk_bytes", &Options::p2p_chunk_bytes)
      .def_property(
          "yield_ns", [](const Options& self) { return self.yield_ns; },
          [](Options& self, int64_t ns) {
            TORCH_CHECK_VALUE(ns >= -1,
                              "spyreccl: Options.yield_ns must be >= 0 (ns) or -1 "
                              "(the core's default), got ",
                              ns);
            self.yield_ns = ns;
          })
      .def_readwrite("group_desc", &Options::group_desc)
      // split_group deep-copies the parent's options.
      .def("__copy__", [](const Options& self) { return self.copy(); })
      .def("__deepcopy__", [](const Options& self, const py::dict&) { return self.copy(); })
      .def("__repr__", [](const Options& self) {
        return "ProcessGroupSpyreccl.Options(timeout=" + std::to_string(self.timeout.count()) +
               " ms, chunk_bytes=" + std::to_string(self.chunk_bytes) +
               ", p2p_chunk_bytes=" + std::to_string(self.p2p_chunk_bytes) +
               ", yield_ns=" + std::to_string(self.yield_ns) + ", group_name='" + self.group_name +
               "')";
      });

  backend
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       const py::object& options) {
             c10::intrusive_ptr<Options> opts = options.is_none()
                                                    ? Options::create()
                                                    : options.cast<c10::intrusive_ptr<Options>>();
             // Joining the communicator blocks on the other ranks: let Python run meanwhile.
             py::gil_scoped_release release;
             return c10::make_intrusive<ProcessGroupSpyreccl>(store, rank, size, opts);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options") = py::none())
      .def_property_readonly("options", &ProcessGroupSpyreccl::getOptions)
      .def(
          "perform_nocolor_split",
          [](ProcessGroupSpyreccl& /*self*/, const at::Device& /*device*/) {
            // torch calls this on ranks that are not members of a new_group() when the
            // default group is bound to a device. spyreccl creates new_group()s through the
            // store rendezvous (members only), never by splitting the default group, so
            // there is no collective split the non-members would have to take part in.
          },
          py::arg("device"))
      .def("_disable_flight_recorder", &ProcessGroupSpyreccl::disableFlightRecorder,
           "Leaves this group out of the flight recorder (internal groups of another one).")
      .def("_set_flight_parent", &ProcessGroupSpyreccl::setFlightParent, py::arg("parent"),
           "Makes this group a stage of the multi-node group `parent` (its flight recorder "
           "id): a failure here dumps once, as that group's.")
      .def("dump_state", &ProcessGroupSpyreccl::dumpState, py::call_guard<py::gil_scoped_release>(),
           "The core's human readable state of this group's communicator (recent operations "
           "with sequence numbers and states, what each peer last announced).");

  module.def(
      "core_version",
      []() {
        int version = 0;
        if (spyrecclGetVersion(&version) != spyrecclSuccess) {
          throw std::runtime_error("spyrecclGetVersion failed");
        }
        return version;
      },
      "Version code of the loaded libspyreccl (MAJOR*10000 + MINOR*100 + PATCH).");
  module.def(
      "_prepare_for_exit", &spyreccl_torch::prepareForExit,
      "Called once by an atexit hook (spyreccl_torch._lifecycle): every live spyreccl "
      "group finishes what it queued and stops, and guarded Work callbacks stop running, so that "
      "no thread of ours asks for the GIL while the interpreter finalizes.");
  module.def("_add_guarded_callback", &spyreccl_torch::addGuardedCallback, py::arg("work"),
             py::arg("fn"),
             "Calls fn(error) when the c10d Work completes (error: None or the message of its "
             "exception), on the thread that completes it; skipped once the interpreter "
             "exits (see _prepare_for_exit). For callbacks on Works that may still be "
             "pending at exit, e.g. gloo operations abandoned after a failure.");
  module.def("_set_lean_functional", &spyreccl_torch::setLeanFunctional, py::arg("enabled"),
             "Turns the lean path of the _c10d_functional kernels on (the default) or off "
             "(every functional collective then runs torch's implementation); for "
             "comparisons and tests.");
  module.def("_lean_functional", &spyreccl_torch::leanFunctional,
             "Whether the lean path of the _c10d_functional kernels is on.");
  module.def("_lean_functional_calls", &spyreccl_torch::leanFunctionalCalls,
             "How many functional collectives took the lean path in this process.");
  module.def("_waited_functional_calls", &spyreccl_torch::waitedFunctionalCalls,
             "How many of them were waited at once (wait_follows) and ran without a Work.");
  module.def("_waited_behind_progress_thread_calls",
             &spyreccl_torch::waitedBehindProgressThreadCalls,
             "How many of them, waited at once, took a Work only because the group's progress "
             "thread had work at that moment (depends on thread scheduling).");
  module.def("_set_waited_without_work", &spyreccl_torch::setWaitedWithoutWork, py::arg("enabled"),
             "Turns off (or back on, the default) running functional collectives waited at "
             "once without a Work; for comparisons and tests.");
  module.def(
      "_set_thread_yield_ns",
      [](int64_t ns) {
        if (spyrecclSetThreadYield(ns) != spyrecclSuccess) {
          throw py::value_error(std::string("spyreccl: _set_thread_yield_ns: ") +
                                spyrecclGetLastError(nullptr));
        }
      },
      py::arg("ns"),
      "How long the waits of spyreccl calls that this thread drives yield the CPU before they "
      "sleep, in ns, in place of their groups' yield_ns; -1 restores the groups' own "
      "(spyrecclSetThreadYield).");
  module.def(
      "_dump_flight_recorder",
      [](bool includeCollectives, bool includeStackTraces, bool onlyActive) {
        return py::bytes(
            spyreccl_torch::flight::dumpPickle(includeCollectives, includeStackTraces, onlyActive));
      },
      py::arg("include_collectives") = true, py::arg("include_stack_traces") = true,
      py::arg("only_active") = false,
      "This process's flight recorder in torch's dump format (see "
      "spyreccl_torch.flight_recorder).");
  // Recording for the groups implemented in Python (multinode/flight.py); a record is
  // handed to Python as (id, epoch, group, sequence number) or None.
  module.def("_fr_register_group",
             [](const std::string& name, const std::string& desc, int rank, int size,
                const std::vector<uint64_t>& globalRanks, std::chrono::milliseconds timeout,
                const c10::intrusive_ptr<c10d::Store>& store) {
               return spyreccl_torch::flight::registerPythonGroup(name, desc, rank, size,
                                                                  globalRanks, timeout, store);
             });
  module.def("_fr_record",
             [](int64_t group, const std::string& name, bool isP2P, bool flattenInputs,
                bool flattenOutputs, const std::vector<at::Tensor>& inputs,
                const std::vector<at::Tensor>& outputs) -> py::object {
               const auto ref = spyreccl_torch::flight::recordPython(
                   group, name, isP2P, flattenInputs, flattenOutputs, inputs, outputs);
               if (!ref.valid) {
                 return py::none();
               }
               return py::make_tuple(ref.id, ref.epoch, ref.group, ref.seq);
             });
  module.def("_fr_mark", [](const py::tuple& record, bool completed) {
    spyreccl_torch::flight::Ref ref{record[0].cast<size_t>(), record[1].cast<size_t>(),
                                    record[2].cast<size_t>(), true};
    if (completed) {
      spyreccl_torch::flight::markCompleted(ref);
    } else {
      spyreccl_torch::flight::markStarted(ref);
    }
  });
  module.def("_fr_unregister_group", &spyreccl_torch::flight::unregisterPythonGroup);
  module.def("_fr_group_failed", &spyreccl_torch::flight::groupFailed,
             py::call_guard<py::gil_scoped_release>());
  module.def("_reset_flight_recorder", &spyreccl_torch::flight::reset,
             "Forgets the flight recorder's entries (see spyreccl_torch.flight_recorder).");
  spyreccl_torch::addStagingBindings(module);
  spyreccl_torch::addFastEmpty(module);
  spyreccl_torch::addDirectOps(module);
  module.attr("BACKEND_NAME") = spyreccl_torch::kBackendName;
}
