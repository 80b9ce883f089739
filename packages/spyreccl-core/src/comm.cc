#include "comm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <thread>

#include "common/env.h"
#include "common/log.h"
#include "memory/arena.h"
#include "transport/cma.h"
#include "transport/wait.h"

namespace spyreccl {

using transport::Descriptor;
using transport::RankControl;

// ---------------------------------------------------------------------------------------
// configuration
// ---------------------------------------------------------------------------------------

namespace {

constexpr size_t kMinChunkBytes = 16 << 10;
constexpr size_t kMaxChunkBytes = size_t{1} << 30;
constexpr size_t kMinP2PChunkBytes = 4 << 10;

template <class Field>
bool covers(const spyrecclConfig_t* c, size_t offset) {
  return c->size >= offset + sizeof(Field);
}

const char* resultName(int code) {
  switch (code) {
    case spyrecclSuccess:
      return "spyrecclSuccess";
    case spyrecclSystemError:
      return "spyrecclSystemError";
    case spyrecclInternalError:
      return "spyrecclInternalError";
    case spyrecclInvalidArgument:
      return "spyrecclInvalidArgument";
    case spyrecclInvalidUsage:
      return "spyrecclInvalidUsage";
    case spyrecclRemoteError:
      return "spyrecclRemoteError";
    case spyrecclTimeout:
      return "spyrecclTimeout";
    case spyrecclAborted:
      return "spyrecclAborted";
    case spyrecclMismatch:
      return "spyrecclMismatch";
    case spyrecclUnsupported:
      return "spyrecclUnsupported";
  }
  return "unknown result";
}

bool isFloating(spyrecclDataType_t t) {
  return t == spyrecclFloat16 || t == spyrecclFloat32 || t == spyrecclFloat64 ||
         t == spyrecclBfloat16 || t == spyrecclFloat8e4m3 || t == spyrecclFloat8e5m2;
}

}  // namespace

CommConfig resolveConfig(const spyrecclConfig_t* config, int nranks, const char* op,
                         const CommConfig* inherit) {
  CommConfig c;
  if (inherit != nullptr) {
    c = *inherit;
  } else {
    c.chunkBytes = envBytes("SPYRECCL_CHUNK_BYTES", c.chunkBytes);
    c.p2pChunkBytes = envBytes("SPYRECCL_P2P_CHUNK_BYTES", c.p2pChunkBytes);
    if (envString("SPYRECCL_ALLREDUCE_ONESHOT_MAX")) {
      c.oneshotMaxBytes = envBytes("SPYRECCL_ALLREDUCE_ONESHOT_MAX", c.oneshotMaxBytes);
      c.oneshotAuto = false;
    }
    c.direct = envFlag("SPYRECCL_DIRECT", c.direct);
    c.directMinBytes = envBytes("SPYRECCL_DIRECT_MIN_BYTES", c.directMinBytes);
    c.cma = envFlag("SPYRECCL_CMA", c.cma);
    c.cmaMinBytes = envBytes("SPYRECCL_CMA_MIN_BYTES", c.cmaMinBytes);
    c.cmaVoteProposal = envBytes("SPYRECCL_CMA_VOTE_MIN_BYTES", c.cmaVoteProposal);
    c.spinMaxNs =
        static_cast<int64_t>(envBytes("SPYRECCL_SPIN_MAX_NS", static_cast<size_t>(c.spinMaxNs)));
    c.yieldNs = static_cast<int64_t>(envBytes("SPYRECCL_YIELD_NS", static_cast<size_t>(c.yieldNs)));
    c.eagerMaxBytes = envBytes("SPYRECCL_EAGER_BROADCAST_MAX_BYTES", c.eagerMaxBytes);
  }
  if (config != nullptr) {
    SPYRECCL_CHECK_ARG(config->size >= offsetof(spyrecclConfig_t, version) + sizeof(unsigned), op,
                       "argument 'config' has size %zu, too small for a spyrecclConfig_t "
                       "(initialise it with SPYRECCL_CONFIG_INITIALIZER)",
                       config->size);
    SPYRECCL_CHECK_ARG(config->magic == SPYRECCL_CONFIG_MAGIC, op,
                       "argument 'config' has magic 0x%08x, expected SPYRECCL_CONFIG_MAGIC "
                       "0x%08x (initialise it with SPYRECCL_CONFIG_INITIALIZER)",
                       config->magic, SPYRECCL_CONFIG_MAGIC);
    SPYRECCL_CHECK_ARG(config->version >= 1, op, "argument 'config' has version %u, expected >= 1",
                       config->version);
    if (covers<int64_t>(config, offsetof(spyrecclConfig_t, timeoutMs))) {
      SPYRECCL_CHECK_ARG(config->timeoutMs > 0, op,
                         "argument 'config->timeoutMs' = %lld must be > 0",
                         static_cast<long long>(config->timeoutMs));
      c.timeoutMs = config->timeoutMs;
    }
    if (covers<size_t>(config, offsetof(spyrecclConfig_t, chunkBytes)) && config->chunkBytes) {
      c.chunkBytes = config->chunkBytes;
    }
    if (covers<size_t>(config, offsetof(spyrecclConfig_t, p2pChunkBytes)) &&
        config->p2pChunkBytes) {
      c.p2pChunkBytes = config->p2pChunkBytes;
    }
    if (covers<const char*>(config, offsetof(spyrecclConfig_t, name)) && config->name) {
      c.name = config->name;
    }
    if (covers<int64_t>(config, offsetof(spyrecclConfig_t, yieldNs))) {
      SPYRECCL_CHECK_ARG(config->yieldNs >= -1, op,
                         "argument 'config->yieldNs' = %lld must be >= 0 (ns), or -1 for the "
                         "default",
                         static_cast<long long>(config->yieldNs));
      if (config->yieldNs >= 0) c.yieldNs = config->yieldNs;
    }
  }
  SPYRECCL_CHECK_ARG(c.chunkBytes <= kMaxChunkBytes, op,
                     "chunkBytes = %zu exceeds the maximum of %zu", c.chunkBytes, kMaxChunkBytes);
  SPYRECCL_CHECK_ARG(c.p2pChunkBytes <= kMaxChunkBytes, op,
                     "p2pChunkBytes = %zu exceeds the maximum of %zu", c.p2pChunkBytes,
                     kMaxChunkBytes);
  SPYRECCL_CHECK_ARG(c.eagerMaxBytes <= transport::kEagerMaxBytes, op,
                     "SPYRECCL_EAGER_BROADCAST_MAX_BYTES = %zu exceeds the largest one-way "
                     "broadcast, %zu bytes (0 turns one-way broadcasts off)",
                     c.eagerMaxBytes, transport::kEagerMaxBytes);
  // Every rank must derive the same sizes: only deterministic rounding below. Each rank's
  // share of a chunk must stay a useful size (>= 256 bytes) even for many ranks.
  c.chunkBytes = transport::alignUp(
      std::max({c.chunkBytes, kMinChunkBytes, static_cast<size_t>(nranks) * 256}),
      transport::kPage);
  c.p2pChunkBytes =
      transport::alignUp(std::max(c.p2pChunkBytes, kMinP2PChunkBytes), transport::kCacheLine);
  return c;
}

// ---------------------------------------------------------------------------------------
// lifetime
// ---------------------------------------------------------------------------------------

Communicator::Communicator(int rank, int nranks, CommConfig config,
                           std::unique_ptr<transport::Segment> segment, std::vector<pid_t> pids,
                           int cpus)
    : rank_(rank),
      nranks_(nranks),
      config_(std::move(config)),
      timeoutMs_(config_.timeoutMs),
      segment_(std::move(segment)),
      layout_(nranks, config_.chunkBytes, config_.p2pChunkBytes),
      cpus_(cpus),
      spin_{nranks <= cpus, config_.spinMaxNs, config_.yieldNs},
      p2p_(nranks),
      sources_(nranks),
      pids_(pids),
      peerArenas_(nranks),
      premul_(kMaxPreMulSum) {
  eager_.index.assign(nranks, 0);
  startTickClock();  // the flight recorder's time base (common/clock.h)
  who_ = format("rank %d/%d", rank, nranks);
  if (!config_.name.empty()) who_ += " '" + config_.name + "'";
  watches_.resize(nranks);
  for (int p = 0; p < nranks; ++p) {
    if (p == rank) continue;
    transport::PeerWatch w(pids[p]);
    if (w.dead()) {
      // The peer attached moments ago: a pid we cannot see lives in another pid
      // namespace. Do not watch it rather than report a false death.
      SPYRECCL_LOG(kWarn, who_.c_str(),
                   "cannot observe rank %d (pid %d) from this pid "
                   "namespace; its death will be noticed by timeout only",
                   p, pids[p]);
      continue;
    }
    watches_[p] = std::move(w);
  }
}

Communicator::~Communicator() {
  unmapPeerArenas();
  uint32_t expected = transport::kStatusActive;
  control(rank_)->status.compare_exchange_strong(expected, transport::kStatusDeparted,
                                                 std::memory_order_acq_rel);
  wakeAll();
}

// ---------------------------------------------------------------------------------------
// step protocol
// ---------------------------------------------------------------------------------------

void Communicator::exchange(uint32_t s, const Descriptor* announce) {
  RankControl* me = control(rank_);
  if (announce != nullptr) {  // published by the release below
    me->desc[s & 1] = *announce;
    me->desc[s & 1].eagerDigest = eager_.digest;
  }
  me->step.store(s, std::memory_order_release);
  transport::notify(&me->step, &me->stepSleepers);
  for (int k = 1; k < nranks_; ++k) waitPeerStep((rank_ + k) % nranks_, s);
  if (announce != nullptr) verifyDescriptors(s, *announce);
}

void Communicator::waitPeerStep(int peer, uint32_t s) {
  std::atomic<uint32_t>* word = &control(peer)->step;
  // Wrap-aware: steps are 32-bit and wrap after 4 billion steps.
  auto ready = [word, s] {
    return static_cast<int32_t>(word->load(std::memory_order_acquire) - s) >= 0;
  };
  auto describe = [this, s] {
    std::string missing;
    for (int p = 0; p < nranks_; ++p) {
      if (p == rank_) continue;
      if (static_cast<int32_t>(control(p)->step.load(std::memory_order_acquire) - s) < 0) {
        missing += missing.empty() ? "" : ", ";
        missing += std::to_string(p);
      }
    }
    if (missing.empty()) missing = "none";
    return format("rank(s) %s to reach step %u", missing.c_str(), s);
  };
  auto behind = [this, s](int p) {
    return static_cast<int32_t>(control(p)->step.load(std::memory_order_acquire) - s) < 0;
  };
  transport::waitUntil(spin_, word, &control(peer)->stepSleepers, ready,
                       [&](int64_t waited, bool full) {
                         if (!pendingP2P_.empty()) progressPendingP2P();
                         checkWait(waited, full, nullptr, ready, describe, behind);
                         if (full) checkPeerCalls(s);
                       });
}

void Communicator::checkPeerCalls(uint32_t s) const {
  const Descriptor& mine = current_;
  if (mine.seq == 0) return;  // a step outside any collective (the init probes)
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_) continue;
    // opSeq before step: a peer that released a later call has published every step of
    // the earlier ones, so a peer seen past our call and still behind our step skipped it.
    const uint64_t theirSeq = eager(p)->opSeq.load(std::memory_order_acquire);
    if (static_cast<int32_t>(control(p)->step.load(std::memory_order_acquire) - s) >= 0) continue;
    if (theirSeq < mine.seq) continue;  // not there yet
    Descriptor theirs{};
    const bool known = peerCall(p, mine.seq, &theirs);
    if (known && algorithms::sameCall(theirs, mine) && theirSeq == mine.seq) continue;
    SPYRECCL_THROW(spyrecclMismatch, "%s: rank %d called %s but %s", opLabel().c_str(), rank_,
                   algorithms::describe(mine).c_str(), describePeerCall(p, mine.seq).c_str());
  }
}

