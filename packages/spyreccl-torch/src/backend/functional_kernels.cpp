// functional_kernels.cpp — the `_c10d_functional` collectives for spyre tensors.
//
// torch registers these ops once, for CompositeExplicitAutograd (Functional.cpp), and they
// call the process group with default options, i.e. as asynchronous operations. A kernel
// registered for PrivateUse1 takes precedence for spyre tensors. Ours run torch's own
// implementations (the c10d:: functions of Functional.hpp, so allocation, group resolution
// and the work registry stay torch's) inside a FunctionalCallScope, which tells
// ProcessGroupSpyreccl that the call came from a functional collective. Those, unlike
// dist.*(async_op=True), have no Work a caller could wait on with a timeout of its own, only
// wait_tensor, so a small one may run on the calling thread (the inline path, bounded by
// SPYRECCL_INLINE_FUNCTIONAL_MAX_BYTES) instead of paying for two thread hand-offs; large
// ones still run on the progress thread and overlap with computation placed before their
// wait_tensor.
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/Functional.hpp>

#include "backend/functional_scope.h"

namespace spyreccl_torch {

namespace {
thread_local bool functionalCallActive = false;
}  // namespace

FunctionalCallScope::FunctionalCallScope() : previous_(functionalCallActive) {
  functionalCallActive = true;
}

FunctionalCallScope::~FunctionalCallScope() { functionalCallActive = previous_; }

bool inFunctionalCall() { return functionalCallActive; }

namespace {

using torch::jit::Stack;

// The ops' `Any group_name`: a group name (str) or a ProcessGroup, which reaches C++ as a
// script object or, from Python, as a capsule. torch's c10d:: functions have an overload
// for a name and one for a group.
c10::intrusive_ptr<c10d::ProcessGroup> processGroup(const c10::IValue& group) {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  if (group.isObject()) {
    pg = group.toCustomClass<c10d::ProcessGroup>();
  } else if (group.isCapsule()) {
    pg = c10::dynamic_intrusive_pointer_cast<c10d::ProcessGroup>(group.toCapsule());
  }
  TORCH_CHECK(pg,
              "spyreccl: a _c10d_functional collective's argument 'group_name' must be a "
              "group name (str) or a ProcessGroup, got ",
              group.tagKind());
  return pg;
}

template <typename Fn>
auto withGroup(const c10::IValue& group, Fn&& fn) {
  if (group.isString()) {
    return fn(std::string(group.toStringRef()));
  }
  return fn(processGroup(group));
}

std::vector<at::Tensor> tensors(const c10::IValue& value) { return value.toTensorVector(); }

// all_reduce(Tensor input, str reduce_op, Any group_name) -> Tensor
void allReduce(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  auto out = withGroup(a[2], [&](auto group) {
    return c10d::all_reduce(a[0].toTensor(), a[1].toStringRef(), std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// all_reduce_(Tensor(a!) input, str reduce_op, Any group_name) -> Tensor(a!)
void allReduceInplace(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  at::Tensor input = a[0].toTensor();
  withGroup(a[2], [&](auto group) -> at::Tensor& {
    return c10d::all_reduce_(input, a[1].toStringRef(), std::move(group));
  });
  torch::jit::push(*stack, std::move(input));
}

// all_reduce_coalesced(Tensor[] inputs, str reduce_op, Any group_name) -> Tensor[]
void allReduceCoalesced(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  auto out = withGroup(a[2], [&](auto group) {
    return c10d::all_reduce_coalesced(tensors(a[0]), a[1].toStringRef(), std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// all_reduce_coalesced_(Tensor[](a!) inputs, str reduce_op, Any group_name) -> Tensor[](a!)
void allReduceCoalescedInplace(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  auto out = withGroup(a[2], [&](auto group) {
    return c10d::all_reduce_coalesced_(tensors(a[0]), a[1].toStringRef(), std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// all_gather_into_tensor(Tensor input, int group_size, Any group_name) -> Tensor
void allGatherIntoTensor(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  auto out = withGroup(a[2], [&](auto group) {
    return c10d::all_gather_into_tensor(a[0].toTensor(), a[1].toInt(), std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// all_gather_into_tensor_out(Tensor input, int group_size, Any group_name, *,
//                            Tensor(a!) out) -> Tensor(a!)
void allGatherIntoTensorOut(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 4);
  at::Tensor input = a[0].toTensor();
  at::Tensor output = a[3].toTensor();
  withGroup(a[2], [&](auto group) -> at::Tensor& {
    return c10d::all_gather_into_tensor_out(input, a[1].toInt(), std::move(group), output);
  });
  torch::jit::push(*stack, std::move(output));
}

// all_gather_into_tensor_coalesced(Tensor[] inputs, int group_size, Any group_name)
//   -> Tensor[]
void allGatherIntoTensorCoalesced(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  auto out = withGroup(a[2], [&](auto group) {
    return c10d::all_gather_into_tensor_coalesced(tensors(a[0]), a[1].toInt(), std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, Any group_name)
//   -> Tensor
void reduceScatterTensor(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 4);
  auto out = withGroup(a[3], [&](auto group) {
    return c10d::reduce_scatter_tensor(a[0].toTensor(), a[1].toStringRef(), a[2].toInt(),
                                       std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// reduce_scatter_tensor_out(Tensor input, str reduce_op, int group_size, Any group_name, *,
//                           Tensor(a!) out) -> Tensor(a!)
void reduceScatterTensorOut(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 5);
  at::Tensor output = a[4].toTensor();
  auto result = withGroup(a[3], [&](auto group) {
    return c10d::reduce_scatter_tensor_out(a[0].toTensor(), a[1].toStringRef(), a[2].toInt(),
                                           std::move(group), output);
  });
  torch::jit::push(*stack, std::move(result));
}

// reduce_scatter_tensor_coalesced(Tensor[] inputs, str reduce_op, int group_size,
//                                 Any group_name) -> Tensor[]
void reduceScatterTensorCoalesced(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 4);
  auto out = withGroup(a[3], [&](auto group) {
    return c10d::reduce_scatter_tensor_coalesced(tensors(a[0]), a[1].toStringRef(), a[2].toInt(),
                                                 std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// all_to_all_single(Tensor input, SymInt[] output_split_sizes, SymInt[] input_split_sizes,
//                   Any group_name) -> Tensor
void allToAllSingle(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 4);
  const auto outputSplits = a[1].toSymIntVector();
  const auto inputSplits = a[2].toSymIntVector();
  auto out = withGroup(a[3], [&](auto group) {
    return c10d::all_to_all_single(a[0].toTensor(), outputSplits, inputSplits, std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// broadcast(Tensor input, int src, Any group_name) -> Tensor
void broadcast(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  auto out = withGroup(a[2], [&](auto group) {
    return c10d::broadcast(a[0].toTensor(), a[1].toInt(), std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// broadcast_(Tensor(a!) input, int src, Any group_name) -> Tensor(a!)
void broadcastInplace(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  at::Tensor input = a[0].toTensor();
  withGroup(a[2], [&](auto group) -> at::Tensor& {
    return c10d::broadcast_(input, a[1].toInt(), std::move(group));
  });
  torch::jit::push(*stack, std::move(input));
}

template <void (*Kernel)(const c10::OperatorHandle&, Stack*)>
torch::CppFunction boxed() {
  return torch::CppFunction::makeFromBoxedFunction<Kernel>();
}

}  // namespace
}  // namespace spyreccl_torch

TORCH_LIBRARY_IMPL(_c10d_functional, PrivateUse1, m) {
  using namespace spyreccl_torch;
  m.impl("all_reduce", boxed<&allReduce>());
  m.impl("all_reduce_", boxed<&allReduceInplace>());
  m.impl("all_reduce_coalesced", boxed<&allReduceCoalesced>());
  m.impl("all_reduce_coalesced_", boxed<&allReduceCoalescedInplace>());
  m.impl("all_gather_into_tensor", boxed<&allGatherIntoTensor>());
  m.impl("all_gather_into_tensor_out", boxed<&allGatherIntoTensorOut>());
  m.impl("all_gather_into_tensor_coalesced", boxed<&allGatherIntoTensorCoalesced>());
  m.impl("reduce_scatter_tensor", boxed<&reduceScatterTensor>());
  m.impl("reduce_scatter_tensor_out", boxed<&reduceScatterTensorOut>());
  m.impl("reduce_scatter_tensor_coalesced", boxed<&reduceScatterTensorCoalesced>());
  m.impl("all_to_all_single", boxed<&allToAllSingle>());
  m.impl("broadcast", boxed<&broadcast>());
  m.impl("broadcast_", boxed<&broadcastInplace>());
}
