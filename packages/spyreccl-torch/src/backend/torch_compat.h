// torch_compat.h — the differences between the torch releases the backend builds against
// (torch 2.10 to 2.15), each handled here once, so that the backend's sources read as if
// for the newest torch.
//
// Every entry names the torch release that introduced the API. When the oldest supported
// release reaches that one, delete the entry and use torch's API directly (docs/development.md,
// "Adding a torch version").
#pragma once

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <string>

#define SPYRECCL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||           \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace spyreccl_torch::compat {

// torch 2.13 renamed NCCLPreMulSumSupplement (the factor of ReduceOp.PREMUL_SUM) to
// PreMulSumSupplement, keeping the old name as an alias.
#if SPYRECCL_TORCH_AT_LEAST(2, 13)
using PreMulSumSupplement = c10d::PreMulSumSupplement;
#else
using PreMulSumSupplement = c10d::NCCLPreMulSumSupplement;
#endif

// torch 2.12 added OpType::REDUCE_SCATTER_TENSOR_COALESCED; before, c10d recorded the
// coalesced reduce_scatter_tensor as COALESCED (the OpType only labels the Work).
#if SPYRECCL_TORCH_AT_LEAST(2, 12)
inline constexpr c10d::OpType kReduceScatterTensorCoalesced =
    c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED;
#else
inline constexpr c10d::OpType kReduceScatterTensorCoalesced = c10d::OpType::COALESCED;
#endif

// torch 2.13 added ProcessGroup::hasBackendForDeviceType. Before, getBackend() is the only
// query and throws for a device type without a backend.
inline bool hasBackendForDeviceType(c10d::ProcessGroup& pg, c10::DeviceType type) {
#if SPYRECCL_TORCH_AT_LEAST(2, 13)
  return pg.hasBackendForDeviceType(type);
#else
  try {
    return pg.getBackend(type) != nullptr;
  } catch (const c10::Error&) {
    return false;
  }
#endif
}

// torch 2.11 added Backend::Options::group_desc. Before, the group's description only lived
// in the Backend (setGroupDesc), so our Options carries it itself: OptionsGroupDesc is a
// base of ProcessGroupSpyreccl::Options, empty where torch declares the member.
#if SPYRECCL_TORCH_AT_LEAST(2, 11)
struct OptionsGroupDesc {};
inline std::string groupDesc(const c10d::Backend::Options& opts) { return opts.group_desc; }
#else
struct OptionsGroupDesc {
  std::string group_desc;
};
// A plain Backend::Options (another backend's) has no description on this torch.
inline std::string groupDesc(const c10d::Backend::Options&) { return {}; }
#endif

// torch 2.14 gave Backend::Options a virtual clone() (c10d's split clones a backend's options
// through it; a subclass that does not override it is sliced). Our Options overrides it
// there; its own typed copy is copy().
#if SPYRECCL_TORCH_AT_LEAST(2, 14)
#define SPYRECCL_COMPAT_OPTIONS_CLONE_OVERRIDE \
  c10::intrusive_ptr<c10d::Backend::Options> clone() const override { return copy(); }
#else
#define SPYRECCL_COMPAT_OPTIONS_CLONE_OVERRIDE
#endif

// torch 2.12 made the _c10d_functional ops take `Any group_name` (a group name or a
// ProcessGroup) and gave Functional.hpp an overload taking the group. Before, the schema
// says `str group_name`: a group argument is always a name.
inline constexpr bool kFunctionalOpsTakeGroup = SPYRECCL_TORCH_AT_LEAST(2, 12);

// torch 2.15 made the reduce_op of the all_reduce family (all_reduce, all_reduce_,
// all_reduce_coalesced, all_reduce_coalesced_) `Any` too (a name or a ReduceOp), and
// Functional.hpp's overloads of that family that take a group take a ReduceOp instead of a
// name.
inline constexpr bool kFunctionalAllReduceTakesReduceOp = SPYRECCL_TORCH_AT_LEAST(2, 15);

}  // namespace spyreccl_torch::compat

// torch 2.12 added RECORD_PARAM_COMMS_DATA_WITH_ASYNC_OP (the record_param_comms event says
// whether the call was asynchronous); before, RECORD_PARAM_COMMS_DATA records without it.
#if SPYRECCL_TORCH_AT_LEAST(2, 12)
#define SPYRECCL_RECORD_PARAM_COMMS(seq, pgName, inputs, outputs, rank, name, inNelems, outNelems, \
                                    dtype, inSplits, outSplits, globalRankStart, globalRankStride, \
                                    worldSize, asyncOp)                                            \
  RECORD_PARAM_COMMS_DATA_WITH_ASYNC_OP(seq, pgName, inputs, outputs, rank, name, inNelems,        \
                                        outNelems, dtype, inSplits, outSplits, globalRankStart,    \
                                        globalRankStride, worldSize, asyncOp)
#else
#define SPYRECCL_RECORD_PARAM_COMMS(seq, pgName, inputs, outputs, rank, name, inNelems, outNelems, \
                                    dtype, inSplits, outSplits, globalRankStart, globalRankStride, \
                                    worldSize, asyncOp)                                            \
  RECORD_PARAM_COMMS_DATA(seq, pgName, inputs, outputs, rank, name, inNelems, outNelems, dtype,    \
                          inSplits, outSplits, globalRankStart, globalRankStride, worldSize);      \
  (void)(asyncOp)
#endif