bool Communicator::peerCall(int peer, uint64_t seq, Descriptor* out) const {
  const transport::EagerControl* e = eager(peer);
  if (seq == 0 || e->opSeq.load(std::memory_order_acquire) < seq) return false;
  const Descriptor d = e->history[seq % transport::kHistoryCalls].load();
  // The entry is overwritten only by call seq + kHistoryCalls, released through opSeq.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (e->opSeq.load(std::memory_order_relaxed) >= seq + transport::kHistoryCalls) return false;
  *out = d;
  return d.seq == seq;
}

std::string Communicator::describePeerCall(int peer, uint64_t seq) const {
  Descriptor theirs{};
  if (peerCall(peer, seq, &theirs)) {
    return format("rank %d called %s as its collective seq %llu", peer,
                  algorithms::describe(theirs).c_str(), static_cast<unsigned long long>(seq));
  }
  const uint64_t now = eager(peer)->opSeq.load(std::memory_order_acquire);
  Descriptor latest{};
  const bool known = peerCall(peer, now, &latest);
  return format(
      "rank %d called another collective as its collective seq %llu (it is now at seq "
      "%llu%s%s)",
      peer, static_cast<unsigned long long>(seq), static_cast<unsigned long long>(now),
      known ? ", " : "", known ? algorithms::describe(latest).c_str() : "");
}

