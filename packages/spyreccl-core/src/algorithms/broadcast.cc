// broadcast and scatter. A broadcast of at most eagerMaxBytes goes one-way
// (algorithms/eager.h). Otherwise the root streams its data through its staging buffers, one chunk
// per step; the other ranks copy their part out after each step's wait. Double buffering
// lets the root fill chunk j + 1 while the others still copy chunk j.
// When the root's buffer is in its memory arena (algorithms/direct.h), or is ordinary
// memory and the message reaches the cross-memory-attach threshold, the others copy
// straight from it instead.
#include <cstring>

#include "algorithms/collectives.h"
#include "algorithms/direct.h"
#include "algorithms/eager.h"
#include "algorithms/op_scope.h"

namespace spyreccl::algorithms {

void broadcast(Communicator& c, const void* sendbuff, void* recvbuff, size_t count,
               spyrecclDataType_t dtype, int root) {
  OpScope scope(c, makeDescriptor(Kind::kBroadcast, dtype, count, root));
  const int r = c.rank();
  const size_t bytes = count * kernels::dtypeSize(dtype);
  if (eagerBroadcastFits(c, bytes)) {
    eagerBroadcast(c, *scope.desc(), sendbuff, recvbuff, bytes, root);
    scope.succeed();
    return;
  }
  const size_t chunk = c.layout().chunkBytes();
  const size_t nsteps = std::max<size_t>(1, ceilDiv(bytes, chunk));
  const auto* send = static_cast<const uint8_t*>(sendbuff);
  auto* recv = static_cast<uint8_t*>(recvbuff);
  std::optional<DirectTransfer> x;
  const bool stream = kernels::streamingPaysFor(send, recv, c.nranks(), bytes);
  if (beginDirect(c, scope, bytes, x, r == root ? send : nullptr, bytes) && x->has(root, 0)) {
    if (r != root) x->copyFrom(root, 0, 0, recv, bytes, stream);
    if (r == root && send != recv) kernels::copy(recv, send, bytes, stream);
    x->close();
    scope.succeed();
    return;
  }
  for (size_t j = 0; j < nsteps; ++j) {
    const uint32_t s = c.beginStep();
    const size_t off = j * chunk;
    const size_t len = bytes > off ? std::min(chunk, bytes - off) : 0;
    if (r == root && len) kernels::copy(c.staging(r, s), send + off, len);
    c.exchange(s, j == 0 ? scope.desc() : nullptr);
    if (r != root && len) kernels::copy(recv + off, c.staging(root, s), len, stream);
  }
  // Local copies happen after the first exchange validated every descriptor, so a
  // mismatched call leaves the output untouched on every rank.
  if (r == root && bytes && send != recv) kernels::copy(recv, send, bytes, stream);
  scope.succeed();
}

void scatter(Communicator& c, const void* sendbuff, void* recvbuff, size_t recvcount,
             spyrecclDataType_t dtype, int root) {
  OpScope scope(c, makeDescriptor(Kind::kScatter, dtype, recvcount, root));
  const int n = c.nranks();
  const int r = c.rank();
  const size_t blockBytes = recvcount * kernels::dtypeSize(dtype);
  const size_t slot = slotBytes(c);
  const size_t nsteps = std::max<size_t>(1, ceilDiv(blockBytes, slot));
  const auto* send = static_cast<const uint8_t*>(sendbuff);
  auto* recv = static_cast<uint8_t*>(recvbuff);
  std::optional<DirectTransfer> x;
  const bool stream = kernels::streamingPays(2 * static_cast<size_t>(n) * blockBytes);
  if (beginDirect(c, scope, blockBytes * n, x, r == root ? send : nullptr, blockBytes * n) &&
      x->has(root, 0)) {
    if (r != root) x->copyFrom(root, 0, r * blockBytes, recv, blockBytes, stream);
    if (r == root && recv != send + root * blockBytes) {
      kernels::copy(recv, send + root * blockBytes, blockBytes, stream);
    }
    x->close();
    scope.succeed();
    return;
  }
  for (size_t j = 0; j < nsteps; ++j) {
    const uint32_t s = c.beginStep();
    const size_t off = j * slot;
    const size_t len = blockBytes > off ? std::min(slot, blockBytes - off) : 0;
    if (r == root && len) {
      uint8_t* mine = c.staging(r, s);
      for (int p = 0; p < n; ++p) {
        if (p != root) kernels::copy(mine + p * slot, send + p * blockBytes + off, len);
      }
    }
    c.exchange(s, j == 0 ? scope.desc() : nullptr);
    if (r != root && len) kernels::copy(recv + off, c.staging(root, s) + r * slot, len, stream);
  }
  if (r == root && blockBytes && recv != send + root * blockBytes) {
    kernels::copy(recv, send + root * blockBytes, blockBytes, stream);
  }
  scope.succeed();
}

}  // namespace spyreccl::algorithms
