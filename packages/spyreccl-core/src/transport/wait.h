// Bounded waiting on shared-memory words: spin -> yield -> futex.
//
// Every blocking point of the protocol (a peer's step counter, a p2p doorbell) goes
// through waitUntil(). The phases trade latency for CPU:
//   1. spin with a CPU pause for ~kSpinNs: sub-microsecond hand-off when every rank has a
//      core of its own. Deliberately short: when the peer is not running (other load on
//      the machine), spinning only delays the yield that lets it run; measured on a loaded
//      2-core machine, a 2 us budget gave 7 us small-allreduce latency vs 60 us with 30 us.
//      Skipped when the ranks oversubscribe the CPUs, except by point-to-point waits
//      while spinning keeps paying off (OversubscribedSpin).
//   1b. keep spinning up to kSpinMaxNs while that has been paying off (SpinAdvisor): a peer
//      that is running but a few microseconds late (Python's per-call overhead, an
//      interrupt, a page fault on its side) otherwise sends this rank into sched_yield,
//      which on a machine with other runnable tasks gives the core away for ~10 us or
//      more (EEVDF's yield moves the task behind every other runnable one). That was the
//      ~11 us mode of the bimodal 8-byte allreduce (docs/notes/core-small-messages.md, "Small
//      messages: the tail"). When the extended spins keep failing (the peer is not running), they
//      stop, so the loaded case keeps the short budget; one in 64 waits tries again.
//   2. sched_yield for ~kYieldNs (the communicator's yieldNs): lets a descheduled peer run
//      on this core; this is what keeps small collectives fast when 4 ranks share 2 cores.
//      Where waits are long (ranks waiting for a transfer between hosts), yielding only
//      keeps a CPU busy that others need: a caller shortens it for a communicator (its
//      config's yieldNs) or for the waits one thread drives (spyrecclSetThreadYield).
//   3. FUTEX_WAIT on the word with a 1 ms timeout, announced in the segment-wide
//      `sleepers` counter so that posters skip the FUTEX_WAKE syscall when nobody sleeps.
// From phase 2 on, `check(waitedNs, full)` runs on every wakeup (full=false: cheap local
// checks such as an abort request) and about every kCheckIntervalNs with full=true
// (deadline, peer flags, peer liveness). check reports a problem by throwing.
#pragma once

#include <sched.h>

#include <atomic>
#include <cstdint>

#include "common/clock.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace spyreccl::transport {

constexpr int64_t kSpinNs = 2 * kNsPerUs;
constexpr int64_t kSpinMaxNs = 30 * kNsPerUs;
constexpr int64_t kYieldNs = 2 * kNsPerMs;
constexpr int64_t kFutexSliceNs = 1 * kNsPerMs;
constexpr int64_t kCheckIntervalNs = 50 * kNsPerMs;

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

// Shared (non-private) futex operations: the word lives in a MAP_SHARED mapping and the
// waker is another process.
void futexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeoutNs);
void futexWakeAll(std::atomic<uint32_t>* word);

// Number of CPUs this process may run on (affinity mask, so cpusets/taskset count).
int usableCpus();

// This process's affinity mask as kCpuMaskWords words of 64 CPUs; false when unknown.
bool ownCpuMask(uint64_t* words, int nwords);

// The CPUs the ranks of this process's communicators may run on between them (the largest
// union of their affinity masks seen at bootstrap, noteJobCpus), or usableCpus() if larger:
// what "more runnable tasks than CPUs" compares with (cma.cc) when a launcher binds every
// rank to a core of its own.
int jobCpus();
void noteJobCpus(int n);

// Wakes the sleepers of `word` if there may be any. Call after publishing a new value.
// The seq_cst fence pairs with the one in waitUntil: either the waiter sees the new value
// before sleeping or this sees the waiter's sleepers increment (no lost wake-up).
inline void notify(std::atomic<uint32_t>* word, std::atomic<uint32_t>* sleepers) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (sleepers->load(std::memory_order_relaxed) != 0) futexWakeAll(word);
}

// Decides whether a wait that outlasted kSpinNs keeps spinning up to kSpinMaxNs, from the
// outcomes of the latest such extended spins of this thread (bit i of `history`: the
// (i+1)-th latest one ended with the peer's arrival). Thread-local: waits of one thread
// see the same peers and the same machine load.
struct SpinAdvisor {
  uint32_t history = ~0u;
  uint32_t declined = 0;
  bool extend() {
    if (__builtin_popcount(history & 0xFFu) >= 4) return true;
    return (++declined & 63u) == 0;  // probe again now and then: the load may have gone
  }
  void record(bool arrived) { history = (history << 1) | (arrived ? 1u : 0u); }
  static SpinAdvisor& mine() {
    thread_local SpinAdvisor advisor;
    return advisor;
  }
};