void Communicator::verifyDescriptors(uint32_t s, const Descriptor& mine) const {
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_) continue;
    const Descriptor& theirs = control(p)->desc[s & 1];
    if (algorithms::sameCall(theirs, mine)) continue;
    if (theirs.seq != mine.seq) {
      // The ranks are at different calls: one-way broadcasts take no step, so the first
      // call that differs is at the smaller sequence number; name both calls there.
      const uint64_t first = std::min(theirs.seq, mine.seq);
      Descriptor ours{}, peers{};
      if (peerCall(rank_, first, &ours) && peerCall(p, first, &peers) &&
          !algorithms::sameCall(ours, peers)) {
        SPYRECCL_THROW(spyrecclMismatch,
                       "%s: rank %d called %s as its collective seq %llu but rank %d called %s",
                       opLabel().c_str(), rank_, algorithms::describe(ours).c_str(),
                       static_cast<unsigned long long>(first), p,
                       algorithms::describe(peers).c_str());
      }
    }
    std::string peerSeq =
        theirs.seq != mine.seq
            ? format(" as its collective seq %llu", static_cast<unsigned long long>(theirs.seq))
            : std::string();
    SPYRECCL_THROW(spyrecclMismatch, "%s: rank %d called %s but rank %d called %s%s",
                   opLabel().c_str(), rank_, algorithms::describe(mine).c_str(), p,
                   algorithms::describe(theirs).c_str(), peerSeq.c_str());
  }
  // The arguments agree; so must the one-way broadcasts before this call, whose mismatches
  // only their receivers could see in the call (algorithms/eager.h).
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_) continue;
    const Descriptor& theirs = control(p)->desc[s & 1];
    if (theirs.eagerDigest == eager_.digest) continue;
    const transport::EagerControl* e = eager(p);
    auto latest = [](const transport::EagerControl* ec) {
      const uint64_t completed = ec->completed.load(std::memory_order_relaxed);
      if (completed == 0) return std::string("none");
      const Descriptor last = ec->lastEager.load();
      return format("%llu, the latest %s as its collective seq %llu",
                    static_cast<unsigned long long>(completed), algorithms::describe(last).c_str(),
                    static_cast<unsigned long long>(last.seq));
    };
    SPYRECCL_THROW(spyrecclMismatch,
                   "%s: the one-way small broadcasts before it differ: rank %d called broadcasts "
                   "(%s) but rank %d called broadcasts (%s); the calls of every rank must match",
                   opLabel().c_str(), rank_, latest(eager(rank_)).c_str(), p, latest(e).c_str());
  }
}

// ---------------------------------------------------------------------------------------
// direct transfers
// ---------------------------------------------------------------------------------------

bool Communicator::directCapable(size_t bytes, bool cma, const Descriptor* announce,
                                 bool* announced) {
  if (!config_.direct || nranks_ < 2) return false;
  if (bytes >= config_.directMinBytes && directState_ == DirectState::kUnknown) {
    probeDirect(announce);
    if (announced != nullptr) *announced = true;
  }
  return (bytes >= config_.directMinBytes && directState_ == DirectState::kOn) || cma;
}

void Communicator::probeDirect(const Descriptor* announce) {
  // Step 1: everyone publishes its arena's descriptor number and size, or "none" when it
  // has not allocated from its arena yet. If any rank has none, every rank sees that and
  // the probe is simply repeated at a later collective (one step each time; processes
  // that never use spyrecclMemAlloc never get an arena). Otherwise each rank maps every
  // peer's arena, and step 2 publishes whether that worked: the feature is used only
  // when every rank mapped every peer, so all ranks take the same path from then on, and
  // a refused mapping disables it for good.
  constexpr uint64_t kNone = ~0ull;
  const memory::Arena* arena = memory::Arena::existing();
  if (arena != nullptr && !arena->shareable()) arena = nullptr;  // a forked child's
  const uint32_t s = beginStep();
  control(rank_)->xfer[s & 1][0] = arena ? static_cast<uint64_t>(arena->fd()) : kNone;
  control(rank_)->xfer[s & 1][1] = arena ? arena->size() : 0;
  exchange(s, announce);
  for (int p = 0; p < nranks_; ++p) {
    if (control(p)->xfer[s & 1][0] == kNone) return;  // still unknown: retried later
  }
  int failedPeer = -1, failedErr = 0;
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_) continue;
    const uint64_t fd = control(p)->xfer[s & 1][0];
    const uint64_t size = control(p)->xfer[s & 1][1];
    size_t mapped = 0;
    int err = 0;
    const uint8_t* base = memory::mapPeerArena(pids_[p], static_cast<int>(fd), &mapped, &err);
    if (base != nullptr && mapped != size) {
      ::munmap(const_cast<uint8_t*>(base), mapped);
      base = nullptr;
      err = EINVAL;  // another file behind that descriptor (pid namespaces, pid reuse)
    }
    if (base != nullptr) {
      peerArenas_[p] = PeerArena{base, mapped};
    } else if (failedPeer < 0) {
      failedPeer = p;
      failedErr = err;
    }
  }
  const uint32_t s2 = beginStep();
  control(rank_)->xfer[s2 & 1][0] = failedPeer < 0 ? 1 : 0;
  exchange(s2);
  bool all = true;
  for (int p = 0; p < nranks_; ++p) all = all && control(p)->xfer[s2 & 1][0] == 1;
  directState_ = all ? DirectState::kOn : DirectState::kOff;
  if (!all) unmapPeerArenas();
  if (failedPeer >= 0) {
    SPYRECCL_LOG(kInfo, who_.c_str(),
                 "direct transfers disabled: cannot map the memory arena of rank %d "
                 "(pid %d): %s; large collectives are staged through the segment",
                 failedPeer, pids_[failedPeer], std::strerror(failedErr));
  } else if (!all) {
    SPYRECCL_LOG(kInfo, who_.c_str(),
                 "direct transfers disabled: a peer cannot map this rank's memory arena");
  }
}

