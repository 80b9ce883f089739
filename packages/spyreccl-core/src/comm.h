// The communicator: one rank's view of a shared-memory segment plus the step protocol,
// failure state, flight recorder and reduction-handle table.
//
// Collective step protocol (proof in docs/design.md):
//   s = beginStep()                     s = ++step_
//   write own staging(s) [+ announce]   buffer parity s % 2
//   exchange(s [, &descriptor])         publish step[rank] = s; wait step[p] >= s for all p
//   read peers' staging(s)              safe until they publish s + 2, which needs our s + 1
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "algorithms/descriptor.h"
#include "algorithms/p2p_op.h"
#include "algorithms/path_advisor.h"
#include "common/clock.h"
#include "common/error.h"
#include "kernels/reduce.h"
#include "spyreccl/spyreccl.h"
#include "transport/layout.h"
#include "transport/liveness.h"
#include "transport/segment.h"
#include "transport/wait.h"

namespace spyreccl {

// Effective settings of a communicator (config struct + environment + defaults).
struct CommConfig {
  int64_t timeoutMs = 1800000;
  size_t chunkBytes = 1 << 20;
  size_t p2pChunkBytes = 256 << 10;
  // Largest allreduce/reduce (bytes) using the one-shot algorithm. Unless set explicitly
  // (SPYRECCL_ALLREDUCE_ONESHOT_MAX), it depends on the communicator's size: one-shot reads
  // n copies of the message, so its advantage (one synchronisation) shrinks as n grows;
  // measured crossovers on a 2-vCPU AMD EPYC machine (docs/notes/core-copies.md): 64 KiB at 2
  // ranks, about 16 KiB at 3 and 4 ranks.
  size_t oneshotMaxBytes = 64 << 10;
  bool oneshotAuto = true;
  size_t oneshotMax(int nranks) const {
    return oneshotAuto ? (nranks <= 2 ? size_t{64} << 10 : size_t{16} << 10) : oneshotMaxBytes;
  }
  // Direct transfers (algorithms/direct.h) between buffers in the ranks' memory arenas, for
  // collectives moving at least directMinBytes per rank.
  bool direct = true;
  size_t directMinBytes = 256 << 10;
  // Single-copy transfers of ordinary memory through cross-memory attach (transport/cma.h),
  // when the init probe finds them permitted between every pair of ranks (SPYRECCL_CMA=0
  // forces staging). cmaMinBytes: 0 = the per-operation thresholds measured on the dev
  // machine (algorithms/direct.cc, cmaThreshold); otherwise one threshold for every
  // operation (SPYRECCL_CMA_MIN_BYTES).
  bool cma = true;
  size_t cmaMinBytes = 0;
  // This rank's proposal of where the ranks start voting between staged and single copy
  // instead of its init probe's (SPYRECCL_CMA_VOTE_MIN_BYTES; 0: the probe's). Read with the
  // other settings, so that a malformed value fails this rank before any collective step.
  size_t cmaVoteProposal = 0;
  // Longest extended spin of a wait (transport/wait.h, SpinAdvisor), SPYRECCL_SPIN_MAX_NS;
  // 2000 or less: waits yield after the base 2 us spin, as before the extension existed.
  int64_t spinMaxNs = transport::kSpinMaxNs;
  // How long a wait yields before it sleeps (transport/wait.h): spyrecclConfig_t::yieldNs,
  // SPYRECCL_YIELD_NS.
  int64_t yieldNs = transport::kYieldNs;
  // Broadcasts of at most this many bytes go one-way (algorithms/eager.h): this rank's
  // proposal (SPYRECCL_EAGER_BROADCAST_MAX_BYTES, at most transport::kEagerMaxBytes; 0: off);
  // the ranks use the smallest one.
  size_t eagerMaxBytes = transport::kEagerMaxBytes;
  std::string name;
};

// Validates `config` (may be null) for API call `op` and fills in defaults. `inherit`
// (may be null) supplies the defaults instead of the environment (CommSplit).
CommConfig resolveConfig(const spyrecclConfig_t* config, int nranks, const char* op,
                         const CommConfig* inherit = nullptr);

class Communicator {
 public:
  // `cpus`: how many CPUs the ranks may run on between them (bootstrap); waits spin only
  // when there are at least as many as ranks.
  Communicator(int rank, int nranks, CommConfig config, std::unique_ptr<transport::Segment> segment,
               std::vector<pid_t> pids, int cpus);
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  const CommConfig& config() const { return config_; }
  // "rank 1/4 'name'": prefix of log lines and messages.
  const std::string& who() const { return who_; }
  int64_t timeoutMs() const { return timeoutMs_.load(std::memory_order_relaxed); }
  void setTimeoutMs(int64_t ms) { timeoutMs_.store(ms, std::memory_order_relaxed); }

