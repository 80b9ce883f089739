// tensor_translation.h — the ONE place where an at::Tensor becomes what the spyreccl C API
// moves: (pointer, element count, spyrecclDataType_t).
//
// Why this is isolated: with the emulated device in its default memory mode a spyre tensor's
// data_ptr() is plain host memory laid out densely, so translation is trivial. A device whose
// memory the host cannot address (device_caps.h: a real Spyre runtime, or the emulated device
// with SPYRECCL_SPYRE_MEMORY=discrete) is staged through pooled host buffers with the
// device's own copies (staging.h). Nothing else in the backend looks at data pointers,
// strides or storage offsets.
//
// Contract used by the rest of the backend:
//  - CommBuffer::input/output/inOut/snapshot run on the CALLING thread when an operation is
//    enqueued: they validate the dtype and decide whether the tensor can be handed to the
//    core as it is or must be staged through a dense temporary (non-contiguous tensors).
//  - prepare() runs on the progress thread right before the core call (so a staged input
//    is copied when the operations queued before it have completed); data()/count()/dtype()
//    are then what the core gets; commit() runs after the core wrote and copies a staged
//    result back into the caller's tensor.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <spyreccl/spyreccl.h>

namespace spyreccl_torch {

// What the operation does with the values: pure data movement (broadcast, gathers,
// all-to-all, point-to-point) can carry any dtype as raw bytes; reductions need a dtype the
// core can compute on.
enum class Usage { kDataMovement, kReduction };

// How one tensor element is expressed in core elements. Complex types travel as pairs of
// their real component type (units == 2); dtypes the core does not know (uint16, float8
// e8m0, ...) travel as bytes for data movement (units == itemsize). All counts handed to
// the core are numel * units.
struct ElementType {
  spyrecclDataType_t dtype;
  int64_t units;
};
// Throws a clear error naming `opName` and `argName` when the dtype cannot be used for
// `usage` (e.g. a reduction over uint16).
ElementType translateScalarType(at::ScalarType type, Usage usage, const char* opName,
                                const char* argName);

// Human readable dtype name used in error messages ("torch.float32").
std::string dtypeName(at::ScalarType type);

class CommBuffer {
 public:
  CommBuffer() = default;

  // The tensor is only read by the operation.
  static CommBuffer input(const at::Tensor& tensor, Usage usage, const char* opName,
                          const char* argName);
  // The tensor is only written (its old contents do not matter).
  static CommBuffer output(const at::Tensor& tensor, Usage usage, const char* opName,
                           const char* argName);
  // The tensor is read and written (in-place collectives).
  static CommBuffer inOut(const at::Tensor& tensor, Usage usage, const char* opName,
                          const char* argName);
  // Like input(), but always staged through a private copy: for inputs that alias an output
  // of the same call where the core does not allow in-place operation (all-to-all).
  static CommBuffer snapshot(const at::Tensor& tensor, Usage usage, const char* opName,
                             const char* argName);

  // Progress thread, before the core call: allocates/fills the staging copy if needed.
  void prepare();

  // Never null: a zero-element buffer gets a valid dummy address, because a count of 0 is
  // legal for every core call but null pointers are not everywhere.
  void* data() const;
  size_t count() const { return count_; }
  // Core elements per tensor element (see ElementType::units).
  int64_t units() const { return units_; }
  spyrecclDataType_t dtype() const { return dtype_; }
  // Element offset helper for flat buffers (e.g. block r of an allgather output).
  void* dataAtElement(size_t elementOffset) const;

  // The user's tensor.
  const at::Tensor& userTensor() const { return user_; }

  // Copies staged results back into the user's tensor. Call after the core wrote.
  void commit() const;

  // The tensor's device memory is not host-addressable: the core works on a host copy.
  bool hostStaged() const { return hostStaged_; }
  // A step that runs as a chunk pipeline (staging.h) marks all its buffers: prepare() and
  // commit() then do nothing, the pipeline moves the data chunk by chunk.
  void markPipelined() { pipelined_ = true; }
  bool pipelined() const { return pipelined_; }
  size_t bytes() const { return count_ * elementBytes_; }

 private:
  static CommBuffer make(const at::Tensor& tensor, Usage usage, const char* opName,
                         const char* argName, bool copyIn, bool copyOut, bool forceStage);

  at::Tensor user_;
  at::Tensor comm_;  // what the core addresses: user_ itself or the staging copy
  bool stage_ = false;
  bool hostStaged_ = false;
  bool pipelined_ = false;
  bool copyIn_ = false;
  bool copyOut_ = false;
  size_t count_ = 0;
  size_t elementBytes_ = 0;  // bytes of one core element
  int64_t units_ = 1;
  spyrecclDataType_t dtype_ = spyrecclUint8;
};

// A dense, freshly allocated buffer on the same device and dtype as `like`, holding
// `numel` values; used to flatten lists of tensors (allgather into a list, gather, scatter,
// alltoall with lists) into the single contiguous buffer the core expects.
at::Tensor allocateFlat(const at::Tensor& like, int64_t numel);

// Copies tensors[i] (in order) into consecutive regions of `flat` and the reverse.
void packInto(const at::Tensor& flat, const std::vector<at::Tensor>& tensors);
void unpackFrom(const at::Tensor& flat, const std::vector<at::Tensor>& tensors);

}  // namespace spyreccl_torch