// ---------------------------------------------------------------------------------------
// single-copy transfers (cross-memory attach)
// ---------------------------------------------------------------------------------------

void Communicator::probeCma() {
  if (nranks_ < 2) {
    eagerMax_ = 0;  // nobody to broadcast to
    return;
  }
  using algorithms::PathAdvisor;
  constexpr int kSizes = PathAdvisor::kProbeSizes;
  // The timing probe needs a staging slot that holds every probe size side by side, and an
  // advisor that will use what it finds; SPYRECCL_CMA_MIN_BYTES fixes the path instead.
  const bool timing = config_.cma && config_.cmaMinBytes == 0 && advisor_.enabled() &&
                      layout_.chunkBytes() >= PathAdvisor::kProbeRegionBytes;
  // Our probe buffer: ordinary memory a peer reads with process_vm_readv, written (so
  // resident and in our cache, as a buffer just computed) before we publish it.
  std::vector<uint8_t> mineBuf(timing ? PathAdvisor::kProbeRegionBytes : 0);
  std::vector<uint8_t> scratch(mineBuf.size());
  for (size_t i = 0; i < mineBuf.size(); ++i) mineBuf[i] = static_cast<uint8_t>(i * 131 + rank_);
  // Step 1: the address of a word of our memory and the value it holds (0: this rank does
  // not offer CMA, SPYRECCL_CMA=0), and of the probe buffer (0: no timing). The word lives
  // in this object and the buffer in this frame, so both are valid for as long as a peer
  // could read them (until step 2 completes).
  const uint64_t magic = 0x5350434d41000000ull ^ static_cast<uint64_t>(::getpid());
  volatile uint64_t word = magic;
  if (config_.cma) transport::allowPeerAccess();
  const uint32_t s = beginStep();
  const int peer = (rank_ + 1) % nranks_;
  int64_t stagedNs[kSizes] = {}, cmaNs[kSizes] = {};
  if (timing) {
    // The staged path's first copy, into our staging slot, as a staged broadcast's root
    // does it; the slot's pages and the peer's slot are touched first (a real call finds
    // them mapped), so that the times hold copies, not page faults.
    uint8_t* slot = staging(rank_, s);
    std::memset(slot, 0, PathAdvisor::kProbeRegionBytes);
    const uint8_t* theirs = staging(peer, s);
    uint8_t sink = 0;
    for (size_t off = 0; off < PathAdvisor::kProbeRegionBytes; off += transport::kPage) {
      sink ^= reinterpret_cast<const volatile uint8_t*>(theirs)[off];
    }
    (void)sink;
    size_t off = 0;
    for (int i = 0; i < kSizes; ++i) {
      const int64_t t0 = nowNs();
      kernels::copy(slot + off, mineBuf.data() + off, PathAdvisor::kProbeBytes[i]);
      stagedNs[i] = nowNs() - t0;
      off += PathAdvisor::kProbeBytes[i];
    }
  }
  control(rank_)->xfer[s & 1][0] = config_.cma ? reinterpret_cast<uintptr_t>(&word) : 0;
  control(rank_)->xfer[s & 1][1] = magic;
  control(rank_)->xfer[s & 1][2] = timing ? reinterpret_cast<uintptr_t>(mineBuf.data()) : 0;
  exchange(s);
  int failedPeer = -1, failedErr = 0;
  bool offered = true;
  for (int p = 0; p < nranks_; ++p) {
    const uint64_t addr = control(p)->xfer[s & 1][0];
    const uint64_t expect = control(p)->xfer[s & 1][1];
    if (addr == 0) offered = false;
    if (!config_.cma || p == rank_ || addr == 0 || failedPeer >= 0) continue;
    uint64_t seen = 0;
    int err = transport::cmaRead(pids_[p], &seen, addr, sizeof seen);
    if (err == 0 && seen != expect) err = EINVAL;  // another process behind that pid
    if (err != 0) {
      failedPeer = p;
      failedErr = err;
    }
  }
  bool ok = offered && failedPeer < 0;
  // The timing probe, against our successor: the staged path's second copy (out of its
  // staging slot, which it just wrote), then the single copy of the same sizes from its
  // ordinary memory. Each size has its own region, so no read finds lines an earlier one
  // brought in.
  const uint64_t theirBuf = control(peer)->xfer[s & 1][2];
  if (timing && ok && theirBuf != 0) {
    const uint8_t* theirs = staging(peer, s);
    size_t off = 0;
    for (int i = 0; i < kSizes && ok; ++i) {
      const size_t len = PathAdvisor::kProbeBytes[i];
      int64_t t0 = nowNs();
      kernels::copy(scratch.data() + off, theirs + off, len);
      stagedNs[i] += nowNs() - t0;
      t0 = nowNs();
      const int err = transport::cmaRead(pids_[peer], scratch.data() + off, theirBuf + off, len);
      cmaNs[i] = nowNs() - t0;
      if (err != 0) {
        failedPeer = peer;
        failedErr = err;
        ok = false;
      }
      off += len;
    }
  } else {
    for (int i = 0; i < kSizes; ++i) stagedNs[i] = cmaNs[i] = 0;
  }
  // This rank's proposal of the vote floor: SPYRECCL_CMA_VOTE_MIN_BYTES when set (tests:
  // ranks that propose different floors must still agree), else its probe's.
  const size_t proposal = config_.cmaVoteProposal != 0 ? config_.cmaVoteProposal
                                                       : PathAdvisor::voteFloor(stagedNs, cmaNs);
  // Step 2: agree. Every rank publishes its verdict; CMA is used only if all succeeded. The
  // vote floor is the smallest proposal: the ranks vote wherever one rank's probe found the
  // single copy worth measuring (their votes then decide, as above the floor). The largest
  // one-way broadcast is agreed here too (the smallest proposal), since a root and its
  // receivers must take the same path.
  const uint32_t s2 = beginStep();
  control(rank_)->xfer[s2 & 1][0] = ok ? 1 : 0;
  control(rank_)->xfer[s2 & 1][1] = proposal;
  control(rank_)->xfer[s2 & 1][2] = config_.eagerMaxBytes;
  exchange(s2);
  bool all = true;
  size_t floor = SIZE_MAX;
  int floorRank = 0;
  size_t eagerMax = transport::kEagerMaxBytes;
  for (int p = 0; p < nranks_; ++p) {
    eagerMax = std::min<size_t>(eagerMax, control(p)->xfer[s2 & 1][2]);
    all = all && control(p)->xfer[s2 & 1][0] == 1;
    const size_t theirs = control(p)->xfer[s2 & 1][1];
    if (theirs < floor) {
      floor = theirs;
      floorRank = p;
    }
  }
  (void)word;
  eagerMax_ = static_cast<int64_t>(eagerMax);
  cmaOn_ = all;
  if (all) {
    cmaState_ = "on";
  } else if (!offered) {
    cmaState_ = "off (SPYRECCL_CMA=0 on some rank)";
  } else if (failedPeer >= 0) {
    cmaState_ = format("off (process_vm_readv of rank %d, pid %d: %s)", failedPeer,
                       pids_[failedPeer], std::strerror(failedErr));
  } else {
    cmaState_ = "off (a peer cannot read this rank's memory)";
  }
  if (all) {
    cmaVoteFloor_ = floor;
    std::string times;
    for (int i = 0; i < kSizes; ++i) {
      times += format("%s%zu KiB %.2f/%.2f us", i ? ", " : "", PathAdvisor::kProbeBytes[i] >> 10,
                      static_cast<double>(stagedNs[i]) / 1e3, static_cast<double>(cmaNs[i]) / 1e3);
    }
    cmaCalibration_ = format(
        "the ranks vote staged/single copy from %zu bytes (rank %d's proposal; this rank's: "
        "%zu bytes%s; its probe of rank %d, staged/single copy: %s)",
        floor, floorRank, proposal,
        config_.cmaVoteProposal != 0 ? ", from SPYRECCL_CMA_VOTE_MIN_BYTES" : "", peer,
        timing ? times.c_str() : "not timed");
  } else {
    cmaCalibration_ = "staged at every size (no single copy)";
  }
  SPYRECCL_LOG(kInfo, who_.c_str(), "single-copy transfers of ordinary memory (CMA): %s%s; %s",
               cmaState_.c_str(), all ? "" : "; they are staged through the segment",
               cmaCalibration_.c_str());
}