// Decides whether a point-to-point wait of ranks that oversubscribe the CPUs spins kSpinNs
// before it yields (SpinPolicy::pairwise), from the outcomes of this thread's latest such
// spins (bit i of `history`: the (i+1)-th latest found the peer). Mostly such a wait cannot
// end by spinning: the rank it waits for is descheduled, and spinning only delays the yield
// that lets it run. But where only some of the ranks communicate while the others sleep (two
// ranks in a ping-pong, the third blocked in a later collective), the two have a CPU each and
// a hand-off takes well under a microsecond, against 1.9 us through sched_yield. The spin is
// tried once in 64 waits and kept while the latest spin, or 3 of the latest 4, paid off: a
// sleeping rank's periodic wake-up (the futex phase's 1 ms slices) costs one failed spin, not
// the spinning; two failures in a row stop it, as when the CPUs get crowded.
// SPYRECCL_SPIN_MAX_NS <= 2000 turns it off, with the extended spin.
struct OversubscribedSpin {
  uint32_t history = 0;
  uint32_t declined = 0;
  bool tryNow() {
    if ((history & 1u) != 0 || __builtin_popcount(history & 0xFu) >= 3) return true;
    return (++declined & 63u) == 0;
  }
  void record(bool arrived) { history = (history << 1) | (arrived ? 1u : 0u); }
  static OversubscribedSpin& mine() {
    thread_local OversubscribedSpin advisor;
    return advisor;
  }
};

// How a communicator's waits spin: not at all (ranks oversubscribe the CPUs), or kSpinNs
// extended up to extendNs (<= kSpinNs: never extended) while that pays off.
struct SpinPolicy {
  bool spin = true;
  int64_t extendNs = kSpinMaxNs;
  int64_t yieldNs = kYieldNs;  // phase 2's length; 0: sleep right after the spin
  // Without `spin`: a wait for one peer (point-to-point) may still spin where that has been
  // paying off (OversubscribedSpin). Never for a collective's step: every rank takes part,
  // so with more ranks than CPUs one of them is descheduled until some rank yields.
  bool pairwise = false;
};

// `policy` for a wait on a single peer (point-to-point).
inline SpinPolicy pairwise(SpinPolicy policy) {
  policy.pairwise = true;
  return policy;
}

// The one-shot hook of spyrecclSetBlockingHook (thread-local): fired by the first wait of
// the calling thread that outlasts its initial spin, right before it spins on (extended)
// or yields. Lets a binding keep its interpreter lock over calls that end within the spin.
struct BlockingHook {
  void (*fn)(void*) = nullptr;
  void* arg = nullptr;
};
BlockingHook& blockingHook();

// spyrecclSetThreadYield's override of the yield phase for the calling thread (-1: none).
int64_t& threadYieldNs();
inline void fireBlockingHook() {
  BlockingHook& hook = blockingHook();
  if (hook.fn == nullptr) return;
  void (*fn)(void*) = hook.fn;
  hook.fn = nullptr;  // disarmed before it runs: it fires once
  fn(hook.arg);
}

// Spins with a CPU pause until ready() (true) or until `budgetNs` have passed since `start`
// (false). The clock is first read after 16 pauses (~0.4 us on the dev machine): a wait
// that ends sooner, the common case of small collectives between ranks that each have a
// core, reads no clock at all. `start` 0 becomes that first reading: the budget counts from
// there, the pauses before it are not worth a clock read to account for. A later call with
// the same `start` continues the same budget.
template <class Ready, class Check>
bool spinFor(int64_t& start, int64_t budgetNs, Ready& ready, Check& check) {
  for (uint32_t i = 1;; ++i) {
    cpuRelax();
    if (ready()) return true;
    if ((i & 15) == 0) {
      const int64_t now = nowNs();
      if (start == 0) start = now;
      check(now - start, false);
      if (now - start >= budgetNs) return false;
    }
  }
}

template <class Ready, class Check>
void waitUntil(SpinPolicy policy, std::atomic<uint32_t>* word, std::atomic<uint32_t>* sleepers,
               Ready&& ready, Check&& check) {
  if (ready()) return;
  int64_t start = 0;
  if (policy.spin) {
    if (spinFor(start, kSpinNs, ready, check)) return;
    fireBlockingHook();  // from here on the wait may last
    if (policy.extendNs > kSpinNs && SpinAdvisor::mine().extend()) {
      const bool arrived = spinFor(start, policy.extendNs, ready, check);
      SpinAdvisor::mine().record(arrived);
      if (arrived) return;
    }
  } else {
    OversubscribedSpin& advisor = OversubscribedSpin::mine();
    if (policy.pairwise && policy.extendNs > kSpinNs && advisor.tryNow()) {
      const bool arrived = spinFor(start, kSpinNs, ready, check);
      advisor.record(arrived);
      if (arrived) return;
    }
    start = nowNs();
    fireBlockingHook();
  }
  int64_t lastFull = start;
  const int64_t yieldNs = threadYieldNs() >= 0 ? threadYieldNs() : policy.yieldNs;
  for (uint32_t i = 1; yieldNs > 0; ++i) {
    sched_yield();
    if (ready()) return;
    if ((i & 15) == 0) {
      int64_t now = nowNs();
      bool full = now - lastFull >= kCheckIntervalNs;
      if (full) lastFull = now;
      check(now - start, full);
      if (now - start >= yieldNs) break;
    }
  }
  for (;;) {
    uint32_t seen = word->load(std::memory_order_acquire);
    sleepers->fetch_add(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    bool done = ready();
    if (!done) futexWait(word, seen, kFutexSliceNs);
    sleepers->fetch_sub(1, std::memory_order_relaxed);
    if (done || ready()) return;
    int64_t now = nowNs();
    bool full = now - lastFull >= kCheckIntervalNs;
    if (full) lastFull = now;
    check(now - start, full);
  }
}

}  // namespace spyreccl::transport
