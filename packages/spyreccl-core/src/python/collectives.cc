// collectives.cc — the collective operations of Communicator.
//
// Each method checks its arguments here, before anything is communicated, so that a bad call
// raises on the calling rank with a message naming the argument (the peers are not involved
// and the communicator stays usable). Sizes are checked against what the C API will read or
// write, because the C API only sees raw pointers. The GIL is released for the C call (for
// small messages only once the call has to wait: call_gil_until_wait); the BufferViews keep the
// memory exported until the call returned.
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "buffer_view.h"
#include "communicator.h"
#include "types.h"

namespace spyreccl_py {
namespace {

using DType = std::optional<spyrecclDataType_t>;

std::string count_text(size_t n) { return std::to_string(n); }

// size * count with an overflow check (a huge count is a caller bug, not a wrap-around).
size_t times_size(const char* op, size_t count, int size) {
  size_t total = 0;
  if (__builtin_mul_overflow(count, static_cast<size_t>(size), &total)) {
    throw_invalid_argument(op, "element count " + count_text(count) + " times size " +
                                   std::to_string(size) + " overflows");
  }
  return total;
}

void require_count(const char* op, const BufferView& buf, size_t expected,
                   const std::string& expected_text) {
  if (buf.count() != expected) {
    throw_invalid_argument(op, std::string("argument '") + buf.arg() + "' has " +
                                   count_text(buf.count()) + " elements, expected " +
                                   expected_text + " = " + count_text(expected));
  }
}

void require_root(const char* op, int root, int size) {
  if (root < 0 || root >= size) {
    throw_invalid_argument(op, "argument 'root' = " + std::to_string(root) +
                                   " is outside [0, size=" + std::to_string(size) + ")");
  }
}

// The C API allows exactly one overlap per operation: the in-place layout where `inner`
// starts `block` blocks of `inner.nbytes()` into `outer` (block 0 and equal sizes for the
// element-wise operations). Any other overlap would read data already overwritten.
bool is_in_place(const BufferView& outer, const BufferView& inner, size_t block) {
  return inner.begin() == outer.begin() + block * inner.nbytes();
}

void forbid_overlap(const char* op, const BufferView& a, const BufferView& b,
                    const char* allowed_layout) {
  if (!overlaps(a, b)) return;
  std::string message = std::string("arguments '") + a.arg() + "' and '" + b.arg() + "' overlap";
  message += allowed_layout != nullptr
                 ? std::string("; the only overlap allowed is ") + allowed_layout
                 : std::string("; this operation is not in place");
  throw_invalid_argument(op, message);
}

// Resolves a ReduceOp for one call. PREMUL_SUM becomes a handle created on the communicator
// for this call's dtype and scalar and destroyed afterwards (the C API caps live handles).
class Reduction {
 public:
  Reduction(const char* op_name, spyrecclComm_t comm, ReduceOp op, std::optional<double> scalar,
            spyrecclDataType_t dtype)
      : comm_(comm) {
    if (op != ReduceOp::kPremulSum) {
      if (scalar.has_value()) {
        throw_invalid_argument(op_name, std::string("argument 'scalar' is only used with "
                                                    "ReduceOp.PREMUL_SUM, not ReduceOp.") +
                                            reduce_op_name(op));
      }
      value_ = static_cast<spyrecclRedOp_t>(op);
      return;
    }
    if (!scalar.has_value()) {
      throw_invalid_argument(op_name, "ReduceOp.PREMUL_SUM needs argument 'scalar'");
    }
    check_result(spyrecclRedOpCreatePreMulSum(&value_, *scalar, dtype, comm_), comm_);
    owned_ = true;
  }
  ~Reduction() {
    // Failing here only means the communicator already broke; the call reported that.
    if (owned_) spyrecclRedOpDestroy(value_, comm_);
  }
  Reduction(const Reduction&) = delete;
  Reduction& operator=(const Reduction&) = delete;
  spyrecclRedOp_t value() const { return value_; }

