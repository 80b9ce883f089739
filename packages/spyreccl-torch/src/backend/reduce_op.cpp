// reduce_op.cpp — see reduce_op.h.
#include "backend/reduce_op.h"

#include <c10/util/Exception.h>

#include "backend/errors.h"
#include "backend/tensor_translation.h"
#include "backend/torch_compat.h"

namespace spyreccl_torch {
namespace {

const char* reduceOpName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return "UNUSED";
  }
}

}  // namespace

ReduceSpec checkReduceOp(const c10d::ReduceOp& reduceOp, at::ScalarType dtype, const char* opName) {
  ReduceSpec spec;
  spec.name = reduceOpName(reduceOp.op_);
  const bool isBool = dtype == at::kBool;
  const bool isComplex = at::isComplexType(dtype);
  const bool isFloating = at::isFloatingType(dtype);
  const bool isInteger = !isBool && !isComplex && !isFloating;
  auto reject = [&](const char* expected) {
    TORCH_CHECK(false, "spyreccl ", opName, ": ReduceOp.", spec.name,
                " is not supported for dtype ", dtypeName(dtype), "; ", expected);
  };

  switch (reduceOp.op_) {
    case c10d::ReduceOp::SUM:
      spec.op = spyrecclSum;
      break;
    case c10d::ReduceOp::PRODUCT:
      spec.op = spyrecclProd;
      break;
    case c10d::ReduceOp::MIN:
      spec.op = spyrecclMin;
      break;
    case c10d::ReduceOp::MAX:
      spec.op = spyrecclMax;
      break;
    case c10d::ReduceOp::AVG:
      spec.op = spyrecclAvg;
      break;
    case c10d::ReduceOp::BAND:
      spec.op = spyrecclBand;
      break;
    case c10d::ReduceOp::BOR:
      spec.op = spyrecclBor;
      break;
    case c10d::ReduceOp::BXOR:
      spec.op = spyrecclBxor;
      break;
    case c10d::ReduceOp::PREMUL_SUM:
      spec.preMulSum = true;
      break;
    default:
      TORCH_CHECK(false, "spyreccl ", opName, ": unknown reduce op (value ",
                  static_cast<int>(reduceOp.op_), ")");
  }

  switch (reduceOp.op_) {
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      if (isComplex) {
        reject("complex tensors support SUM, AVG and PREMUL_SUM only");
      }
      break;
    case c10d::ReduceOp::AVG:
      if (isBool) {
        reject("an average of booleans is not defined; use SUM (logical or) or MIN/MAX");
      }
      break;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      if (!isInteger && !isBool) {
        reject("bitwise reductions need an integer or bool dtype");
      }
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      if (!isFloating && !isComplex) {
        reject("PREMUL_SUM needs a floating-point (or complex) dtype");
      }
      auto* supplement = dynamic_cast<compat::PreMulSumSupplement*>(reduceOp.supplement_.get());
      TORCH_CHECK(supplement != nullptr, "spyreccl ", opName,
                  ": ReduceOp.PREMUL_SUM carries no factor; create it with "
                  "torch.distributed._make_nccl_premul_sum(factor)");
      if (supplement->tensor_factor.defined()) {
        const at::Tensor& factor = supplement->tensor_factor;
        TORCH_CHECK(factor.numel() == 1, "spyreccl ", opName,
                    ": the PREMUL_SUM factor tensor must hold exactly one element, got ",
                    factor.numel());
        TORCH_CHECK(!at::isComplexType(factor.scalar_type()), "spyreccl ", opName,
                    ": a complex PREMUL_SUM factor is not supported (got dtype ",
                    dtypeName(factor.scalar_type()), "); use a real factor");
        spec.factorTensor = factor;
      } else {
        spec.factor = supplement->double_factor;
      }
      break;
    }
    default:
      break;
  }
  return spec;
}

ScopedRedOp::ScopedRedOp(const ReduceSpec& spec, spyrecclDataType_t dtype, spyrecclComm_t comm,
                         const char* opName)
    : op_(spec.op), comm_(comm) {
  if (!spec.preMulSum) {
    return;
  }
  const double factor =
      spec.factorTensor.defined() ? spec.factorTensor.item<double>() : spec.factor;
  checkCore(spyrecclRedOpCreatePreMulSum(&op_, factor, dtype, comm), comm,
            std::string(opName) + " (creating the PREMUL_SUM reduction)");
  owned_ = true;
}

ScopedRedOp::~ScopedRedOp() {
  if (owned_) {
    // Only fails for an unknown handle, which cannot happen here; nothing to report from a
    // destructor anyway.
    (void)spyrecclRedOpDestroy(op_, comm_);
  }
}

}  // namespace spyreccl_torch
