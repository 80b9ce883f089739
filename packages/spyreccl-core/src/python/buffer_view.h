// buffer_view.h — a checked, owned view of one buffer-protocol argument.
//
// Every operation receives numpy arrays (or any C-contiguous buffer) and must hand the C API
// (pointer, element count, data type). BufferView performs the checks once, with messages
// that name the operation and the argument, and holds the Py_buffer export for as long as
// the C call may touch the memory: the exporter cannot be resized or freed meanwhile, even
// though the GIL is released around the call.
#pragma once

#include <pybind11/pybind11.h>
#include <spyreccl/spyreccl.h>

#include <cstddef>
#include <optional>

namespace spyreccl_py {

namespace py = pybind11;

enum class Access { kRead, kWrite };

class BufferView {
 public:
  // Acquires `obj` as argument `arg` of operation `op`. The data type comes from the buffer's
  // struct format unless `dtype` overrides it; an override must be the inferred type itself
  // or reinterpret an integer view of the same width (uint16 → bfloat16, uint8 → float8).
  // Raises TypeError for non-buffers and unsupported formats, InvalidArgumentError for
  // read-only outputs and non-contiguous memory.
  static BufferView acquire(py::handle obj, const char* op, const char* arg, Access access,
                            std::optional<spyrecclDataType_t> dtype);

  BufferView(BufferView&& other) noexcept;
  BufferView& operator=(BufferView&&) = delete;
  BufferView(const BufferView&) = delete;
  BufferView& operator=(const BufferView&) = delete;
  ~BufferView();  // releases the export; the GIL must be held

  void* data() const { return view_.buf; }
  size_t count() const { return count_; }
  size_t nbytes() const { return static_cast<size_t>(view_.len); }
  size_t itemsize() const { return static_cast<size_t>(view_.itemsize); }
  spyrecclDataType_t dtype() const { return dtype_; }
  const char* arg() const { return arg_; }

  // Address range helpers used for the in-place / overlap rules of the C API.
  const char* begin() const { return static_cast<const char*>(view_.buf); }
  const char* end() const { return begin() + view_.len; }

 private:
  BufferView() = default;

  Py_buffer view_{};
  size_t count_ = 0;
  spyrecclDataType_t dtype_ = spyrecclUint8;
  const char* arg_ = "";
};

// Requires `other` to hold the same data type as `first` (TypeError otherwise).
void require_same_dtype(const char* op, const BufferView& first, const BufferView& other);

// True when the byte ranges of the two views intersect (empty views never overlap).
bool overlaps(const BufferView& a, const BufferView& b);

}  // namespace spyreccl_py
