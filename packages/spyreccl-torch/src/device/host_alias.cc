#include "host_alias.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "allocator.h"
#include "device_memory.h"
#include "device_state.h"

namespace spyreccl::device {
namespace {

void copy_bits(const at::Tensor& from, at::Tensor& to) {
  if (from.is_conj()) {
    to._set_conj(true);
  }
  if (from.is_neg()) {
    to._set_neg(true);
  }
}

bool same_geometry(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.storage_offset() == b.storage_offset();
}

}  // namespace

at::Tensor make_spyre_tensor(c10::Storage storage, const at::Tensor& like) {
  // The plain constructor (not TensorImpl::VIEW) adds the autograd keys, or
  // leaves them out under InferenceMode, exactly as for any fresh tensor;
  // autograd's view tracking above this layer handles views.
  at::Tensor result = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), like.dtype());
  result.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                      like.storage_offset());
  copy_bits(like, result);
  return result;
}

HostAliasScope::HostAliasScope(const char* op, c10::Device device, bool adopt_results)
    : op_(op), device_(device), adopt_results_(adopt_results) {
  TORCH_INTERNAL_ASSERT(device.type() == kSpyreDeviceType && device.has_index());
}

const c10::Storage& HostAliasScope::host_storage_for(const c10::Storage& spyre) {
  for (const LentStorage& lent : storages_) {
    if (lent.spyre.is_alias_of(spyre)) {
      return lent.host;
    }
  }
  c10::StorageImpl* impl = spyre.unsafeGetStorageImpl();
  // mutable_data_ptr() materialises copy-on-write storages, so that writes
  // through the alias cannot reach a lazily cloned sibling. The CPU kernel
  // works through the memory's host address (its accessible twin in discrete
  // mode, device_memory.h).
  void* data = host_address(impl->mutable_data_ptr().get());
  const size_t nbytes = impl->nbytes();
  // The borrowed DataPtr owns nothing; the spyre storage keeps the memory
  // alive for the whole call. Growth goes through the alias growth allocator
  // (spyre memory labelled CPU) so commit() can hand the block over as is.
  auto host = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                    c10::DataPtr(data, c10::Device(c10::kCPU)),
                                                    alias_growth_allocator(), impl->resizable());
  storages_.push_back(LentStorage{spyre, c10::Storage(std::move(host)), data, nbytes});
  return storages_.back().host;
}

at::Tensor HostAliasScope::lend(const at::Tensor& spyre) {
  return lend_impl(spyre, /*borrow=*/false);
}

at::Tensor HostAliasScope::lend_borrowed(const at::Tensor& spyre) {
  return lend_impl(spyre, /*borrow=*/true);
}

at::Tensor HostAliasScope::lend_impl(const at::Tensor& spyre, bool borrow) {
  TORCH_INTERNAL_ASSERT(spyre.defined() && spyre.device().type() == kSpyreDeviceType);
  const c10::TensorImpl* spyre_impl = spyre.unsafeGetTensorImpl();
  for (const LentTensor& lent : tensors_) {
    if (lent.spyre_impl == spyre_impl) {
      return lent.host_tensor;
    }
  }
  TORCH_CHECK(spyre.has_storage(), op_, ": spyre tensor without storage (layout ", spyre.layout(),
              ") cannot be lent to a CPU kernel");
  at::Tensor host = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(host_storage_for(spyre.storage())), c10::DispatchKeySet(c10::DispatchKey::CPU),
      spyre.dtype());
  host.unsafeGetTensorImpl()->set_sizes_and_strides(spyre.sizes(), spyre.strides(),
                                                    spyre.storage_offset());
  copy_bits(spyre, host);
  tensors_.push_back(LentTensor{host.unsafeGetTensorImpl(), spyre_impl,
                                borrow ? c10::MaybeOwned<at::Tensor>::borrowed(spyre)
                                       : c10::MaybeOwned<at::Tensor>::owned(std::in_place, spyre),
                                host});
  return host;
}

at::Tensor HostAliasScope::lend_argument(const at::Tensor& t, bool borrow) {
  if (is_spyre(t)) {
    return lend_impl(t, borrow);
  }
  if (t.defined()) {
    note_cpu_input(t);
  }
  return t;
}

void HostAliasScope::note_cpu_input(const at::Tensor& cpu) {
  if (cpu.has_storage()) {
    cpu_inputs_.push_back(cpu.storage().unsafeGetStorageImpl());
  }
}

