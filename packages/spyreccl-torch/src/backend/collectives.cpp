// collectives.cpp — the c10d operations of ProcessGroupSpyreccl.
//
// Each method: (1) validates its arguments on the calling thread (input_checks.h), (2)
// translates tensors into CommBuffers (tensor_translation.h), (3) describes the core calls
// as Steps and (4) submits them. Operations whose c10d signature uses lists of tensors that
// the core wants as one buffer (allgather into a list, gather, scatter, reduce_scatter from
// a list, alltoall with lists) go through a flat staging tensor on the same device. Lists of
// unequal sizes (uneven allgather / reduce_scatter) become one broadcast / reduce per rank.
#include <numeric>

#include <c10/util/Exception.h>

#include "backend/errors.h"
#include "backend/input_checks.h"
#include "backend/process_group_spyreccl.hpp"
#include "backend/reduce_op.h"
#include "backend/staging.h"
#include "backend/tensor_translation.h"

namespace spyreccl_torch {
namespace {

using Buffers = std::vector<CommBuffer>;
constexpr Usage kMove = Usage::kDataMovement;
constexpr Usage kReduce = Usage::kReduction;

OpRecord newOp(c10d::OpType type, const char* name, const char* profilingTitle,
               std::chrono::milliseconds timeout, bool asyncOp, const DeviceChecker& devices) {
  OpRecord op;
  op.type = type;
  op.name = name;
  op.profilingTitle = profilingTitle;
  op.timeout = timeout;
  op.asyncOp = asyncOp;
  op.devices = devices.devices();
  return op;
}

int64_t totalNumel(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const auto& tensor : tensors) {
    total += tensor.numel();
  }
  return total;
}

// Marks the buffers of a step for the staged chunk pipeline (staging.h) when they all live
// in memory the host cannot address and pipelineWanted says so for one rank's block
// (`blockBytes`, the same on every rank) in a group of `groupSize`. Depends only on sizes,
// the group, the device type and settings, so every rank decides alike.
void pipelineIfStaged(Buffers& buffers, size_t blockBytes, int groupSize) {
  for (const auto& buffer : buffers) {
    if (!buffer.hostStaged()) {
      return;
    }
  }
  if (!pipelineWanted(blockBytes, buffers[0].userTensor().device().type(), groupSize)) {
    return;
  }
  for (auto& buffer : buffers) {
    buffer.markPipelined();
  }
}

constexpr StagedLayout kFlat = StagedLayout::kFlat;
constexpr StagedLayout kBlocked = StagedLayout::kBlocked;

// Single-tensor steps shared by several operations.

Step allreduceStep(CommBuffer buffer, const ReduceSpec& spec, const char* opName, int groupSize) {
  Step step;
  step.buffers = {std::move(buffer)};
  pipelineIfStaged(step.buffers, step.buffers[0].bytes(), groupSize);
  step.issue = [spec, opName](const Buffers& b, spyrecclComm_t comm) {
    ScopedRedOp op(spec, b[0].dtype(), comm, opName);
    if (b[0].pipelined()) {
      runStagedPipeline({&b[0]}, {&b[0]}, 1, opName,
                        [&](const void*, void* data, size_t count, const std::string& what) {
                          checkCore(
                              spyrecclAllReduce(data, data, count, b[0].dtype(), op.get(), comm),
                              comm, what);
                        });
      return;
    }
    checkCore(
        spyrecclAllReduce(b[0].data(), b[0].data(), b[0].count(), b[0].dtype(), op.get(), comm),
        comm, opName);
  };
  return step;
}

// b[0]: this rank's input; b[1]: the output holding size blocks of b[0].count().
Step allgatherStep(CommBuffer input, CommBuffer output, const char* opName, int groupSize) {
  Step step;
  step.buffers = {std::move(input), std::move(output)};
  pipelineIfStaged(step.buffers, step.buffers[0].bytes(), groupSize);
  step.issue = [opName](const Buffers& b, spyrecclComm_t comm) {
    if (b[0].pipelined()) {
      runStagedPipeline(
          {&b[0]}, {&b[1], kBlocked}, static_cast<int>(b[1].count() / b[0].count()), opName,
          [&](const void* in, void* out, size_t count, const std::string& what) {
            checkCore(spyrecclAllGather(in, out, count, b[0].dtype(), comm), comm, what);
          });
      return;
    }
    checkCore(spyrecclAllGather(b[0].data(), b[1].data(), b[0].count(), b[0].dtype(), comm), comm,
              opName);
  };
  return step;
}

// b[0]: input of size blocks; b[1]: this rank's reduced block.
Step reduceScatterStep(CommBuffer input, CommBuffer output, const ReduceSpec& spec,
                       const char* opName, int groupSize) {
  Step step;
  step.buffers = {std::move(input), std::move(output)};
  pipelineIfStaged(step.buffers, step.buffers[1].bytes(), groupSize);
  step.issue = [spec, opName](const Buffers& b, spyrecclComm_t comm) {
    ScopedRedOp op(spec, b[1].dtype(), comm, opName);
    if (b[1].pipelined()) {
      runStagedPipeline(
          {&b[0], kBlocked}, {&b[1]}, static_cast<int>(b[0].count() / b[1].count()), opName,
          [&](const void* in, void* out, size_t count, const std::string& what) {
            checkCore(spyrecclReduceScatter(in, out, count, b[1].dtype(), op.get(), comm), comm,
                      what);
          });
      return;
    }
    checkCore(
        spyrecclReduceScatter(b[0].data(), b[1].data(), b[1].count(), b[1].dtype(), op.get(), comm),
        comm, opName);
  };
  return step;
}

// Broadcast from `root`: on root b[0] is the source and b[1] (optional) the destination; on
// the other ranks b[0] is the destination.
Step broadcastStep(Buffers buffers, int root, bool isRoot, const char* opName, int groupSize) {
  Step step;
  step.buffers = std::move(buffers);
  pipelineIfStaged(step.buffers, step.buffers.back().bytes(), groupSize);
  step.issue = [root, isRoot, opName](const Buffers& b, spyrecclComm_t comm) {
    const CommBuffer& destination = b.back();
    if (destination.pipelined()) {
      // On a root with one buffer the source is the destination, whose values stay.
      const StagedSide source{isRoot ? &b[0] : nullptr};
      const bool unchanged = isRoot && &b[0] == &destination;
      runStagedPipeline(source, {&destination, kFlat, !unchanged}, 1, opName,
                        [&](const void* in, void* out, size_t count, const std::string& what) {
                          checkCore(
                              spyrecclBroadcast(in, out, count, destination.dtype(), root, comm),
                              comm, what);
                        });
      return;
    }
    checkCore(spyrecclBroadcast(isRoot ? b[0].data() : nullptr, destination.data(),
                                destination.count(), destination.dtype(), root, comm),
              comm, opName);
  };
  return step;
}

// Reduce to `root`: b[0] is this rank's contribution and b[1] (root only) the destination;
// with `inPlace` (root only) b[0] is both.
Step reduceStep(Buffers buffers, int root, const ReduceSpec& spec, const char* opName,
                int groupSize, bool inPlace = false) {
  Step step;
  step.buffers = std::move(buffers);
  pipelineIfStaged(step.buffers, step.buffers[0].bytes(), groupSize);
  step.issue = [root, spec, opName, inPlace](const Buffers& b, spyrecclComm_t comm) {
    ScopedRedOp op(spec, b[0].dtype(), comm, opName);
    const CommBuffer* output = inPlace ? &b[0] : (b.size() > 1 ? &b[1] : nullptr);
    if (b[0].pipelined()) {
      runStagedPipeline({&b[0]}, {output}, 1, opName,
                        [&](const void* in, void* out, size_t count, const std::string& what) {
                          checkCore(
                              spyrecclReduce(in, out, count, b[0].dtype(), op.get(), root, comm),
                              comm, what);
                        });
      return;
    }
    checkCore(spyrecclReduce(b[0].data(), output != nullptr ? output->data() : nullptr,
                             b[0].count(), b[0].dtype(), op.get(), root, comm),
              comm, opName);
  };
  return step;
}

// Common checks of the "one output tensor, input = size blocks of it" family
// (_allgather_base and its coalesced form): same dtype and output.numel == size * input.numel.
void checkGatherBase(const at::Tensor& output, const at::Tensor& input, int size,
                     const char* opName, const std::string& outName, const std::string& inName) {
  checkSameDtype(output, input.scalar_type(), opName, outName, inName);
  checkNumel(output, input.numel() * size, opName, outName,
             "(group size " + std::to_string(size) + " x the " + std::to_string(input.numel()) +
                 " elements of '" + inName + "')");
}

// Dim-0 split sizes of an all-to-all side; empty means "equal split".
std::vector<int64_t> resolveSplits(const std::vector<int64_t>& splits, const at::Tensor& tensor,
                                   int size, const char* opName, const char* splitName,
                                   const char* tensorName) {
  const int64_t rows = tensor.dim() == 0 ? 1 : tensor.size(0);
  if (splits.empty()) {
    TORCH_CHECK(rows % size == 0, "spyreccl ", opName, ": argument '", tensorName, "' has ", rows,
                " rows (dim 0), which the group size ", size, " does not divide; pass '", splitName,
                "' for uneven splits");
    return std::vector<int64_t>(size, rows / size);
  }
  checkListSize(splits.size(), size, opName, splitName, "split sizes (one per rank)");
  int64_t sum = 0;
  for (size_t i = 0; i < splits.size(); ++i) {
    TORCH_CHECK(splits[i] >= 0, "spyreccl ", opName, ": argument '", splitName, "[", i, "]' is ",
                splits[i], ", expected a non-negative number of rows");
    sum += splits[i];
  }
  TORCH_CHECK(sum == rows, "spyreccl ", opName, ": argument '", splitName, "' sums to ", sum,
              " rows but '", tensorName, "' has ", rows, " rows (dim 0)");
  return splits;
}

int64_t rowNumel(const at::Tensor& tensor) {
  if (tensor.dim() == 0) {
    return 1;
  }
  int64_t numel = 1;
  for (int64_t d = 1; d < tensor.dim(); ++d) {
    numel *= tensor.size(d);
  }
  return numel;
}

// Counts and displacements (in core elements) of an all-to-all with per-peer element counts.
struct AllToAllLayout {
  std::vector<size_t> sendCounts, sendDispls, recvCounts, recvDispls;
};

AllToAllLayout makeLayout(const std::vector<int64_t>& sendElements,
                          const std::vector<int64_t>& recvElements, int64_t units) {
  AllToAllLayout layout;
  size_t sendOffset = 0;
  size_t recvOffset = 0;
  for (size_t p = 0; p < sendElements.size(); ++p) {
    layout.sendCounts.push_back(static_cast<size_t>(sendElements[p] * units));
    layout.sendDispls.push_back(sendOffset);
    sendOffset += layout.sendCounts.back();
    layout.recvCounts.push_back(static_cast<size_t>(recvElements[p] * units));
    layout.recvDispls.push_back(recvOffset);
    recvOffset += layout.recvCounts.back();
  }
  return layout;
}

// Whether an all-to-all with split sizes on these buffers may run as a staged pipeline: both
// sides staged and pipelines allowed for the group. Its ranks cannot see each other's split
// sizes, so those that may agree on the chunk count when it runs (agreeOnSplitChunks).
bool splitPipelineAllowed(const Buffers& buffers, int groupSize) {
  return buffers[0].hostStaged() && buffers[1].hostStaged() &&
         pipelineAllowed(buffers[0].userTensor().device().type(), groupSize);
}

// Every rank's largest message to or from one peer, maximised over the group by a core
// all_reduce of one word (a few us, only where staged pipelines are allowed: real cards, or
// a core per rank for the copy thread), then the chunk count all ranks derive from it.
int64_t agreeOnSplitChunks(const std::vector<int64_t>& sendElements,
                           const std::vector<int64_t>& recvElements, size_t elementSize,
                           spyrecclComm_t comm, const char* opName) {
  int64_t largest = 0;
  for (size_t p = 0; p < sendElements.size(); ++p) {
    largest = std::max({largest, sendElements[p], recvElements[p]});
  }
  int64_t bytes = largest * static_cast<int64_t>(elementSize);
  checkCore(spyrecclAllReduce(&bytes, &bytes, 1, spyrecclInt64, spyrecclMax, comm), comm,
            std::string(opName) + " (agreeing on the staged pipeline's chunk count)");
  return splitPipelineChunks(static_cast<uint64_t>(bytes));
}

Step allToAllvStep(CommBuffer input, CommBuffer output, std::vector<int64_t> sendElements,
                   std::vector<int64_t> recvElements, const char* opName, bool mayPipeline,
                   int groupSize) {
  Step step;
  step.buffers = {std::move(input), std::move(output)};
  if (mayPipeline && splitPipelineAllowed(step.buffers, groupSize)) {
    for (auto& buffer : step.buffers) {
      buffer.markPipelined();
    }
  }
  step.issue = [sendElements = std::move(sendElements), recvElements = std::move(recvElements),
                opName](const Buffers& b, spyrecclComm_t comm) {
    if (b[0].pipelined()) {
      const int64_t chunks = agreeOnSplitChunks(sendElements, recvElements,
                                                b[0].userTensor().element_size(), comm, opName);
      runStagedAllToAllv(b[0], b[1], sendElements, recvElements, chunks, opName,
                         [&](const void* in, const size_t* sc, const size_t* sd, void* out,
                             const size_t* rc, const size_t* rd, const std::string& what) {
                           checkCore(spyrecclAllToAllv(in, sc, sd, out, rc, rd, b[0].dtype(), comm),
                                     comm, what);
                         });
      return;
    }
    const AllToAllLayout layout = makeLayout(sendElements, recvElements, b[0].units());
    checkCore(spyrecclAllToAllv(b[0].data(), layout.sendCounts.data(), layout.sendDispls.data(),
                                b[1].data(), layout.recvCounts.data(), layout.recvDispls.data(),
                                b[0].dtype(), comm),
              comm, opName);
  };
  return step;
}

}  // namespace