  const transport::Layout& layout() const { return layout_; }
  uint8_t* base() const { return segment_->base(); }
  std::atomic<uint32_t>* sleepers() const { return &segment_->header()->sleepers; }
  transport::RankControl* control(int r) const { return layout_.rank(base(), r); }
  transport::SpinPolicy spin() const { return spin_; }

  // ---- collective step protocol ---------------------------------------------------
  uint32_t beginStep() { return ++step_; }
  uint8_t* staging(int r, uint32_t s) const { return layout_.staging(base(), r, s & 1); }
  // Publishes step s, waits for every peer to reach it. With `announce`, the descriptor is
  // published with the step and every peer's descriptor is compared with it afterwards
  // (spyrecclMismatch naming both sides).
  void exchange(uint32_t s, const transport::Descriptor* announce = nullptr);

  // ---- operation bookkeeping (flight recorder + error context) ----------------------
  // Starts collective `d` (assigns its sequence number); the label "allreduce seq 7"
  // prefixes every error raised until endOp().
  transport::Descriptor beginOp(transport::Descriptor d);
  void endOp(bool ok);
  // "allreduce seq 7" for the current collective, or the label set by setOpLabel for
  // point-to-point work. Built on demand: only error paths need it.
  std::string opLabel() const;
  void setOpLabel(std::string label) { customLabel_ = std::move(label); }

  // ---- one-way small broadcasts (algorithms/eager.h) --------------------------------
  // Largest broadcast (bytes) that goes one-way, agreed by the ranks at init (probeCma;
  // SPYRECCL_EAGER_BROADCAST_MAX_BYTES on any rank lowers it, 0 turns it off); -1 while
  // not agreed, so that nothing goes one-way before every rank knows the limit.
  int64_t eagerMaxBytes() const { return eagerMax_; }
  transport::EagerControl* eager(int r) const { return layout_.eager(base(), r); }
  std::atomic<uint32_t>* eagerConsumed(int r, int root) const {
    return layout_.eagerConsumed(base(), r, root);
  }
  struct EagerState {
    std::vector<uint32_t> index;  // per root: its slots this rank posted (root) or read
    uint32_t freeUntil = 0;       // as a root: first slot index not known to be free
    uint64_t digest = 0;          // of every one-way broadcast completed (Descriptor)
  };
  EagerState& eagerState() { return eager_; }
  // Copies rank `peer`'s call `seq` into *out from its history in the segment; false when
  // the peer has not begun it yet or has run kHistoryCalls calls past it.
  bool peerCall(int peer, uint64_t seq, transport::Descriptor* out) const;
  // "rank 1 called allreduce(count=4, float32, sum) as its collective seq 7" for mismatch
  // messages about a peer's call `seq` (or "...went past seq 7" when no longer recorded).
  std::string describePeerCall(int peer, uint64_t seq) const;

  // ---- waiting ---------------------------------------------------------------------
  // Cheap checks on every slow-path wakeup; full checks (deadline, peer status, peer
  // liveness) about every 50 ms. `peers` lists the ranks whose failure dooms the wait
  // (empty: all). `ready` is re-evaluated before blaming a peer so that a peer that
  // published and then left is not reported. `waitingFor` names what is missing.
  template <class Ready, class Describe, class Awaited>
  void checkWait(int64_t waitedNs, bool full, const std::vector<int>* peers, Ready&& ready,
                 Describe&& waitingFor, Awaited&& awaited);
  void waitPeerStep(int peer, uint32_t s);
  [[noreturn]] void throwPeerFailure(int peer, const std::string& waitingFor) const;

