// Explicit spyre kernels: tensor creation, geometry (views, resize, set_) and
// the host<->spyre copy. Everything else reaches the boxed fallback in
// fallback.cc, which runs CPU kernels on the spyre memory in place (binary
// arithmetic does the same unboxed, binary_ops.cc).
//
// These are explicit because they either create or re-point spyre storages
// (which the fallback cannot do without a spyre tensor to start from), or
// because torch calls them on paths where the fallback's per-call bookkeeping
// would be pure overhead (views, copies, scalars).
#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/ResizeCommon.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstring>

#include "allocator.h"
#include "device_memory.h"
#include "device_state.h"
#include "host_alias.h"

namespace spyreccl::device {
namespace {

void check_factory_options(const char* op, std::optional<c10::Layout> layout,
                           std::optional<bool> pin_memory) {
  TORCH_CHECK(layout.value_or(c10::kStrided) == c10::kStrided, op,
              ": the spyre device only supports strided tensors, got layout ", *layout);
  TORCH_CHECK(!pin_memory.value_or(false), op,
              ": pin_memory=True applies to CPU tensors, not to spyre tensors");
}

c10::DeviceIndex factory_device_index(const char* op, std::optional<c10::Device> device) {
  if (device.has_value()) {
    TORCH_CHECK(device->type() == kSpyreDeviceType, op, ": spyre kernel called for a tensor on ",
                *device);
  }
  return resolve_device_index(device.has_value() ? device->index() : -1, op);
}

void maybe_fill_uninitialized(at::Tensor& tensor) {
  if (C10_UNLIKELY(at::globalContext().deterministicAlgorithms() &&
                   at::globalContext().deterministicFillUninitializedMemory())) {
    at::native::fill_empty_deterministic_(tensor);
  }
}

// --- creation ---------------------------------------------------------------

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  check_factory_options("empty", layout, pin_memory);
  // The allocator labels memory with the current device.
  const c10::DeviceGuard guard(spyre_device(factory_device_index("empty", device)));
  at::Tensor result = at::detail::empty_generic(size, host_allocator(),
                                                c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                c10::dtype_or_default(dtype), memory_format);
  maybe_fill_uninitialized(result);
  return result;
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  check_factory_options("empty_strided", layout, pin_memory);
  const c10::DeviceGuard guard(spyre_device(factory_device_index("empty_strided", device)));
  at::Tensor result = at::detail::empty_strided_generic(
      size, stride, host_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
  maybe_fill_uninitialized(result);
  return result;
}

// --- views and geometry -----------------------------------------------------

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  return at::native::view(self, size);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

// Makes sure `self`'s storage covers its geometry, growing it if needed.
void ensure_storage_covers(const at::Tensor& self) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  if (impl->numel() == 0) {
    return;
  }
  const size_t needed = at::detail::computeStorageNbytes(impl->sizes(), impl->strides(),
                                                         self.itemsize(), impl->storage_offset());
  c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
  if (needed > storage->nbytes()) {
    resize_storage_bytes(*storage, needed);
  }
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  const int64_t old_nbytes = static_cast<int64_t>(impl->unsafe_storage().nbytes());
  if (impl->sizes() != size) {
    impl->set_sizes_contiguous(size);
  }
  if (memory_format.has_value()) {
    TORCH_CHECK(*memory_format != c10::MemoryFormat::Preserve,
                "resize_: memory_format=torch.preserve_format is not supported");
    impl->empty_tensor_restride(*memory_format);
  }
  ensure_storage_covers(self);
  if (C10_UNLIKELY(at::globalContext().deterministicAlgorithms() &&
                   at::globalContext().deterministicFillUninitializedMemory())) {
    at::native::fill_resize_deterministic_(self, old_nbytes);
  }
  return self;
}

void set_storage_and_geometry(const at::Tensor& self, const c10::Storage& source,
                              int64_t storage_offset, c10::IntArrayRef size,
                              std::optional<c10::IntArrayRef> stride) {
  TORCH_CHECK(source.device_type() == kSpyreDeviceType,
              "set_: a spyre tensor can only be set to a spyre storage, got a storage on ",
              source.device());
  TORCH_CHECK(storage_offset >= 0, "set_: storage_offset must be >= 0, got ", storage_offset);
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  if (!impl->unsafe_storage().is_alias_of(source)) {
    impl->set_storage_keep_dtype(source);
  }
  impl->set_storage_offset(storage_offset);
  if (stride.has_value()) {
    TORCH_CHECK(stride->size() == size.size(), "set_: got ", size.size(), " sizes but ",
                stride->size(), " strides");
    impl->set_sizes_and_strides(size, *stride);
  } else {
    impl->set_sizes_contiguous(size);
  }
  ensure_storage_covers(self);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source) {
  const int64_t itemsize = static_cast<int64_t>(self.itemsize());
  const int64_t nbytes = static_cast<int64_t>(source.nbytes());
  TORCH_CHECK(nbytes % itemsize == 0, "set_: storage of ", nbytes,
              " bytes is not a whole number of ", self.dtype(), " elements");
  set_storage_and_geometry(self, source, 0, {nbytes / itemsize}, std::nullopt);
  return self;
}

at::Tensor& set_storage_offset(at::Tensor& self, c10::Storage source, int64_t storage_offset,
                               c10::IntArrayRef size, c10::IntArrayRef stride) {
  // An empty stride list means contiguous, as for the CPU kernel.
  set_storage_and_geometry(self, source, storage_offset, size,
                           stride.empty() ? std::nullopt : std::optional(stride));
  return self;
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  TORCH_CHECK(is_spyre(source), "set_: a spyre tensor can only be set to a spyre tensor, got ",
              source.device());
  TORCH_CHECK(self.dtype() == source.dtype(), "set_: dtype mismatch, self is ", self.dtype(),
              " and source is ", source.dtype());
  if (self.unsafeGetTensorImpl() != source.unsafeGetTensorImpl()) {
    set_storage_and_geometry(self, source.storage(), source.storage_offset(), source.sizes(),
                             source.strides());
  }
  return self;
}

at::Tensor& set_empty(at::Tensor& self) {
  const c10::Device device = self.device();
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, allocate_on(device.index(), 0),
                     host_allocator(), /*resizable=*/true);
  set_storage_and_geometry(self, empty, 0, {0}, std::nullopt);
  return self;
}

