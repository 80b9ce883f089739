// communicator.cc — Communicator construction, split, abort/destroy and queries.
#include "communicator.h"

#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <optional>
#include <thread>
#include <vector>

#include "unique_id.h"

namespace spyreccl_py {

Communicator::Communicator(spyrecclComm_t comm, std::string name)
    : comm_(comm), name_(std::move(name)) {
  // Both queries are thread-safe and cannot fail on a freshly created communicator; the
  // values never change, so they are cached for the argument checks of every operation.
  check_result(spyrecclCommUserRank(comm_, &rank_), comm_);
  check_result(spyrecclCommCount(comm_, &size_), comm_);
}

Communicator::~Communicator() {
  // Reached when the last Python reference goes away, so no operation can be running.
  if (!destroyed_) spyrecclCommDestroy(comm_);
}

Communicator::Use::Use(Communicator& comm, const char* op) : comm_(comm) {
  // The same checks as before, in the same order of precedence, without a lock (see
  // communicator.h): a destroyed communicator is reported as such even while another
  // thread is still inside an operation that destroy() is waiting for.
  if (comm.closing_.load(std::memory_order_seq_cst)) {
    throw_invalid_usage(op, "the communicator was destroyed");
  }
  bool idle = false;
  if (!comm.busy_.compare_exchange_strong(idle, true, std::memory_order_seq_cst)) {
    throw_invalid_usage(op,
                        "the communicator is in use by another thread; a communicator may be "
                        "used by one thread at a time (use one communicator per thread)");
  }
  if (comm.closing_.load(std::memory_order_seq_cst)) {  // destroy() started meanwhile
    comm.busy_.store(false, std::memory_order_release);
    throw_invalid_usage(op, "the communicator was destroyed");
  }
  handle_ = comm.comm_;
}

Communicator::Use::~Use() { comm_.busy_.store(false, std::memory_order_release); }

bool Communicator::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return destroyed_;
}

spyrecclComm_t Communicator::live_handle(const char* op) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (destroyed_) throw_invalid_usage(op, "the communicator was destroyed");
  return comm_;
}

void Communicator::abort() {
  // Holding mu_ keeps destroy() from freeing the handle under our feet; CommAbort only flags
  // the communicator and wakes waiters, so it never blocks.
  std::lock_guard<std::mutex> lock(mu_);
  if (destroyed_) return;  // aborting a destroyed communicator has nothing left to stop
  check_result(spyrecclCommAbort(comm_), comm_);
}

void Communicator::destroy() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (destroyed_ || closing_.load(std::memory_order_relaxed)) return;
    if (group_pending_ > 0) {
      throw_invalid_usage("destroy",
                          "send/recv on this communicator are pending in an open group; "
                          "end the group first");
    }
    closing_.store(true, std::memory_order_seq_cst);  // from now on Use refuses new operations
  }
  spyrecclComm_t handle = nullptr;
  {
    py::gil_scoped_release no_gil;  // a running operation needs the GIL to finish
    if (busy_.load(std::memory_order_seq_cst)) {
      // Another thread is inside an operation: abort to unblock it, then wait for it. Its
      // waits notice the abort within a futex slice (1 ms), so a short poll is enough.
      spyrecclCommAbort(comm_);
      while (busy_.load(std::memory_order_acquire)) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    destroyed_ = true;
    handle = comm_;
  }
  call_without_gil(nullptr, [handle] { return spyrecclCommDestroy(handle); });
  orphans_.clear();  // the core freed the requests that could still write these
}

void Communicator::adopt_orphan(BufferView&& view) {
  std::lock_guard<std::mutex> lock(mu_);
  orphans_.push_back(std::move(view));
}

void Communicator::set_timeout(py::handle timeout) {
  const int64_t ms = timeout_to_ms(timeout, "set_timeout");
  spyrecclComm_t handle = live_handle("set_timeout");
  check_result(spyrecclCommSetTimeout(handle, ms), handle);
}

