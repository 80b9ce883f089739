// Monotonic clock helpers (CLOCK_MONOTONIC goes through the vDSO: ~20 ns, no syscall).
#pragma once

#include <time.h>

#include <cstdint>

namespace spyreccl {

inline int64_t nowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

constexpr int64_t kNsPerUs = 1000;
constexpr int64_t kNsPerMs = 1000 * 1000;

}  // namespace spyreccl
