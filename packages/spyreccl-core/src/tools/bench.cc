// spyreccl_bench: timing driver for the C API (developer tool, not a test).
//
//   spyreccl_bench [nranks=2] [min_bytes=8] [max_bytes=128M] [memory=host|arena]
//                  [op=allreduce|broadcast|allgather|barrier] [iters_scale=1]
//
// Forks nranks processes; for each size (x4 steps) runs warm-up iterations, then times
// iterations individually with a barrier-free loop and prints the median, mean and p90
// latency, algbw (bytes / time of the median) and busbw (algbw * 2 (n - 1) / n, the NCCL
// convention for allreduce; the same factor is printed for the other ops) as seen by rank 0.
// memory=arena allocates the buffers with spyrecclMemAlloc (direct transfers), host with
// new[] (staged transfers). bytes are per rank (allgather: the send buffer; barrier: none).
// iters_scale multiplies the iteration counts (e.g. 50 for a perf record of small sizes).
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

int runRank(int rank, int nranks, spyrecclUniqueId id, size_t minBytes, size_t maxBytes, bool arena,
            Op op, int itersScale) {
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
  spyrecclUniqueId id;
  spyrecclGetUniqueId(&id);
  std::vector<pid_t> pids;
  for (int r = 0; r < nranks; ++r) {
    pid_t pid = fork();
    if (pid == 0) _exit(runRank(r, nranks, id, minBytes, maxBytes, arena, op, itersScale));
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