void Communicator::cmaRead(int peer, void* dst, uint64_t remote, size_t len, const char* what) {
  const int err = transport::cmaRead(pids_[peer], dst, remote, len);
  if (err == 0) {
    cmaReads_.fetch_add(1, std::memory_order_relaxed);
    cmaBytes_.fetch_add(len, std::memory_order_relaxed);
    return;
  }
  // A peer that failed or died while we copied its buffer: report it the usual way.
  const uint32_t status = control(peer)->status.load(std::memory_order_acquire);
  if (err == ESRCH) {
    // The kernel drops a killed process's memory before it marks the process exited, so
    // ESRCH can come first: give the exit a moment (bounded) to finish, so that the report
    // and its state dump show the peer as exited, as a death seen by the liveness watch does.
    for (int i = 0; i < 200 && !watches_[peer].dead(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  if (status != transport::kStatusActive || watches_[peer].dead() || err == ESRCH) {
    throwPeerFailure(peer, format("%s (process_vm_readv: %s)", what, std::strerror(err)));
  }
  SPYRECCL_THROW(spyrecclRemoteError,
                 "%s: cannot read %zu bytes of rank %d's buffer at 0x%llx (pid %d) for %s: "
                 "process_vm_readv: %s",
                 opLabel().c_str(), len, peer, static_cast<unsigned long long>(remote), pids_[peer],
                 what, std::strerror(err));
}

void Communicator::unmapPeerArenas() {
  for (PeerArena& a : peerArenas_) {
    if (a.base != nullptr) ::munmap(const_cast<uint8_t*>(a.base), a.bytes);
    a = PeerArena{};
  }
}

// ---------------------------------------------------------------------------------------
// operation bookkeeping
// ---------------------------------------------------------------------------------------

std::string Communicator::opLabel() const {
  if (!customLabel_.empty()) return customLabel_;
  return format("%s seq %llu", algorithms::kindName(curKind_),
                static_cast<unsigned long long>(seq_));
}

void Communicator::openSlot(FlightSlot& slot) {
  // Only the owner thread writes, so it can read the version without a RMW operation.
  slot.version.store(slot.version.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  // Orders the odd version before the field stores below (pairs with readSlot's acquire
  // fence): a reader that sees any new field value also sees the version change.
  std::atomic_thread_fence(std::memory_order_release);
}

void Communicator::closeSlot(FlightSlot& slot) {
  slot.version.store(slot.version.load(std::memory_order_relaxed) + 1, std::memory_order_release);
}

bool Communicator::readSlot(uint64_t index, FlightRecord* out) const {
  const FlightSlot& slot = records_[index % kFlightRecords];
  // The writer holds a slot odd for a few stores; a reader only spins long when the
  // writer was preempted right then. Give up after a while rather than wait on it.
  for (int attempt = 0; attempt < 10000; ++attempt) {
    const uint32_t v1 = slot.version.load(std::memory_order_acquire);
    if (v1 & 1) {
      transport::cpuRelax();
      continue;
    }
    const uint64_t held = slot.index.load(std::memory_order_relaxed);
    uint64_t words[kDescWords];
    for (int w = 0; w < kDescWords; ++w) words[w] = slot.desc[w].load(std::memory_order_relaxed);
    out->startTicks = slot.startTicks.load(std::memory_order_relaxed);
    out->endTicks = slot.endTicks.load(std::memory_order_relaxed);
    out->firstStep = slot.firstStep.load(std::memory_order_relaxed);
    out->state = slot.state.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (slot.version.load(std::memory_order_relaxed) != v1) continue;  // torn: again
    if (held != index) return false;  // overwritten by a later record
    std::memcpy(&out->d, words, sizeof out->d);
    return true;
  }
  return false;
}

Descriptor Communicator::beginOp(Descriptor d) {
  d.seq = ++seq_;
  curKind_ = d.kind;
  current_ = d;
  {
    // Our call, readable by peers that wait for us (checkPeerCalls, algorithms/eager.h).
    transport::EagerControl* e = eager(rank_);
    e->history[d.seq % transport::kHistoryCalls].store(d);
    e->opSeq.store(d.seq, std::memory_order_release);
  }
  customLabel_.clear();
  SPYRECCL_LOG(kTrace, who_.c_str(), "seq %llu %s: start at step %u",
               static_cast<unsigned long long>(d.seq), algorithms::describe(d).c_str(), step_ + 1);
  const uint64_t index = recordCount_.load(std::memory_order_relaxed);  // we are its writer
  FlightSlot& slot = records_[index % kFlightRecords];
  uint64_t words[kDescWords];
  std::memcpy(words, &d, sizeof d);
  openSlot(slot);
  slot.index.store(index, std::memory_order_relaxed);
  for (int w = 0; w < kDescWords; ++w) slot.desc[w].store(words[w], std::memory_order_relaxed);
  slot.startTicks.store(ticksNow(), std::memory_order_relaxed);
  slot.endTicks.store(0, std::memory_order_relaxed);
  slot.firstStep.store(step_ + 1, std::memory_order_relaxed);
  slot.state.store(kRunning, std::memory_order_relaxed);
  closeSlot(slot);
  // Publishes the record: a dump that sees the new count finds it complete.
  recordCount_.store(index + 1, std::memory_order_release);
  return d;
}

void Communicator::endOp(bool ok) {
  const uint64_t count = recordCount_.load(std::memory_order_relaxed);
  if (count == 0) return;
  FlightSlot& slot = records_[(count - 1) % kFlightRecords];
  const uint64_t end = ticksNow();
  openSlot(slot);
  slot.endTicks.store(end, std::memory_order_relaxed);
  slot.state.store(ok ? kDone : kFailed, std::memory_order_relaxed);
  closeSlot(slot);
  SPYRECCL_LOG(kTrace, who_.c_str(), "seq %llu %s: %s after %.1f us at step %u",
               static_cast<unsigned long long>(seq_), algorithms::kindName(curKind_),
               ok ? "done" : "failed",
               static_cast<double>(end - slot.startTicks.load(std::memory_order_relaxed)) *
                   nsPerTick() / 1e3,
               step_);
}

// ---------------------------------------------------------------------------------------
// failures
// ---------------------------------------------------------------------------------------

void Communicator::throwAborted(const std::string& waitingFor) const {
  SPYRECCL_THROW(spyrecclAborted, "%s: spyrecclCommAbort was called on %s while it waited for %s",
                 opLabel().c_str(), who_.c_str(), waitingFor.c_str());
}

void Communicator::throwPeerFailure(int peer, const std::string& waitingFor) const {
  const RankControl* pc = control(peer);
  uint32_t status = pc->status.load(std::memory_order_acquire);
  int pid = pc->pid.load(std::memory_order_relaxed);
  // What the peer said about itself is more precise than its death: a rank that failed
  // (e.g. timed out) and then exited is reported as failed.
  const bool dead = watches_[peer].dead();
  const char* exited = dead ? " and exited" : "";
  std::string what;
  if (status == transport::kStatusDeparted) {
    what = format("rank %d (pid %d) left the communicator (spyrecclCommDestroy)%s during %s", peer,
                  pid, exited, opLabel().c_str());
  } else if (status == transport::kStatusAborted) {
    what = format("rank %d (pid %d) aborted the communicator (spyrecclCommAbort)%s during %s", peer,
                  pid, exited, opLabel().c_str());
  } else if (status == transport::kStatusFailed) {
    // The peer's own words when it failed for a reason of its own (a mismatch only it could
    // see, a timeout); a remote error of its own already names the rank behind it, below.
    const int code = pc->failCode.load(std::memory_order_relaxed);
    std::string cause =
        code == spyrecclRemoteError
            ? std::string()
            : std::string(pc->failText, strnlen(pc->failText, transport::kFailTextBytes));
    what = format("rank %d (pid %d) failed with %s%s%s%s%s during %s", peer, pid, resultName(code),
                  cause.empty() ? "" : " (", cause.c_str(), cause.empty() ? "" : ")", exited,
                  opLabel().c_str());
  } else {
    what = format("rank %d (pid %d) died during %s", peer, pid, opLabel().c_str());
  }
  // A peer that failed with spyrecclRemoteError failed because of another rank. When a rank
  // died without a word, that death is the root cause: name it first. (The peer we waited
  // for may be a bystander: the dead rank had already passed this step when it was killed,
  // so only the bystander's failure shows on the step we wait on.)
  if (status == transport::kStatusFailed &&
      pc->failCode.load(std::memory_order_relaxed) == spyrecclRemoteError) {
    for (int q = 0; q < nranks_; ++q) {
      if (q == rank_ || q == peer) continue;
      const RankControl* qc = control(q);
      if (qc->status.load(std::memory_order_acquire) == transport::kStatusActive &&
          watches_[q].dead()) {
        what = format("rank %d (pid %d) died during %s; %s after it", q,
                      qc->pid.load(std::memory_order_relaxed), opLabel().c_str(), what.c_str());
        break;
      }
    }
  }
  std::string msg =
      format("%s (%s was waiting for %s)", what.c_str(), who_.c_str(), waitingFor.c_str());
  throw Error(spyrecclRemoteError, withDump(msg), __FILE__, __LINE__);
}

void Communicator::throwTimeout(int64_t waitedNs, const std::string& waitingFor) const {
  std::string msg =
      format("%s: %s timed out after %lld ms (timeout %lld ms) waiting for %s", opLabel().c_str(),
             who_.c_str(), static_cast<long long>(waitedNs / kNsPerMs),
             static_cast<long long>(timeoutMs()), waitingFor.c_str());
  throw Error(spyrecclTimeout, withDump(msg), __FILE__, __LINE__);
}

void Communicator::ensureUsable(const char* op) const {
  int code = failCode_.load(std::memory_order_acquire);
  if (code == spyrecclSuccess) return;
  std::string original;
  {
    std::lock_guard<std::mutex> lock(mu_);
    original = failMessage_;
  }
  SPYRECCL_THROW(spyrecclInvalidUsage,
                 "%s: communicator %s is unusable after an earlier error (%s): %s; destroy it", op,
                 who_.c_str(), resultName(code), original.c_str());
}

void Communicator::markFailed(spyrecclResult_t code, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failCode_.load(std::memory_order_relaxed) != spyrecclSuccess) return;
    // Keep the first line only: the dump that may follow is in the returned message.
    failMessage_ = message.substr(0, message.find('\n'));
    failCode_.store(code, std::memory_order_release);
  }
  RankControl* me = control(rank_);
  me->failCode.store(code, std::memory_order_relaxed);
  const std::string first = message.substr(0, message.find('\n'));
  const size_t n = std::min(first.size(), transport::kFailTextBytes - 1);
  std::memcpy(me->failText, first.data(), n);
  me->failText[n] = '\0';
  uint32_t expected = transport::kStatusActive;
  me->status.compare_exchange_strong(expected, transport::kStatusFailed, std::memory_order_acq_rel);
  wakeAll();
  SPYRECCL_LOG(kInfo, who_.c_str(), "communicator failed: %s", message.c_str());
}

void Communicator::abort() {
  abortRequested_.store(true, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failCode_.load(std::memory_order_relaxed) == spyrecclSuccess) {
      failMessage_ = "spyrecclCommAbort was called";
      failCode_.store(spyrecclAborted, std::memory_order_release);
    }
  }
  RankControl* me = control(rank_);
  uint32_t expected = transport::kStatusActive;
  me->status.compare_exchange_strong(expected, transport::kStatusAborted,
                                     std::memory_order_acq_rel);
  wakeAll();
}

void Communicator::wakeAll() {
  for (int r = 0; r < nranks_; ++r) {
    transport::futexWakeAll(&control(r)->step);
    transport::futexWakeAll(&control(r)->doorbell);
    transport::futexWakeAll(&eager(r)->posted);
  }
}

void Communicator::setLastError(const std::string& msg) {
  std::lock_guard<std::mutex> lock(mu_);
  lastError_ = msg;
}

const char* Communicator::lastError() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lastError_.c_str();
}