  // ---- failure state -----------------------------------------------------------------
  // Throws spyrecclInvalidUsage when an earlier error broke the communicator.
  void ensureUsable(const char* op) const;
  // Records the error that broke the communicator (first one wins), tells peers.
  void markFailed(spyrecclResult_t code, const std::string& message);
  spyrecclResult_t asyncError() const {
    return static_cast<spyrecclResult_t>(failCode_.load(std::memory_order_acquire));
  }
  void abort();
  bool abortRequested() const { return abortRequested_.load(std::memory_order_relaxed); }
  // Wakes every futex word a thread of this rank could sleep on.
  void wakeAll();

  void setLastError(const std::string& msg);
  const char* lastError() const;

  // ---- diagnostics ---------------------------------------------------------------------
  std::string dumpState() const;
  // Appends the state dump to `message` and writes it to $SPYRECCL_DUMP_DIR if set.
  std::string withDump(const std::string& message) const;

  // ---- reduction handles -----------------------------------------------------------------
  spyrecclRedOp_t createPreMulSum(double scalar, spyrecclDataType_t dtype);
  void destroyRedOp(int op);
  // Resolves (op, dtype) for API call `api` into a kernel spec; spyrecclInvalidArgument
  // for invalid ops, unknown handles and unsupported (op, dtype) pairs.
  // `op` is the raw integer of the API argument (any value may arrive from C).
  kernels::ReduceSpec resolveOp(int op, spyrecclDataType_t dtype, const char* api) const;

  // ---- point-to-point bookkeeping (owned by algorithms/p2p.cc) ----------------------------
  struct PeerP2P {
    uint64_t sendMsgs = 0;        // messages started to this peer
    uint64_t recvMsgs = 0;        // messages started from this peer
    uint32_t postedChunks = 0;    // shadow of mailbox(rank, peer)->posted
    uint32_t consumedChunks = 0;  // shadow of mailbox(peer, rank)->consumed
  };
  PeerP2P& p2p(int peer) { return p2p_[peer]; }
  const transport::PeerWatch& watch(int peer) const { return watches_[peer]; }

  // Operations pending on this communicator in posting order (algorithms::post), owned by
  // their posters: requests of the C API or the vectors of blocking calls.
  std::vector<algorithms::P2POp*>& pendingP2P() { return pendingP2P_; }
  // Requests of the C API (spyrecclIsend/spyrecclIrecv) not yet released by spyrecclTest
  // or spyrecclWait: owned here so that destroying the communicator frees them.
  std::vector<std::unique_ptr<algorithms::P2POp>>& requests() { return requests_; }
  // Set by algorithms::wakeProgress (any thread), consumed by algorithms::waitProgress.
  std::atomic<bool>& progressWake() { return progressWake_; }
  // When algorithms::waitProgress last ran the full wait checks (peer liveness, timeouts).
  int64_t& lastPollFullCheckNs() { return lastPollFullCheckNs_; }
  // Moves the pending operations from inside a collective's wait, so that a send posted
  // before a collective cannot deadlock against a peer that receives it only after the
  // collective. An error abandons them (algorithms::progress) and is left to them: the
  // collective itself goes on. Defined in algorithms/p2p.cc.
  void progressPendingP2P() noexcept;

  // nranks pointers of scratch for kernels::reduce source lists (no allocation per call).
  const void** sourceScratch() { return sources_.data(); }

  // ---- direct transfers (memory/arena.h, algorithms/direct.h) -----------------------------
  // Whether the current collective, moving `bytes` per rank, may read peers' arena buffers
  // directly. Collective: every rank calls it at the same point with the same bytes. Until
  // every rank has an arena, each call at or above the threshold spends one protocol step
  // finding that out; then the ranks map each other's arenas and agree on the outcome in
  // one more step (the first step publishes `announce`, and *announced is set). The
  // agreed answer is kept for the communicator's life. `cma`: the collective may reach
  // buffers outside arenas through cross-memory attach (then the answer is yes anyway).
  bool directCapable(size_t bytes, bool cma, const transport::Descriptor* announce,
                     bool* announced);
  // Start of `peer`'s arena as mapped (read-only) into this process; valid once
  // directCapable() returned true.
  const uint8_t* peerArena(int peer) const { return peerArenas_[peer].base; }
  // Bytes of that mapping (0 while not mapped).
  size_t peerArenaBytes(int peer) const { return peerArenas_[peer].bytes; }
  // Whether an earlier collective established direct transfers (never probes: for
  // point-to-point, which must not run a collective step).
  bool directOn() const { return directState_ == DirectState::kOn; }

