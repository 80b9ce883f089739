// communicator.h — the Python Communicator: ownership, thread rules and lifecycle.
//
// The C API allows one thread at a time to communicate on a communicator, lets any thread
// abort it, and forbids destroying it while another thread still uses it. Python code cannot
// be trusted to follow those rules, so this class enforces them: an operation holds a
// Communicator::Use for its whole duration (a second concurrent user gets InvalidUsageError
// instead of undefined behaviour), abort() may run at any time, and destroy() aborts and
// waits for a running operation before it releases the handle.
#pragma once

#include <pybind11/pybind11.h>
#include <spyreccl/spyreccl.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "buffer_view.h"
#include "errors.h"

namespace spyreccl_py {

namespace py = pybind11;

class Communicator {
 public:
  Communicator(spyrecclComm_t comm, std::string name);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Exclusive use of the communicator by one operation `op` (GIL held at construction).
  class Use {
   public:
    Use(Communicator& comm, const char* op);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    spyrecclComm_t handle() const { return handle_; }

   private:
    Communicator& comm_;
    spyrecclComm_t handle_;
  };

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  // The C handle without any check: for reading its last error only.
  spyrecclComm_t raw_handle() const { return comm_; }
  bool closed() const;

  void abort();
  void destroy();  // idempotent
  void set_timeout(py::handle timeout);
  std::string dump_state();
  spyrecclResult_t async_error();

  // Bookkeeping for send/recv enqueued inside a group: they still reference the handle until
  // the group ends, so destroy() must refuse to run meanwhile.
  void add_group_pending();
  void clear_group_pending();

  // A non-blocking request (p2p.cc) dropped while still pending in the core hands over its
  // buffer export: the core may write the memory until the request completes, which only
  // a later call on the communicator notices, or until destroy() frees the request. The
  // exports are released after spyrecclCommDestroy (GIL held).
  void adopt_orphan(BufferView&& view);

 private:
  // The handle for thread-safe queries; throws InvalidUsageError once destroyed.
  spyrecclComm_t live_handle(const char* op) const;

  // The per-operation path takes no lock: Use claims `busy_` with one compare-exchange and
  // releases it with a plain store. `closing_` and `busy_` form a Dekker pair (seq_cst):
  // Use sets busy_ then reads closing_, destroy() sets closing_ then reads busy_, so at
  // least one of them sees the other and either the operation refuses to start or
  // destroy() waits for it to end (polling: destroy is rare, and a Use that ends must not
  // pay for a notification nobody waits for).
  std::atomic<bool> busy_{false};
  std::atomic<bool> closing_{false};  // destroy() started: no new operation may begin
  mutable std::mutex mu_;             // guards the fields below (never taken per operation)
  spyrecclComm_t comm_;
  bool destroyed_ = false;
  int group_pending_ = 0;
  std::vector<BufferView> orphans_;  // declared after comm_: released after it is destroyed
  int rank_ = -1;
  int size_ = 0;
  std::string name_;
};

// Converts a timeout given as datetime.timedelta or seconds (int/float) into whole
// milliseconds (> 0), naming `op` and argument 'timeout' in errors.
int64_t timeout_to_ms(py::handle timeout, const char* op);

// Releases the GIL, runs the C call `fn` and throws on failure with comm's detailed message
// (read before the GIL is taken back, so no other call can overwrite it).
template <typename Fn>
void call_without_gil(spyrecclComm_t comm, Fn&& fn) {
  py::gil_scoped_release no_gil;
  check_result(fn(), comm);
}

// Collectives and send/recv moving at most this many bytes per buffer keep the GIL while
// they complete within the core's initial spin (call_gil_until_wait): their copies and reductions
// take a few microseconds at most, the time another thread would wait for the GIL anyway.
constexpr size_t kKeepGilMaxBytes = 64 << 10;

// Runs the C collective or send/recv `fn` moving at most `max_bytes` per buffer and throws
// on failure like call_without_gil. A small one keeps the GIL unless it has to wait: the core's
// blocking hook (spyrecclSetBlockingHook) releases the GIL when a wait outlasts the initial
// spin (~2 us), so other Python threads run while this one blocks, as with
// call_without_gil, but a call that completes within the spin skips the release and
// re-acquisition of the GIL (about 30-40 ns each way, a sizeable part of a small
// collective). Larger messages release the GIL up front: their copies may take long.
template <typename Fn>
void call_gil_until_wait(spyrecclComm_t comm, size_t max_bytes, Fn&& fn) {
  if (max_bytes > kKeepGilMaxBytes) {
    call_without_gil(comm, std::forward<Fn>(fn));
    return;
  }
  struct Released {
    PyThreadState* state = nullptr;
    ~Released() {
      if (state != nullptr) PyEval_RestoreThread(state);  // also when check_result throws
    }
  } released;
  spyrecclSetBlockingHook(
      [](void* arg) { static_cast<Released*>(arg)->state = PyEval_SaveThread(); }, &released);
  const spyrecclResult_t result = fn();
  spyrecclSetBlockingHook(nullptr, nullptr);  // disarm when no wait fired it
  check_result(result, comm);
}

void bind_communicator(py::module_& m);
// Defined in collectives.cc and p2p.cc: add the communication methods to the class.
void bind_collectives(py::class_<Communicator>& cls);
void bind_point_to_point(py::module_& m, py::class_<Communicator>& cls);

}  // namespace spyreccl_py
