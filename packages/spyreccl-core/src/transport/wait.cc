#include "transport/wait.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>

namespace spyreccl::transport {

void futexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeoutNs) {
  timespec ts{static_cast<time_t>(timeoutNs / 1000000000LL),
              static_cast<long>(timeoutNs % 1000000000LL)};
  // EAGAIN (value already changed), EINTR and ETIMEDOUT all just mean "re-check".
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

BlockingHook& blockingHook() {
  thread_local BlockingHook hook;
  return hook;
}

int64_t& threadYieldNs() {
  thread_local int64_t ns = -1;
  return ns;
}

int usableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

bool ownCpuMask(uint64_t* words, int nwords) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return false;
  for (int w = 0; w < nwords; ++w) words[w] = 0;
  const int cpus = std::min<int>(CPU_SETSIZE, nwords * 64);
  for (int cpu = 0; cpu < cpus; ++cpu) {
    if (CPU_ISSET(cpu, &set)) words[cpu / 64] |= uint64_t{1} << (cpu % 64);
  }
  return true;
}

namespace {
std::atomic<int> notedJobCpus{0};
}  // namespace

void noteJobCpus(int n) {
  int cur = notedJobCpus.load(std::memory_order_relaxed);
  while (n > cur && !notedJobCpus.compare_exchange_weak(cur, n, std::memory_order_relaxed)) {
  }
}

int jobCpus() { return std::max(usableCpus(), notedJobCpus.load(std::memory_order_relaxed)); }

}  // namespace spyreccl::transport
