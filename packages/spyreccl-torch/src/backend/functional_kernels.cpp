// functional_kernels.cpp — the `_c10d_functional` collectives for spyre tensors.
//
// torch registers these ops once, for CompositeExplicitAutograd (Functional.cpp), and they
// call the process group with default options, i.e. as asynchronous operations. A kernel
// registered for PrivateUse1 takes precedence for spyre tensors. Every kernel here runs
// inside a FunctionalCallScope, which tells ProcessGroupSpyreccl that the call came from a
// functional collective. Those, unlike dist.*(async_op=True), have no Work a caller could
// wait on with a timeout of its own, only wait_tensor, so a small one may run on the calling
// thread (the inline path, bounded by SPYRECCL_INLINE_FUNCTIONAL_MAX_BYTES) instead of paying
// for two thread hand-offs; large ones still run on the progress thread and overlap with
// computation placed before their wait_tensor.
//
// The lean path. When the group is a plain c10d ProcessGroup whose spyre backend is
// ProcessGroupSpyreccl, a kernel allocates its output as torch's does, calls the backend
// directly and registers the Work in torch's work registry (which wait_tensor pops). That
// skips c10d's ProcessGroup layer: the boxed c10d::allreduce_ (etc.) dispatcher op, its
// ReduceOp object and tuple result, about 0.7 us of the ~3.4 us an all_reduce_ + wait_tensor
// cost on one rank (docs/notes/functional-collectives.md, "The lean path and spyre's buffer
// allocation"). Everything else -- another backend (e.g. ProcessGroupWrapper under
// TORCH_DISTRIBUTED_DEBUG=DETAIL), a ProcessGroup subclass written in Python (the multi-node
// group), complex or non-contiguous tensors, symbolic split sizes, shapes torch's own
// implementation warns about -- runs torch's implementation (the c10d:: functions of
// Functional.hpp) unchanged.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <optional>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/Functional.hpp>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "backend/functional_scope.h"
#include "backend/process_group_spyreccl.hpp"
#include "backend/torch_compat.h"

namespace spyreccl_torch {

namespace {
// spyreccl::_set_wait_follows(bool enabled) -> bool: sets the calling thread's WaitFollowsScope
// flag and returns its previous value, for code that cannot link against this extension
// (the C++ wrappers inductor compiles for spyre graphs, spyreccl_torch.device._cpp_wrapper).
bool setWaitFollows(bool enabled) {
  bool& flag = WaitFollowsScope::flag();
  const bool previous = flag;
  flag = enabled;
  return previous;
}
}  // namespace

TORCH_LIBRARY(spyreccl, m) { m.def("_set_wait_follows(bool enabled) -> bool", &setWaitFollows); }

namespace {
std::atomic<bool> leanEnabled{true};
std::atomic<uint64_t> leanCalls{0};
std::atomic<uint64_t> waitedCalls{0};
std::atomic<uint64_t> waitedBehindProgressThread{0};
std::atomic<bool> waitedEnabled{true};
}  // namespace

void setWaitedWithoutWork(bool enabled) { waitedEnabled.store(enabled, std::memory_order_relaxed); }

void setLeanFunctional(bool enabled) { leanEnabled.store(enabled, std::memory_order_relaxed); }

bool leanFunctional() { return leanEnabled.load(std::memory_order_relaxed); }

uint64_t leanFunctionalCalls() { return leanCalls.load(std::memory_order_relaxed); }

uint64_t waitedFunctionalCalls() { return waitedCalls.load(std::memory_order_relaxed); }

uint64_t waitedBehindProgressThreadCalls() {
  return waitedBehindProgressThread.load(std::memory_order_relaxed);
}

void countWaitedBehindProgressThread() {
  waitedBehindProgressThread.fetch_add(1, std::memory_order_relaxed);
}

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
  if constexpr (compat::kFunctionalOpsTakeGroup) {
    if (!group.isString()) {
      return fn(processGroup(group));
    }
  }
  return fn(std::string(group.toStringRef()));
}

std::vector<at::Tensor> tensors(const c10::IValue& value) { return value.toTensorVector(); }

// --- the lean path -------------------------------------------------------------------------

// The spyreccl backend behind a group argument, or none (then torch's implementation runs).
// Holds the backend for the duration of the call.
struct Lean {
  c10::intrusive_ptr<c10d::Backend> backend;
  ProcessGroupSpyreccl* spyreccl = nullptr;

