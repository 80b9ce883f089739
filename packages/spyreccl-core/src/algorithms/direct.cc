#include "algorithms/direct.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "algorithms/path_advisor.h"
#include "common/clock.h"
#include "common/log.h"
#include "memory/arena.h"
#include "transport/cma.h"

namespace spyreccl::algorithms {

DirectTransfer::DirectTransfer(Communicator& c, const OpScope& scope, bool announced, bool arena,
                               bool cma, uint64_t vote, const void* a, size_t aBytes, const void* b,
                               size_t bBytes)
    : c_(c),
      cma_(cma),
      offsets_(2 * static_cast<size_t>(c.nranks())),
      addrs_(offsets_.size()),
      lens_(offsets_.size()) {
  auto offsetOf = [](const void* p, size_t bytes) {
    const int64_t off = memory::Arena::sharedOffsetOf(p, bytes);
    return off < 0 ? kNotInArena : static_cast<uint64_t>(off);
  };
  const uint32_t s = c.beginStep();
  uint64_t* mine = c.control(c.rank())->xfer[s & 1];
  mine[0] = offsetOf(a, aBytes);
  mine[1] = offsetOf(b, bBytes);
  mine[2] = reinterpret_cast<uintptr_t>(a);
  mine[3] = reinterpret_cast<uintptr_t>(b);
  mine[4] = a != nullptr ? aBytes : 0;
  mine[5] = b != nullptr ? bBytes : 0;
  mine[6] = cma ? 0 : vote;
  c.exchange(s, announced ? nullptr : scope.desc());
  // Copied now: a peer may reuse the published words two steps later.
  int inArena = 0;
  uint64_t votes = 0;
  for (int p = 0; p < c.nranks(); ++p) {
    for (int w = 0; w < 2; ++w) {
      // Arena offsets count only where peers' arenas are mapped for this collective: below
      // the arena threshold, or before the arenas were mapped, they are ordinary memory.
      offsets_[slot(p, w)] = arena ? c.control(p)->xfer[s & 1][w] : kNotInArena;
      addrs_[slot(p, w)] = c.control(p)->xfer[s & 1][2 + w];
      lens_[slot(p, w)] = c.control(p)->xfer[s & 1][4 + w];
      inArena += offsets_[slot(p, w)] != kNotInArena;
    }
    votes |= c.control(p)->xfer[s & 1][6];
  }
  if (PathAdvisor::decide(votes)) cma_ = true;
  anyInArena_ = inArena != 0;
  SPYRECCL_LOG(kTrace, c.who().c_str(),
               "%s: %d of %d published buffers are in arenas; votes 0x%llx, single copy %s",
               c.opLabel().c_str(), inArena, 2 * c.nranks(), static_cast<unsigned long long>(votes),
               cma_ ? "on" : "off");
}

bool DirectTransfer::allHave(int which, int except) const {
  for (int p = 0; p < c_.nranks(); ++p) {
    if (p != except && !has(p, which)) return false;
  }
  return true;
}

bool DirectTransfer::has(int p, int which) const {
  // A rank's own buffers are always "reachable"; a null buffer (count 0) publishes
  // address 0, which cross-memory attach never reads (copies of 0 bytes are skipped).
  return inArena(p, which) || (cma_ && (addrs_[slot(p, which)] != 0 || p == c_.rank()));
}

void DirectTransfer::copyFrom(int p, int which, size_t off, uint8_t* dst, size_t len,
                              bool stream) const {
  if (len == 0) return;
  if (inArena(p, which)) {
    kernels::copy(dst, peer(p, which) + off, len, stream);
    return;
  }
  // Never outside what the owner announced: a disagreement here is a bug, not a reason
  // to read whatever lies beyond a peer's buffer.
  const uint64_t have = lens_[slot(p, which)];
  if (!cma_ || off > have || len > have - off) {
    SPYRECCL_THROW(spyrecclInternalError,
                   "%s: internal error: read of bytes [%zu, %zu) of rank %d's buffer %d, which "
                   "it announced with %llu bytes (cross-memory attach %s)",
                   c_.opLabel().c_str(), off, off + len, p, which,
                   static_cast<unsigned long long>(have), cma_ ? "on" : "off");
  }
  c_.cmaRead(p, dst, addrs_[slot(p, which)] + off, len, "a direct transfer");
}

size_t cmaBusyThreshold(const Communicator& c, Kind kind) {
  if (c.config().cmaMinBytes != 0) return c.config().cmaMinBytes;
  // The allreduce's direct algorithm reads every byte across processes twice (the reduce
  // phase, then the owners' results): on a quiet machine it took twice the staged
  // pipeline's time at every size, but with the CPUs contended the staged pipeline stalls at
  // every step (two busy loops on a 2-vCPU AMD EPYC machine: 4 MiB 24 vs 12 ms single copy, 16 MiB
  // 68 vs 11 ms; docs/notes/core-single-copy.md, "Large messages: the vote at every size"). From 2
  // MiB, where the vote's extra step costs at most ~1 % of the call, it is voted like the others.
  return kind == Kind::kAllReduce ? size_t{2} << 20 : size_t{64} << 10;
}

size_t cmaVoteThreshold(const Communicator& c, Kind kind) {
  const size_t busy = cmaBusyThreshold(c, kind);
  if (c.config().cmaMinBytes != 0 || kind == Kind::kAllReduce) return busy;
  return std::min(busy, c.cmaVoteFloor());
}

size_t cmaThreshold(const Communicator& c, Kind kind) {
  if (c.config().cmaMinBytes != 0) return c.config().cmaMinBytes;
  // The quiet threshold: where a rank whose path advisor is off (SPYRECCL_CMA_ADAPTIVE=0)
  // votes for the single copy; with the advisor on (the default) measured speed decides at
  // every size (path_advisor.h). Bytes as passed to beginDirect (kNone: a send/recv
  // message). Crossovers against the staged algorithms, measured interleaved at 2 ranks on
  // a 2-vCPU AMD EPYC machine (docs/notes/core-single-copy.md, "Single copy for any memory"):
  // process_vm_readv copies at 10-15 GB/s, about half of a cached memcpy, and one process does it
  // alone while the staged paths copy in and out on both ranks' cores at once. So the single copy
  // only wins once the message is far beyond the cache, where the staged copies are bound by memory
  // bandwidth twice; earliest for send/recv (its staging ring is only 2 x 256 KiB). The allreduce's
  // direct algorithm reads every byte twice across processes (reduce phase, then the owners'
  // results), so through CMA it never beat the staged pipeline on a quiet machine (it does on a
  // contended one: cmaBusyThreshold).
  switch (kind) {
    case Kind::kNone:
      return size_t{16} << 20;
    case Kind::kAllReduce:
      return SIZE_MAX;
    default:
      return size_t{32} << 20;
  }
}

bool cmaFixed(const Communicator& c, size_t bytes) {
  return c.config().cmaMinBytes != 0 && bytes >= c.config().cmaMinBytes;
}

uint64_t cmaVote(const Communicator& c, uint32_t advisorKind, size_t bytes, int64_t nowNs,
                 bool quietCma, bool contention) {
  uint64_t vote = c.pathAdvisor().vote(advisorKind, bytes, nowNs, quietCma);
  if (contention && transport::cpusContended()) vote |= PathAdvisor::kContended;
  return vote;
}

bool beginDirect(Communicator& c, OpScope& scope, size_t bytes, std::optional<DirectTransfer>& x,
                 const void* a, size_t aBytes, const void* b, size_t bBytes) {
  bool announced = false;
  const Kind kind = static_cast<Kind>(scope.desc()->kind);
  // SPYRECCL_CMA_MIN_BYTES fixes the path; otherwise the ranks vote from the vote floor up,
  // at every size (every rank computes the same window: it depends on the size and the
  // communicator's agreed settings only, the floor included, never on a rank's own advisor
  // mode).
  const bool cma = c.cmaOn() && cmaFixed(c, bytes);
  const bool voted = !cma && c.cmaOn() && bytes >= cmaVoteThreshold(c, kind);
  // Read the clock only for a voted collective: a small one (an 8-byte broadcast takes
  // about 0.4 us) would pay it for nothing.
  const int64_t startNs = voted ? nowNs() : 0;
  if (!c.directCapable(bytes, cma || voted, scope.desc(), &announced)) return false;
  const bool arena = c.directOn() && bytes >= c.config().directMinBytes;
  const uint64_t vote =
      voted ? cmaVote(c, scope.desc()->kind, bytes, startNs, bytes >= cmaThreshold(c, kind),
                      bytes >= cmaBusyThreshold(c, kind))
            : 0;
  x.emplace(c, scope, announced, arena, cma, vote, a, aBytes, b, bBytes);
  // The path the votes chose is timed to the collective's end, when it concerns ordinary
  // memory only (a path through arenas is neither of the two the advisor compares). From
  // before the step that publishes the votes: a rank that is preempted in that step (ranks
  // sharing a CPU) may find its peers done with the whole transfer when it resumes, and a
  // window opened after the step would then time nothing (a 2 MiB single-copy broadcast's
  // root: 90 ns every other call).
  if (voted && !x->anyInArena() && c.pathAdvisor().enabled()) {
    scope.timePath(bytes, x->cma(), startNs);
  }
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
  // with the same bits. With peers read through scratch (cross-memory attach) our block is
  // copied there too when aliased, which keeps rank order: the same order, hence the same
  // bits, as the staged algorithms, whichever path the contention vote picks.
  const uint8_t* mine = own + off * esize;
  const bool aliased = dst == mine;
  bool staged = false;
  for (int q = 0; q < n; ++q) staged = staged || (q != r && !x.inArena(q, which));
  // Peers' buffers outside arenas are read into scratch, a block at a time that stays in
  // the L2 cache between the read and the reduction.
  constexpr size_t kBlockBytes = 64 << 10;
  const size_t block = staged ? std::max<size_t>(1, kBlockBytes / esize) : len;
  thread_local std::vector<uint8_t> scratch;
  if (staged && scratch.size() < static_cast<size_t>(n) * kBlockBytes + esize) {
    scratch.resize(static_cast<size_t>(n) * kBlockBytes + esize);
  }
  const bool ownCopy = staged && aliased && r != 0;
  for (size_t b = 0; b < len; b += block) {
    const size_t bl = std::min(block, len - b);
    int i = 0;
    if (aliased && !ownCopy) srcs[i++] = mine + b * esize;
    for (int q = 0; q < n; ++q) {
      if (q == r) {
        if (ownCopy) {
          uint8_t* tmp = scratch.data() + static_cast<size_t>(r) * kBlockBytes;
          kernels::copy(tmp, mine + b * esize, bl * esize);
          srcs[i++] = tmp;
        } else if (!aliased) {
          srcs[i++] = mine + b * esize;
        }
      } else if (x.inArena(q, which)) {
        srcs[i++] = x.peer(q, which) + (off + b) * esize;
      } else {
        uint8_t* tmp = scratch.data() + static_cast<size_t>(q) * kBlockBytes;
        x.copyFrom(q, which, (off + b) * esize, tmp, bl * esize, false);
        srcs[i++] = tmp;
      }
    }
    kernels::reduce(spec, dst + b * esize, srcs, n, bl, stream);
  }
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
      x.copyFrom(q, 1, off * esize, recv + off * esize, len * esize, stream);
    }
  }
  x.close();
}

}  // namespace spyreccl::algorithms