// ---------------------------------------------------------------------------------------
// diagnostics
// ---------------------------------------------------------------------------------------

std::string Communicator::dumpState() const {
  static const char* const kStates[] = {"running", "done", "failed"};
  const double nsPerTick = spyreccl::nsPerTick();
  const uint64_t nowTicks = ticksNow();
  // Any thread may dump: read our step from shared memory, not the owner's step_.
  std::string out = format("spyreccl state of %s (pid %d, segment %s): step %u, %s\n", who_.c_str(),
                           static_cast<int>(::getpid()), segment_->name().c_str(),
                           control(rank_)->step.load(std::memory_order_relaxed),
                           resultName(failCode_.load(std::memory_order_acquire)));
  {
    // Lock-free read of the owner's flight recorder (readSlot); records that the owner
    // overwrites while we read are left out (they are older than the ones shown).
    const uint64_t count = recordCount_.load(std::memory_order_acquire);
    const uint64_t first = count > kFlightRecords ? count - kFlightRecords : 0;
    std::string lines;
    int shown = 0;
    for (uint64_t i = first; i < count; ++i) {
      FlightRecord r;
      if (!readSlot(i, &r)) continue;
      ++shown;
      // A collective that started after `nowTicks` was read counts as just started.
      const uint64_t end = r.state == kRunning ? std::max(nowTicks, r.startTicks) : r.endTicks;
      lines += format("    seq %-6llu %-44s from step %-8u %-7s %.1f us\n",
                      static_cast<unsigned long long>(r.d.seq), algorithms::describe(r.d).c_str(),
                      r.firstStep, r.state <= kFailed ? kStates[r.state] : "?",
                      static_cast<double>(end - r.startTicks) * nsPerTick / 1e3);
    }
    out += format("  last %d collectives on this rank:\n", shown);
    out += lines;
  }
  out += format("  waits: %s (%d ranks on %d CPUs)\n",
                spin_.spin ? "spinning" : "yielding, the ranks oversubscribe the CPUs", nranks_,
                cpus_);
  out += format("  transfers: single-copy of ordinary memory (CMA) %s, %llu reads, %llu bytes\n",
                cmaState_.c_str(),
                static_cast<unsigned long long>(cmaReads_.load(std::memory_order_relaxed)),
                static_cast<unsigned long long>(cmaBytes_.load(std::memory_order_relaxed)));
  out += format("  copy paths: %s; CPUs contended now (the load vote, from 64 KiB): %s\n",
                cmaCalibration_.c_str(), transport::cpusContended() ? "yes" : "no");
  {
    // Read from the segment (any thread may dump): what this rank posted and read.
    const transport::EagerControl* e = eager(rank_);
    std::string read;
    for (int p = 0; p < nranks_; ++p) {
      if (p == rank_) continue;
      read += format("%s%d from rank %d", read.empty() ? "" : ", ",
                     eagerConsumed(rank_, p)->load(std::memory_order_relaxed), p);
    }
    if (eagerMax_ > 0) {
      out += format(
          "  one-way broadcasts: up to %lld bytes, ring of %u slots; %u posted as the "
          "root, read %s\n",
          static_cast<long long>(eagerMax_), transport::kEagerSlots,
          e->posted.load(std::memory_order_relaxed), read.c_str());
    } else {
      out += format("  one-way broadcasts: off (%s)\n",
                    eagerMax_ < 0 ? "not agreed yet"
                    : nranks_ < 2 ? "one rank"
                                  : "SPYRECCL_EAGER_BROADCAST_MAX_BYTES=0 on some rank");
    }
  }
  // What this rank's estimates say where the ranks vote (its vote; the ranks' votes combine).
  out += advisor_.describe(
      [](uint32_t kind) { return kind == 0 ? "send/recv" : algorithms::kindName(kind); });
  out += "  peers:\n";
  static const char* const kStatus[] = {"active", "aborted", "failed", "departed"};
  for (int p = 0; p < nranks_; ++p) {
    const RankControl* pc = control(p);
    uint32_t step = pc->step.load(std::memory_order_acquire);
    // The latest announced descriptor is the one with the larger sequence number. Our own
    // is being written by the owner thread while another thread may dump: take it from
    // the flight recorder (read consistently) instead of the shared words.
    Descriptor d{};
    FlightRecord last;
    if (p == rank_) {
      const uint64_t count = recordCount_.load(std::memory_order_acquire);
      if (count > 0 && readSlot(count - 1, &last)) d = last.d;
    } else if (!peerCall(p, eager(p)->opSeq.load(std::memory_order_acquire), &d)) {
      // Its latest call from its history (one-way broadcasts announce nothing in a step),
      // else the latest descriptor it announced.
      const Descriptor& d0 = pc->desc[0];
      const Descriptor& d1 = pc->desc[1];
      d = d0.seq >= d1.seq ? d0 : d1;
    }
    uint32_t status = pc->status.load(std::memory_order_relaxed);
    bool dead = p != rank_ && watches_[p].dead();
    out += format("    rank %-4d pid %-8d step %-8u %-8s latest call seq %llu %s%s\n", p,
                  pc->pid.load(std::memory_order_relaxed), step, status < 4 ? kStatus[status] : "?",
                  static_cast<unsigned long long>(d.seq), algorithms::describe(d).c_str(),
                  dead ? " [process exited]" : "");
  }
  return out;
}

