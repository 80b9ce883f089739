// memory.cc — SharedBuffer: a writable, one-dimensional byte buffer allocated with
// spyrecclMemAlloc and freed with spyrecclMemFree when the last reference (e.g. the numpy
// array viewing it) goes away. Collectives on such buffers read peers' data in place.
#include "memory.h"

#include <spyreccl/spyreccl.h>

#include <cstddef>

#include "errors.h"

namespace spyreccl_py {
namespace {

class SharedBuffer {
 public:
  explicit SharedBuffer(size_t nbytes) : nbytes_(nbytes) {
    check_result(spyrecclMemAlloc(&data_, nbytes), nullptr);
  }
  ~SharedBuffer() {
    // Cannot fail for a block we allocated; a destructor must not throw anyway.
    if (data_ != nullptr) (void)spyrecclMemFree(data_);
  }
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_;
};

}  // namespace

void bind_memory(py::module_& m) {
  py::class_<SharedBuffer>(m, "SharedBuffer", py::buffer_protocol(), R"doc(
A block of this process's spyreccl memory arena (spyrecclMemAlloc), usable wherever a
writable buffer is accepted. Large collectives whose buffers are such blocks on every rank
read the peers' data in place instead of staging it through shared memory (one copy between
processes instead of two). Freed when the last reference goes away. Use
spyreccl_core.empty() for a numpy array over one.)doc")
      .def(py::init<size_t>(), py::arg("nbytes"),
           "Allocates `nbytes` bytes (raises SystemError_ when the arena is unavailable).")
      .def("__len__", &SharedBuffer::nbytes)
      .def_property_readonly("nbytes", &SharedBuffer::nbytes)
      .def_buffer([](SharedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<unsigned char>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {1}, /*readonly=*/false);
      });
}

}  // namespace spyreccl_py