// --- broadcast / allreduce / reduce ---------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::broadcast(std::vector<at::Tensor>& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  static constexpr const char* kOp = "broadcast";
  checkUsable(kOp);
  checkSingleTensor(tensors.size(), kOp, "tensors");
  checkRank(opts.rootRank, size_, kOp, "rootRank");
  TORCH_CHECK(opts.rootTensor == 0, "spyreccl ", kOp, ": argument 'rootTensor' is ",
              opts.rootTensor, ", expected 0 (one tensor per rank)");
  DeviceChecker devices(kOp);
  devices.add(tensors[0], "tensors[0]");
  const int root = static_cast<int>(opts.rootRank);
  const bool isRoot = rank_ == root;
  CommBuffer buffer = isRoot ? CommBuffer::input(tensors[0], kMove, kOp, "tensors[0]")
                             : CommBuffer::output(tensors[0], kMove, kOp, "tensors[0]");

  OpRecord op = newOp(c10d::OpType::BROADCAST, kOp, "spyreccl:broadcast", opts.timeout,
                      opts.asyncOp, devices);
  op.inputs = tensors;
  op.outputs = tensors;
  op.inNelems = op.outNelems = tensors[0].numel();
  op.dtype = tensors[0].scalar_type();
  op.steps.push_back(broadcastStep({std::move(buffer)}, root, isRoot, kOp, size_));
  return submit(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  static constexpr const char* kOp = "allreduce";
  checkUsable(kOp);
  checkSingleTensor(tensors.size(), kOp, "tensors");
  DeviceChecker devices(kOp);
  devices.add(tensors[0], "tensors[0]");
  const ReduceSpec spec = checkReduceOp(opts.reduceOp, tensors[0].scalar_type(), kOp);

  OpRecord op = newOp(c10d::OpType::ALLREDUCE, kOp, "spyreccl:all_reduce", opts.timeout,
                      opts.asyncOp, devices);
  op.inputs = tensors;
  op.outputs = tensors;
  op.inNelems = op.outNelems = tensors[0].numel();
  op.dtype = tensors[0].scalar_type();
  op.steps.push_back(
      allreduceStep(CommBuffer::inOut(tensors[0], kReduce, kOp, "tensors[0]"), spec, kOp, size_));
  return submit(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  static constexpr const char* kOp = "allreduce_coalesced";
  checkUsable(kOp);
  checkNonEmpty(tensors.size(), kOp, "tensors");
  DeviceChecker devices(kOp);
  std::vector<ReduceSpec> specs;
  for (size_t i = 0; i < tensors.size(); ++i) {
    devices.add(tensors[i], indexedName("tensors", i));
    specs.push_back(checkReduceOp(opts.reduceOp, tensors[i].scalar_type(), kOp));
  }

  OpRecord op = newOp(c10d::OpType::ALLREDUCE_COALESCED, kOp, "spyreccl:all_reduce_coalesced",
                      opts.timeout, opts.asyncOp, devices);
  op.inputs = tensors;
  op.outputs = tensors;
  op.inNelems = op.outNelems = totalNumel(tensors);
  op.dtype = tensors[0].scalar_type();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string name = indexedName("tensors", i);
    op.steps.push_back(allreduceStep(CommBuffer::inOut(tensors[i], kReduce, kOp, name.c_str()),
                                     specs[i], kOp, size_));
  }
  return submit(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::reduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::ReduceOptions& opts) {
  static constexpr const char* kOp = "reduce";
  checkUsable(kOp);
  checkSingleTensor(tensors.size(), kOp, "tensors");
  checkRank(opts.rootRank, size_, kOp, "rootRank");
  TORCH_CHECK(opts.rootTensor == 0, "spyreccl ", kOp, ": argument 'rootTensor' is ",
              opts.rootTensor, ", expected 0 (one tensor per rank)");
  DeviceChecker devices(kOp);
  devices.add(tensors[0], "tensors[0]");
  const ReduceSpec spec = checkReduceOp(opts.reduceOp, tensors[0].scalar_type(), kOp);
  const int root = static_cast<int>(opts.rootRank);

  OpRecord op =
      newOp(c10d::OpType::REDUCE, kOp, "spyreccl:reduce", opts.timeout, opts.asyncOp, devices);
  op.inputs = tensors;
  op.outputs = tensors;
  op.inNelems = op.outNelems = tensors[0].numel();
  op.dtype = tensors[0].scalar_type();
  // Only the root's tensor is written (in place); the others keep their contents.
  if (rank_ == root) {
    op.steps.push_back(reduceStep({CommBuffer::inOut(tensors[0], kReduce, kOp, "tensors[0]")}, root,
                                  spec, kOp, size_, /*inPlace=*/true));
  } else {
    op.steps.push_back(reduceStep({CommBuffer::input(tensors[0], kReduce, kOp, "tensors[0]")}, root,
                                  spec, kOp, size_));
  }
  return submit(std::move(op));
}

// --- allgather family -----------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  static constexpr const char* kOp = "allgather";
  checkUsable(kOp);
  checkSingleTensor(inputs.size(), kOp, "inputTensors");
  checkListSize(outputs.size(), 1, kOp, "outputTensors", "list of tensors");
  std::vector<at::Tensor>& outList = outputs[0];
  checkListSize(outList.size(), size_, kOp, "outputTensors[0]", "tensors (one per rank)");
  const at::Tensor& input = inputs[0];
  DeviceChecker devices(kOp);
  devices.add(input, "inputTensors[0]");
  bool even = true;
  for (size_t r = 0; r < outList.size(); ++r) {
    const std::string name = indexedName("outputTensors", 0, r);
    devices.add(outList[r], name);
    checkSameDtype(outList[r], input.scalar_type(), kOp, name, "inputTensors[0]");
    even = even && outList[r].numel() == input.numel();
  }
  checkNumel(outList[rank_], input.numel(), kOp, indexedName("outputTensors", 0, rank_),
             "(it receives this rank's own 'inputTensors[0]')");

  OpRecord op = newOp(c10d::OpType::ALLGATHER, kOp, "spyreccl:all_gather", opts.timeout,
                      opts.asyncOp, devices);
  op.inputs = inputs;
  op.outputs = outList;
  op.inNelems = input.numel();
  op.outNelems = totalNumel(outList);
  op.dtype = input.scalar_type();
  if (even) {
    at::Tensor flat = allocateFlat(input, input.numel() * size_);
    Step step = allgatherStep(CommBuffer::input(input, kMove, kOp, "inputTensors[0]"),
                              CommBuffer::output(flat, kMove, kOp, "outputTensors[0]"), kOp, size_);
    step.after = [flat, outList]() { unpackFrom(flat, outList); };
    op.steps.push_back(std::move(step));
  } else {
    // Uneven blocks: every rank broadcasts its input into its slot of the list (the core
    // checks that all ranks agree on each block's size).
    for (int r = 0; r < size_; ++r) {
      const std::string name = indexedName("outputTensors", 0, r);
      Buffers buffers;
      if (r == rank_) {
        buffers.push_back(CommBuffer::input(input, kMove, kOp, "inputTensors[0]"));
      }
      buffers.push_back(CommBuffer::output(outList[r], kMove, kOp, name.c_str()));
      op.steps.push_back(broadcastStep(std::move(buffers), r, r == rank_, kOp, size_));
    }
  }
  return submit(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  static constexpr const char* kOp = "_allgather_base";
  checkUsable(kOp);
  DeviceChecker devices(kOp);
  devices.add(input, "inputBuffer");
  devices.add(output, "outputBuffer");
  checkGatherBase(output, input, size_, kOp, "outputBuffer", "inputBuffer");

  OpRecord op = newOp(c10d::OpType::_ALLGATHER_BASE, kOp, "spyreccl:_allgather_base", opts.timeout,
                      opts.asyncOp, devices);
  op.inputs = {input};
  op.outputs = {output};
  op.inNelems = input.numel();
  op.outNelems = output.numel();
  op.dtype = input.scalar_type();
  op.steps.push_back(allgatherStep(CommBuffer::input(input, kMove, kOp, "inputBuffer"),
                                   CommBuffer::output(output, kMove, kOp, "outputBuffer"), kOp,
                                   size_));
  return submit(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  static constexpr const char* kOp = "allgather_coalesced";
  checkUsable(kOp);
  checkNonEmpty(inputs.size(), kOp, "inputTensors");
  checkListSize(outputLists.size(), size_, kOp, "outputTensorLists",
                "lists (one per rank, each with one tensor per input)");
  DeviceChecker devices(kOp);
  for (size_t i = 0; i < inputs.size(); ++i) {
    devices.add(inputs[i], indexedName("inputTensors", i));
  }
  for (size_t r = 0; r < outputLists.size(); ++r) {
    const std::string listName = indexedName("outputTensorLists", r);
    checkListSize(outputLists[r].size(), inputs.size(), kOp, listName.c_str(),
                  "tensors (one per input tensor)");
    for (size_t i = 0; i < inputs.size(); ++i) {
      const std::string name = indexedName("outputTensorLists", r, i);
      const std::string inName = indexedName("inputTensors", i);
      devices.add(outputLists[r][i], name);
      checkSameDtype(outputLists[r][i], inputs[i].scalar_type(), kOp, name, inName);
      checkNumel(outputLists[r][i], inputs[i].numel(), kOp, name, "(the size of '" + inName + "')");
    }
  }

  OpRecord op = newOp(c10d::OpType::ALLGATHER_COALESCED, kOp, "spyreccl:all_gather_coalesced",
                      opts.timeout, opts.asyncOp, devices);
  op.inputs = inputs;
  for (const auto& list : outputLists) {
    op.outputs.insert(op.outputs.end(), list.begin(), list.end());
  }
  op.inNelems = totalNumel(inputs);
  op.outNelems = totalNumel(op.outputs);
  op.dtype = inputs[0].scalar_type();
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<at::Tensor> column;  // rank r's copy of input i, for every r
    for (const auto& list : outputLists) {
      column.push_back(list[i]);
    }
    at::Tensor flat = allocateFlat(inputs[i], inputs[i].numel() * size_);
    const std::string inName = indexedName("inputTensors", i);
    Step step =
        allgatherStep(CommBuffer::input(inputs[i], kMove, kOp, inName.c_str()),
                      CommBuffer::output(flat, kMove, kOp, "outputTensorLists"), kOp, size_);
    step.after = [flat, column]() { unpackFrom(flat, column); };
    op.steps.push_back(std::move(step));
  }
  return submit(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  static constexpr const char* kOp = "allgather_into_tensor_coalesced";
  checkUsable(kOp);
  checkNonEmpty(inputs.size(), kOp, "inputs");
  checkListSize(outputs.size(), inputs.size(), kOp, "outputs", "tensors (one per input)");
  DeviceChecker devices(kOp);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string inName = indexedName("inputs", i);
    const std::string outName = indexedName("outputs", i);
    devices.add(inputs[i], inName);
    devices.add(outputs[i], outName);
    checkGatherBase(outputs[i], inputs[i], size_, kOp, outName, inName);
  }

  OpRecord op = newOp(c10d::OpType::COALESCED, kOp, "spyreccl:all_gather_into_tensor_coalesced",
                      opts.timeout, opts.asyncOp, devices);
  op.inputs = inputs;
  op.outputs = outputs;
  op.inNelems = totalNumel(inputs);
  op.outNelems = totalNumel(outputs);
  op.dtype = inputs[0].scalar_type();
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string inName = indexedName("inputs", i);
    const std::string outName = indexedName("outputs", i);
    op.steps.push_back(allgatherStep(CommBuffer::input(inputs[i], kMove, kOp, inName.c_str()),
                                     CommBuffer::output(outputs[i], kMove, kOp, outName.c_str()),
                                     kOp, size_));
  }
  return submit(std::move(op));
}

