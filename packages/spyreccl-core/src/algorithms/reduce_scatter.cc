// reduce_scatter: in each step every rank posts, for every rank p, the next slice of the
// block p will own; each rank then reduces its slice over all ranks (rank order) straight
// into its output. One copy in, one reduction, no copy out. When the inputs are in the
// ranks' memory arenas (algorithms/direct.h) each rank reduces its block straight from them.
#include <cstring>

#include "algorithms/collectives.h"
#include "algorithms/direct.h"
#include "algorithms/op_scope.h"

namespace spyreccl::algorithms {

void reduceScatter(Communicator& c, const void* sendbuff, void* recvbuff, size_t recvcount,
                   spyrecclDataType_t dtype, spyrecclRedOp_t op, const kernels::ReduceSpec& spec) {
  OpScope scope(c,
                makeDescriptor(Kind::kReduceScatter, dtype, recvcount, -1, static_cast<int>(op)));
  const int n = c.nranks();
  const int r = c.rank();
  const size_t esize = kernels::dtypeSize(dtype);
  const size_t blockBytes = recvcount * esize;
  const size_t slot = slotBytes(c);
  const size_t slotElems = slot / esize;
  const size_t nsteps = std::max<size_t>(1, ceilDiv(recvcount, slotElems));
  const auto* send = static_cast<const uint8_t*>(sendbuff);
  auto* recv = static_cast<uint8_t*>(recvbuff);
  std::optional<DirectTransfer> x;
  if (beginDirect(c, scope, blockBytes * n, x, send, blockBytes * n) && x->allHave(0)) {
    // In place, our output is our own block r of the input: peers read only other blocks.
    reduceFromPeers(c, *x, spec, recv, send, 0, r * recvcount, recvcount, esize,
                    streamingReduction(blockBytes * n));
    x->close();
    scope.succeed();
    return;
  }
  // In place, our own block is the output; kernels::reduce lets dst alias srcs[0] only, so
  // ranks other than 0 stage their own slice too and reduce from the copy.
  const bool stageOwn = recv == send + r * blockBytes && r != 0;
  const void** srcs = c.sourceScratch();

  for (size_t j = 0; j < nsteps; ++j) {
    const uint32_t s = c.beginStep();
    uint8_t* mine = c.staging(r, s);
    const size_t eoff = j * slotElems;
    const size_t elen = recvcount > eoff ? std::min(slotElems, recvcount - eoff) : 0;
    for (int p = 0; p < n; ++p) {
      if (p == r && !stageOwn) continue;
      if (elen) kernels::copy(mine + p * slot, send + p * blockBytes + eoff * esize, elen * esize);
    }
    c.exchange(s, j == 0 ? scope.desc() : nullptr);
    if (elen == 0) continue;
    for (int q = 0; q < n; ++q) {
      if (q == r && !stageOwn) {
        srcs[q] = send + r * blockBytes + eoff * esize;
      } else {
        srcs[q] = c.staging(q, s) + r * slot;
      }
    }
    kernels::reduce(spec, recv + eoff * esize, srcs, n, elen);
  }
  scope.succeed();
}

}  // namespace spyreccl::algorithms