void HostAliasScope::commit() {
  for (LentStorage& lent : storages_) {
    c10::StorageImpl* host = lent.host.unsafeGetStorageImpl();
    c10::StorageImpl* spyre = lent.spyre.unsafeGetStorageImpl();
    const void* now = host->data_ptr().get();
    if (now == lent.data && host->nbytes() == lent.nbytes) {
      continue;
    }
    if (now != lent.data) {
      // The kernel resized the alias, which allocated a new block. Leave the
      // alias borrowing it and give the spyre storage the ownership; the old
      // block is released by the spyre storage.
      c10::DataPtr owned =
          host->set_data_ptr(c10::DataPtr(const_cast<void*>(now), c10::Device(c10::kCPU)));
      adopt(owned, host->nbytes(), spyre->device());
      spyre->set_data_ptr_noswap(std::move(owned));
    }
    spyre->set_nbytes(host->nbytes());
    lent.data = now;
    lent.nbytes = host->nbytes();
  }
}

const HostAliasScope::LentStorage* HostAliasScope::find_by_host(
    const c10::StorageImpl* host) const {
  for (const LentStorage& lent : storages_) {
    if (lent.host.unsafeGetStorageImpl() == host) {
      return &lent;
    }
  }
  return nullptr;
}

c10::Storage HostAliasScope::adopt_storage(const c10::Storage& host) {
  c10::StorageImpl* impl = host.unsafeGetStorageImpl();
  if (std::find(adopted_.begin(), adopted_.end(), impl) == adopted_.end()) {
    // Fresh memory the CPU kernel allocated for its result: nobody else holds
    // it, so relabelling it as spyre memory is a move, not a copy (adopt()
    // also counts it in the spyre memory statistics). The spyre allocator
    // serves any later growth.
    c10::DataPtr data = impl->set_data_ptr(c10::DataPtr());
    adopt(data, impl->nbytes(), device_);
    impl->set_data_ptr_noswap(std::move(data));
    if (impl->allocator() != nullptr) {
      impl->set_allocator(host_allocator());
    }
    adopted_.push_back(impl);
  }
  return host;
}

void HostAliasScope::write_back(const at::Tensor& spyre, const at::Tensor& host) {
  c10::TensorImpl* spyre_impl = spyre.unsafeGetTensorImpl();
  const c10::StorageImpl* host_storage =
      host.has_storage() ? host.storage().unsafeGetStorageImpl() : nullptr;
  const LentStorage* lent = host_storage != nullptr ? find_by_host(host_storage) : nullptr;
  if (lent == nullptr || !lent->spyre.is_alias_of(spyre.storage())) {
    // The kernel re-pointed the tensor (set_-style) at another storage.
    TORCH_CHECK(host_storage != nullptr, op_, ": kernel left a lent tensor without storage");
    const bool foreign = lent == nullptr && std::find(cpu_inputs_.begin(), cpu_inputs_.end(),
                                                      host_storage) != cpu_inputs_.end();
    TORCH_CHECK(!foreign, op_,
                ": the CPU kernel pointed a spyre tensor at the memory of a CPU tensor; "
                "this cannot be expressed without copying");
    spyre_impl->set_storage_keep_dtype(lent != nullptr ? lent->spyre
                                                       : adopt_storage(host.storage()));
  }
  if (!same_geometry(spyre, host)) {
    spyre_impl->set_sizes_and_strides(host.sizes(), host.strides(), host.storage_offset());
  }
  if (spyre.is_conj() != host.is_conj()) {
    spyre_impl->_set_conj(host.is_conj());
  }
  if (spyre.is_neg() != host.is_neg()) {
    spyre_impl->_set_neg(host.is_neg());
  }
}

void HostAliasScope::write_back_lent() {
  for (const LentTensor& lent : tensors_) {
    write_back(*lent.spyre, lent.host_tensor);
  }
}

at::Tensor HostAliasScope::to_spyre(const at::Tensor& host) {
  if (!host.defined() || host.device().type() != c10::kCPU) {
    return host;
  }
  const c10::TensorImpl* host_impl = host.unsafeGetTensorImpl();
  for (const LentTensor& lent : tensors_) {
    if (lent.host == host_impl) {
      // In-place and out= kernels return their argument: hand back the very
      // same spyre tensor, which autograd and Python expect.
      return *lent.spyre;
    }
  }
  TORCH_CHECK(host.has_storage(), op_, ": CPU kernel returned a tensor without storage (layout ",
              host.layout(), "), which the spyre device cannot represent");
  if (const LentStorage* lent = find_by_host(host.storage().unsafeGetStorageImpl())) {
    return make_spyre_tensor(lent->spyre, host);
  }
  if (!adopt_results_) {
    return host;
  }
  const c10::StorageImpl* storage = host.storage().unsafeGetStorageImpl();
  if (std::find(cpu_inputs_.begin(), cpu_inputs_.end(), storage) != cpu_inputs_.end()) {
    // A view of a CPU input: adopting it would steal the caller's CPU memory.
    at::Tensor fresh = host.clone(at::MemoryFormat::Preserve);
    return make_spyre_tensor(adopt_storage(fresh.storage()), fresh);
  }
  return make_spyre_tensor(adopt_storage(host.storage()), host);
}

}  // namespace spyreccl::device
