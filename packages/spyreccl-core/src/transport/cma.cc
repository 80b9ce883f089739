#include "transport/cma.h"

#include <sys/prctl.h>
#include <sys/uio.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/clock.h"
#include "transport/wait.h"

namespace spyreccl::transport {

int cmaRead(pid_t pid, void* dst, uint64_t remote, size_t len) {
  auto* out = static_cast<uint8_t*>(dst);
  while (len > 0) {
    iovec local{out, len};
    iovec peer{reinterpret_cast<void*>(static_cast<uintptr_t>(remote)), len};
    const ssize_t got = ::process_vm_readv(pid, &local, 1, &peer, 1, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    // A short read means the copy stopped at an unmapped page of the peer (the next call
    // reports EFAULT) or was interrupted; zero progress would loop forever.
    if (got == 0) return EFAULT;
    out += got;
    remote += static_cast<uint64_t>(got);
    len -= static_cast<size_t>(got);
  }
  return 0;
}

bool cpusContended() {
  // SPYRECCL_CMA_CONTENDED=1/0 replaces the measurement (a machine known to be shared, or
  // tests); read once per process.
  static const int forced = [] {
    const char* v = std::getenv("SPYRECCL_CMA_CONTENDED");
    if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return -1;
    return std::strcmp(v, "0") == 0 ? 0 : 1;
  }();
  if (forced >= 0) return forced == 1;
  static std::atomic<int64_t> lastNs{0};
  static std::atomic<bool> contended{false};
  const int64_t now = nowNs();
  if (now - lastNs.load(std::memory_order_relaxed) < 20 * kNsPerMs) {
    return contended.load(std::memory_order_relaxed);
  }
  lastNs.store(now, std::memory_order_relaxed);
  bool busy = false;
  if (FILE* f = std::fopen("/proc/loadavg", "re")) {
    double load1 = 0;
    int running = 0;
    if (std::fscanf(f, "%lf %*f %*f %d/", &load1, &running) == 2) {
      const int cpus = jobCpus();
      // `running` includes the reader itself; a peer rank spinning is one more.
      busy = running > cpus + 1 || load1 > cpus + 1.0;
    }
    std::fclose(f);
  }
  contended.store(busy, std::memory_order_relaxed);
  return busy;
}

void allowPeerAccess() {
#ifdef PR_SET_PTRACER
  FILE* f = std::fopen("/proc/sys/kernel/yama/ptrace_scope", "re");
  if (f == nullptr) return;
  int scope = -1;
  const bool read = std::fscanf(f, "%d", &scope) == 1;
  std::fclose(f);
  if (read && scope == 1) ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
#endif
}

}  // namespace spyreccl::transport
