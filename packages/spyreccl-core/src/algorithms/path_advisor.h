// Which copy path is faster right now: staged (two copies through the segment) or the
// single copy of cross-memory attach (transport/cma.h), learnt from the operations
// themselves.
//
// On a 2-vCPU AMD EPYC virtual machine the relative speed of the two paths changes with whether the
// two ranks share a cache, not with the load (docs/notes/core-single-copy.md, "Adaptive single
// copy"): with both ranks on one vCPU, or on vCPUs the host runs on nearby cores, the staged copies
// beat the single copy by 1.4-2x; on vCPUs the host runs far apart, the cache lines the
// staged paths hand between the ranks cost 5-10x more (a root's copy into a staging slot its
// peer just read: 0.32 CPU ticks per byte, 0.027 when the peer does not read it), and the
// single copy, which moves each byte across once, wins by 2-3x. No fixed threshold is right
// in both, and the state changes within seconds to minutes.
//
// Each communicator keeps, per operation kind and size class (factors of 2 below 128 KiB, of 4
// above), a running estimate (exponentially weighted mean) of the time per KiB each path took:
// every collective from the communicator's vote floor up (cmaVoteThreshold: calibrated at init,
// see "Where the vote starts" below), at any size, measures the path it took, from the step
// where the ranks agreed on it to its end. A sample is the faster of two consecutive calls on
// the path; the first call after a switch only primes (it runs cold). A rank votes for the
// single copy while that is the faster estimate; a stale estimate asks for calls on its path
// (a probe, three calls): 2, 4, 8, ... ms after its last sample while it is young, every
// kStaleNs after that (three slower calls per size class and quarter second, about 0.1 % of
// the calls of a loop of 512 KiB collectives), and never sooner than kProbeSpacing times
// the probe's own expected time, so that probing a slow path of large messages stays a
// small share of the time too (a 128 MiB staged broadcast took 20 ms against 3 ms single
// copy in the machine's slow state).
//
// There is no size above which the single copy is fixed: it used to be chosen without a
// vote from cmaThreshold (16 MiB send/recv, 32 MiB the other collectives), and on the dev
// machine's fast state the staged paths were then 1.2-1.5x faster than that choice at
// 16-128 MiB, because the pipeline's slots stay in the cache and both ranks copy at once
// (docs/notes/core-single-copy.md, "Large messages: the vote at every size"). cmaThreshold is now
// the vote of a rank whose advisor is off (SPYRECCL_CMA_ADAPTIVE=0).
//
// Where the vote starts. A voted collective pays one step more than a plain staged one (the
// step that publishes the votes), so below some size only staged copies are worth it. That
// size depends on the CPU: on a 2-vCPU AMD EPYC machine the staged copies won below 64 KiB
// (docs/notes/core-single-copy.md), on a 2-vCPU Intel Xeon the single copy already won at
// 16-32 KiB (docs/notes/core-path-calibration.md). So the communicator's init probe
// (Communicator::probeCma) times both on this machine: each rank copies kProbeSizes into its
// staging slot, its peer copies them out, then reads the same sizes from the rank's ordinary
// memory with process_vm_readv. A rank proposes the smallest probe size from which the single
// copy took less than kProbeMargin of the two staged copies (voteFloor()); the ranks take the
// smallest proposal (one more word of the probe's agreement step), so every rank computes the
// same vote window. Within the window the estimates below decide, as at every larger size.
//
// Votes travel with the buffers every rank publishes (DirectTransfer, word 6), so every
// rank combines the same words (decide()) and all take the same path. Point-to-point: the
// sender alone chooses, per message (p2p.cc: above two p2p chunks, or down to 32 KiB when
// the receiver is already waiting for the message).
//
// SPYRECCL_CMA_ADAPTIVE: "1" (default) / "0" (off: the fixed thresholds and the
// load-average vote only); "cma" / "staged" force this rank's estimate to prefer that path
// (tests: ranks with different estimates must still agree).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace spyreccl::algorithms {

class PathAdvisor {
 public:
  enum Mode : int { kOff = 0, kAuto = 1, kPreferCmaAlways = 2, kPreferStagedAlways = 3 };
  // Bits of a rank's vote word.
  static constexpr uint64_t kContended = 1;    // CPUs contended (load average): single copy
  static constexpr uint64_t kPreferCma = 2;    // single copy is faster by this rank's estimate
  static constexpr uint64_t kProbeStaged = 4;  // this rank's staged estimate is stale
  static constexpr int64_t kStaleNs = 250 * 1000 * 1000;
  static constexpr int64_t kFirstProbeNs = 1000 * 1000;
  // A stale estimate is re-measured no sooner than this many times its probe's expected
  // time (three calls at the estimate): a probe then costs at most ~1.5 % of the time.
  static constexpr int64_t kProbeSpacing = 64;
  static constexpr int kKinds = 16;
  // The table index (beyond algorithms::Kind) of point-to-point messages of up to two
  // chunks handed to a waiting receiver; kNone (0) holds the larger messages.
  static constexpr uint32_t kSmallP2P = 15;
  static constexpr int kClasses = 11;