std::string Communicator::withDump(const std::string& message) const {
  std::string dump = dumpState();
  if (auto dir = envString("SPYRECCL_DUMP_DIR")) {
    // "/spyreccl-<hex>" -> the first 12 hex digits identify the communicator.
    std::string label = config_.name.empty() ? segment_->name().substr(10, 12) : config_.name;
    // The label may come from user input: keep the file name to a safe alphabet.
    for (char& ch : label) {
      if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-' && ch != '_' && ch != '.')
        ch = '_';
    }
    std::string path = format("%s/spyreccl-%s-rank%d.txt", dir->c_str(), label.c_str(), rank_);
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd >= 0) {
      std::string text = message + "\n" + dump;
      ssize_t ignored = ::write(fd, text.data(), text.size());
      (void)ignored;
      ::close(fd);
    } else {
      SPYRECCL_LOG(kWarn, who_.c_str(), "cannot write state dump to %s: %s", path.c_str(),
                   std::strerror(errno));
    }
  }
  return message + "\n" + dump;
}

// ---------------------------------------------------------------------------------------
// reduction handles
// ---------------------------------------------------------------------------------------

spyrecclRedOp_t Communicator::createPreMulSum(double scalar, spyrecclDataType_t dtype) {
  const char* op = "spyrecclRedOpCreatePreMulSum";
  SPYRECCL_CHECK_ARG(kernels::dtypeSize(dtype) != 0, op,
                     "argument 'datatype' = %d is not a valid spyrecclDataType_t",
                     static_cast<int>(dtype));
  SPYRECCL_CHECK_ARG(isFloating(dtype), op,
                     "argument 'datatype' = %s: PreMulSum is defined for floating-point types "
                     "only",
                     kernels::dtypeName(dtype));
  kernels::ReduceSpec spec;
  spec.dtype = dtype;
  spec.op = spyrecclSum;
  spec.premul = true;
  spec.scalar = scalar;
  std::string why;
  SPYRECCL_CHECK_ARG(kernels::validate(spec, &why), op, "%s", why.c_str());
  std::lock_guard<std::mutex> lock(mu_);
  for (int i = 0; i < kMaxPreMulSum; ++i) {
    if (premul_[i].used) continue;
    premul_[i] = PreMulSum{true, scalar, dtype};
    return static_cast<spyrecclRedOp_t>(spyrecclNumOps + i);
  }
  SPYRECCL_THROW(spyrecclInvalidUsage,
                 "%s: %s already has %d live PreMulSum handles (the maximum); destroy unused "
                 "ones with spyrecclRedOpDestroy",
                 op, who_.c_str(), kMaxPreMulSum);
}

