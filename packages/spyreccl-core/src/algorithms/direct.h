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
// Buffers outside the arenas (ordinary memory: numpy arrays, malloc'ed tensors) take the
// same algorithms through cross-memory attach (transport/cma.h) when the communicator's
// init probe found it permitted and the ranks' vote chose it (from cmaBusyThreshold up:
// contended CPUs, or the faster path by the ranks' estimates): x.copyFrom() then reads the peer's
// pages with one process_vm_readv instead of a load from a mapping. Each rank publishes every
// buffer's address and length with its arena offset, and a peer's buffer is only ever read within
// the [address, address + length) its owner announced.
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
  // `cma`: buffers outside arenas are reachable through cross-memory attach (the same
  // value on every rank: the communicator's agreed state and the collective's size);
  // `vote`: otherwise, this rank's PathAdvisor vote bits (contended CPUs, single copy
  // faster by its estimate, staged estimate stale; 0 when the collective is outside the
  // window where votes count). Each rank publishes its vote with its buffers and every rank
  // combines all of them (PathAdvisor::decide), so every rank reaches the same decision.
  // `arena`: peers' arenas are mapped and the collective is large enough to read them
  // (otherwise buffers in arenas count as ordinary memory).
  DirectTransfer(Communicator& c, const OpScope& scope, bool announced, bool arena, bool cma,
                 uint64_t vote, const void* a, size_t aBytes, const void* b = nullptr,
                 size_t bBytes = 0);
  DirectTransfer(const DirectTransfer&) = delete;
  DirectTransfer& operator=(const DirectTransfer&) = delete;

  // Whether every rank (except `except`) published buffer `which` (0: a, 1: b) where this
  // rank can read it (its arena, or any memory when cross-memory attach is in use).
  bool allHave(int which, int except = -1) const;
  // Whether rank `p` published buffer `which` where this rank can read it.
  bool has(int p, int which) const;
  // Whether rank `p`'s buffer `which` is in its arena (readable with plain loads: peer()).
  bool inArena(int p, int which) const { return offsets_[slot(p, which)] != kNotInArena; }
  // `peer`'s buffer `which` in its arena; only for buffers inArena() vouched for.
  const uint8_t* peer(int p, int which) const { return c_.peerArena(p) + offsets_[slot(p, which)]; }
  // Copies bytes [off, off + len) of rank `p`'s buffer `which` into `dst` (which has()
  // vouched for): from the mapped arena, or with process_vm_readv. `stream`: non-temporal
  // stores for the arena copy (kernels::copy); the kernel's copy has no such choice.
  void copyFrom(int p, int which, size_t off, uint8_t* dst, size_t len, bool stream) const;
  // Whether buffers outside arenas are read through cross-memory attach (the agreed path).
  bool cma() const { return cma_; }
  // Whether any rank published a buffer in its arena (then the collective's time says
  // nothing about the staged or single-copy path of ordinary memory).
  bool anyInArena() const { return anyInArena_; }
  void sync() { c_.exchange(c_.beginStep()); }
  void close() { sync(); }

  static constexpr uint64_t kNotInArena = ~0ull;

 private:
  static size_t slot(int p, int which) { return 2 * static_cast<size_t>(p) + which; }
  Communicator& c_;
  bool cma_;
  bool anyInArena_ = false;
  std::vector<uint64_t> offsets_, addrs_, lens_;
};

// Smallest collective (bytes, as passed to beginDirect) of kind `kind` whose buffers outside
// arenas are transferred through cross-memory attach while some rank's CPUs are contended
// (transport::cpusContended; kNone: a send/recv message whose sender's are):
// SPYRECCL_CMA_MIN_BYTES when set, else 64 KiB (2 MiB for the allreduce; send/recv only
// above two p2p chunks). From there up contention alone chooses the single copy. Measured
// with the machine loaded (load average 5-10 on 2 CPUs): 2 MiB send/recv 0.9 ms single-copy vs 1.6
// ms staged; 128 KiB broadcast 10 vs 20 us, all_gather 8 vs 14 us (docs/notes/core-single-copy.md).
size_t cmaBusyThreshold(const Communicator& c, Kind kind);

// Smallest collective of kind `kind` for which the ranks vote between staged and single copy
// by measured speed (path_advisor.h): SPYRECCL_CMA_MIN_BYTES when set; 2 MiB for the
// allreduce (cmaBusyThreshold); otherwise the communicator's vote floor, agreed at init from
// the ranks' probes of both paths on this machine (Communicator::cmaVoteFloor), at most
// cmaBusyThreshold. Below cmaBusyThreshold contended CPUs do not count in the vote: there the
// vote's extra step weighs most when the ranks wait for the CPU (4 ranks on 2 CPUs).
size_t cmaVoteThreshold(const Communicator& c, Kind kind);

// The quiet threshold of kind `kind` (kNone: a send/recv message; bytes as passed to
// beginDirect): SPYRECCL_CMA_MIN_BYTES when set (then the single copy is fixed from there),
// else the per-operation crossover measured once on a 2-vCPU AMD EPYC machine
// (docs/notes/core-single-copy.md), which is now only the vote of a rank whose path advisor is off:
// with it on, the ranks vote by measured speed at every size from cmaBusyThreshold
// (path_advisor.h).
size_t cmaThreshold(const Communicator& c, Kind kind);

// Whether SPYRECCL_CMA_MIN_BYTES is set and `bytes` reach it: the single copy without a vote.
bool cmaFixed(const Communicator& c, size_t bytes);

// This rank's vote word on the copy path of a transfer of `bytes` at `nowNs`: whether its
// CPUs are contended (when `contention` counts: from cmaBusyThreshold up), and its path
// advisor's vote for table entry `advisorKind` (`quietCma`: the transfer reaches the quiet
// threshold, the vote of an advisor that is off).
uint64_t cmaVote(const Communicator& c, uint32_t advisorKind, size_t bytes, int64_t nowNs,
                 bool quietCma, bool contention = true);

// Step 1 of a direct transfer, when the collective qualifies (size, switch, arenas mapped):
// constructs `x` and returns true; the caller then checks which buffers are in arenas.
// Returns false, touching nothing, when the collective must be staged.
bool beginDirect(Communicator& c, OpScope& scope, size_t bytes, std::optional<DirectTransfer>& x,
                 const void* a, size_t aBytes, const void* b = nullptr, size_t bBytes = 0);

// dst[i] = reduction over every rank of element i of buffer `which` at element offset
// `off` (ours: own + off), for i < len. `dst` may alias `own + off`. `stream`: write dst
// with non-temporal stores (kernels::reduce), for outputs beyond the last-level cache.
// Peers' buffers outside arenas are read block by block into a cache-sized scratch buffer
// first (one process_vm_readv per peer and block).
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