  // ---- single-copy transfers of ordinary memory (transport/cma.h) ------------------------
  // Collective, run once by bootstrap right after construction: every rank publishes the
  // address of a word of its own memory, reads every peer's with process_vm_readv and the
  // ranks agree (one more step) whether every read worked. Any refusal, or SPYRECCL_CMA=0
  // on any rank, leaves cross-memory attach off for the communicator's life.
  // With CMA on, the same probe times both copy paths on this machine and the ranks agree on
  // where they start voting between them (cmaVoteFloor; path_advisor.h, "Where the vote
  // starts").
  void probeCma();
  bool cmaOn() const { return cmaOn_; }
  // Smallest collective (bytes as passed to beginDirect) whose copy path the ranks vote on,
  // the same on every rank (algorithms/direct.cc, cmaVoteThreshold).
  size_t cmaVoteFloor() const { return cmaVoteFloor_; }
  // Copies `len` bytes at address `remote` of rank `peer`'s memory into `dst`. A failed
  // read (the peer died, or unmapped its buffer after failing) throws the peer's failure
  // if it failed or died, else spyrecclRemoteError naming the peer and the errno.
  void cmaRead(int peer, void* dst, uint64_t remote, size_t len, const char* what);
  pid_t peerPid(int peer) const { return pids_[peer]; }
  // Running estimates of the staged and single-copy paths' speed (algorithms/path_advisor.h).
  algorithms::PathAdvisor& pathAdvisor() { return advisor_; }
  const algorithms::PathAdvisor& pathAdvisor() const { return advisor_; }

 private:
  // The flight recorder: the last kFlightRecords collectives of this communicator. Written
  // only by the thread that runs the collective (one thread at a time per communicator),
  // read by any thread (dumpState: error paths and spyrecclCommDumpState). No lock: each
  // slot is a seqlock (version odd while its writer updates it; a reader retries until it
  // copied the slot between two equal even versions), so the owner's two updates per call
  // are plain stores, and a reader never sees half of a record. Every field is an atomic
  // accessed relaxed, ordered by the version's fences: no data race in the C++ sense.
  enum RecordState : uint32_t { kRunning, kDone, kFailed };
  static constexpr int kDescWords = transport::kDescriptorWords;
  struct FlightSlot {
    std::atomic<uint32_t> version{0};
    std::atomic<uint64_t> index{0};  // which record (0, 1, ...) the slot holds
    std::atomic<uint64_t> desc[kDescWords] = {};
    // ticksNow() at the start and the end (0 while running): cheaper than the clock.
    std::atomic<uint64_t> startTicks{0}, endTicks{0};
    std::atomic<uint32_t> firstStep{0}, state{kRunning};
  };
  // A consistent copy of one slot (readSlot).
  struct FlightRecord {
    transport::Descriptor d{};
    uint64_t startTicks = 0, endTicks = 0;
    uint32_t firstStep = 0;
    uint32_t state = kRunning;
  };
  static constexpr int kFlightRecords = 16;
  // Seqlock write side (owner thread only): openSlot makes the version odd, closeSlot even.
  static void openSlot(FlightSlot& slot);
  static void closeSlot(FlightSlot& slot);
  // Copies record `index` into *out; false when the slot was overwritten by a later record
  // (or stayed busy for too long, which only a writer preempted mid-update can cause).
  bool readSlot(uint64_t index, FlightRecord* out) const;
  static constexpr int kMaxPreMulSum = 1024;
  struct PreMulSum {
    bool used = false;
    double scalar = 1.0;
    spyrecclDataType_t dtype = spyrecclFloat32;
  };

