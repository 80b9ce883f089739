// torch.ops.spyreccl_device.host_view: a CPU tensor over a spyre tensor's
// memory, for code outside operators that hands spyre memory to CPU-only
// libraries (the multi-node layer's gloo stages) without copying it.
//
// Unlike HostAliasScope (host_alias.h), which lends borrowed aliases for the
// length of one operator call, the view outlives the call that made it: its
// storage owns a reference to the spyre storage, so the memory stays allocated
// while the view exists, whatever happens to the spyre tensor.
#include <ATen/core/Tensor.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "device_memory.h"
#include "device_state.h"

namespace spyreccl::device {
namespace {

void release_storage_ref(void* ctx) { delete static_cast<c10::Storage*>(ctx); }

at::Tensor host_view(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.defined(), "host_view: argument 'tensor' must be a spyre tensor, got None");
  TORCH_CHECK(tensor.device().type() == kSpyreDeviceType,
              "host_view: argument 'tensor' must be a spyre tensor, got a tensor on ",
              tensor.device());
  TORCH_CHECK(tensor.layout() == c10::kStrided && tensor.has_storage(),
              "host_view: argument 'tensor' must be a strided spyre tensor with storage, got "
              "layout ",
              tensor.layout());
  const c10::Storage& spyre = tensor.storage();
  c10::StorageImpl* impl = spyre.unsafeGetStorageImpl();
  // mutable_data_ptr() materialises a copy-on-write storage first: writes
  // through the view must not reach a lazily cloned sibling.
  // In discrete mode (device_memory.h) the view is the one door from the host to device
  // memory: it reads the accessible twin of the block, not the device address.
  void* data = host_address(impl->mutable_data_ptr().get());
  // The DataPtr's context holds a reference to the spyre storage, released
  // with the view's storage: the memory is not freed while the view exists,
  // even after the last spyre tensor over it is gone. Not resizable: growing
  // the view would move it off the spyre memory silently. What this cannot
  // guard (as for Tensor.numpy()): resizing the spyre storage itself
  // (resize_storage_bytes moves it to a new block and frees the old one) while
  // a view exists; the multi-node layer never resizes the tensors it views.
  auto* keep = new c10::Storage(spyre);
  c10::DataPtr view_data(data, keep, &release_storage_ref, c10::Device(c10::kCPU));
  auto host = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                    impl->nbytes(), std::move(view_data),
                                                    /*allocator=*/nullptr, /*resizable=*/false);

  // Like detach(): an inference tensor gives an inference tensor (no version
  // counter); any other shares the version counter, so in-place writes through
  // the view bump the spyre tensor's version as a view's would. The view is
  // never part of the autograd graph.
  std::optional<c10::InferenceMode> inference;
  if (tensor.is_inference()) {
    inference.emplace();
  }
  at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(std::move(host)), c10::DispatchKeySet(c10::DispatchKey::CPU), tensor.dtype());
  c10::TensorImpl* view_impl = view.unsafeGetTensorImpl();
  view_impl->set_sizes_and_strides(tensor.sizes(), tensor.strides(), tensor.storage_offset());
  if (!tensor.is_inference()) {
    view_impl->set_version_counter(tensor.unsafeGetTensorImpl()->version_counter());
  }
  if (tensor.is_conj()) {
    view_impl->_set_conj(true);
  }
  if (tensor.is_neg()) {
    view_impl->_set_neg(true);
  }
  return view;
}

}  // namespace

// A catch-all kernel (CompositeImplicitAutograd): it runs for any device, so a
// CPU argument gets host_view's own error instead of a dispatcher message, and
// autograd sees a fresh tensor (requires_grad=False), as for detach().
TORCH_LIBRARY_FRAGMENT(spyreccl_device, m) {
  m.def("host_view(Tensor tensor) -> Tensor", &host_view);
}

}  // namespace spyreccl::device