// --- gather / scatter -----------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  static constexpr const char* kOp = "gather";
  checkUsable(kOp);
  checkSingleTensor(inputs.size(), kOp, "inputTensors");
  checkRank(opts.rootRank, size_, kOp, "rootRank");
  const int root = static_cast<int>(opts.rootRank);
  const at::Tensor& input = inputs[0];
  DeviceChecker devices(kOp);
  devices.add(input, "inputTensors[0]");
  std::vector<at::Tensor> outList;
  if (rank_ == root) {
    checkListSize(outputs.size(), 1, kOp, "outputTensors", "list of tensors on the root");
    outList = outputs[0];
    checkListSize(outList.size(), size_, kOp, "outputTensors[0]", "tensors (one per rank)");
    for (size_t r = 0; r < outList.size(); ++r) {
      const std::string name = indexedName("outputTensors", 0, r);
      devices.add(outList[r], name);
      checkSameDtype(outList[r], input.scalar_type(), kOp, name, "inputTensors[0]");
      checkNumel(outList[r], input.numel(), kOp, name, "(the size of 'inputTensors[0]')");
    }
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), "spyreccl ", kOp,
                ": argument 'outputTensors' must be empty on non-root rank ", rank_,
                " (only the root, rank ", root, ", receives)");
  }

  OpRecord op =
      newOp(c10d::OpType::GATHER, kOp, "spyreccl:gather", opts.timeout, opts.asyncOp, devices);
  op.inputs = inputs;
  op.outputs = outList;
  op.inNelems = input.numel();
  op.outNelems = totalNumel(outList);
  op.dtype = input.scalar_type();
  Step step;
  step.buffers = {CommBuffer::input(input, kMove, kOp, "inputTensors[0]")};
  if (rank_ == root) {
    at::Tensor flat = allocateFlat(input, input.numel() * size_);
    step.buffers.push_back(CommBuffer::output(flat, kMove, kOp, "outputTensors[0]"));
    step.after = [flat, outList]() { unpackFrom(flat, outList); };
  }
  pipelineIfStaged(step.buffers, step.buffers[0].bytes(), size_);
  step.issue = [root, size = size_](const Buffers& b, spyrecclComm_t comm) {
    if (b[0].pipelined()) {
      runStagedPipeline({&b[0]}, {b.size() > 1 ? &b[1] : nullptr, kBlocked}, size, kOp,
                        [&](const void* in, void* out, size_t count, const std::string& what) {
                          checkCore(spyrecclGather(in, out, count, b[0].dtype(), root, comm), comm,
                                    what);
                        });
      return;
    }
    checkCore(spyrecclGather(b[0].data(), b.size() > 1 ? b[1].data() : nullptr, b[0].count(),
                             b[0].dtype(), root, comm),
              comm, kOp);
  };
  op.steps.push_back(std::move(step));
  return submit(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  static constexpr const char* kOp = "scatter";
  checkUsable(kOp);
  checkSingleTensor(outputs.size(), kOp, "outputTensors");
  checkRank(opts.rootRank, size_, kOp, "rootRank");
  const int root = static_cast<int>(opts.rootRank);
  const at::Tensor& output = outputs[0];
  DeviceChecker devices(kOp);
  devices.add(output, "outputTensors[0]");
  std::vector<at::Tensor> inList;
  if (rank_ == root) {
    checkListSize(inputs.size(), 1, kOp, "inputTensors", "list of tensors on the root");
    inList = inputs[0];
    checkListSize(inList.size(), size_, kOp, "inputTensors[0]", "tensors (one per rank)");
    for (size_t r = 0; r < inList.size(); ++r) {
      const std::string name = indexedName("inputTensors", 0, r);
      devices.add(inList[r], name);
      checkSameDtype(inList[r], output.scalar_type(), kOp, name, "outputTensors[0]");
      checkNumel(inList[r], output.numel(), kOp, name, "(the size of 'outputTensors[0]')");
    }
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), "spyreccl ", kOp,
                ": argument 'inputTensors' must be empty on non-root rank ", rank_,
                " (only the root, rank ", root, ", sends)");
  }

  OpRecord op =
      newOp(c10d::OpType::SCATTER, kOp, "spyreccl:scatter", opts.timeout, opts.asyncOp, devices);
  op.inputs = inList;
  op.outputs = outputs;
  op.inNelems = totalNumel(inList);
  op.outNelems = output.numel();
  op.dtype = output.scalar_type();
  Step step;
  step.buffers = {CommBuffer::output(output, kMove, kOp, "outputTensors[0]")};
  if (rank_ == root) {
    at::Tensor flat = allocateFlat(output, output.numel() * size_);
    step.buffers.push_back(CommBuffer::input(flat, kMove, kOp, "inputTensors[0]"));
    step.before = [flat, inList]() { packInto(flat, inList); };
  }
  pipelineIfStaged(step.buffers, step.buffers[0].bytes(), size_);
  step.issue = [root, size = size_](const Buffers& b, spyrecclComm_t comm) {
    if (b[0].pipelined()) {
      runStagedPipeline({b.size() > 1 ? &b[1] : nullptr, kBlocked}, {&b[0]}, size, kOp,
                        [&](const void* in, void* out, size_t count, const std::string& what) {
                          checkCore(spyrecclScatter(in, out, count, b[0].dtype(), root, comm), comm,
                                    what);
                        });
      return;
    }
    checkCore(spyrecclScatter(b.size() > 1 ? b[1].data() : nullptr, b[0].data(), b[0].count(),
                              b[0].dtype(), root, comm),
              comm, kOp);
  };
  op.steps.push_back(std::move(step));
  return submit(std::move(op));
}

