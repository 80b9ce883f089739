// Collective kinds and the human readable form of a collective descriptor, used in
// mismatch messages and state dumps: "allreduce(count=1000, float32, sum)".
#pragma once

#include <cstdint>
#include <string>

#include "spyreccl/spyreccl.h"
#include "transport/layout.h"

namespace spyreccl::algorithms {

enum class Kind : uint32_t {
  kNone = 0,
  kAllReduce,
  kReduce,
  kBroadcast,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kAllToAllv,
  kGather,
  kScatter,
  kBarrier,
  kSplit,
};

const char* kindName(uint32_t kind);

// "allreduce(count=1000, float32, sum)", "broadcast(count=8, int32, root=1)", "barrier()".
std::string describe(const transport::Descriptor& d);

// Builds a descriptor; unused fields get fixed neutral values so that comparing whole
// descriptors compares exactly the arguments that must agree.
transport::Descriptor makeDescriptor(Kind kind, spyrecclDataType_t dtype, size_t count,
                                     int root = -1, int redop = -1, uint64_t extra = 0);

bool sameCall(const transport::Descriptor& a, const transport::Descriptor& b);

}  // namespace spyreccl::algorithms
