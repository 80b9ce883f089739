// p2p.cc — send/recv, recv_any_source and groups.
//
// Inside spyrecclGroupStart/End a send or recv only enqueues (pointer, count); the memory is
// touched when the outermost GroupEnd runs. The binding therefore keeps every buffer export
// of an open group alive in a per-thread GroupState until that GroupEnd returned, and keeps
// the communicators alive too (and refuses to destroy them meanwhile).
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "buffer_view.h"
#include "communicator.h"
#include "types.h"

namespace spyreccl_py {
namespace {

using DType = std::optional<spyrecclDataType_t>;

struct GroupState {
  int depth = 0;
  std::vector<BufferView> buffers;  // exports referenced by enqueued operations
  std::vector<py::object> comms;    // communicators with enqueued operations
};

// Heap-allocated on the first group_start of a thread and freed by the outermost group_end.
// A thread that exits inside a group leaks it on purpose: releasing buffer exports needs the
// GIL, which a thread-exit destructor cannot take safely.
thread_local GroupState* t_group = nullptr;

bool in_group() { return t_group != nullptr && t_group->depth > 0; }

void require_peer(const char* op, const Communicator& self, int peer) {
  if (peer < 0 || peer >= self.size()) {
    throw_invalid_argument(op, "argument 'peer' = " + std::to_string(peer) +
                                   " is outside [0, size=" + std::to_string(self.size()) + ")");
  }
  if (peer == self.rank()) {
    throw_invalid_argument(op, "argument 'peer' = " + std::to_string(peer) +
                                   " is this rank; send/recv need another rank");
  }
}

void require_tag(const char* op, int tag) {
  if (tag < 0)
    throw_invalid_argument(op, "argument 'tag' = " + std::to_string(tag) + " must be >= 0");
}

// After a successful enqueue inside a group, hands the export to the group so that it stays
// valid until group_end.
void keep_for_group(Communicator& self, BufferView&& view) {
  t_group->buffers.push_back(std::move(view));
  t_group->comms.push_back(py::cast(&self, py::return_value_policy::reference));
  self.add_group_pending();
}

void send(Communicator& self, py::handle buf, int peer, int tag, DType dtype) {
  constexpr const char* kOp = "send";
  Communicator::Use use(self, kOp);
  require_peer(kOp, self, peer);
  require_tag(kOp, tag);
  BufferView data = BufferView::acquire(buf, kOp, "buf", Access::kRead, dtype);
  spyrecclComm_t comm = use.handle();
  call_gil_until_wait(comm, data.nbytes(), [&] {
    return spyrecclSend(data.data(), data.count(), data.dtype(), peer, tag, comm);
  });
  if (in_group()) keep_for_group(self, std::move(data));
}

void recv(Communicator& self, py::handle buf, int peer, int tag, DType dtype) {
  constexpr const char* kOp = "recv";
  Communicator::Use use(self, kOp);
  require_peer(kOp, self, peer);
  require_tag(kOp, tag);
  BufferView data = BufferView::acquire(buf, kOp, "buf", Access::kWrite, dtype);
  spyrecclComm_t comm = use.handle();
  call_gil_until_wait(comm, data.nbytes(), [&] {
    return spyrecclRecv(data.data(), data.count(), data.dtype(), peer, tag, comm);
  });
  if (in_group()) keep_for_group(self, std::move(data));
}

int recv_any_source(Communicator& self, py::handle buf, int tag, DType dtype) {
  constexpr const char* kOp = "recv_any_source";
  Communicator::Use use(self, kOp);
  require_tag(kOp, tag);
  if (in_group()) throw_invalid_usage(kOp, "not allowed inside a group");
  BufferView data = BufferView::acquire(buf, kOp, "buf", Access::kWrite, dtype);
  spyrecclComm_t comm = use.handle();
  int source = -1;
  call_without_gil(comm, [&] {
    return spyrecclRecvAnySource(data.data(), data.count(), data.dtype(), tag, &source, comm);
  });
  return source;
}

void group_start() {
  check_result(spyrecclGroupStart(), nullptr);
  if (t_group == nullptr) t_group = new GroupState();
  ++t_group->depth;
}

void group_end() {
  if (!in_group()) throw_invalid_usage("group_end", "no group is open on this thread");
  const bool outermost = t_group->depth == 1;
  // Detach the state before running: whatever GroupEnd reports, the group is over and its
  // buffers are released when `state` goes out of scope (with the GIL held).
  std::unique_ptr<GroupState> state;
  if (outermost)
    state.reset(std::exchange(t_group, nullptr));
  else
    --t_group->depth;

  spyrecclResult_t result = spyrecclSuccess;
  std::string message;
  {
    py::gil_scoped_release no_gil;
    result = spyrecclGroupEnd();
    if (result != spyrecclSuccess) {
      // The failure is recorded on the thread (no communicator) or on the communicator
      // whose operation failed; take the first non-empty message.
      const char* detail = spyrecclGetLastError(nullptr);
      if (detail != nullptr && detail[0] != '\0') message = detail;
    }
  }
  if (state) {
    for (py::object& obj : state->comms) obj.cast<Communicator&>().clear_group_pending();
  }
  if (result == spyrecclSuccess) return;
  if (message.empty() && state) {
    for (py::object& obj : state->comms) {
      Communicator& comm = obj.cast<Communicator&>();
      if (comm.closed()) continue;
      const char* detail = nullptr;
      // The handle is alive: destroy() refuses to run while operations are pending, and the
      // pending count was cleared only just now on this thread.
      detail = spyrecclGetLastError(comm.raw_handle());
      if (detail != nullptr && detail[0] != '\0') {
        message = detail;
        break;
      }
    }
  }
  throw SpyrecclException(result, message.empty() ? spyrecclGetErrorString(result) : message);
}

// `with comm.group():` / `with spyreccl_core.group():`
struct GroupContext {};

// A posted isend/irecv (spyrecclRequest_t). Keeps its communicator and its buffer export
// alive while the core may still use them; a request dropped while pending gives the
// export to the communicator (Communicator::adopt_orphan).
class Request {
 public:
  Request(py::object comm, Communicator& self, BufferView&& view, spyrecclRequest_t handle)
      : comm_obj_(std::move(comm)), comm_(self), view_(std::move(view)), handle_(handle) {}
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() {
    if (handle_ != nullptr && view_ && !comm_.closed()) comm_.adopt_orphan(std::move(*view_));
  }