  // The vote floor of the collectives (except the allreduce) when no probe lowered it: the
  // contended threshold measured on a 2-vCPU AMD EPYC machine (direct.cc, cmaBusyThreshold).
  static constexpr size_t kDefaultVoteFloor = size_t{64} << 10;
  // Sizes the init probe times (bytes; each in its own region, so none reads lines an
  // earlier one brought in), and the bytes of staging slot they need.
  static constexpr int kProbeSizes = 3;
  static constexpr size_t kProbeBytes[kProbeSizes] = {size_t{8} << 10, size_t{16} << 10,
                                                      size_t{32} << 10};
  static constexpr size_t kProbeRegionBytes = (size_t{8} + 16 + 32) << 10;
  // A size is proposed when its single copy took under this share of the staged copies: the
  // probe leaves out the vote's extra step, which a real call pays on either path.
  static constexpr double kProbeMargin = 0.9;
  // This rank's proposal from its probe: the smallest kProbeBytes[i] such that at it and at
  // every larger probe size the single copy (cmaNs[i]) was under kProbeMargin times the staged
  // copies (stagedNs[i]); kDefaultVoteFloor when none. A zero time means not measured.
  static size_t voteFloor(const int64_t stagedNs[kProbeSizes], const int64_t cmaNs[kProbeSizes]);

  // Reads SPYRECCL_CMA_ADAPTIVE (once per process).
  static Mode envMode();

  explicit PathAdvisor(Mode mode = envMode()) : mode_(mode) {}
  Mode mode() const { return mode_; }
  bool enabled() const { return mode_ != kOff; }

  // This rank's vote bits (kPreferCma, kProbeStaged or 0) for an operation of `kind`
  // moving `bytes` at time `nowNs`. `quietCma`: the message reaches the fixed quiet
  // threshold (cmaThreshold), which decides when the advisor is off.
  uint64_t vote(uint32_t kind, size_t bytes, int64_t nowNs, bool quietCma = false) const;
  // The path for the OR of every rank's vote word: true = single copy.
  static bool decide(uint64_t anyVotes) {
    if (anyVotes & kContended) return true;
    if (anyVotes & kProbeStaged) return false;
    return (anyVotes & kPreferCma) != 0;
  }
  // Records that an operation of `kind` moving `bytes` took `elapsedNs` on path `cma`.
  void record(uint32_t kind, size_t bytes, bool cma, int64_t elapsedNs, int64_t nowNs);

  // Current estimate (ns per KiB; 0: none yet), for tests and trace logs.
  double estimate(uint32_t kind, size_t bytes, bool cma) const;
  // One line per (kind, size class) with estimates, for the state dump: both estimates and
  // the path this rank's estimates prefer. `kindName` names table index `kind`.
  std::string describe(const char* (*kindName)(uint32_t kind)) const;

  static int sizeClass(size_t bytes);

 private:
  struct Estimate {
    std::atomic<double> nsPerKiB{0};
    std::atomic<int64_t> atNs{0};      // when last updated; 0: never
    std::atomic<uint32_t> samples{0};  // how many samples it has taken
    std::atomic<uint32_t> run{0};      // consecutive calls on this path (record())
    std::atomic<double> prevRaw{0};    // the previous call's time per KiB
    // When it asks for a new sample: kFirstProbeNs after its first, doubling with each
    // sample up to kStaleNs, so that a first sample taken cold (page faults, caches) is
    // soon corrected, and a path not in use is re-measured every kStaleNs after that; for
    // a message of `bytes`, never sooner than kProbeSpacing probes' time.
    bool stale(int64_t nowNs, size_t bytes) const;
  };
  struct Entry {
    Estimate path[2];              // [0] staged, [1] single copy
    std::atomic<int> lastPath{0};  // of the last call recorded: 1 staged, 2 single copy
  };
  const Entry& entry(uint32_t kind, size_t bytes) const {
    return table_[kind % kKinds][sizeClass(bytes)];
  }
  Mode mode_;
  Entry table_[kKinds][kClasses];
};

}  // namespace spyreccl::algorithms