std::string Communicator::dump_state() {
  spyrecclComm_t handle = live_handle("dump_state");
  std::vector<char> text(1 << 16, '\0');
  call_without_gil(handle, [&] { return spyrecclCommDumpState(handle, text.data(), text.size()); });
  text.back() = '\0';
  return std::string(text.data());
}

spyrecclResult_t Communicator::async_error() {
  spyrecclComm_t handle = live_handle("async_error");
  spyrecclResult_t error = spyrecclSuccess;
  check_result(spyrecclCommGetAsyncError(handle, &error), handle);
  return error;
}

void Communicator::add_group_pending() {
  std::lock_guard<std::mutex> lock(mu_);
  ++group_pending_;
}

void Communicator::clear_group_pending() {
  std::lock_guard<std::mutex> lock(mu_);
  group_pending_ = 0;
}

int64_t timeout_to_ms(py::handle timeout, const char* op) {
  double seconds = 0.0;
  if (py::hasattr(timeout, "total_seconds")) {  // datetime.timedelta
    seconds = timeout.attr("total_seconds")().cast<double>();
  } else if ((PyFloat_Check(timeout.ptr()) || PyLong_Check(timeout.ptr())) &&
             !PyBool_Check(timeout.ptr())) {
    seconds = timeout.cast<double>();
  } else {
    throw_type_error(op,
                     "argument 'timeout' must be a datetime.timedelta or seconds as a "
                     "float, got " +
                         std::string(py::str(py::type::handle_of(timeout).attr("__name__"))));
  }
  // The C type is int64 ms; a century is plenty and keeps the conversion exact.
  constexpr double kMaxSeconds = 100.0 * 365 * 24 * 3600;
  if (!std::isfinite(seconds) || seconds <= 0.0 || seconds > kMaxSeconds) {
    throw_invalid_argument(op,
                           "argument 'timeout' must be a positive, finite duration of at "
                           "most 100 years, got " +
                               std::to_string(seconds) + " s");
  }
  // Round up so that a small positive timeout never becomes 0 ms (which C rejects).
  return static_cast<int64_t>(std::ceil(seconds * 1000.0));
}

namespace {

constexpr const char* kInit = "Communicator";

int64_t checked_nonnegative(int64_t value, const char* op, const char* arg) {
  if (value < 0) {
    throw_invalid_argument(
        op, std::string("argument '") + arg + "' must be >= 0, got " + std::to_string(value));
  }
  return value;
}

std::unique_ptr<Communicator> create_communicator(int rank, int size, const UniqueId& uid,
                                                  py::handle timeout, int64_t chunk_bytes,
                                                  int64_t p2p_chunk_bytes,
                                                  std::optional<std::string> name,
                                                  std::optional<int64_t> yield_ns) {
  if (size < 1) {
    throw_invalid_argument(kInit, "argument 'size' must be >= 1, got " + std::to_string(size));
  }
  if (rank < 0 || rank >= size) {
    throw_invalid_argument(kInit, "argument 'rank' = " + std::to_string(rank) +
                                      " is outside [0, size=" + std::to_string(size) + ")");
  }
  spyrecclConfig_t config = SPYRECCL_CONFIG_INITIALIZER;
  if (!timeout.is_none()) config.timeoutMs = timeout_to_ms(timeout, kInit);
  config.chunkBytes = static_cast<size_t>(checked_nonnegative(chunk_bytes, kInit, "chunk_bytes"));
  config.p2pChunkBytes =
      static_cast<size_t>(checked_nonnegative(p2p_chunk_bytes, kInit, "p2p_chunk_bytes"));
  if (name.has_value()) config.name = name->c_str();
  if (yield_ns.has_value()) config.yieldNs = checked_nonnegative(*yield_ns, kInit, "yield_ns");

  spyrecclComm_t comm = nullptr;
  const spyrecclUniqueId id = uid.id;
  call_without_gil(nullptr, [&] { return spyrecclCommInitRank(&comm, size, id, rank, &config); });
  return std::make_unique<Communicator>(comm, name.value_or(""));
}

py::object split(Communicator& self, std::optional<int> color, std::optional<int> key) {
  constexpr const char* kOp = "split";
  if (color.has_value() && *color < 0) {
    throw_invalid_argument(kOp,
                           "argument 'color' must be >= 0 or None (no new communicator), "
                           "got " +
                               std::to_string(*color));
  }
  Communicator::Use use(self, kOp);
  const int c = color.value_or(SPYRECCL_SPLIT_NOCOLOR);
  const int k = key.value_or(self.rank());
  spyrecclComm_t child = nullptr;
  spyrecclComm_t handle = use.handle();
  call_without_gil(handle, [&] { return spyrecclCommSplit(handle, c, k, &child, nullptr); });
  if (child == nullptr) return py::none();
  std::string name =
      self.name().empty() ? std::string() : self.name() + ".split(" + std::to_string(c) + ")";
  return py::cast(std::make_unique<Communicator>(child, std::move(name)));
}

std::string communicator_repr(const Communicator& self) {
  std::string text = "<spyreccl_core.Communicator";
  if (!self.name().empty()) text += " name='" + self.name() + "'";
  text += " rank=" + std::to_string(self.rank()) + " size=" + std::to_string(self.size());
  if (self.closed()) text += " destroyed";
  return text + ">";
}

}  // namespace