  [[noreturn]] void throwAborted(const std::string& waitingFor) const;
  // A peer still behind step `s` whose call differs from ours (its history says so, or it
  // went past our call without taking this step): a mismatch no descriptor exchange can
  // show, because the peer ran a one-way broadcast that takes no step.
  void checkPeerCalls(uint32_t s) const;
  [[noreturn]] void throwTimeout(int64_t waitedNs, const std::string& waitingFor) const;
  void verifyDescriptors(uint32_t s, const transport::Descriptor& mine) const;
  void probeDirect(const transport::Descriptor* announce);
  void unmapPeerArenas();

  const int rank_;
  const int nranks_;
  const CommConfig config_;
  std::string who_;
  std::atomic<int64_t> timeoutMs_;
  std::unique_ptr<transport::Segment> segment_;
  transport::Layout layout_;
  std::vector<transport::PeerWatch> watches_;
  const int cpus_;  // CPUs the ranks may run on between them (bootstrap)
  transport::SpinPolicy spin_;

  uint32_t step_ = 0;
  uint64_t seq_ = 0;
  uint32_t curKind_ = 0;
  transport::Descriptor current_{};
  int64_t eagerMax_ = -1;
  EagerState eager_;
  std::string customLabel_;
  std::vector<PeerP2P> p2p_;
  std::vector<algorithms::P2POp*> pendingP2P_;
  std::vector<std::unique_ptr<algorithms::P2POp>> requests_;
  std::atomic<bool> progressWake_{false};
  int64_t lastPollFullCheckNs_ = 0;
  std::vector<const void*> sources_;
  std::vector<pid_t> pids_;
  enum class DirectState : uint8_t { kUnknown, kOn, kOff };
  DirectState directState_ = DirectState::kUnknown;
  struct PeerArena {
    const uint8_t* base = nullptr;
    size_t bytes = 0;
  };
  std::vector<PeerArena> peerArenas_;
  bool cmaOn_ = false;
  std::string cmaState_ = "not probed";
  size_t cmaVoteFloor_ = algorithms::PathAdvisor::kDefaultVoteFloor;
  std::string cmaCalibration_ = "not probed";  // the probe's times and outcome, for dumps
  std::atomic<uint64_t> cmaReads_{0}, cmaBytes_{0};
  algorithms::PathAdvisor advisor_;

  std::atomic<bool> abortRequested_{false};
  std::atomic<int> failCode_{spyrecclSuccess};

  FlightSlot records_[kFlightRecords];
  // Records started so far: written by the owner thread, read by dumps (acquire).
  std::atomic<uint64_t> recordCount_{0};

  mutable std::mutex mu_;  // guards the fields below (read by other threads); not per call
  std::string failMessage_;
  std::string lastError_;
  std::vector<PreMulSum> premul_;
};

// ---- template implementation -----------------------------------------------------------

template <class Ready, class Describe, class Awaited>
void Communicator::checkWait(int64_t waitedNs, bool full, const std::vector<int>* peers,
                             Ready&& ready, Describe&& waitingFor, Awaited&& awaited) {
  if (abortRequested()) throwAborted(waitingFor());
  if (!full) return;
  // Blame the peers this wait is missing before bystanders that merely failed too.
  auto inspect = [&](int p, bool awaitedPass) {
    if (p == rank_ || awaited(p) != awaitedPass) return;
    uint32_t status = control(p)->status.load(std::memory_order_acquire);
    if ((status != transport::kStatusActive || watches_[p].dead()) && !ready()) {
      throwPeerFailure(p, waitingFor());
    }
  };
  for (bool awaitedPass : {true, false}) {
    if (peers != nullptr) {
      for (int p : *peers) inspect(p, awaitedPass);
    } else {
      for (int p = 0; p < nranks_; ++p) inspect(p, awaitedPass);
    }
  }
  if (waitedNs > timeoutMs() * kNsPerMs && !ready()) throwTimeout(waitedNs, waitingFor());
}

}  // namespace spyreccl

// The opaque handle of the C API is the communicator itself.
struct spyrecclComm final : public spyreccl::Communicator {
  using spyreccl::Communicator::Communicator;
};