 private:
  spyrecclComm_t comm_;
  spyrecclRedOp_t value_ = spyrecclSum;
  bool owned_ = false;
};

// ---------------------------------------------------------------------------------------

void all_reduce(Communicator& self, py::handle send, py::handle recv, py::handle op_arg,
                std::optional<double> scalar, DType dtype) {
  constexpr const char* kOp = "all_reduce";
  const ReduceOp op = reduce_op_arg(op_arg, kOp);
  Communicator::Use use(self, kOp);
  BufferView in = BufferView::acquire(send, kOp, "send",
                                      recv.is_none() ? Access::kWrite : Access::kRead, dtype);
  void* out_ptr = in.data();
  std::optional<BufferView> out;
  if (!recv.is_none()) {
    out.emplace(BufferView::acquire(recv, kOp, "recv", Access::kWrite, dtype));
    require_same_dtype(kOp, in, *out);
    require_count(kOp, *out, in.count(), "len(send)");
    if (!is_in_place(in, *out, 0)) forbid_overlap(kOp, in, *out, "recv is send (in place)");
    out_ptr = out->data();
  }
  Reduction red(kOp, use.handle(), op, scalar, in.dtype());
  spyrecclComm_t comm = use.handle();
  call_gil_until_wait(comm, in.nbytes(), [&] {
    return spyrecclAllReduce(in.data(), out_ptr, in.count(), in.dtype(), red.value(), comm);
  });
}

void reduce(Communicator& self, py::handle send, py::handle recv, int root, py::handle op_arg,
            std::optional<double> scalar, DType dtype) {
  constexpr const char* kOp = "reduce";
  const ReduceOp op = reduce_op_arg(op_arg, kOp);
  Communicator::Use use(self, kOp);
  require_root(kOp, root, self.size());
  const bool is_root = self.rank() == root;
  const bool in_place = is_root && recv.is_none();
  BufferView in =
      BufferView::acquire(send, kOp, "send", in_place ? Access::kWrite : Access::kRead, dtype);
  void* out_ptr = in_place ? in.data() : nullptr;  // recv is ignored on the other ranks
  std::optional<BufferView> out;
  if (is_root && !in_place) {
    out.emplace(BufferView::acquire(recv, kOp, "recv", Access::kWrite, dtype));
    require_same_dtype(kOp, in, *out);
    require_count(kOp, *out, in.count(), "len(send)");
    if (!is_in_place(in, *out, 0)) forbid_overlap(kOp, in, *out, "recv is send (in place)");
    out_ptr = out->data();
  }
  Reduction red(kOp, use.handle(), op, scalar, in.dtype());
  spyrecclComm_t comm = use.handle();
  call_gil_until_wait(comm, in.nbytes(), [&] {
    return spyrecclReduce(in.data(), out_ptr, in.count(), in.dtype(), red.value(), root, comm);
  });
}

void broadcast(Communicator& self, py::handle buf, int root, DType dtype) {
  constexpr const char* kOp = "broadcast";
  Communicator::Use use(self, kOp);
  require_root(kOp, root, self.size());
  // Only the root's buffer is read; every other rank's buffer is overwritten.
  const Access access = self.rank() == root ? Access::kRead : Access::kWrite;
  BufferView data = BufferView::acquire(buf, kOp, "buf", access, dtype);
  spyrecclComm_t comm = use.handle();
  call_gil_until_wait(comm, data.nbytes(), [&] {
    return spyrecclBroadcast(data.data(), data.data(), data.count(), data.dtype(), root, comm);
  });
}

void all_gather(Communicator& self, py::handle send, py::handle recv, DType dtype) {
  constexpr const char* kOp = "all_gather";
  Communicator::Use use(self, kOp);
  BufferView in = BufferView::acquire(send, kOp, "send", Access::kRead, dtype);
  BufferView out = BufferView::acquire(recv, kOp, "recv", Access::kWrite, dtype);
  require_same_dtype(kOp, in, out);
  require_count(kOp, out, times_size(kOp, in.count(), self.size()), "size*len(send)");
  if (!is_in_place(out, in, static_cast<size_t>(self.rank()))) {
    forbid_overlap(kOp, in, out, "send being block `rank` of recv (in place)");
  }
  spyrecclComm_t comm = use.handle();
  call_gil_until_wait(comm, out.nbytes(), [&] {
    return spyrecclAllGather(in.data(), out.data(), in.count(), in.dtype(), comm);
  });
}

void reduce_scatter(Communicator& self, py::handle send, py::handle recv, py::handle op_arg,
                    std::optional<double> scalar, DType dtype) {
  constexpr const char* kOp = "reduce_scatter";
  const ReduceOp op = reduce_op_arg(op_arg, kOp);
  Communicator::Use use(self, kOp);
  BufferView in = BufferView::acquire(send, kOp, "send", Access::kRead, dtype);
  BufferView out = BufferView::acquire(recv, kOp, "recv", Access::kWrite, dtype);
  require_same_dtype(kOp, in, out);
  require_count(kOp, in, times_size(kOp, out.count(), self.size()), "size*len(recv)");
  if (!is_in_place(in, out, static_cast<size_t>(self.rank()))) {
    forbid_overlap(kOp, in, out, "recv being block `rank` of send (in place)");
  }
  Reduction red(kOp, use.handle(), op, scalar, in.dtype());
  spyrecclComm_t comm = use.handle();
  call_gil_until_wait(comm, in.nbytes(), [&] {
    return spyrecclReduceScatter(in.data(), out.data(), out.count(), in.dtype(), red.value(), comm);
  });
}

void all_to_all(Communicator& self, py::handle send, py::handle recv, DType dtype) {
  constexpr const char* kOp = "all_to_all";
  Communicator::Use use(self, kOp);
  BufferView in = BufferView::acquire(send, kOp, "send", Access::kRead, dtype);
  BufferView out = BufferView::acquire(recv, kOp, "recv", Access::kWrite, dtype);
  require_same_dtype(kOp, in, out);
  const size_t size = static_cast<size_t>(self.size());
  if (in.count() % size != 0) {
    throw_invalid_argument(
        kOp, "argument 'send' has " + count_text(in.count()) +
                 " elements, which is not a multiple of size = " + std::to_string(size));
  }
  require_count(kOp, out, in.count(), "len(send)");
  forbid_overlap(kOp, in, out, nullptr);
  const size_t block = in.count() / size;
  spyrecclComm_t comm = use.handle();
  call_gil_until_wait(comm, in.nbytes(), [&] {
    return spyrecclAllToAll(in.data(), out.data(), block, in.dtype(), comm);
  });
}

// Checks one side of all_to_all_v: `counts` and optional `displs` (default: packed blocks in
// rank order) must describe blocks inside `buf`. Returns (counts, displs) as size_t.
std::pair<std::vector<size_t>, std::vector<size_t>> block_layout(
    const char* op, const BufferView& buf, const std::vector<int64_t>& counts,
    const char* counts_arg, const std::optional<std::vector<int64_t>>& displs,
    const char* displs_arg, int size) {
  const auto expect_entries = [&](const std::vector<int64_t>& values, const char* arg) {
    if (values.size() != static_cast<size_t>(size)) {
      throw_invalid_argument(op, std::string("argument '") + arg + "' has " +
                                     std::to_string(values.size()) +
                                     " entries, expected size = " + std::to_string(size));
    }
    for (size_t p = 0; p < values.size(); ++p) {
      if (values[p] < 0) {
        throw_invalid_argument(op, std::string("argument '") + arg + "'[" + std::to_string(p) +
                                       "] = " + std::to_string(values[p]) + " must be >= 0");
      }
    }
  };
  expect_entries(counts, counts_arg);
  if (displs.has_value()) expect_entries(*displs, displs_arg);

  std::vector<size_t> c(counts.begin(), counts.end());
  std::vector<size_t> d(c.size());
  size_t packed = 0;
  for (size_t p = 0; p < c.size(); ++p) {
    d[p] = displs.has_value() ? static_cast<size_t>((*displs)[p]) : packed;
    size_t end = 0;
    if (__builtin_add_overflow(d[p], c[p], &end) || end > buf.count()) {
      throw_invalid_argument(
          op, std::string(displs.has_value() ? displs_arg : "(packed displacement)") + "[" +
                  std::to_string(p) + "] + " + counts_arg + "[" + std::to_string(p) +
                  "] = " + (end >= d[p] ? count_text(end) : std::string("overflow")) +
                  " exceeds len(" + buf.arg() + ") = " + count_text(buf.count()));
    }
    packed = end;
  }
  return {std::move(c), std::move(d)};
}

void all_to_all_v(Communicator& self, py::handle send, const std::vector<int64_t>& send_counts,
                  py::handle recv, const std::vector<int64_t>& recv_counts,
                  const std::optional<std::vector<int64_t>>& send_displs,
                  const std::optional<std::vector<int64_t>>& recv_displs, DType dtype) {
  constexpr const char* kOp = "all_to_all_v";
  Communicator::Use use(self, kOp);
  BufferView in = BufferView::acquire(send, kOp, "send", Access::kRead, dtype);
  BufferView out = BufferView::acquire(recv, kOp, "recv", Access::kWrite, dtype);
  require_same_dtype(kOp, in, out);
  auto [scounts, sdispls] =
      block_layout(kOp, in, send_counts, "send_counts", send_displs, "send_displs", self.size());
  auto [rcounts, rdispls] =
      block_layout(kOp, out, recv_counts, "recv_counts", recv_displs, "recv_displs", self.size());
  forbid_overlap(kOp, in, out, nullptr);
  spyrecclComm_t comm = use.handle();
  call_without_gil(comm, [&] {
    return spyrecclAllToAllv(in.data(), scounts.data(), sdispls.data(), out.data(), rcounts.data(),
                             rdispls.data(), in.dtype(), comm);
  });
}

void gather(Communicator& self, py::handle send, py::handle recv, int root, DType dtype) {
  constexpr const char* kOp = "gather";
  Communicator::Use use(self, kOp);
  require_root(kOp, root, self.size());
  BufferView in = BufferView::acquire(send, kOp, "send", Access::kRead, dtype);
  std::optional<BufferView> out;  // only the root receives; recv is ignored elsewhere
  if (self.rank() == root) {
    out.emplace(BufferView::acquire(recv, kOp, "recv", Access::kWrite, dtype));
    require_same_dtype(kOp, in, *out);
    require_count(kOp, *out, times_size(kOp, in.count(), self.size()), "size*len(send)");
    if (!is_in_place(*out, in, static_cast<size_t>(root))) {
      forbid_overlap(kOp, in, *out, "send being block `root` of recv (in place)");
    }
  }
  void* out_ptr = out.has_value() ? out->data() : nullptr;
  spyrecclComm_t comm = use.handle();
  call_without_gil(
      comm, [&] { return spyrecclGather(in.data(), out_ptr, in.count(), in.dtype(), root, comm); });
}

void scatter(Communicator& self, py::handle send, py::handle recv, int root, DType dtype) {
  constexpr const char* kOp = "scatter";
  Communicator::Use use(self, kOp);
  require_root(kOp, root, self.size());
  BufferView out = BufferView::acquire(recv, kOp, "recv", Access::kWrite, dtype);
  std::optional<BufferView> in;  // only the root's send is read
  if (self.rank() == root) {
    in.emplace(BufferView::acquire(send, kOp, "send", Access::kRead, dtype));
    require_same_dtype(kOp, out, *in);
    require_count(kOp, *in, times_size(kOp, out.count(), self.size()), "size*len(recv)");
    if (!is_in_place(*in, out, static_cast<size_t>(root))) {
      forbid_overlap(kOp, *in, out, "recv being block `root` of send (in place)");
    }
  }
  const void* in_ptr = in.has_value() ? in->data() : nullptr;
  spyrecclComm_t comm = use.handle();
  call_without_gil(comm, [&] {
    return spyrecclScatter(in_ptr, out.data(), out.count(), out.dtype(), root, comm);
  });
}

void barrier(Communicator& self) {
  Communicator::Use use(self, "barrier");
  spyrecclComm_t comm = use.handle();
  call_gil_until_wait(comm, 0, [&] { return spyrecclBarrier(comm); });
}

}  // namespace

void bind_collectives(py::class_<Communicator>& cls) {
  const auto sum = ReduceOp::kSum;
  cls.def("all_reduce", &all_reduce, py::arg("send"), py::arg("recv") = py::none(),
          py::arg("op") = sum, py::kw_only(), py::arg("scalar") = py::none(),
          py::arg("dtype") = py::none(),
          "recv[i] = op over ranks of send[i]. recv None: in place into send.")
      .def("reduce", &reduce, py::arg("send"), py::arg("recv"), py::arg("root"),
           py::arg("op") = sum, py::kw_only(), py::arg("scalar") = py::none(),
           py::arg("dtype") = py::none(),
           "Like all_reduce but only `root` receives (recv ignored elsewhere, may be None; "
           "None on root: in place).")
      .def("broadcast", &broadcast, py::arg("buf"), py::arg("root"), py::kw_only(),
           py::arg("dtype") = py::none(), "Copies root's buf into every rank's buf.")
      .def("all_gather", &all_gather, py::arg("send"), py::arg("recv"), py::kw_only(),
           py::arg("dtype") = py::none(), "recv holds size blocks: block r is rank r's send.")
      .def("reduce_scatter", &reduce_scatter, py::arg("send"), py::arg("recv"), py::arg("op") = sum,
           py::kw_only(), py::arg("scalar") = py::none(), py::arg("dtype") = py::none(),
           "recv = op over ranks of block `rank` of send (len(send) = size*len(recv)).")
      .def("all_to_all", &all_to_all, py::arg("send"), py::arg("recv"), py::kw_only(),
           py::arg("dtype") = py::none(),
           "Block p of send goes to rank p, landing as block `rank` of its recv.")
      .def("all_to_all_v", &all_to_all_v, py::arg("send"), py::arg("send_counts"), py::arg("recv"),
           py::arg("recv_counts"), py::arg("send_displs") = py::none(),
           py::arg("recv_displs") = py::none(), py::kw_only(), py::arg("dtype") = py::none(),
           "send_counts[p] elements from send[send_displs[p]:] go to rank p; displacements "
           "default to packed blocks in rank order. Counts in elements.")
      .def("gather", &gather, py::arg("send"), py::arg("recv"), py::arg("root"), py::kw_only(),
           py::arg("dtype") = py::none(),
           "root's recv holds size blocks, block r being rank r's send (recv ignored "
           "elsewhere).")
      .def("scatter", &scatter, py::arg("send"), py::arg("recv"), py::arg("root"), py::kw_only(),
           py::arg("dtype") = py::none(),
           "recv = block `rank` of root's send (send ignored elsewhere).")
      .def("barrier", &barrier, "Returns once every rank has entered it.");
}

}  // namespace spyreccl_py
