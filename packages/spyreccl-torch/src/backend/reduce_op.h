// reduce_op.h — c10d::ReduceOp → spyrecclRedOp_t.
//
// Split in two phases because they run on different threads:
//  - checkReduceOp() on the calling thread, when the operation is enqueued: rejects
//    (op, dtype) pairs the core cannot do with a message naming the c10d operation;
//  - ScopedRedOp on the progress thread, right before the core call: PREMUL_SUM needs a
//    per-communicator handle (spyrecclRedOpCreatePreMulSum) and the core allows only one
//    thread at a time to use a communicator. A tensor factor is read there too, so that a
//    factor produced by an earlier queued operation is seen with its final value.
#pragma once

#include <string>

#include <ATen/core/Tensor.h>
#include <spyreccl/spyreccl.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace spyreccl_torch {

struct ReduceSpec {
  spyrecclRedOp_t op = spyrecclSum;  // the builtin op; spyrecclSum for PREMUL_SUM
  bool preMulSum = false;
  double factor = 1.0;      // PREMUL_SUM with a double factor
  at::Tensor factorTensor;  // PREMUL_SUM with a one-element tensor factor
  std::string name;         // "SUM", "PREMUL_SUM", ... for messages
};

ReduceSpec checkReduceOp(const c10d::ReduceOp& reduceOp, at::ScalarType dtype, const char* opName);

class ScopedRedOp {
 public:
  // `dtype` is the core element type the reduction runs on (for complex tensors their real
  // component type).
  ScopedRedOp(const ReduceSpec& spec, spyrecclDataType_t dtype, spyrecclComm_t comm,
              const char* opName);
  ~ScopedRedOp();
  ScopedRedOp(const ScopedRedOp&) = delete;
  ScopedRedOp& operator=(const ScopedRedOp&) = delete;

  spyrecclRedOp_t get() const { return op_; }

 private:
  spyrecclRedOp_t op_;
  spyrecclComm_t comm_;
  bool owned_ = false;
};

}  // namespace spyreccl_torch