// --- reduce_scatter family ------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  static constexpr const char* kOp = "reduce_scatter";
  checkUsable(kOp);
  checkSingleTensor(outputs.size(), kOp, "outputTensors");
  checkListSize(inputs.size(), 1, kOp, "inputTensors", "list of tensors");
  std::vector<at::Tensor>& inList = inputs[0];
  checkListSize(inList.size(), size_, kOp, "inputTensors[0]", "tensors (one per rank)");
  const at::Tensor& output = outputs[0];
  DeviceChecker devices(kOp);
  devices.add(output, "outputTensors[0]");
  bool even = true;
  for (size_t r = 0; r < inList.size(); ++r) {
    const std::string name = indexedName("inputTensors", 0, r);
    devices.add(inList[r], name);
    checkSameDtype(inList[r], output.scalar_type(), kOp, name, "outputTensors[0]");
    even = even && inList[r].numel() == output.numel();
  }
  checkNumel(inList[rank_], output.numel(), kOp, indexedName("inputTensors", 0, rank_),
             "(its reduction lands in this rank's 'outputTensors[0]')");
  const ReduceSpec spec = checkReduceOp(opts.reduceOp, output.scalar_type(), kOp);

  OpRecord op = newOp(c10d::OpType::REDUCE_SCATTER, kOp, "spyreccl:reduce_scatter", opts.timeout,
                      opts.asyncOp, devices);
  op.inputs = inList;
  op.outputs = outputs;
  op.inNelems = totalNumel(inList);
  op.outNelems = output.numel();
  op.dtype = output.scalar_type();
  if (even) {
    at::Tensor flat = allocateFlat(output, output.numel() * size_);
    Step step = reduceScatterStep(CommBuffer::input(flat, kReduce, kOp, "inputTensors[0]"),
                                  CommBuffer::output(output, kReduce, kOp, "outputTensors[0]"),
                                  spec, kOp, size_);
    step.before = [flat, inList]() { packInto(flat, inList); };
    op.steps.push_back(std::move(step));
  } else {
    // Uneven blocks: one reduce per destination rank.
    for (int r = 0; r < size_; ++r) {
      const std::string name = indexedName("inputTensors", 0, r);
      Buffers buffers{CommBuffer::input(inList[r], kReduce, kOp, name.c_str())};
      if (r == rank_) {
        buffers.push_back(CommBuffer::output(output, kReduce, kOp, "outputTensors[0]"));
      }
      op.steps.push_back(reduceStep(std::move(buffers), r, spec, kOp, size_));
    }
  }
  return submit(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  static constexpr const char* kOp = "_reduce_scatter_base";
  checkUsable(kOp);
  DeviceChecker devices(kOp);
  devices.add(input, "inputBuffer");
  devices.add(output, "outputBuffer");
  checkGatherBase(input, output, size_, kOp, "inputBuffer", "outputBuffer");
  const ReduceSpec spec = checkReduceOp(opts.reduceOp, output.scalar_type(), kOp);

  OpRecord op = newOp(c10d::OpType::_REDUCE_SCATTER_BASE, kOp, "spyreccl:_reduce_scatter_base",
                      opts.timeout, opts.asyncOp, devices);
  op.inputs = {input};
  op.outputs = {output};
  op.inNelems = input.numel();
  op.outNelems = output.numel();
  op.dtype = output.scalar_type();
  op.steps.push_back(reduceScatterStep(CommBuffer::input(input, kReduce, kOp, "inputBuffer"),
                                       CommBuffer::output(output, kReduce, kOp, "outputBuffer"),
                                       spec, kOp, size_));
  return submit(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  static constexpr const char* kOp = "reduce_scatter_tensor_coalesced";
  checkUsable(kOp);
  checkNonEmpty(inputs.size(), kOp, "inputs");
  checkListSize(outputs.size(), inputs.size(), kOp, "outputs", "tensors (one per input)");
  DeviceChecker devices(kOp);
  std::vector<ReduceSpec> specs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string inName = indexedName("inputs", i);
    const std::string outName = indexedName("outputs", i);
    devices.add(inputs[i], inName);
    devices.add(outputs[i], outName);
    checkGatherBase(inputs[i], outputs[i], size_, kOp, inName, outName);
    specs.push_back(checkReduceOp(opts.reduceOp, outputs[i].scalar_type(), kOp));
  }

  OpRecord op =
      newOp(compat::kReduceScatterTensorCoalesced, kOp, "spyreccl:reduce_scatter_tensor_coalesced",
            opts.timeout, opts.asyncOp, devices);
  op.inputs = inputs;
  op.outputs = outputs;
  op.inNelems = totalNumel(inputs);
  op.outNelems = totalNumel(outputs);
  op.dtype = outputs[0].scalar_type();
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string inName = indexedName("inputs", i);
    const std::string outName = indexedName("outputs", i);
    op.steps.push_back(reduceScatterStep(
        CommBuffer::input(inputs[i], kReduce, kOp, inName.c_str()),
        CommBuffer::output(outputs[i], kReduce, kOp, outName.c_str()), specs[i], kOp, size_));
  }
  return submit(std::move(op));
}