  explicit operator bool() const { return spyreccl != nullptr; }

  // Counts the call and returns the backend to call.
  ProcessGroupSpyreccl& use() const {
    leanCalls.fetch_add(1, std::memory_order_relaxed);
    return *spyreccl;
  }
};

Lean leanTarget(const c10::IValue& group) {
  if (!leanFunctional()) return {};
  // A name that no group has raises torch's own error here, as torch's implementation would.
  c10::intrusive_ptr<c10d::ProcessGroup> pg =
      group.isString() ? c10d::resolve_process_group(group.toStringRef()) : processGroup(group);
  // A subclass may route collectives its own way (the multi-node group is a ProcessGroup
  // written in Python); only the plain ProcessGroup is known to hand them to its backend.
  if (typeid(*pg) != typeid(c10d::ProcessGroup) ||
      !compat::hasBackendForDeviceType(*pg, c10::DeviceType::PrivateUse1)) {
    return {};
  }
  Lean lean;
  lean.backend = pg->getBackend(c10::DeviceType::PrivateUse1);
  lean.spyreccl = dynamic_cast<ProcessGroupSpyreccl*>(lean.backend.get());
  return lean;
}

// The reduce_op strings torch's functional collectives accept; any other (and "premul_sum",
// which torch rejects too) takes torch's path, which raises its own error.
std::optional<c10d::ReduceOp> leanReduceOp(const std::string& name) {
  using Type = c10d::ReduceOp::RedOpType;
  static const std::pair<const char*, Type> kOps[] = {
      {"sum", Type::SUM}, {"avg", Type::AVG},   {"product", Type::PRODUCT}, {"min", Type::MIN},
      {"max", Type::MAX}, {"band", Type::BAND}, {"bor", Type::BOR},         {"bxor", Type::BXOR}};
  for (const auto& [text, type] : kOps) {
    if (name == text) return c10d::ReduceOp(type);
  }
  return std::nullopt;
}

// What torch's implementation would reject or treat specially (complex views, its
// contiguity checks) stays on torch's path, so that its errors and conversions stay as they
// are.
bool leanTensor(const at::Tensor& t) { return !t.is_complex() && t.is_contiguous(); }

// A reduction on the lean path: the backend, and the reduce op torch would use; none when
// either is missing (the reduce op is checked first: it costs no group lookup).
struct LeanReduction {
  Lean lean;
  c10d::ReduceOp op;
};

// A ReduceOp object (the all_reduce family accepts one from torch 2.15 on) takes torch's path.
std::optional<LeanReduction> leanReduction(const c10::IValue& reduceOp, const c10::IValue& group) {
  if (!reduceOp.isString()) return std::nullopt;
  const auto op = leanReduceOp(reduceOp.toStringRef());
  if (!op) return std::nullopt;
  Lean lean = leanTarget(group);
  if (!lean) return std::nullopt;
  return LeanReduction{std::move(lean), *op};
}

// The all_reduce family's reduce_op as a ReduceOp, for Functional.hpp's overloads that take
// a group (torch 2.15 on): a name torch's functional collectives accept, or a ReduceOp object.
c10::intrusive_ptr<c10d::ReduceOp> reduceOpObject(const c10::IValue& reduceOp) {
  if (reduceOp.isString()) {
    const auto op = leanReduceOp(reduceOp.toStringRef());
    TORCH_CHECK(op, "spyreccl: a _c10d_functional all_reduce's argument 'reduce_op' must be one ",
                "of sum, avg, product, min, max, band, bor, bxor or a ReduceOp, got '",
                reduceOp.toStringRef(), "'");
    return c10::make_intrusive<c10d::ReduceOp>(*op);
  }
  c10::intrusive_ptr<c10d::ReduceOp> op;
  if (reduceOp.isObject()) {
    op = reduceOp.toCustomClass<c10d::ReduceOp>();
  } else if (reduceOp.isCapsule()) {
    op = c10::dynamic_intrusive_pointer_cast<c10d::ReduceOp>(reduceOp.toCapsule());
  }
  TORCH_CHECK(op,
              "spyreccl: a _c10d_functional all_reduce's argument 'reduce_op' must be a name "
              "(str) or a ReduceOp, got ",
              reduceOp.tagKind());
  return op;
}

