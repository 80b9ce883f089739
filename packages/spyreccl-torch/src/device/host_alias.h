// Zero-copy lending of spyre tensors to CPU kernels.
//
// Spyre storages are host memory, so a CPU kernel can work on them in place
// (through their host_address(), device_memory.h, in discrete memory mode).
// A HostAliasScope lives for one operator call and
//   * lends each spyre tensor as a CPU tensor over a CPU storage that borrows
//     the spyre memory (one alias storage per spyre storage, so aliasing
//     between arguments is preserved and overlap checks still work);
//   * the alias storages are resizable through the spyre allocator, so out=
//     kernels may grow them; commit() then moves the new memory into the spyre
//     storage, which every view of it observes;
//   * writes back size/stride/offset/storage changes that in-place kernels made
//     to the lent tensors;
//   * maps CPU results back to spyre without copying: the lent tensor itself
//     becomes the original spyre tensor, a view of a lent storage becomes the
//     same view of the spyre storage, and fresh CPU memory is adopted by
//     relabelling its storage as spyre memory.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <c10/util/MaybeOwned.h>
#include <c10/util/SmallVector.h>

#include <optional>

#include "device_state.h"

namespace spyreccl::device {

// Whether `t` is a (defined) spyre tensor: what the lending paths ask of every argument.
inline bool is_spyre(const at::Tensor& t) {
  return t.defined() && t.device().type() == kSpyreDeviceType;
}

class HostAliasScope {
 public:
  // `op` names the operator in error messages; `device` is the spyre device
  // that fresh results are adopted onto.
  // Fresh results stay on the CPU when `adopt_results` is false (the op was
  // asked for results on another device).
  HostAliasScope(const char* op, c10::Device device, bool adopt_results = true);
  HostAliasScope(const HostAliasScope&) = delete;
  HostAliasScope& operator=(const HostAliasScope&) = delete;

  // CPU tensor sharing `spyre`'s memory, geometry and conj/neg bits.
  at::Tensor lend(const at::Tensor& spyre);

  // lend() for a caller that keeps `spyre` alive until the scope ends (an unboxed kernel's
  // argument): the scope borrows it instead of holding a reference of its own. Taking a
  // reference to a tensor that only Python holds increfs its Python object under the GIL.
  at::Tensor lend_borrowed(const at::Tensor& spyre);

  // Records a CPU tensor passed to the op, so that a result sharing its memory
  // is copied instead of being taken over.
  void note_cpu_input(const at::Tensor& cpu);

  // One tensor argument of the op, as CPU's kernel takes it: a spyre tensor lent (lend(), or
  // lend_borrowed() with `borrow`), a CPU tensor noted (note_cpu_input) and passed as is, an
  // undefined one passed as is. What the boxed fallback and the unboxed kernels share.
  at::Tensor lend_argument(const at::Tensor& t, bool borrow = false);

  // After the CPU kernel: moves memory that kernels reallocated into the
  // spyre storages. Call once, before write_back/to_spyre.
  void commit();

  // Reflects metadata changes of the lent tensor `host` onto `spyre`.
  void write_back(const at::Tensor& spyre, const at::Tensor& host);

  // write_back() for every tensor lend() lent so far (in the order they were first lent).
  void write_back_lent();

  // Spyre tensor for a CPU result of the kernel (see the file comment).
  at::Tensor to_spyre(const at::Tensor& host);

 private:
  struct LentStorage {
    c10::Storage spyre;
    c10::Storage host;
    const void* data;  // memory the host alias borrowed last
    size_t nbytes;
  };
  struct LentTensor {
    const c10::TensorImpl* host;
    const c10::TensorImpl* spyre_impl;
    c10::MaybeOwned<at::Tensor> spyre;
    at::Tensor host_tensor;
  };

  at::Tensor lend_impl(const at::Tensor& spyre, bool borrow);

  const c10::Storage& host_storage_for(const c10::Storage& spyre);
  const LentStorage* find_by_host(const c10::StorageImpl* host) const;
  c10::Storage adopt_storage(const c10::Storage& host);

  // A scope lives for one operator call, and almost every operator takes a handful of
  // tensors: inline capacity for that many keeps the bookkeeping off the heap (each
  // std::vector growth was a malloc/free pair per call, a measurable part of the emulated
  // device's per-op overhead next to CPU's). Larger calls (cat of many tensors) spill to
  // the heap as before.
  static constexpr unsigned kInline = 4;

  const char* op_;
  c10::Device device_;
  bool adopt_results_;
  c10::SmallVector<LentStorage, kInline> storages_;
  c10::SmallVector<LentTensor, kInline> tensors_;
  c10::SmallVector<const c10::StorageImpl*, kInline> cpu_inputs_;
  c10::SmallVector<c10::StorageImpl*, kInline> adopted_;
};

// A spyre tensor over `storage` with the dtype, geometry and conj/neg bits of
// `like`.
at::Tensor make_spyre_tensor(c10::Storage storage, const at::Tensor& like);

}  // namespace spyreccl::device
