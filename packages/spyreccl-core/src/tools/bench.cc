// spyreccl_bench: timing driver for the C API (developer tool, not a test).
//
//   spyreccl_bench [nranks=2] [min_bytes=8] [max_bytes=128M] [memory=host|arena]
//                  [op=allreduce|broadcast|allgather|barrier] [iters_scale=1] [flush_mib=0]
//
// Forks nranks processes; for each size (x4 steps) runs warm-up iterations, then times
// iterations individually with a barrier-free loop and prints the median, mean and p90
// latency, algbw (bytes / time of the median) and busbw (algbw * 2 (n - 1) / n, the NCCL
// convention for allreduce; the same factor is printed for the other ops) as seen by rank 0.
// memory=arena allocates the buffers with spyrecclMemAlloc (direct transfers), host with
// new[] (staged transfers). bytes are per rank (allgather: the send buffer; barrier: none).
// iters_scale multiplies the iteration counts (e.g. 50 for a perf record of small sizes).
//
// flush_mib > 0 times each call as it runs inside a model's step on a CPU: before every timed
// call each rank writes one byte per cache line of its own flush_mib MiB buffer (as a layer
// streams its weights), so the call finds the library's code, the segment and the buffers
// evicted. The ranks then arrive at different times, so each call is split, from timestamps of
// one machine-wide clock, into the wait (last arrival - first) and the in-call time (from the
// last arrival to each rank's return, mean over the ranks). For comparison the same split is
// printed for a warm pass in which the ranks busy-wait instead of streaming (caches untouched).
// Both passes assume a core per rank: with more ranks than cores a busy-waiting or streaming rank
// holds a core its peer needs.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
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

// Timed calls per size and pass of the cold mode (each follows a flush of several ms).
constexpr int kColdIters = 200;

enum class Op { kAllReduce, kBroadcast, kAllGather, kBarrier };

const char* opName(Op op) {
  switch (op) {
    case Op::kAllReduce:
      return "allreduce float32 sum";
    case Op::kBroadcast:
      return "broadcast float32 from rank 0";
    case Op::kAllGather:
      return "allgather float32";
    case Op::kBarrier:
      return "barrier";
  }
  return "?";
}

spyrecclResult_t runOp(Op op, const float* in, float* out, size_t count, spyrecclComm_t comm) {
  switch (op) {
    case Op::kAllReduce:
      return spyrecclAllReduce(in, out, count, spyrecclFloat32, spyrecclSum, comm);
    case Op::kBroadcast:
      return spyrecclBroadcast(in, out, count, spyrecclFloat32, 0, comm);
    case Op::kAllGather:
      return spyrecclAllGather(in, out, count, spyrecclFloat32, comm);
    case Op::kBarrier:
      return spyrecclBarrier(comm);
  }
  return spyrecclInternalError;
}

// Timestamps of the cold mode, shared by the forked ranks (mapped before the fork).
struct CallTimes {
  int64_t arrive;
  int64_t leave;
};

int64_t monotonicNs() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);  // one clock for every process of the machine
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

// Prints, for one size, the median and p90 in-call time and the median wait of the timed
// calls of `times` ([iteration][rank]).
void printSplit(const char* pass, size_t bytes, const CallTimes* times, int iters, int nranks) {
  std::vector<double> inCall(iters);
  std::vector<double> wait(iters);
  for (int i = 0; i < iters; ++i) {
    const CallTimes* t = times + static_cast<size_t>(i) * nranks;
    int64_t first = t[0].arrive;
    int64_t last = t[0].arrive;
    for (int r = 1; r < nranks; ++r) {
      first = std::min(first, t[r].arrive);
      last = std::max(last, t[r].arrive);
    }
    double sum = 0;
    for (int r = 0; r < nranks; ++r) sum += static_cast<double>(t[r].leave - last);
    inCall[i] = sum / nranks / 1e3;
    wait[i] = static_cast<double>(last - first) / 1e3;
  }
  std::sort(inCall.begin(), inCall.end());
  std::sort(wait.begin(), wait.end());
  std::printf("%12zu %6s %14.3f %12.3f %14.3f\n", bytes, pass, inCall[iters / 2],
              inCall[iters * 9 / 10], wait[iters / 2]);
  std::fflush(stdout);
}

