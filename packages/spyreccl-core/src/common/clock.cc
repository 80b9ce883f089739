#include "common/clock.h"

#include <sched.h>

namespace spyreccl {
namespace {

struct Anchor {
  uint64_t ticks;
  int64_t ns;
};

const Anchor& anchor() {
  static const Anchor a{ticksNow(), nowNs()};  // thread-safe initialisation
  return a;
}

}  // namespace

void startTickClock() { (void)anchor(); }

double nsPerTick() {
#if !defined(__x86_64__) && !defined(__i386__) && !defined(__aarch64__)
  return 1.0;  // ticksNow() is nowNs()
#else
  // The rate is measured over at least 10 ms, so the error of reading the two clocks one
  // after the other (tens of ns) stays below 1e-5.
  constexpr int64_t kMinSpanNs = 10 * kNsPerMs;
  const Anchor& a = anchor();
  for (;;) {
    const uint64_t t = ticksNow();
    const int64_t ns = nowNs();
    if (ns - a.ns >= kMinSpanNs) {
      return t > a.ticks ? static_cast<double>(ns - a.ns) / static_cast<double>(t - a.ticks) : 0.0;
    }
    sched_yield();
  }
#endif
}

}  // namespace spyreccl
