// Unit tests of the copy-path advisor (src/algorithms/path_advisor.cc), compiled into their
// own executable with it: the library exports the C API only.
//
//   advisor.learns          no estimate: staged first, then the single copy; then the
//                           faster path by the estimates, at any size (no fixed threshold).
//   advisor.off             SPYRECCL_CMA_ADAPTIVE=0: the quiet threshold is the whole vote.
//   advisor.probe_spacing   a stale estimate is re-measured after kStaleNs for small
//                           messages, but no sooner than kProbeSpacing times the probe's
//                           expected time for large ones.
//   advisor.vote_floor      the init probe's proposal: the smallest probe size from which
//                           the single copy keeps winning by kProbeMargin, else the default.
//   advisor.small_classes   16, 32 and 64 KiB messages keep separate estimates (the vote
//                           may start there), so one size's winner does not decide another's.
//   advisor.oversubscribed_spin  a point-to-point wait of ranks that oversubscribe the CPUs
//                           spins once in 64 waits, keeps spinning while the latest spin or
//                           3 of the latest 4 paid off, and stops after two failures in a row.
#include <cstdint>
#include <string>

#include "algorithms/path_advisor.h"
#include "multiproc.h"
#include "transport/wait.h"

namespace {

using spyreccl::algorithms::PathAdvisor;
using spyreccl_test::registerTest;

constexpr uint32_t kKind = 3;
constexpr int64_t kMs = 1000 * 1000;

// Three consecutive calls on one path: the first primes, the next two make one sample.
void feed(PathAdvisor& a, size_t bytes, bool cma, int64_t ns, int64_t& now) {
  for (int i = 0; i < 3; ++i) {
    now += ns;
    a.record(kKind, bytes, cma, ns, now);
  }
}

void learnsTest() {
  for (size_t bytes : {size_t{1} << 20, size_t{128} << 20}) {
    PathAdvisor a(PathAdvisor::kAuto);
    int64_t now = 10 * kMs;
    SPY_CHECK(a.vote(kKind, bytes, now) == PathAdvisor::kProbeStaged,
              "%zu bytes, no estimate: staged first", bytes);
    feed(a, bytes, false, 5 * kMs, now);  // staged: 5 ms a call
    SPY_CHECK(a.vote(kKind, bytes, now) == PathAdvisor::kPreferCma,
              "%zu bytes: the single copy is measured next", bytes);
    feed(a, bytes, true, 8 * kMs, now);  // single copy: slower
    SPY_CHECK(a.vote(kKind, bytes, now) == 0, "%zu bytes: staged is faster (5 vs 8 ms)", bytes);
    SPY_CHECK(a.estimate(kKind, bytes, false) > 0 && a.estimate(kKind, bytes, true) > 0,
              "both estimates taken");
    // Whatever the quiet threshold says: the estimates decide.
    SPY_CHECK(a.vote(kKind, bytes, now, true) == 0, "%zu bytes above the quiet threshold", bytes);
  }
  // And the other way round.
  PathAdvisor a(PathAdvisor::kAuto);
  int64_t now = 10 * kMs;
  const size_t bytes = size_t{64} << 20;
  feed(a, bytes, false, 9 * kMs, now);
  feed(a, bytes, true, 3 * kMs, now);
  SPY_CHECK(a.vote(kKind, bytes, now, false) == PathAdvisor::kPreferCma,
            "single copy faster (3 vs 9 ms)");
}

void offTest() {
  PathAdvisor off(PathAdvisor::kOff);
  SPY_CHECK(off.vote(kKind, size_t{64} << 20, kMs, true) == PathAdvisor::kPreferCma,
            "off, above the quiet threshold: single copy");
  SPY_CHECK(off.vote(kKind, size_t{1} << 20, kMs, false) == 0,
            "off, below the quiet threshold: staged");
  PathAdvisor staged(PathAdvisor::kPreferStagedAlways);
  SPY_CHECK(staged.vote(kKind, size_t{64} << 20, kMs, true) == 0, "forced staged estimate");
  PathAdvisor cma(PathAdvisor::kPreferCmaAlways);
  SPY_CHECK(cma.vote(kKind, size_t{1} << 20, kMs, false) == PathAdvisor::kPreferCma,
            "forced single-copy estimate");
}

// Settles the estimates of `bytes` (staged `stagedNs`, single copy `cmaNs` a call) with
// enough samples that the young re-probe intervals are over; returns the time of the last.
int64_t settle(PathAdvisor& a, size_t bytes, int64_t stagedNs, int64_t cmaNs) {
  int64_t now = 10 * kMs;
  for (int i = 0; i < 10; ++i) {
    feed(a, bytes, false, stagedNs, now);
    feed(a, bytes, true, cmaNs, now);
  }
  return now;
}

void probeSpacingTest() {
  // 1 MiB, staged 100 us, single copy 300 us: staged is used; its rival is re-measured
  // once kStaleNs has passed since its last sample.
  {
    PathAdvisor a(PathAdvisor::kAuto);
    const size_t bytes = size_t{1} << 20;
    const int64_t last = settle(a, bytes, 100 * 1000, 300 * 1000);
    SPY_CHECK(a.vote(kKind, bytes, last + PathAdvisor::kStaleNs / 2) == 0,
              "fresh estimates: the faster path (staged)");
    SPY_CHECK(a.vote(kKind, bytes, last + PathAdvisor::kStaleNs + kMs) != 0,
              "after kStaleNs the single copy is probed");
  }
  // 128 MiB, single copy 4 ms, staged 30 ms: a probe of the staged path costs ~90 ms, so
  // it is not asked for before kProbeSpacing x 90 ms (~5.8 s), but is after that.
  {
    PathAdvisor a(PathAdvisor::kAuto);
    const size_t bytes = size_t{128} << 20;
    const int64_t last = settle(a, bytes, 30 * kMs, 4 * kMs);
    const int64_t probeNs = 3 * 30 * kMs;
    SPY_CHECK(a.vote(kKind, bytes, last + PathAdvisor::kStaleNs + kMs) == PathAdvisor::kPreferCma,
              "no staged probe at kStaleNs: it would cost more than 1/%lld of the time",
              static_cast<long long>(PathAdvisor::kProbeSpacing));
    SPY_CHECK(a.vote(kKind, bytes, last + PathAdvisor::kProbeSpacing * probeNs / 2) ==
                  PathAdvisor::kPreferCma,
              "still no staged probe halfway");
    SPY_CHECK(a.vote(kKind, bytes, last + PathAdvisor::kProbeSpacing * probeNs * 11 / 10) ==
                  PathAdvisor::kProbeStaged,
              "the staged path is re-measured after kProbeSpacing probes' time");
  }
}

void voteFloorTest() {
  using P = PathAdvisor;
  auto floorOf = [](int64_t s0, int64_t c0, int64_t s1, int64_t c1, int64_t s2, int64_t c2) {
    const int64_t staged[P::kProbeSizes] = {s0, s1, s2};
    const int64_t cma[P::kProbeSizes] = {c0, c1, c2};
    return P::voteFloor(staged, cma);
  };
  // Times as measured on a 2-vCPU AMD EPYC machine: staged faster at 16 and 32 KiB.
  SPY_CHECK(floorOf(3360, 1880, 960, 2280, 1680, 3350) == P::kDefaultVoteFloor,
            "staged faster at 16 and 32 KiB: no vote below the default (8 KiB alone does not "
            "count)");
  SPY_CHECK(floorOf(900, 1500, 1800, 1700, 4000, 2500) == (size_t{32} << 10),
            "single copy faster by the margin from 32 KiB only (16 KiB: 1700 vs 1800 ns is "
            "within it)");
  SPY_CHECK(floorOf(900, 1500, 2400, 1700, 4000, 2500) == (size_t{16} << 10),
            "single copy faster from 16 KiB");
  SPY_CHECK(floorOf(1000, 800, 2400, 1700, 4000, 2500) == (size_t{8} << 10),
            "single copy faster at every probe size");
  SPY_CHECK(floorOf(0, 0, 0, 0, 0, 0) == P::kDefaultVoteFloor, "not timed: the default");
  SPY_CHECK(floorOf(1000, 800, 2400, 1700, 0, 0) == P::kDefaultVoteFloor,
            "32 KiB not timed: the default");
}

void smallClassesTest() {
  SPY_CHECK(PathAdvisor::sizeClass(size_t{8} << 10) == 0 &&
                PathAdvisor::sizeClass((size_t{16} << 10) - 1) == 0,
            "below 16 KiB: one class");
  SPY_CHECK(PathAdvisor::sizeClass(size_t{16} << 10) == 1 &&
                PathAdvisor::sizeClass(size_t{32} << 10) == 2 &&
                PathAdvisor::sizeClass(size_t{64} << 10) == 3 &&
                PathAdvisor::sizeClass((size_t{128} << 10) - 1) == 3,
            "16, 32 and 64 KiB: a class each");
  SPY_CHECK(PathAdvisor::sizeClass(size_t{128} << 10) == 4 &&
                PathAdvisor::sizeClass((size_t{512} << 10) - 1) == 4 &&
                PathAdvisor::sizeClass(size_t{512} << 10) == 5,
            "from 128 KiB: factors of 4");
  SPY_CHECK(PathAdvisor::sizeClass(size_t{1} << 40) == PathAdvisor::kClasses - 1, "the largest");
  // The single copy wins at 32 KiB, staged at 16 KiB: each keeps its own estimate.
  PathAdvisor a(PathAdvisor::kAuto);
  int64_t now = 10 * kMs;
  feed(a, size_t{16} << 10, false, 1000, now);
  feed(a, size_t{16} << 10, true, 2000, now);
  feed(a, size_t{32} << 10, false, 4000, now);
  feed(a, size_t{32} << 10, true, 2000, now);
  SPY_CHECK(a.vote(kKind, size_t{16} << 10, now) == 0, "16 KiB: staged (1 vs 2 us)");
  SPY_CHECK(a.vote(kKind, size_t{32} << 10, now) == PathAdvisor::kPreferCma,
            "32 KiB: single copy (2 vs 4 us)");
  const std::string d = a.describe([](uint32_t) { return "test"; });
  SPY_CHECK(
      d.find("from 16 KiB") != std::string::npos && d.find("from 32 KiB") != std::string::npos,
      "the dump lists both classes: %s", d.c_str());
}

void oversubscribedSpinTest() {
  spyreccl::transport::OversubscribedSpin s;
  // No history: one wait in 64 tries a spin.
  int tried = 0;
  for (int i = 0; i < 640; ++i) tried += s.tryNow() ? 1 : 0;
  SPY_CHECK(tried == 10, "without history %d of 640 waits spun, expected 10", tried);
  // A spin that found the peer: every wait spins from then on.
  s.record(true);
  for (int i = 0; i < 100; ++i) SPY_CHECK(s.tryNow(), "wait %d after a success did not spin", i);
  // Three successes and one failure in the latest four keep it (a sleeper's wake-up).
  s.record(true);
  s.record(true);
  s.record(false);
  SPY_CHECK(s.tryNow(), "one failure after three successes stopped the spins");
  // Two failures in a row stop it: back to one wait in 64.
  s.record(false);
  int after = 0;
  for (int i = 0; i < 64; ++i) after += s.tryNow() ? 1 : 0;
  SPY_CHECK(after == 1, "after two failures in a row, %d of 64 waits spun, expected 1", after);
}

[[maybe_unused]] const bool registered = [] {
  registerTest("advisor.oversubscribed_spin", oversubscribedSpinTest);
  registerTest("advisor.vote_floor", voteFloorTest);
  registerTest("advisor.small_classes", smallClassesTest);
  registerTest("advisor.learns", learnsTest);
  registerTest("advisor.off", offTest);
  registerTest("advisor.probe_spacing", probeSpacingTest);
  return true;
}();

}  // namespace

int main(int argc, char** argv) { return spyreccl_test::runTests(argc, argv); }