void Communicator::destroyRedOp(int op) {
  const char* api = "spyrecclRedOpDestroy";
  int index = op - spyrecclNumOps;
  SPYRECCL_CHECK_ARG(index >= 0, api,
                     "argument 'op' = %d is a built-in reduce op; only handles from "
                     "spyrecclRedOpCreatePreMulSum can be destroyed",
                     op);
  std::lock_guard<std::mutex> lock(mu_);
  SPYRECCL_CHECK_ARG(index < kMaxPreMulSum && premul_[index].used, api,
                     "argument 'op' = %d is not a live PreMulSum handle of %s", op, who_.c_str());
  premul_[index].used = false;
}

kernels::ReduceSpec Communicator::resolveOp(int value, spyrecclDataType_t dtype,
                                            const char* api) const {
  kernels::ReduceSpec spec;
  spec.dtype = dtype;
  spec.avgDivisor = nranks_;
  if (value >= 0 && value < spyrecclNumOps) {
    spec.op = static_cast<spyrecclRedOp_t>(value);
  } else {
    int index = value - spyrecclNumOps;
    std::lock_guard<std::mutex> lock(mu_);
    SPYRECCL_CHECK_ARG(index >= 0 && index < kMaxPreMulSum && premul_[index].used, api,
                       "argument 'op' = %d is not a valid spyrecclRedOp_t (a built-in op in "
                       "[0, %d) or a live PreMulSum handle of this communicator)",
                       value, static_cast<int>(spyrecclNumOps));
    const PreMulSum& h = premul_[index];
    SPYRECCL_CHECK_ARG(h.dtype == dtype, api,
                       "argument 'op' is a PreMulSum handle created for %s but 'datatype' is %s",
                       kernels::dtypeName(h.dtype), kernels::dtypeName(dtype));
    spec.op = spyrecclSum;
    spec.premul = true;
    spec.scalar = h.scalar;
  }
  std::string why;
  SPYRECCL_CHECK_ARG(kernels::validate(spec, &why), api, "%s", why.c_str());
  return spec;
}

}  // namespace spyreccl
