#include "algorithms/path_advisor.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/log.h"

namespace spyreccl::algorithms {

PathAdvisor::Mode PathAdvisor::envMode() {
  static const Mode mode = [] {
    const char* v = std::getenv("SPYRECCL_CMA_ADAPTIVE");
    if (v == nullptr || *v == '\0' || std::strcmp(v, "1") == 0 || std::strcmp(v, "auto") == 0) {
      return kAuto;
    }
    if (std::strcmp(v, "cma") == 0) return kPreferCmaAlways;
    if (std::strcmp(v, "staged") == 0) return kPreferStagedAlways;
    return kOff;
  }();
  return mode;
}

int PathAdvisor::sizeClass(size_t bytes) {
  // Factors of 2 below 128 KiB, where the vote may start (voteFloor): [0, 16K) -> 0,
  // [16K, 32K) -> 1, [32K, 64K) -> 2, [64K, 128K) -> 3; factors of 4 above: [128K, 512K) -> 4,
  // ..., >= 512 MiB -> 10.
  if (bytes < (size_t{16} << 10)) return 0;
  if (bytes < (size_t{128} << 10))
    return bytes < (size_t{32} << 10) ? 1 : bytes < (size_t{64} << 10) ? 2 : 3;
  int cls = 4;
  for (size_t b = bytes >> 19; b != 0 && cls < kClasses - 1; b >>= 2) ++cls;
  return cls;
}

size_t PathAdvisor::voteFloor(const int64_t stagedNs[kProbeSizes],
                              const int64_t cmaNs[kProbeSizes]) {
  size_t floor = kDefaultVoteFloor;
  // From the largest probe size down, while the single copy keeps winning.
  for (int i = kProbeSizes - 1; i >= 0; --i) {
    if (stagedNs[i] <= 0 || cmaNs[i] <= 0) break;
    if (static_cast<double>(cmaNs[i]) >= kProbeMargin * static_cast<double>(stagedNs[i])) break;
    floor = kProbeBytes[i];
  }
  return floor;
}

bool PathAdvisor::Estimate::stale(int64_t nowNs, size_t bytes) const {
  const int64_t at = atNs.load(std::memory_order_relaxed);
  if (at == 0) return true;
  const uint32_t n = samples.load(std::memory_order_relaxed);
  const int64_t after = n >= 8 ? kStaleNs : std::min(kStaleNs, kFirstProbeNs << n);
  const double probeNs =
      3.0 * nsPerKiB.load(std::memory_order_relaxed) * static_cast<double>(bytes) / 1024.0;
  return nowNs - at > std::max<int64_t>(after, static_cast<int64_t>(kProbeSpacing * probeNs));
}

uint64_t PathAdvisor::vote(uint32_t kind, size_t bytes, int64_t nowNs, bool quietCma) const {
  switch (mode_) {
    case kOff:
      return quietCma ? kPreferCma : 0;
    case kPreferStagedAlways:
      return 0;
    case kPreferCmaAlways:
      return kPreferCma;
    case kAuto:
      break;
  }
  const Entry& e = entry(kind, bytes);
  // Missing estimates first, staged (the default path) before the single copy; then stale
  // ones, the older first: calls slower than a young estimate's re-probe interval (1, 2,
  // 4 ... ms) would otherwise keep re-probing the staged path and never measure the other.
  const int64_t stagedAt = e.path[0].atNs.load(std::memory_order_relaxed);
  const int64_t cmaAt = e.path[1].atNs.load(std::memory_order_relaxed);
  if (stagedAt == 0) return kProbeStaged;
  if (cmaAt == 0) return kPreferCma;
  const bool stagedStale = e.path[0].stale(nowNs, bytes);
  const bool cmaStale = e.path[1].stale(nowNs, bytes);
  if (stagedStale && (!cmaStale || stagedAt <= cmaAt)) return kProbeStaged;
  if (cmaStale) return kPreferCma;
  const double staged = e.path[0].nsPerKiB.load(std::memory_order_relaxed);
  const double cma = e.path[1].nsPerKiB.load(std::memory_order_relaxed);
  return cma < staged ? kPreferCma : 0;
}

void PathAdvisor::record(uint32_t kind, size_t bytes, bool cma, int64_t elapsedNs, int64_t nowNs) {
  if (mode_ != kAuto || bytes == 0 || elapsedNs <= 0) return;
  Entry& entry = table_[kind % kKinds][sizeClass(bytes)];
  Estimate& e = entry.path[cma ? 1 : 0];
  const double raw = static_cast<double>(elapsedNs) * 1024.0 / static_cast<double>(bytes);
  // The first call after a switch of path runs cold (the staging slots' or the buffers'
  // cache lines are elsewhere: measured 2-3x the warm time for a 128 KiB allgather), and
  // single calls are preempted now and then: a sample is the faster of two consecutive
  // calls on the same path, and the first call after a switch only primes. The estimate
  // stays stale meanwhile, so a probe lasts three calls.
  const int path = cma ? 2 : 1;
  uint32_t run = 1;
  if (entry.lastPath.exchange(path, std::memory_order_relaxed) == path) {
    run = e.run.load(std::memory_order_relaxed) + 1;
  }
  e.run.store(run, std::memory_order_relaxed);
  const double prev = e.prevRaw.exchange(raw, std::memory_order_relaxed);
  if (run < 3) return;
  const double sample = std::min(prev, raw);
  const int64_t at = e.atNs.load(std::memory_order_relaxed);
  const double old = e.nsPerKiB.load(std::memory_order_relaxed);
  double est;
  if (at == 0 || old <= 0) {
    est = sample;
  } else {
    // A rare slow pair must not swing the estimate: a sample counts for at most 4x the
    // estimate. Samples of the path in use arrive every call (weight 1/4); a probe's (the
    // path not in use) and the first few weigh 1/2.
    const double s = std::min(sample, 4 * old);
    const bool probe = nowNs - at > kStaleNs / 2 || e.samples.load(std::memory_order_relaxed) < 4;
    est = old + (probe ? 0.5 : 0.25) * (s - old);
  }
  // A path whose estimate just fell behind the other's (the path in use loses the vote) is
  // measured again soon, 1, 2, 4, ... ms later, instead of after kStaleNs: if one slow pair
  // of calls made it lose, the next probe wins it back before a quarter second on the
  // slower path has passed.
  const double other = entry.path[cma ? 0 : 1].nsPerKiB.load(std::memory_order_relaxed);
  const bool lost = other > 0 && est > other && (old <= 0 || old <= other);
  // Races (point-to-point from another thread) lose a sample at worst.
  e.nsPerKiB.store(est, std::memory_order_relaxed);
  e.atNs.store(nowNs, std::memory_order_relaxed);
  e.samples.store(lost ? 0 : e.samples.load(std::memory_order_relaxed) + 1,
                  std::memory_order_relaxed);
  SPYRECCL_LOG(kTrace, "path advisor", "kind %u, %zu bytes, %s: %.0f ns, estimate %.1f ns/KiB",
               kind, bytes, cma ? "single copy" : "staged", static_cast<double>(elapsedNs), est);
}

double PathAdvisor::estimate(uint32_t kind, size_t bytes, bool cma) const {
  return entry(kind, bytes).path[cma ? 1 : 0].nsPerKiB.load(std::memory_order_relaxed);
}

std::string PathAdvisor::describe(const char* (*kindName)(uint32_t kind)) const {
  static const char* const kFrom[kClasses] = {"< 16 KiB", "16 KiB",  "32 KiB", "64 KiB",
                                              "128 KiB",  "512 KiB", "2 MiB",  "8 MiB",
                                              "32 MiB",   "128 MiB", "512 MiB"};
  std::string out;
  for (int k = 0; k < kKinds; ++k) {
    for (int cls = 0; cls < kClasses; ++cls) {
      const Entry& e = table_[k][cls];
      const double staged = e.path[0].nsPerKiB.load(std::memory_order_relaxed);
      const double cma = e.path[1].nsPerKiB.load(std::memory_order_relaxed);
      if (staged <= 0 && cma <= 0) continue;
      char staged_s[32] = "not measured", cma_s[32] = "not measured";
      if (staged > 0) std::snprintf(staged_s, sizeof staged_s, "%.1f ns/KiB", staged);
      if (cma > 0) std::snprintf(cma_s, sizeof cma_s, "%.1f ns/KiB", cma);
      char line[192];
      std::snprintf(line, sizeof line, "    %-22s from %-8s staged %-16s single copy %-16s %s\n",
                    k == static_cast<int>(kSmallP2P) ? "send/recv (small)" : kindName(k),
                    kFrom[cls], staged_s, cma_s,
                    staged <= 0 || cma <= 0 ? ""
                    : cma < staged          ? "faster: single copy"
                                            : "faster: staged");
      out += line;
    }
  }
  return out;
}

}  // namespace spyreccl::algorithms