void bind_communicator(py::module_& m) {
  py::class_<Communicator> cls(
      m, "Communicator",
      "A group of `size` processes on this host that communicate through shared memory.\n\n"
      "Collective: every rank constructs it with the same UniqueId and its own rank. Blocks "
      "until all ranks joined or `timeout` expired.");
  cls.def(py::init(&create_communicator), py::arg("rank"), py::arg("size"), py::arg("unique_id"),
          py::kw_only(), py::arg("timeout") = py::none(), py::arg("chunk_bytes") = 0,
          py::arg("p2p_chunk_bytes") = 0, py::arg("name") = py::none(),
          py::arg("yield_ns") = py::none(),
          "timeout: datetime.timedelta or seconds bounding every wait (default 30 min).\n"
          "chunk_bytes / p2p_chunk_bytes: staging sizes (0 = library default).\n"
          "name: label used in error messages and state dumps.\n"
          "yield_ns: how long a wait yields the CPU before it sleeps (None = library "
          "default, SPYRECCL_YIELD_NS or 2 ms; 0 = sleep at once).")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("name", &Communicator::name)
      .def_property_readonly("closed", &Communicator::closed, "True once destroy()/close() ran.")
      .def("split", &split, py::arg("color"), py::arg("key") = py::none(),
           "Collective: ranks passing the same color (>= 0) form a new communicator ordered "
           "by (key, rank); color None yields None.")
      .def("abort", &Communicator::abort,
           "Marks the communicator failed and wakes every wait, also from another thread: a "
           "blocked operation raises AbortedError, peers get RemoteError.")
      .def("destroy", &Communicator::destroy,
           "Releases the communicator (local, idempotent). An operation running on another "
           "thread is aborted and awaited first.")
      .def("close", &Communicator::destroy, "Alias of destroy().")
      .def("set_timeout", &Communicator::set_timeout, py::arg("timeout"))
      .def("dump_state", &Communicator::dump_state,
           "Human readable snapshot of recent operations and what each peer announced.")
      .def("async_error", &Communicator::async_error,
           "Result.SUCCESS while healthy, otherwise the error that broke the communicator.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](Communicator& self, const py::object&, const py::object&, const py::object&) {
             self.destroy();
             return false;
           })
      .def("__repr__", &communicator_repr);
  bind_collectives(cls);
  bind_point_to_point(m, cls);
}

}  // namespace spyreccl_py