// The cold mode (flush_mib > 0): see the top of this file.
int runCold(int rank, int nranks, spyrecclComm_t comm, Op op, const float* in, float* out,
            size_t minBytes, size_t maxBytes, size_t flushBytes, int iters, CallTimes* times) {
  std::vector<unsigned char> flush(flushBytes);
  if (rank == 0) {
    std::printf(
        "# %s, %d ranks, each call after streaming %zu MiB (cold) or after a busy wait"
        " (warm)\n",
        opName(op), nranks, flushBytes >> 20);
    std::printf("%12s %6s %14s %12s %14s\n", "bytes", "pass", "in-call_us", "in-call_p90",
                "wait_median_us");
  }
  for (size_t bytes = minBytes; bytes <= maxBytes; bytes *= 4) {
    const size_t count = std::max<size_t>(1, bytes / 4);
    for (int cold = 0; cold < 2; ++cold) {
      for (int i = 0; i < 10; ++i) runOp(op, in, out, count, comm);
      spyrecclBarrier(comm);
      for (int i = 0; i < iters; ++i) {
        if (cold) {
          for (size_t k = 0; k < flushBytes; k += 64) ++flush[k];
        } else {
          const int64_t until = monotonicNs() + 1000000;  // 1 ms: a pace, not a flush
          while (monotonicNs() < until) {
          }
        }
        CallTimes& t = times[static_cast<size_t>(i) * nranks + rank];
        t.arrive = monotonicNs();
        spyrecclResult_t rc = runOp(op, in, out, count, comm);
        t.leave = monotonicNs();
        if (rc != spyrecclSuccess) {
          std::fprintf(stderr, "rank %d: %s\n", rank, spyrecclGetLastError(comm));
          return 1;
        }
      }
      spyrecclBarrier(comm);  // every rank's timestamps are written
      if (rank == 0) printSplit(cold ? "cold" : "warm", count * 4, times, iters, nranks);
      spyrecclBarrier(comm);  // rank 0 has read them before they are overwritten
    }
    if (op == Op::kBarrier) break;
  }
  return 0;
}

// The default mode: back-to-back calls, each timed on its own.
int runTimed(int rank, int nranks, spyrecclComm_t comm, Op op, const float* in, float* out,
             size_t minBytes, size_t maxBytes, bool arena, int itersScale) {
  if (rank == 0) {
    std::printf("# %s, %d ranks, %s memory (per-call latency of timed iterations)\n", opName(op),
                nranks, arena ? "arena" : "host");
    std::printf("%12s %12s %12s %12s %12s %12s\n", "bytes", "median_us", "mean_us", "p90_us",
                "algbw_GB/s", "busbw_GB/s");
  }
  for (size_t bytes = minBytes; bytes <= maxBytes; bytes *= 4) {
    const size_t count = std::max<size_t>(1, bytes / 4);
    const int iters = (bytes <= (64 << 10) ? 2000 : bytes <= (4 << 20) ? 100 : 10) * itersScale;
    for (int i = 0; i < std::max(5, iters / 10); ++i) runOp(op, in, out, count, comm);
    spyrecclBarrier(comm);
    std::vector<double> us(iters);
    for (int i = 0; i < iters; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      spyrecclResult_t rc = runOp(op, in, out, count, comm);
      us[i] =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      if (rc != spyrecclSuccess) {
        std::fprintf(stderr, "rank %d: %s\n", rank, spyrecclGetLastError(comm));
        return 1;
      }
    }
    double mean = 0;
    for (double u : us) mean += u / iters;
    std::sort(us.begin(), us.end());
    double med = us[iters / 2];
    double p90 = us[iters * 9 / 10];
    double algbw = count * 4.0 / (med * 1e3);
    if (rank == 0) {
      std::printf("%12zu %12.3f %12.3f %12.3f %12.3f %12.3f\n", count * 4, med, mean, p90, algbw,
                  algbw * 2.0 * (nranks - 1) / nranks);
      std::fflush(stdout);
    }
    if (op == Op::kBarrier) break;  // no sizes
  }
  return 0;
}

