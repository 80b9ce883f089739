// functional_autograd.cpp — C++ autograd kernels of the hot functional collectives for spyre
// tensors.
//
// Why: torch registers the autograd of `_c10d_functional::wait_tensor`, `all_reduce` and the
// other functional collectives from Python (torch.library.register_autograd in
// torch/distributed/_functional_collectives.py). Every call of these ops therefore enters the
// interpreter at the Autograd key, on every device and even when no gradient is needed: about
// 3 us per op, as much as a whole small all_reduce through spyreccl. DTensor, FSDP2 and every
// compiled graph call wait_tensor after each collective, and DTensor's Partial -> Replicate is
// all_reduce + wait_tensor. A kernel registered for AutogradPrivateUse1 takes precedence over
// the Autograd alias key for spyre tensors, so these two get C++ kernels with torch's
// semantics:
//  - wait_tensor: the gradient is the identity and the op returns its input tensor itself, so
//    the output already carries the input's autograd history: dispatching below autograd is
//    all there is to do.
//  - all_reduce: below autograd when no gradient is needed; otherwise an autograd node whose
//    backward, like torch's, all-reduces the gradient with "sum" (and, like torch's, refuses
//    any other reduction when backward runs).
// The other functional collectives keep torch's Python autograd (their calls are rarer).
#include <cctype>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace spyreccl_torch {
namespace {

c10::OperatorHandle functionalOp(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Calls `op` boxed below the autograd keys (for ops whose arguments include `Any`).
std::vector<c10::IValue> callBelowAutograd(const c10::OperatorHandle& op,
                                           std::vector<c10::IValue> stack) {
  at::AutoDispatchBelowADInplaceOrView guard;
  op.callBoxed(stack);
  return stack;
}

void waitTensorAutograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                        torch::jit::Stack* stack) {
  at::AutoDispatchBelowADInplaceOrView guard;
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

at::Tensor waitTensor(const at::Tensor& tensor) {
  static const c10::OperatorHandle op = functionalOp("_c10d_functional::wait_tensor");
  return callBelowAutograd(op, {tensor}).at(0).toTensor();
}

// The reduce_op argument as a name: from torch 2.15 on it may be a ReduceOp object.
std::string reduceOpName(const c10::IValue& reduceOp) {
  if (reduceOp.isString()) return reduceOp.toStringRef();
  c10::intrusive_ptr<c10d::ReduceOp> op;
  if (reduceOp.isObject()) {
    op = reduceOp.toCustomClass<c10d::ReduceOp>();
  } else if (reduceOp.isCapsule()) {
    op = c10::dynamic_intrusive_pointer_cast<c10d::ReduceOp>(reduceOp.toCapsule());
  }
  TORCH_CHECK(op, "spyreccl: all_reduce's argument 'reduce_op' must be a name (str) or a ",
              "ReduceOp, got ", reduceOp.tagKind());
  using Type = c10d::ReduceOp::RedOpType;
  switch (op->op_) {
    case Type::SUM:
      return "sum";
    case Type::AVG:
      return "avg";
    case Type::PRODUCT:
      return "product";
    case Type::MIN:
      return "min";
    case Type::MAX:
      return "max";
    case Type::BAND:
      return "band";
    case Type::BOR:
      return "bor";
    case Type::BXOR:
      return "bxor";
    default:
      return "premul_sum";
  }
}

class AllReduceFunction : public torch::autograd::Function<AllReduceFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const std::string& reduceOp, const c10::IValue& group) {
    std::string lowered = reduceOp;
    for (char& c : lowered) {
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    ctx->saved_data["reduce_op"] = lowered;
    ctx->saved_data["group"] = group;
    return allReduce(input, reduceOp, group);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::string reduceOp = ctx->saved_data["reduce_op"].toStringRef();
    TORCH_CHECK(reduceOp == "sum", "all_reduce backward only supports 'sum' reduction, got '",
                reduceOp, "'");
    at::Tensor grad =
        waitTensor(allReduce(grads.at(0).contiguous(), "sum", ctx->saved_data["group"]));
    return {grad, at::Tensor(), at::Tensor()};
  }

  // The out-of-place op below autograd: a new tensor with a collective in flight.
  static at::Tensor allReduce(const at::Tensor& input, const std::string& reduceOp,
                              const c10::IValue& group) {
    static const c10::OperatorHandle op = functionalOp("_c10d_functional::all_reduce");
    return callBelowAutograd(op, {input, reduceOp, group}).at(0).toTensor();
  }
};

void allReduceAutograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                       torch::jit::Stack* stack) {
  // Schema: all_reduce(Tensor input, str reduce_op, Any group_name) -> Tensor
  const at::Tensor& input = torch::jit::peek(*stack, 0, 3).toTensor();
  if (!(at::GradMode::is_enabled() && input.requires_grad())) {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
    return;
  }
  auto args = torch::jit::pop(*stack, 3);
  at::Tensor output = AllReduceFunction::apply(args[0].toTensor(), reduceOpName(args[1]), args[2]);
  torch::jit::push(*stack, std::move(output));
}

}  // namespace
}  // namespace spyreccl_torch

TORCH_LIBRARY_IMPL(_c10d_functional, AutogradPrivateUse1, m) {
  m.impl("wait_tensor",
         torch::CppFunction::makeFromBoxedFunction<&spyreccl_torch::waitTensorAutograd>());
  m.impl("all_reduce",
         torch::CppFunction::makeFromBoxedFunction<&spyreccl_torch::allReduceAutograd>());
}
