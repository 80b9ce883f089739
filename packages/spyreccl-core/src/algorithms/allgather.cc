// allgather and gather: in each step every rank posts the next chunk of its input; after
// the wait every rank (allgather) or the root (gather) copies the peers' chunks into place.
// When the inputs are in the ranks' memory arenas (algorithms/direct.h), or are ordinary
// memory read with cross-memory attach (large messages), the receivers copy them straight
// from their owners instead.
#include <cstring>

#include "algorithms/collectives.h"
#include "algorithms/direct.h"
#include "algorithms/op_scope.h"

namespace spyreccl::algorithms {
namespace {

void gatherImpl(Communicator& c, Kind kind, const void* sendbuff, void* recvbuff, size_t sendcount,
                spyrecclDataType_t dtype, int root) {
  OpScope scope(c, makeDescriptor(kind, dtype, sendcount, root));
  const int n = c.nranks();
  const int r = c.rank();
  const bool receives = root < 0 || r == root;
  const size_t bytes = sendcount * kernels::dtypeSize(dtype);
  const size_t chunk = c.layout().chunkBytes();
  const size_t nsteps = std::max<size_t>(1, ceilDiv(bytes, chunk));
  const auto* send = static_cast<const uint8_t*>(sendbuff);
  auto* recv = static_cast<uint8_t*>(recvbuff);
  std::optional<DirectTransfer> x;
  const bool stream = kernels::streamingPays(2 * static_cast<size_t>(n) * n * bytes);
  if (beginDirect(c, scope, bytes * n, x, send, bytes) && x->allHave(0, root)) {
    if (receives) {
      for (int q = 0; q < n; ++q) {
        if (q != r) x->copyFrom(q, 0, 0, recv + q * bytes, bytes, stream);
      }
      // In place our block is already in place; peers only read it.
      if (send != recv + r * bytes) kernels::copy(recv + r * bytes, send, bytes, stream);
    }
    x->close();
    scope.succeed();
    return;
  }
  for (size_t j = 0; j < nsteps; ++j) {
    const uint32_t s = c.beginStep();
    const size_t off = j * chunk;
    const size_t len = bytes > off ? std::min(chunk, bytes - off) : 0;
    if (len && r != root) kernels::copy(c.staging(r, s), send + off, len);
    c.exchange(s, j == 0 ? scope.desc() : nullptr);
    if (!receives || len == 0) continue;
    for (int q = 0; q < n; ++q) {
      if (q != r) kernels::copy(recv + q * bytes + off, c.staging(q, s), len, stream);
    }
  }
  // Our own block is copied only after the first exchange has validated every rank's
  // descriptor: a mismatched call must leave the output untouched. In place
  // (send == recv + rank * bytes) the block is already where it belongs.
  if (receives && bytes && send != recv + r * bytes) {
    kernels::copy(recv + r * bytes, send, bytes, stream);
  }
  scope.succeed();
}

}  // namespace

void allGather(Communicator& c, const void* send, void* recv, size_t sendcount,
               spyrecclDataType_t dtype) {
  gatherImpl(c, Kind::kAllGather, send, recv, sendcount, dtype, -1);
}

void gather(Communicator& c, const void* send, void* recv, size_t sendcount,
            spyrecclDataType_t dtype, int root) {
  gatherImpl(c, Kind::kGather, send, recv, sendcount, dtype, root);
}

}  // namespace spyreccl::algorithms