int runRank(int rank, int nranks, spyrecclUniqueId id, size_t minBytes, size_t maxBytes, bool arena,
            Op op, int itersScale, size_t flushBytes, CallTimes* times) {
  spyrecclComm_t comm = nullptr;
  if (spyrecclCommInitRank(&comm, nranks, id, rank, nullptr) != spyrecclSuccess) {
    std::fprintf(stderr, "rank %d: init failed: %s\n", rank, spyrecclGetLastError(nullptr));
    return 1;
  }
  const size_t maxCount = std::max<size_t>(1, maxBytes / 4);
  // allgather receives nranks blocks; the other ops one.
  const size_t outCount = op == Op::kAllGather ? maxCount * nranks : maxCount;
  float* in = nullptr;
  float* out = nullptr;
  if (arena) {
    if (spyrecclMemAlloc(reinterpret_cast<void**>(&in), maxCount * 4) != spyrecclSuccess ||
        spyrecclMemAlloc(reinterpret_cast<void**>(&out), outCount * 4) != spyrecclSuccess) {
      std::fprintf(stderr, "rank %d: %s\n", rank, spyrecclGetLastError(nullptr));
      return 1;
    }
  } else {
    in = new float[maxCount];
    out = new float[outCount];
  }
  std::fill(in, in + maxCount, 1.0f);
  std::fill(out, out + outCount, 0.0f);
  const int rc = flushBytes > 0 ? runCold(rank, nranks, comm, op, in, out, minBytes, maxBytes,
                                          flushBytes, kColdIters * itersScale, times)
                                : runTimed(rank, nranks, comm, op, in, out, minBytes, maxBytes,
                                           arena, itersScale);
  spyrecclCommDestroy(comm);
  if (arena) {
    spyrecclMemFree(in);
    spyrecclMemFree(out);
  } else {
    delete[] in;
    delete[] out;
  }
  std::fflush(stdout);  // the caller leaves with _exit
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  int nranks = argc > 1 ? std::atoi(argv[1]) : 2;
  size_t minBytes = argc > 2 ? parseBytes(argv[2]) : 8;
  size_t maxBytes = argc > 3 ? parseBytes(argv[3]) : (128u << 20);
  bool arena = argc > 4 && std::strcmp(argv[4], "arena") == 0;
  Op op = Op::kAllReduce;
  if (argc > 5) {
    const std::string name = argv[5];
    if (name == "broadcast") {
      op = Op::kBroadcast;
    } else if (name == "allgather") {
      op = Op::kAllGather;
    } else if (name == "barrier") {
      op = Op::kBarrier;
    } else if (name != "allreduce") {
      std::fprintf(stderr,
                   "spyreccl_bench: unknown op '%s' (allreduce|broadcast|allgather|barrier)\n",
                   argv[5]);
      return 2;
    }
  }
  const int itersScale = argc > 6 ? std::max(1, std::atoi(argv[6])) : 1;
  const size_t flushBytes =
      argc > 7 ? static_cast<size_t>(std::max(0, std::atoi(argv[7]))) << 20 : 0;
  CallTimes* times = nullptr;
  if (flushBytes > 0) {
    const size_t bytes = sizeof(CallTimes) * kColdIters * itersScale * nranks;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("spyreccl_bench: mmap");
      return 1;
    }
    times = static_cast<CallTimes*>(p);
  }
  spyrecclUniqueId id;
  spyrecclGetUniqueId(&id);
  std::vector<pid_t> pids;
  for (int r = 0; r < nranks; ++r) {
    pid_t pid = fork();
    if (pid == 0)
      _exit(runRank(r, nranks, id, minBytes, maxBytes, arena, op, itersScale, flushBytes, times));
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
