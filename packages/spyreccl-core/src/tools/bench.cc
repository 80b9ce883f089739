// spyreccl_bench: timing driver for allreduce (developer tool, not a test).
//
//   spyreccl_bench [nranks=2] [min_bytes=8] [max_bytes=128M] [memory=host|arena]
//
// Forks nranks processes; for each size (x4 steps) runs warm-up iterations, then times
// iterations individually with a barrier-free loop and prints the median latency, algbw
// (bytes / time) and busbw (algbw * 2 (n - 1) / n, the NCCL convention) as seen by rank 0.
// memory=arena allocates the buffers with spyrecclMemAlloc (direct transfers), host with
// new[] (staged transfers).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "spyreccl/spyreccl.h"

namespace {

size_t parseBytes(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  switch (*end) {
    case 'K':
    case 'k':
      v *= 1024;
      break;
    case 'M':
    case 'm':
      v *= 1024 * 1024;
      break;
    case 'G':
    case 'g':
      v *= 1024.0 * 1024 * 1024;
      break;
    default:
      break;
  }
  return static_cast<size_t>(v);
}

int runRank(int rank, int nranks, spyrecclUniqueId id, size_t minBytes, size_t maxBytes,
            bool arena) {
  spyrecclComm_t comm = nullptr;
  if (spyrecclCommInitRank(&comm, nranks, id, rank, nullptr) != spyrecclSuccess) {
    std::fprintf(stderr, "rank %d: init failed: %s\n", rank, spyrecclGetLastError(nullptr));
    return 1;
  }
  const size_t maxCount = std::max<size_t>(1, maxBytes / 4);
  float* in = nullptr;
  float* out = nullptr;
  if (arena) {
    if (spyrecclMemAlloc(reinterpret_cast<void**>(&in), maxCount * 4) != spyrecclSuccess ||
        spyrecclMemAlloc(reinterpret_cast<void**>(&out), maxCount * 4) != spyrecclSuccess) {
      std::fprintf(stderr, "rank %d: %s\n", rank, spyrecclGetLastError(nullptr));
      return 1;
    }
  } else {
    in = new float[maxCount];
    out = new float[maxCount];
  }
  std::fill(in, in + maxCount, 1.0f);
  std::fill(out, out + maxCount, 0.0f);
  if (rank == 0) {
    std::printf("# allreduce float32 sum, %d ranks, %s memory (median of timed iterations)\n",
                nranks, arena ? "arena" : "host");
    std::printf("%12s %12s %12s %12s\n", "bytes", "time_us", "algbw_GB/s", "busbw_GB/s");
  }
  for (size_t bytes = minBytes; bytes <= maxBytes; bytes *= 4) {
    const size_t count = std::max<size_t>(1, bytes / 4);
    const int iters = bytes <= (64 << 10) ? 2000 : bytes <= (4 << 20) ? 100 : 10;
    for (int i = 0; i < std::max(5, iters / 10); ++i) {
      spyrecclAllReduce(in, out, count, spyrecclFloat32, spyrecclSum, comm);
    }
    spyrecclBarrier(comm);
    std::vector<double> us(iters);
    for (int i = 0; i < iters; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      spyrecclResult_t rc = spyrecclAllReduce(in, out, count, spyrecclFloat32, spyrecclSum, comm);
      us[i] =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      if (rc != spyrecclSuccess) {
        std::fprintf(stderr, "rank %d: %s\n", rank, spyrecclGetLastError(comm));
        return 1;
      }
    }
    std::sort(us.begin(), us.end());
    double med = us[iters / 2];
    double algbw = count * 4.0 / (med * 1e3);
    if (rank == 0) {
      std::printf("%12zu %12.2f %12.3f %12.3f\n", count * 4, med, algbw,
                  algbw * 2.0 * (nranks - 1) / nranks);
      std::fflush(stdout);
    }
  }
  spyrecclCommDestroy(comm);
  if (arena) {
    spyrecclMemFree(in);
    spyrecclMemFree(out);
  } else {
    delete[] in;
    delete[] out;
  }
  std::fflush(stdout);  // the caller leaves with _exit
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int nranks = argc > 1 ? std::atoi(argv[1]) : 2;
  size_t minBytes = argc > 2 ? parseBytes(argv[2]) : 8;
  size_t maxBytes = argc > 3 ? parseBytes(argv[3]) : (128u << 20);
  bool arena = argc > 4 && std::strcmp(argv[4], "arena") == 0;
  spyrecclUniqueId id;
  spyrecclGetUniqueId(&id);
  std::vector<pid_t> pids;
  for (int r = 0; r < nranks; ++r) {
    pid_t pid = fork();
    if (pid == 0) _exit(runRank(r, nranks, id, minBytes, maxBytes, arena));
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  }
  return failed;
}