// --- all-to-all -----------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes, const c10d::AllToAllOptions& opts) {
  static constexpr const char* kOp = "alltoall_base";
  checkUsable(kOp);
  DeviceChecker devices(kOp);
  devices.add(input, "inputBuffer");
  devices.add(output, "outputBuffer");
  checkSameDtype(output, input.scalar_type(), kOp, "outputBuffer", "inputBuffer");
  const int64_t inRow = rowNumel(input);
  const int64_t outRow = rowNumel(output);
  TORCH_CHECK(inRow == outRow, "spyreccl ", kOp, ": rows (dim 0 slices) of 'inputBuffer' have ",
              inRow, " elements but rows of 'outputBuffer' have ", outRow,
              "; both must have the same trailing shape");
  const std::vector<int64_t> inSplits =
      resolveSplits(inputSplitSizes, input, size_, kOp, "inputSplitSizes", "inputBuffer");
  const std::vector<int64_t> outSplits =
      resolveSplits(outputSplitSizes, output, size_, kOp, "outputSplitSizes", "outputBuffer");

  OpRecord op = newOp(c10d::OpType::ALLTOALL_BASE, kOp, "spyreccl:all_to_all", opts.timeout,
                      opts.asyncOp, devices);
  op.inputs = {input};
  op.outputs = {output};
  op.inNelems = input.numel();
  op.outNelems = output.numel();
  op.dtype = input.scalar_type();
  op.inSplitSizes = inputSplitSizes;
  op.outSplitSizes = outputSplitSizes;
  // The core's all-to-all is not in place: give it a private copy of an aliasing input.
  CommBuffer in = input.is_alias_of(output) ? CommBuffer::snapshot(input, kMove, kOp, "inputBuffer")
                                            : CommBuffer::input(input, kMove, kOp, "inputBuffer");
  CommBuffer out = CommBuffer::output(output, kMove, kOp, "outputBuffer");
  const bool equal = inputSplitSizes.empty() && outputSplitSizes.empty();
  if (equal) {
    checkNumel(output, input.numel(), kOp, "outputBuffer",
               "(without split sizes it receives as many elements as 'inputBuffer' sends)");
    Step step;
    step.buffers = {std::move(in), std::move(out)};
    // A pipeline writes output chunks while later input chunks are still to be read: only
    // for an input that does not alias the output (an aliasing one is snapshotted whole).
    if (!input.is_alias_of(output)) {
      pipelineIfStaged(step.buffers, step.buffers[0].bytes() / size_, size_);
    }
    step.issue = [size = size_](const Buffers& b, spyrecclComm_t comm) {
      if (b[0].pipelined()) {
        runStagedPipeline({&b[0], kBlocked}, {&b[1], kBlocked}, size, kOp,
                          [&](const void* in, void* out, size_t count, const std::string& what) {
                            checkCore(spyrecclAllToAll(in, out, count, b[0].dtype(), comm), comm,
                                      what);
                          });
        return;
      }
      checkCore(spyrecclAllToAll(b[0].data(), b[1].data(), b[0].count() / size, b[0].dtype(), comm),
                comm, kOp);
    };
    op.steps.push_back(std::move(step));
  } else {
    std::vector<int64_t> sendElements, recvElements;
    for (int p = 0; p < size_; ++p) {
      sendElements.push_back(inSplits[p] * inRow);
      recvElements.push_back(outSplits[p] * outRow);
    }
    // As for equal splits, an aliasing input is snapshotted whole, never pipelined.
    op.steps.push_back(allToAllvStep(std::move(in), std::move(out), std::move(sendElements),
                                     std::move(recvElements), kOp, !input.is_alias_of(output),
                                     size_));
  }
  return submit(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::alltoall(std::vector<at::Tensor>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllToAllOptions& opts) {
  static constexpr const char* kOp = "alltoall";
  checkUsable(kOp);
  checkListSize(inputs.size(), size_, kOp, "inputTensors", "tensors (one per rank)");
  checkListSize(outputs.size(), size_, kOp, "outputTensors", "tensors (one per rank)");
  DeviceChecker devices(kOp);
  std::vector<int64_t> sendElements, recvElements;
  for (int p = 0; p < size_; ++p) {
    const std::string inName = indexedName("inputTensors", p);
    const std::string outName = indexedName("outputTensors", p);
    devices.add(inputs[p], inName);
    devices.add(outputs[p], outName);
    checkSameDtype(inputs[p], inputs[0].scalar_type(), kOp, inName, "inputTensors[0]");
    checkSameDtype(outputs[p], inputs[0].scalar_type(), kOp, outName, "inputTensors[0]");
    sendElements.push_back(inputs[p].numel());
    recvElements.push_back(outputs[p].numel());
  }

  OpRecord op = newOp(c10d::OpType::ALLTOALL, kOp, "spyreccl:all_to_all", opts.timeout,
                      opts.asyncOp, devices);
  op.inputs = inputs;
  op.outputs = outputs;
  op.inNelems = totalNumel(inputs);
  op.outNelems = totalNumel(outputs);
  op.dtype = inputs[0].scalar_type();
  op.inSplitSizes = sendElements;
  op.outSplitSizes = recvElements;
  at::Tensor flatIn = allocateFlat(inputs[0], op.inNelems);
  at::Tensor flatOut = allocateFlat(inputs[0], op.outNelems);
  Step step = allToAllvStep(CommBuffer::input(flatIn, kMove, kOp, "inputTensors"),
                            CommBuffer::output(flatOut, kMove, kOp, "outputTensors"),
                            std::move(sendElements), std::move(recvElements), kOp,
                            /*mayPipeline=*/true, size_);
  std::vector<at::Tensor> inList = inputs;
  std::vector<at::Tensor> outList = outputs;
  step.before = [flatIn, inList]() { packInto(flatIn, inList); };
  step.after = [flatOut, outList]() { unpackFrom(flatOut, outList); };
  op.steps.push_back(std::move(step));
  return submit(std::move(op));
}

// --- point-to-point -------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::pointToPoint(std::vector<at::Tensor>& tensors,
                                                                  PeerCall call) {
  const bool sends = call.kind == PeerCall::Kind::kSend;
  const bool anySource = call.kind == PeerCall::Kind::kRecvAnySource;
  const char* opName = sends ? "send" : anySource ? "recvAnysource" : "recv";
  checkUsable(opName);
  TORCH_CHECK(!(anySource && coalescing_), "spyreccl ", opName,
              ": a receive from any source cannot be part of a coalescing batch");
  checkSingleTensor(tensors.size(), opName, "tensors");
  if (!anySource) {
    const char* peerArg = sends ? "dstRank" : "srcRank";
    checkRank(call.peer, size_, opName, peerArg);
    TORCH_CHECK(call.peer != rank_, "spyreccl ", opName, ": argument '", peerArg, "' is ",
                call.peer, ", this rank itself; ", sends ? "sending to" : "receiving from",
                " oneself is not supported");
  }
  DeviceChecker devices(opName);
  devices.add(tensors[0], "tensors[0]");

  OpRecord op = sends ? newOp(c10d::OpType::SEND, opName, "spyreccl:send", c10d::kUnsetTimeout,
                              /*asyncOp=*/true, devices)
                : anySource ? newOp(c10d::OpType::RECVANYSOURCE, opName, "spyreccl:recvAnySource",
                                    c10d::kUnsetTimeout, /*asyncOp=*/true, devices)
                            : newOp(c10d::OpType::RECV, opName, "spyreccl:recv",
                                    c10d::kUnsetTimeout, /*asyncOp=*/true, devices);
  op.dtype = tensors[0].scalar_type();
  Step step;
  if (sends) {
    op.inputs = tensors;
    op.inNelems = tensors[0].numel();
    step.buffers = {CommBuffer::input(tensors[0], kMove, opName, "tensors[0]")};
  } else {
    op.outputs = tensors;
    op.outNelems = tensors[0].numel();
    step.buffers = {CommBuffer::output(tensors[0], kMove, opName, "tensors[0]")};
  }
  if (anySource) {
    call.source = std::make_shared<int>(-1);
    op.sourceRank = call.source;
  }
  // Larger than a chunk: a chain of chunk messages (peer_pipeline.h), split alike on both
  // sides from the byte count and the settings.
  pipelineIfStaged(step.buffers, step.buffers[0].bytes(), size_);
  step.peerCall = std::move(call);
  op.steps.push_back(std::move(step));
  return submit(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::send(std::vector<at::Tensor>& tensors,
                                                          int dstRank, int tag) {
  return pointToPoint(tensors, PeerCall{PeerCall::Kind::kSend, dstRank, tag, nullptr});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::recv(std::vector<at::Tensor>& tensors,
                                                          int srcRank, int tag) {
  return pointToPoint(tensors, PeerCall{PeerCall::Kind::kRecv, srcRank, tag, nullptr});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                   int tag) {
  return pointToPoint(tensors, PeerCall{PeerCall::Kind::kRecvAnySource, -1, tag, nullptr});
}

// --- barriers -------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::barrier(const c10d::BarrierOptions& opts) {
  static constexpr const char* kOp = "barrier";
  checkUsable(kOp);
  OpRecord op = newOp(c10d::OpType::BARRIER, kOp, "spyreccl:barrier", opts.timeout, opts.asyncOp,
                      DeviceChecker(kOp));
  Step step;
  step.issue = [](const Buffers&, spyrecclComm_t comm) {
    checkCore(spyrecclBarrier(comm), comm, kOp);
  };
  op.steps.push_back(std::move(step));
  return submit(std::move(op));
}

void ProcessGroupSpyreccl::monitoredBarrier(const c10d::BarrierOptions& opts,
                                            bool /*waitAllRanks*/) {
  static constexpr const char* kOp = "monitoredBarrier";
  const std::chrono::milliseconds timeout = effectiveTimeout(opts.timeout);
  // Numbered and recorded like the other collectives (it runs without a Work, so the
  // flight recorder's entry is driven here: started when the core call starts).
  ++seq_;
  const flight::Ref trace =
      trace_.record(*this, "spyreccl:monitoredBarrier", c10d::OpType::BARRIER, {}, {}, -1);
  try {
    runSynchronously(kOp, timeout, [trace](spyrecclComm_t comm) {
      flight::markStarted(trace);
      checkCore(spyrecclBarrier(comm), comm, kOp);
    });
  } catch (const c10::Error& e) {
    const std::exception_ptr error = makeDistBackendError(
        "spyreccl monitoredBarrier: not all ranks of " + label() + " reached the barrier within " +
        std::to_string(timeout.count()) + " ms (rank " + std::to_string(rank_) +
        " reports): " + e.what_without_backtrace());
    flight::markFailed(trace, error);  // dumps, once per group
    std::rethrow_exception(error);
  }
  flight::markCompleted(trace);
}

}  // namespace spyreccl_torch