// --- data movement ----------------------------------------------------------

c10::Device spyre_side(const at::Tensor& a, const at::Tensor& b, const char* op) {
  if (is_spyre(a)) {
    return a.device();
  }
  TORCH_CHECK(is_spyre(b), op, ": expected a spyre tensor, got ", a.device(), " and ", b.device());
  return b.device();
}

at::Tensor lend_if_spyre(HostAliasScope& scope, const at::Tensor& t) {
  return is_spyre(t) ? scope.lend(t) : t;
}

// A copy that is one run of bytes: same dtype and shape, both contiguous, no conj/neg
// bits, small enough that the CPU kernel would run it on one thread anyway (below
// TensorIterator's grain size). The staged collective path makes two such copies per
// small message (to the host and back); going through a host alias and a second copy_
// dispatch costs about as much as the bytes themselves.
constexpr int64_t kOneThreadElements = 32768;  // at::internal::GRAIN_SIZE (TensorIterator.h)

bool one_run(const at::Tensor& self, const at::Tensor& dst) {
  return self.scalar_type() == dst.scalar_type() && self.numel() < kOneThreadElements &&
         !self.is_quantized() && !self.is_conj() && !dst.is_conj() && !self.is_neg() &&
         !dst.is_neg() && self.sizes().equals(dst.sizes()) && self.is_contiguous() &&
         dst.is_contiguous() &&
         // Overlapping memory keeps the CPU kernel's answer (an error for partial overlap).
         at::get_overlap_status(self, dst) == at::MemOverlapStatus::No;
}

// copy_ sends every copy that involves a spyre tensor here (spyre->spyre,
// cpu->spyre, spyre->cpu). Both sides are host memory, so a one-run copy is a
// memmove and the CPU copy kernel does the rest, including dtype conversion,
// broadcasting and conj/neg bits.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.device().type() == c10::kCPU || is_spyre(self), "copy_: cannot copy from ",
              self.device(), " to ", dst.device(), " (spyre copies support cpu and spyre tensors)");
  TORCH_CHECK(dst.device().type() == c10::kCPU || is_spyre(dst), "copy_: cannot copy from ",
              self.device(), " to ", dst.device(), " (spyre copies support cpu and spyre tensors)");
  if (one_run(self, dst)) {
    const size_t bytes = static_cast<size_t>(self.numel()) * self.element_size();
    if (bytes > 0) {
      // host_address: the accessible twin of discrete memory, the pointer itself otherwise.
      // memmove: a host view of a spyre tensor shares its memory under another storage.
      std::memmove(host_address(dst.mutable_data_ptr()), host_address(self.const_data_ptr()),
                   bytes);
    }
    return dst;
  }
  HostAliasScope scope("copy_", spyre_side(self, dst, "copy_"));
  lend_if_spyre(scope, dst).copy_(lend_if_spyre(scope, self), non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, /*non_blocking=*/false);
}

c10::Scalar local_scalar_dense(const at::Tensor& self) {
  HostAliasScope scope("_local_scalar_dense", self.device());
  return at::_local_scalar_dense(scope.lend(self));
}

at::Tensor& fill_scalar(at::Tensor& self, const c10::Scalar& value) {
  HostAliasScope scope("fill_", self.device());
  scope.lend(self).fill_(value);
  return self;
}

// Every spyre stream is the device's single in-order stream: memory can never
// be in use by another stream, so there is nothing to record.
void record_stream(at::Tensor& self, c10::Stream stream) {
  TORCH_CHECK(stream.device_type() == kSpyreDeviceType,
              "record_stream: expected a spyre stream, got one on ", stream.device());
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("as_strided", TORCH_FN(as_strided));
  m.impl("view", TORCH_FN(view));
  m.impl("_reshape_alias", TORCH_FN(reshape_alias));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage", TORCH_FN(set_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage_offset));
  m.impl("set_.source_Tensor", TORCH_FN(set_tensor));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  m.impl("fill_.Scalar", TORCH_FN(fill_scalar));
  m.impl("record_stream", TORCH_FN(record_stream));
}

// The conjugate and negative fallbacks materialise conj/neg inputs with clone,
// which copies through _copy_from again: for _copy_from itself that recursion
// never ends. The kernel above resolves both bits itself (the lent CPU tensors
// carry them and the CPU copy kernel applies them), so let the calls through.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

}  // namespace spyreccl::device