  bool done() const { return handle_ == nullptr; }

  bool test() {
    if (done()) return true;
    Communicator::Use use(comm_, "Request.test");
    int finished = 0;
    const spyrecclResult_t result = [&] {
      py::gil_scoped_release no_gil;
      return spyrecclTest(handle_, &finished);
    }();
    if (result != spyrecclSuccess && result != spyrecclInvalidArgument) finished = 1;
    if (finished) release();
    check_result(result, use.handle());
    return finished != 0;
  }

  void wait() {
    if (done()) return;
    Communicator::Use use(comm_, "Request.wait");
    spyrecclRequest_t handle = std::exchange(handle_, nullptr);  // released on any outcome
    const spyrecclResult_t result = [&] {
      py::gil_scoped_release no_gil;
      return spyrecclWait(handle);
    }();
    view_.reset();
    check_result(result, use.handle());
  }

 private:
  void release() {
    handle_ = nullptr;
    view_.reset();
  }

  py::object comm_obj_;
  Communicator& comm_;
  std::optional<BufferView> view_;
  spyrecclRequest_t handle_;
};

std::unique_ptr<Request> post(py::object self_obj, bool is_send, py::handle buf, int peer, int tag,
                              DType dtype) {
  const char* op = is_send ? "isend" : "irecv";
  Communicator& self = self_obj.cast<Communicator&>();
  Communicator::Use use(self, op);
  require_peer(op, self, peer);
  require_tag(op, tag);
  if (in_group()) throw_invalid_usage(op, "not allowed inside a group (use send/recv there)");
  BufferView data =
      BufferView::acquire(buf, op, "buf", is_send ? Access::kRead : Access::kWrite, dtype);
  spyrecclComm_t comm = use.handle();
  spyrecclRequest_t handle = nullptr;
  call_without_gil(comm, [&] {
    return is_send
               ? spyrecclIsend(data.data(), data.count(), data.dtype(), peer, tag, comm, &handle)
               : spyrecclIrecv(data.data(), data.count(), data.dtype(), peer, tag, comm, &handle);
  });
  return std::make_unique<Request>(std::move(self_obj), self, std::move(data), handle);
}

}  // namespace

void bind_point_to_point(py::module_& m, py::class_<Communicator>& cls) {
  py::class_<GroupContext>(m, "Group", "Context manager returned by group().")
      .def("__enter__",
           [](py::object self) {
             group_start();
             return self;
           })
      .def("__exit__", [](GroupContext&, const py::object&, const py::object&, const py::object&) {
        // Always end the group, also when its body raised: the per-thread group state
        // must stay balanced for later calls.
        group_end();
        return false;
      });
  cls.def("send", &send, py::arg("buf"), py::arg("peer"), py::arg("tag") = 0, py::kw_only(),
          py::arg("dtype") = py::none(),
          "Sends buf to `peer` (FIFO per pair; the receive must match count, dtype and tag).")
      .def("recv", &recv, py::arg("buf"), py::arg("peer"), py::arg("tag") = 0, py::kw_only(),
           py::arg("dtype") = py::none(), "Receives into buf from `peer`.")
      .def("recv_any_source", &recv_any_source, py::arg("buf"), py::arg("tag") = 0, py::kw_only(),
           py::arg("dtype") = py::none(),
           "Receives the next message with `tag` from any rank; returns that rank.")
      .def(
          "isend",
          [](py::object self, py::handle buf, int peer, int tag, DType dtype) {
            return post(std::move(self), true, buf, peer, tag, dtype);
          },
          py::arg("buf"), py::arg("peer"), py::arg("tag") = 0, py::kw_only(),
          py::arg("dtype") = py::none(),
          "Posts a send of buf to `peer` and returns a Request at once (buf must stay "
          "unchanged until the request is done).")
      .def(
          "irecv",
          [](py::object self, py::handle buf, int peer, int tag, DType dtype) {
            return post(std::move(self), false, buf, peer, tag, dtype);
          },
          py::arg("buf"), py::arg("peer"), py::arg("tag") = 0, py::kw_only(),
          py::arg("dtype") = py::none(),
          "Posts a receive into buf from `peer` and returns a Request at once (buf is "
          "complete once the request is done).")
      .def(
          "group", [](const Communicator&) { return GroupContext{}; },
          "Context manager grouping send/recv so that they progress together (same as "
          "spyreccl_core.group(); groups are per thread, not per communicator).");

  py::class_<Request>(m, "Request",
                      "A posted isend/irecv. Pending requests of a communicator progress "
                      "during every call on it (test, wait, send/recv, collectives).")
      .def("test", &Request::test,
           "Progresses the communicator's requests once without blocking; True once this "
           "one is complete. Raises the request's error (then it is done).")
      .def("wait", &Request::wait,
           "Blocks until the request is complete (bounded by the communicator's timeout); "
           "raises its error.")
      .def_property_readonly("done", &Request::done,
                             "Whether test() or wait() reported the request complete.");

  m.def(
      "group", [] { return GroupContext{}; },
      "Context manager: send/recv inside only enqueue; leaving it runs them all together.");
  m.def("group_start", &group_start, "Opens a (nestable) group on this thread.");
  m.def("group_end", &group_end,
        "Closes a group; the outermost one runs the enqueued send/recv and waits for them.");
}

}  // namespace spyreccl_py