// Calls fn(reduce_op, group) for torch's implementation of the all_reduce family with a pair
// Functional.hpp has an overload for: see compat::kFunctionalAllReduceTakesReduceOp.
template <typename Fn>
auto withReduceOpAndGroup(const c10::IValue& reduceOp, const c10::IValue& group, Fn&& fn) {
  if constexpr (compat::kFunctionalAllReduceTakesReduceOp) {
    if (reduceOp.isString() && group.isString()) {
      return fn(std::string(reduceOp.toStringRef()), std::string(group.toStringRef()));
    }
    auto pg =
        group.isString() ? c10d::resolve_process_group(group.toStringRef()) : processGroup(group);
    return fn(reduceOpObject(reduceOp), std::move(pg));
  } else {
    return withGroup(group, [&](auto g) { return fn(std::string(reduceOp.toStringRef()), g); });
  }
}

bool leanTensors(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    if (!leanTensor(t)) return false;
  }
  return true;
}

// The output of an all_gather_into_tensor, shaped as torch shapes it: dim 0 times the group
// size (a 0-d input gathers into a 1-d output).
at::Tensor gatheredOutput(const at::Tensor& input, int64_t groupSize) {
  auto sizes = input.sizes().vec();
  if (sizes.empty()) {
    sizes.push_back(groupSize);
  } else {
    sizes[0] *= groupSize;
  }
  return at::empty(sizes, input.options());
}

// Whether the lean path shapes a reduce_scatter_tensor's output: not where torch's path
// would log a warning (dim 0 not divisible) or fail (0-d), which stays there.
bool scatterable(const at::Tensor& input, int64_t groupSize) {
  return input.dim() > 0 && groupSize > 0 && input.size(0) % groupSize == 0;
}

// The output of a reduce_scatter_tensor (scatterable input): dim 0 divided by the group size.
at::Tensor scatteredOutput(const at::Tensor& input, int64_t groupSize) {
  auto sizes = input.sizes().vec();
  sizes[0] /= groupSize;
  return at::empty(sizes, input.options());
}

void registerWork(const std::vector<at::Tensor>& outputs,
                  const c10::intrusive_ptr<c10d::Work>& work) {
  for (const auto& t : outputs) c10d::register_work(t, work);
}

