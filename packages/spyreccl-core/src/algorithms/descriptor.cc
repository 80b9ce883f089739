#include "algorithms/descriptor.h"

#include "common/error.h"
#include "kernels/reduce.h"

namespace spyreccl::algorithms {

const char* kindName(uint32_t kind) {
  switch (static_cast<Kind>(kind)) {
    case Kind::kNone:
      return "none";
    case Kind::kAllReduce:
      return "allreduce";
    case Kind::kReduce:
      return "reduce";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kAllGather:
      return "allgather";
    case Kind::kReduceScatter:
      return "reduce_scatter";
    case Kind::kAllToAll:
      return "alltoall";
    case Kind::kAllToAllv:
      return "alltoallv";
    case Kind::kGather:
      return "gather";
    case Kind::kScatter:
      return "scatter";
    case Kind::kBarrier:
      return "barrier";
    case Kind::kSplit:
      return "comm_split";
  }
  return "unknown";
}

static std::string opLabel(int32_t redop) {
  if (redop >= 0 && redop < spyrecclNumOps) {
    return kernels::opName(static_cast<spyrecclRedOp_t>(redop), false);
  }
  return format("%s#%d", kernels::opName(spyrecclSum, true), redop - spyrecclNumOps);
}

std::string describe(const transport::Descriptor& d) {
  const Kind kind = static_cast<Kind>(d.kind);
  std::string s = kindName(d.kind);
  if (kind == Kind::kNone) return s;
  if (kind == Kind::kBarrier || kind == Kind::kSplit) return s + "()";
  s += "(";
  if (kind != Kind::kAllToAllv)
    s += format("count=%llu, ", static_cast<unsigned long long>(d.count));
  s += kernels::dtypeName(static_cast<spyrecclDataType_t>(d.dtype));
  if (d.redop >= 0) s += ", " + opLabel(d.redop);
  if (d.root >= 0) s += format(", root=%d", d.root);
  return s + ")";
}

transport::Descriptor makeDescriptor(Kind kind, spyrecclDataType_t dtype, size_t count, int root,
                                     int redop, uint64_t extra) {
  transport::Descriptor d{};
  d.kind = static_cast<uint32_t>(kind);
  d.dtype = static_cast<int32_t>(dtype);
  d.count = count;
  d.root = root;
  d.redop = redop;
  d.extra = extra;
  return d;
}

bool sameCall(const transport::Descriptor& a, const transport::Descriptor& b) {
  return a.seq == b.seq && a.kind == b.kind && a.dtype == b.dtype && a.count == b.count &&
         a.root == b.root && a.redop == b.redop && a.extra == b.extra;
}

}  // namespace spyreccl::algorithms
