#include "algorithms/direct.h"

#include <algorithm>
#include <cstring>

#include "common/log.h"
#include "memory/arena.h"

namespace spyreccl::algorithms {
namespace {
constexpr uint64_t kNotInArena = ~0ull;
}  // namespace

DirectTransfer::DirectTransfer(Communicator& c, const OpScope& scope, bool announced, const void* a,
                               size_t aBytes, const void* b, size_t bBytes)
    : c_(c), offsets_(2 * static_cast<size_t>(c.nranks())) {
  auto offsetOf = [](const void* p, size_t bytes) {
    const int64_t off = memory::Arena::sharedOffsetOf(p, bytes);
    return off < 0 ? kNotInArena : static_cast<uint64_t>(off);
  };
  const uint32_t s = c.beginStep();
  uint64_t* mine = c.control(c.rank())->xfer[s & 1];
  mine[0] = offsetOf(a, aBytes);
  mine[1] = offsetOf(b, bBytes);
  c.exchange(s, announced ? nullptr : scope.desc());
  // Copied now: a peer may reuse the published words two steps later.
  int inArena = 0;
  for (int p = 0; p < c.nranks(); ++p) {
    offsets_[2 * p] = c.control(p)->xfer[s & 1][0];
    offsets_[2 * p + 1] = c.control(p)->xfer[s & 1][1];
    inArena += (offsets_[2 * p] != kNotInArena) + (offsets_[2 * p + 1] != kNotInArena);
  }
  SPYRECCL_LOG(kTrace, c.who().c_str(), "%s: %d of %d published buffers are in arenas",
               c.opLabel().c_str(), inArena, 2 * c.nranks());
}

bool DirectTransfer::allHave(int which, int except) const {
  for (int p = 0; p < c_.nranks(); ++p) {
    if (p != except && offsets_[2 * static_cast<size_t>(p) + which] == kNotInArena) return false;
  }
  return true;
}

bool DirectTransfer::has(int p, int which) const {
  return offsets_[2 * static_cast<size_t>(p) + which] != kNotInArena;
}

bool beginDirect(Communicator& c, const OpScope& scope, size_t bytes,
                 std::optional<DirectTransfer>& x, const void* a, size_t aBytes, const void* b,
                 size_t bBytes) {
  bool announced = false;
  if (!c.directCapable(bytes, scope.desc(), &announced)) return false;
  x.emplace(c, scope, announced, a, aBytes, b, bBytes);
  return true;
}

void reduceFromPeers(Communicator& c, const DirectTransfer& x, const kernels::ReduceSpec& spec,
                     uint8_t* dst, const uint8_t* own, int which, size_t off, size_t len,
                     size_t esize, bool stream) {
  if (len == 0) return;
  const int n = c.nranks();
  const int r = c.rank();
  const void** srcs = c.sourceScratch();
  // Sources in rank order, ours from our own buffer; when the output aliases our input,
  // ours must be srcs[0] (the only source kernels::reduce lets alias the output). Either
  // way a single rank reduces each element and the others copy it, so every rank ends
  // with the same bits.
  const uint8_t* mine = own + off * esize;
  const bool aliased = dst == mine;
  int i = 0;
  if (aliased) srcs[i++] = mine;
  for (int q = 0; q < n; ++q) {
    if (q == r) {
      if (!aliased) srcs[i++] = mine;
    } else {
      srcs[i++] = x.peer(q, which) + off * esize;
    }
  }
  kernels::reduce(spec, dst, srcs, n, len, stream);
}

void evenSegment(size_t count, int n, int p, size_t esize, size_t* off, size_t* len) {
  const size_t quantum = std::max<size_t>(1, transport::kCacheLine / esize);
  const size_t per = ceilDiv(ceilDiv(count, n), quantum) * quantum;
  const size_t a = std::min(count, per * p);
  const size_t b = std::min(count, per * (p + 1));
  *off = a;
  *len = b - a;
}

void directReduce(Communicator& c, DirectTransfer& x, const kernels::ReduceSpec& spec,
                  const uint8_t* send, uint8_t* recv, size_t count, size_t esize, int root) {
  const int n = c.nranks();
  const int r = c.rank();
  // Outputs copied from peers are written with non-temporal stores by the same rule as in
  // the staged pipeline (kernels::streamingPaysFor). The reductions' outputs are re-read by
  // every peer right after, so they stream only once the message itself is well beyond the
  // cache (streamingReduction).
  const bool stream = kernels::streamingPaysFor(send, recv, n, count * esize);
  const bool streamReduced = streamingReduction(count * esize);
  if (root >= 0) {
    // reduce: the root combines every rank's whole input.
    if (r == root) reduceFromPeers(c, x, spec, recv, send, 0, 0, count, esize, streamReduced);
    x.close();
    return;
  }
  // allreduce: rank p reduces segment p of every input into its own output, then every
  // rank copies the other segments from their owners' outputs. In place, segment r of our
  // input is overwritten in phase 1: peers read only their own segments of it then.
  size_t off, len;
  evenSegment(count, n, r, esize, &off, &len);
  reduceFromPeers(c, x, spec, recv + off * esize, send, 0, off, len, esize, streamReduced);
  x.sync();
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    evenSegment(count, n, q, esize, &off, &len);
    if (len) {
      kernels::copy(recv + off * esize, x.peer(q, 1) + off * esize, len * esize, stream);
    }
  }
  x.close();
}

}  // namespace spyreccl::algorithms