// Calls `call(backend)` (one backend method) for a lean functional collective and registers
// the Work it returns for `outputs`, for their wait_tensor. Waited at once (a compiled
// graph's wait_tensor is the next line), the backend may run it without a Work
// (WorkOptionalScope): nothing to create, register and look up for that wait, which then
// finds nothing registered and returns.
template <typename Call>
void leanRun(const Lean& lean, const std::vector<at::Tensor>& outputs, Call&& call) {
  ProcessGroupSpyreccl& backend = lean.use();
  c10::intrusive_ptr<c10d::Work> work;
  if (waitFollows() && waitedEnabled.load(std::memory_order_relaxed)) {
    WorkOptionalScope optional;
    work = call(backend);
  } else {
    work = call(backend);
  }
  if (work == ranWithoutWork()) {
    waitedCalls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  registerWork(outputs, work);
}

// The lean calls of the backend, each registering its Work for the outputs. torch's
// implementation gathers and reduce-scatters with the coalesced backend methods, one tensor
// or many; so do these.
void leanAllReduceInplace(const LeanReduction& r, at::Tensor& io) {
  c10d::AllreduceOptions opts;
  opts.reduceOp = r.op;
  std::vector<at::Tensor> tensors{io};
  leanRun(r.lean, tensors, [&](ProcessGroupSpyreccl& b) { return b.allreduce(tensors, opts); });
}

void leanAllReduceCoalesced(const LeanReduction& r, std::vector<at::Tensor>& io) {
  c10d::AllreduceCoalescedOptions opts;
  opts.reduceOp = r.op;
  leanRun(r.lean, io, [&](ProcessGroupSpyreccl& b) { return b.allreduce_coalesced(io, opts); });
}

void leanAllGather(const Lean& lean, std::vector<at::Tensor>& outputs,
                   std::vector<at::Tensor>& inputs) {
  leanRun(lean, outputs, [&](ProcessGroupSpyreccl& b) {
    return b.allgather_into_tensor_coalesced(outputs, inputs, c10d::AllgatherOptions());
  });
}

void leanReduceScatter(const LeanReduction& r, std::vector<at::Tensor>& outputs,
                       std::vector<at::Tensor>& inputs) {
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = r.op;
  leanRun(r.lean, outputs, [&](ProcessGroupSpyreccl& b) {
    return b.reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  });
}

void leanBroadcastInplace(const Lean& lean, at::Tensor& io, int64_t src) {
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  std::vector<at::Tensor> tensors{io};
  leanRun(lean, tensors, [&](ProcessGroupSpyreccl& b) { return b.broadcast(tensors, opts); });
}

// Split sizes as plain integers; empty when one is symbolic (torch's path handles those).
std::optional<std::vector<int64_t>> concreteSplits(const std::vector<c10::SymInt>& splits) {
  std::vector<int64_t> out;
  out.reserve(splits.size());
  for (const auto& s : splits) {
    const auto value = s.maybe_as_int();
    if (!value) return std::nullopt;
    out.push_back(*value);
  }
  return out;
}

// all_reduce(Tensor input, str reduce_op, Any group_name) -> Tensor
void allReduce(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  const at::Tensor& input = a[0].toTensor();
  if (!input.is_complex()) {
    if (const auto r = leanReduction(a[1], a[2])) {
      // A copy at the call, as torch's implementation makes, rather than the core's
      // out-of-place reduction: the result must be that of the input as it is now, and a
      // collective above the inline bound runs later on the progress thread, after the
      // caller may have written to its input (it only waits for the output).
      at::Tensor output = input.clone(at::MemoryFormat::Contiguous);
      leanAllReduceInplace(*r, output);
      torch::jit::push(*stack, std::move(output));
      return;
    }
  }
  auto out = withReduceOpAndGroup(a[1], a[2], [&](auto op, auto group) {
    return c10d::all_reduce(a[0].toTensor(), std::move(op), std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// all_reduce_(Tensor(a!) input, str reduce_op, Any group_name) -> Tensor(a!)
void allReduceInplace(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  at::Tensor input = a[0].toTensor();
  if (leanTensor(input)) {
    if (const auto r = leanReduction(a[1], a[2])) {
      leanAllReduceInplace(*r, input);
      torch::jit::push(*stack, std::move(input));
      return;
    }
  }
  withReduceOpAndGroup(a[1], a[2], [&](auto op, auto group) -> at::Tensor& {
    return c10d::all_reduce_(input, std::move(op), std::move(group));
  });
  torch::jit::push(*stack, std::move(input));
}

// all_reduce_coalesced(Tensor[] inputs, str reduce_op, Any group_name) -> Tensor[]
void allReduceCoalesced(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  if (auto inputs = tensors(a[0]); leanTensors(inputs)) {
    if (const auto r = leanReduction(a[1], a[2])) {
      std::vector<at::Tensor> outputs;
      outputs.reserve(inputs.size());
      for (const auto& t : inputs) outputs.push_back(t.clone(at::MemoryFormat::Contiguous));
      leanAllReduceCoalesced(*r, outputs);
      torch::jit::push(*stack, std::move(outputs));
      return;
    }
  }
  auto out = withReduceOpAndGroup(a[1], a[2], [&](auto op, auto group) {
    return c10d::all_reduce_coalesced(tensors(a[0]), std::move(op), std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// all_reduce_coalesced_(Tensor[](a!) inputs, str reduce_op, Any group_name) -> Tensor[](a!)
void allReduceCoalescedInplace(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  if (auto io = tensors(a[0]); leanTensors(io)) {
    if (const auto r = leanReduction(a[1], a[2])) {
      leanAllReduceCoalesced(*r, io);
      torch::jit::push(*stack, std::move(io));
      return;
    }
  }
  auto out = withReduceOpAndGroup(a[1], a[2], [&](auto op, auto group) {
    return c10d::all_reduce_coalesced_(tensors(a[0]), std::move(op), std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// all_gather_into_tensor(Tensor input, int group_size, Any group_name) -> Tensor
void allGatherIntoTensor(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  if (const at::Tensor& input = a[0].toTensor(); leanTensor(input)) {
    if (const Lean lean = leanTarget(a[2])) {
      std::vector<at::Tensor> outputs{gatheredOutput(input, a[1].toInt())};
      std::vector<at::Tensor> inputs{input};
      leanAllGather(lean, outputs, inputs);
      torch::jit::push(*stack, std::move(outputs[0]));
      return;
    }
  }
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
  if (leanTensor(input)) {
    if (const Lean lean = leanTarget(a[2])) {
      // As torch's implementation: the plain (not coalesced) method for a given output.
      leanRun(lean, {output}, [&](ProcessGroupSpyreccl& b) {
        return b._allgather_base(output, input, c10d::AllgatherOptions());
      });
      torch::jit::push(*stack, std::move(output));
      return;
    }
  }
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
  if (auto inputs = tensors(a[0]); leanTensors(inputs)) {
    if (const Lean lean = leanTarget(a[2])) {
      std::vector<at::Tensor> outputs;
      outputs.reserve(inputs.size());
      for (const auto& t : inputs) outputs.push_back(gatheredOutput(t, a[1].toInt()));
      leanAllGather(lean, outputs, inputs);
      torch::jit::push(*stack, std::move(outputs));
      return;
    }
  }
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
  const at::Tensor& input = a[0].toTensor();
  const int64_t groupSize = a[2].toInt();
  if (leanTensor(input) && scatterable(input, groupSize)) {
    if (const auto r = leanReduction(a[1], a[3])) {
      std::vector<at::Tensor> outputs{scatteredOutput(input, groupSize)};
      std::vector<at::Tensor> inputs{input};
      leanReduceScatter(*r, outputs, inputs);
      torch::jit::push(*stack, std::move(outputs[0]));
      return;
    }
  }
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
  const at::Tensor& input = a[0].toTensor();
  if (leanTensor(input) && !output.is_complex()) {
    if (const auto r = leanReduction(a[1], a[3])) {
      std::vector<at::Tensor> outputs{output};
      std::vector<at::Tensor> inputs{input};
      leanReduceScatter(*r, outputs, inputs);
      torch::jit::push(*stack, std::move(output));
      return;
    }
  }
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
  const int64_t groupSize = a[2].toInt();
  auto inputs = tensors(a[0]);
  const bool shaped = std::all_of(inputs.begin(), inputs.end(), [&](const at::Tensor& t) {
    return leanTensor(t) && scatterable(t, groupSize);
  });
  if (shaped) {
    if (const auto r = leanReduction(a[1], a[3])) {
      std::vector<at::Tensor> outputs;
      outputs.reserve(inputs.size());
      for (const auto& t : inputs) outputs.push_back(scatteredOutput(t, groupSize));
      leanReduceScatter(*r, outputs, inputs);
      torch::jit::push(*stack, std::move(outputs));
      return;
    }
  }
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
  const at::Tensor& input = a[0].toTensor();
  if (leanTensor(input) && input.dim() > 0) {
    auto outSplits = concreteSplits(outputSplits);
    auto inSplits = concreteSplits(inputSplits);
    if (outSplits && inSplits) {
      if (const Lean lean = leanTarget(a[3])) {
        // As torch's: the input's shape with dim 0 = the rows this rank receives.
        auto sizes = input.sizes().vec();
        sizes[0] = std::accumulate(outSplits->begin(), outSplits->end(), int64_t{0});
        at::Tensor output = at::empty(sizes, input.options());
        at::Tensor in = input;
        leanRun(lean, {output}, [&](ProcessGroupSpyreccl& b) {
          return b.alltoall_base(output, in, *outSplits, *inSplits, c10d::AllToAllOptions());
        });
        torch::jit::push(*stack, std::move(output));
        return;
      }
    }
  }
  auto out = withGroup(a[3], [&](auto group) {
    return c10d::all_to_all_single(a[0].toTensor(), outputSplits, inputSplits, std::move(group));
  });
  torch::jit::push(*stack, std::move(out));
}

// broadcast(Tensor input, int src, Any group_name) -> Tensor
void broadcast(const c10::OperatorHandle&, Stack* stack) {
  FunctionalCallScope scope;
  auto a = torch::jit::pop(*stack, 3);
  const at::Tensor& input = a[0].toTensor();
  if (!input.is_complex()) {
    if (const Lean lean = leanTarget(a[2])) {
      at::Tensor output = input.clone(at::MemoryFormat::Contiguous);
      leanBroadcastInplace(lean, output, a[1].toInt());
      torch::jit::push(*stack, std::move(output));
      return;
    }
  }
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
  if (leanTensor(input)) {
    if (const Lean lean = leanTarget(a[2])) {
      leanBroadcastInplace(lean, input, a[1].toInt());
      torch::jit::push(*stack, std::move(input));
      return;
    }
  }
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
