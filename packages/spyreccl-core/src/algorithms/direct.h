// Direct transfers: collectives that read peers' buffers in place.
//
// When every buffer a collective reads from a peer lies in that peer's memory arena
// (memory/arena.h; the torch device allocates its tensors there), ranks skip the
// segment's staging buffers and load the peers' data straight from their arenas, which
// every rank has mapped read-only. Each byte then crosses between processes once instead
// of twice (staged: sender -> segment -> receiver).
//
//   DirectTransfer x(c, scope, announced, a, aBytes, b, bBytes);
//       step 1: publish the arena offsets of our buffers a and b; afterwards every rank
//       knows every peer's, so x.allHave(...) is the same on every rank and all ranks
//       take the same path (direct, or staged when some buffer is outside an arena)
//   x.peer(q, which)   a peer's buffer, readable with plain loads
//   x.sync()           one step (a phase that reads what peers wrote in the previous one)
//   x.close()          final step: no rank returns, and so reuses or frees its buffers,
//                      while a peer may still be reading them
//
// Ranks only ever read peers' buffers and write their own, so a rank that fails midway
// cannot corrupt a peer: the peer's next wait reports the failure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "algorithms/op_scope.h"
#include "comm.h"
#include "kernels/reduce.h"

namespace spyreccl::algorithms {

class DirectTransfer {
 public:
  // `announced`: the arena probe already published this collective's descriptor.
  DirectTransfer(Communicator& c, const OpScope& scope, bool announced, const void* a,
                 size_t aBytes, const void* b = nullptr, size_t bBytes = 0);
  DirectTransfer(const DirectTransfer&) = delete;
  DirectTransfer& operator=(const DirectTransfer&) = delete;

  // Whether every rank (except `except`) published buffer `which` (0: a, 1: b) in its arena.
  bool allHave(int which, int except = -1) const;
  // Whether rank `p` published buffer `which` in its arena.
  bool has(int p, int which) const;
  // `peer`'s buffer `which`; only for buffers allHave() vouched for.
  const uint8_t* peer(int p, int which) const {
    return c_.peerArena(p) + offsets_[2 * static_cast<size_t>(p) + which];
  }
  void sync() { c_.exchange(c_.beginStep()); }
  void close() { sync(); }

 private:
  Communicator& c_;
  std::vector<uint64_t> offsets_;
};

// Step 1 of a direct transfer, when the collective qualifies (size, switch, arenas mapped):
// constructs `x` and returns true; the caller then checks which buffers are in arenas.
// Returns false, touching nothing, when the collective must be staged.
bool beginDirect(Communicator& c, const OpScope& scope, size_t bytes,
                 std::optional<DirectTransfer>& x, const void* a, size_t aBytes,
                 const void* b = nullptr, size_t bBytes = 0);

// dst[i] = reduction over every rank of element i of buffer `which` at element offset
// `off` (ours: own + off), for i < len. `dst` may alias `own + off`. `stream`: write dst
// with non-temporal stores (kernels::reduce), for outputs beyond the last-level cache.
void reduceFromPeers(Communicator& c, const DirectTransfer& x, const kernels::ReduceSpec& spec,
                     uint8_t* dst, const uint8_t* own, int which, size_t off, size_t len,
                     size_t esize, bool stream);

// Whether a direct reduction of a `messageBytes` message writes its output with
// non-temporal stores. Measured on the 2-rank allreduce (32 MiB L3, interleaved runs):
// -30 % at 8 MiB (peers then read the reduced segments from memory instead of the cache),
// within the noise at 16-32 MiB, +10-15 % at 64-256 MiB; hence from twice the last-level
// cache.
inline bool streamingReduction(size_t messageBytes) {
  return messageBytes >= 2 * kernels::lastLevelCacheBytes();
}

// Even split of `count` elements over n ranks in cache-line quanta: rank p's part is
// [*off, *off + *len).
void evenSegment(size_t count, int n, int p, size_t esize, size_t* off, size_t* len);

// The direct collectives. Each runs after `x` was constructed and allHave() confirmed the
// buffers it reads; see the algorithm files for what each rank reads.
void directReduce(Communicator& c, DirectTransfer& x, const kernels::ReduceSpec& spec,
                  const uint8_t* send, uint8_t* recv, size_t count, size_t esize, int root);

}  // namespace spyreccl::algorithms
