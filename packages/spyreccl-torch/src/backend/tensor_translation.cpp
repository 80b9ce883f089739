// tensor_translation.cpp — see tensor_translation.h for why this file is the single seam
// between torch tensors and the buffers of the spyreccl C API.
#include "backend/tensor_translation.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include "backend/device_caps.h"
#include "backend/staging.h"

namespace spyreccl_torch {
namespace {

// Target of data() for zero-element buffers; never read or written by the core.
alignas(64) unsigned char gEmptyBufferAnchor[64];

bool nativeType(at::ScalarType type, spyrecclDataType_t* out) {
  switch (type) {
    case at::kChar:
      *out = spyrecclInt8;
      return true;
    case at::kByte:
      *out = spyrecclUint8;
      return true;
    case at::kShort:
      *out = spyrecclInt16;
      return true;
    case at::kInt:
      *out = spyrecclInt32;
      return true;
    case at::kUInt32:
      *out = spyrecclUint32;
      return true;
    case at::kLong:
      *out = spyrecclInt64;
      return true;
    case at::kUInt64:
      *out = spyrecclUint64;
      return true;
    case at::kHalf:
      *out = spyrecclFloat16;
      return true;
    case at::kBFloat16:
      *out = spyrecclBfloat16;
      return true;
    case at::kFloat:
      *out = spyrecclFloat32;
      return true;
    case at::kDouble:
      *out = spyrecclFloat64;
      return true;
    case at::kFloat8_e4m3fn:
      *out = spyrecclFloat8e4m3;
      return true;
    case at::kFloat8_e5m2:
      *out = spyrecclFloat8e5m2;
      return true;
    case at::kBool:
      *out = spyrecclBool;
      return true;
    default:
      return false;
  }
}

}  // namespace

std::string dtypeName(at::ScalarType type) {
  // c10's names are the C++ ones ("Float"); users know the Python spelling.
  return std::string("torch.") + std::string(c10::getDtypeNames(type).first);
}

ElementType translateScalarType(at::ScalarType type, Usage usage, const char* opName,
                                const char* argName) {
  spyrecclDataType_t dtype;
  if (nativeType(type, &dtype)) {
    return {dtype, 1};
  }
  if (at::isComplexType(type)) {
    // (real, imag) pairs of the component type: exact for data movement and for the
    // element-wise SUM/AVG/PREMUL_SUM(real factor) that reduce_op.cpp lets through.
    nativeType(c10::toRealValueType(type), &dtype);
    return {dtype, 2};
  }
  TORCH_CHECK(usage == Usage::kDataMovement, "spyreccl ", opName, ": argument '", argName,
              "' has dtype ", dtypeName(type),
              ", which spyreccl cannot reduce; supported for reductions: int8, uint8, int16, "
              "int32, uint32, int64, uint64, bool, float16, bfloat16, float32, float64, "
              "float8_e4m3fn, float8_e5m2 and complex types (SUM/AVG/PREMUL_SUM)");
  TORCH_CHECK(!c10::isQIntType(type), "spyreccl ", opName, ": argument '", argName,
              "' has quantized dtype ", dtypeName(type), ", which spyreccl does not support");
  // Anything else with a fixed element size (uint16, float8 e8m0, bits types, ...) is
  // moved bit-exactly as bytes.
  return {spyrecclUint8, static_cast<int64_t>(c10::elementSize(type))};
}

CommBuffer CommBuffer::make(const at::Tensor& tensor, Usage usage, const char* opName,
                            const char* argName, bool copyIn, bool copyOut, bool forceStage) {
  TORCH_CHECK(!tensor.is_sparse(), "spyreccl ", opName, ": argument '", argName,
              "' is a sparse tensor; spyreccl supports dense (strided) tensors only");
  const ElementType element = translateScalarType(tensor.scalar_type(), usage, opName, argName);
  // Checked here, before communicating: otherwise only the final copy into the user's
  // tensor would fail, after the peers already took part in the operation.
  TORCH_CHECK(!copyOut || at::has_internal_overlap(tensor) != at::MemOverlap::Yes, "spyreccl ",
              opName, ": argument '", argName,
              "' has internally overlapping memory (e.g. a result of expand()); a tensor the "
              "operation writes needs one memory location per element");
  CommBuffer buffer;
  buffer.user_ = tensor;
  buffer.units_ = element.units;
  buffer.dtype_ = element.dtype;
  buffer.elementBytes_ = static_cast<size_t>(tensor.element_size() / element.units);
  buffer.count_ = static_cast<size_t>(tensor.numel() * element.units);
  // The core addresses a buffer as one dense run of elements. Views with a storage offset
  // (a prefix or slice of a larger tensor) are fine as they are: data_ptr() already
  // includes the offset. Anything strided is staged through a dense copy on the device.
  // Memory the host cannot address is staged through a host buffer, whatever its layout.
  buffer.hostStaged_ = !hostAddressable(tensor.device().type());
  buffer.stage_ = forceStage || buffer.hostStaged_ || !tensor.is_contiguous();
  buffer.copyIn_ = copyIn;
  buffer.copyOut_ = copyOut;
  if (!buffer.stage_) {
    buffer.comm_ = tensor;
  }
  return buffer;
}

CommBuffer CommBuffer::input(const at::Tensor& tensor, Usage usage, const char* opName,
                             const char* argName) {
  return make(tensor, usage, opName, argName, /*copyIn=*/true, /*copyOut=*/false, false);
}

CommBuffer CommBuffer::output(const at::Tensor& tensor, Usage usage, const char* opName,
                              const char* argName) {
  return make(tensor, usage, opName, argName, /*copyIn=*/false, /*copyOut=*/true, false);
}

CommBuffer CommBuffer::inOut(const at::Tensor& tensor, Usage usage, const char* opName,
                             const char* argName) {
  return make(tensor, usage, opName, argName, /*copyIn=*/true, /*copyOut=*/true, false);
}

CommBuffer CommBuffer::snapshot(const at::Tensor& tensor, Usage usage, const char* opName,
                                const char* argName) {
  return make(tensor, usage, opName, argName, /*copyIn=*/true, /*copyOut=*/false, true);
}

void CommBuffer::prepare() {
  if (!stage_ || pipelined_) {
    return;
  }
  if (hostStaged_) {
    if (count_ == 0) {
      return;  // data() is the anchor and nothing is copied: no host buffer needed
    }
    // The shortest route: one device -> host copy (the device's own copy_, DMA on real
    // cards) into a pooled host buffer, whatever the tensor's layout.
    comm_ = acquireHostBuffer(user_.sizes(), user_.scalar_type());
    countStagedBuffer();
  } else {
    comm_ = at::empty(user_.sizes(), user_.options().memory_format(at::MemoryFormat::Contiguous));
  }
  if (copyIn_ && count_ > 0) {
    comm_.copy_(user_);
    if (hostStaged_) {
      countCopy(/*toHost=*/true, bytes());
    }
  }
}

void* CommBuffer::data() const {
  if (count_ == 0 || !comm_.defined()) {
    return gEmptyBufferAnchor;
  }
  // Host memory (a CPU tensor, the emulated device in host mode, or a host staging buffer):
  // the data pointer (storage base + storage offset) is exactly what the core reads and
  // writes. make() staged every tensor whose memory the host cannot address.
  return comm_.data_ptr();
}

void* CommBuffer::dataAtElement(size_t elementOffset) const {
  return static_cast<unsigned char*>(data()) + elementOffset * elementBytes_;
}

void CommBuffer::commit() const {
  if (stage_ && !pipelined_ && copyOut_ && count_ > 0) {
    user_.copy_(comm_);
    if (hostStaged_) {
      countCopy(/*toHost=*/false, bytes());
    }
  }
}

at::Tensor allocateFlat(const at::Tensor& like, int64_t numel) {
  return at::empty({numel}, like.options().memory_format(at::MemoryFormat::Contiguous));
}

void packInto(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& tensor : tensors) {
    const int64_t numel = tensor.numel();
    if (numel > 0) {
      flat.narrow(0, offset, numel).view(tensor.sizes()).copy_(tensor);
    }
    offset += numel;
  }
}

void unpackFrom(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& tensor : tensors) {
    const int64_t numel = tensor.numel();
    if (numel > 0) {
      // `tensor` may alias the user's list entry directly: copy_ writes through views.
      tensor.copy_(flat.narrow(0, offset, numel).view(tensor.sizes()));
    }
    offset += numel;
  }
}

}  // namespace spyreccl_torch
