// spyreccl_smoke: a quick end-to-end check of libspyreccl through the public C API only.
//
// Forks 2-4 rank processes per scenario and checks results of every collective and of
// send/recv against references computed locally in double precision / exact integers,
// plus the failure paths (mismatch, timeout, abort, killed peer, invalid arguments) and
// that no /dev/shm/spyreccl-* name is left behind. Not the test suite (tests/cpp is):
// a developer tool, built with -DSPYRECCL_BUILD_TOOLS=ON and run by ctest.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "spyreccl/spyreccl.h"

namespace {

int gFailures = 0;

#define EXPECT(cond, ...)                                                      \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "  FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                       \
      std::fprintf(stderr, "\n");                                              \
      return false;                                                            \
    }                                                                          \
  } while (0)

#define CHECK_OK(call)                                                                 \
  do {                                                                                 \
    spyrecclResult_t rc_ = (call);                                                     \
    EXPECT(rc_ == spyrecclSuccess, "%s -> %s: %s", #call, spyrecclGetErrorString(rc_), \
           spyrecclGetLastError(comm));                                                \
  } while (0)

struct Rank {
  int rank;
  int nranks;
  spyrecclComm_t comm;
  spyrecclUniqueId id;
};

using Body = std::function<bool(Rank&)>;

// The segment of a communicator is /dev/shm/spyreccl-<hex of the id's nonce>, the nonce
// being bytes [8, 24) of the unique id (see docs/design.md). Checking that exact name keeps
// this check immune to other jobs creating segments on the same machine.
bool segmentExists(const spyrecclUniqueId& id) {
  static const char kHex[] = "0123456789abcdef";
  std::string path = "/dev/shm/spyreccl-";
  for (int i = 8; i < 24; ++i) {
    auto b = static_cast<unsigned char>(id.internal[i]);
    path.push_back(kHex[b >> 4]);
    path.push_back(kHex[b & 15]);
  }
  return access(path.c_str(), F_OK) == 0;
}

// Runs `body` on `nranks` forked processes sharing one fresh communicator. `expectExit`
// lets a scenario declare ranks that die on purpose (exit code ignored).
bool runRanks(const char* name, int nranks, const Body& body,
              const spyrecclConfig_t* config = nullptr, int dyingRank = -1) {
  auto start = std::chrono::steady_clock::now();
  spyrecclUniqueId id;
  if (spyrecclGetUniqueId(&id) != spyrecclSuccess) {
    std::fprintf(stderr, "GetUniqueId failed\n");
    return false;
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < nranks; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      spyrecclComm_t comm = nullptr;
      spyrecclResult_t rc = spyrecclCommInitRank(&comm, nranks, id, r, config);
      if (rc != spyrecclSuccess) {
        std::fprintf(stderr, "  rank %d: init failed: %s\n", r, spyrecclGetLastError(nullptr));
        _exit(2);
      }
      Rank self{r, nranks, comm, id};
      bool ok = body(self);
      spyrecclCommDestroy(comm);
      _exit(ok ? 0 : 1);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (int r = 0; r < nranks; ++r) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    if (r == dyingRank) continue;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "  rank %d of '%s' failed (status 0x%x)\n", r, name, status);
      ok = false;
    }
  }
  if (segmentExists(id)) {
    std::fprintf(stderr, "  '%s' left its segment in /dev/shm\n", name);
    ok = false;
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%-48s n=%d  %-6s %.2f s\n", name, nranks, ok ? "ok" : "FAILED", secs);
  if (!ok) ++gFailures;
  return ok;
}

std::vector<float> rankData(int rank, size_t count, uint32_t salt) {
  std::mt19937 gen(rank * 7919 + salt);
  std::uniform_int_distribution<int> dist(-1000, 1000);
  std::vector<float> v(count);
  for (auto& x : v) x = static_cast<float>(dist(gen));  // integer valued: sums are exact
  return v;
}

// ---- collectives -------------------------------------------------------------------------

bool allReduce(Rank& R) {
  spyrecclComm_t comm = R.comm;
  const size_t sizes[] = {0, 1, 7, 1000, 16384, 70001, 1 << 20, 3 * (1 << 20) + 13};
  uint32_t salt = 1;
  for (size_t count : sizes) {
    for (int inPlace = 0; inPlace < 2; ++inPlace) {
      ++salt;
      std::vector<double> ref(count, 0.0);
      for (int q = 0; q < R.nranks; ++q) {
        auto d = rankData(q, count, salt);
        for (size_t i = 0; i < count; ++i) ref[i] += d[i];
      }
      auto in = rankData(R.rank, count, salt);
      std::vector<float> out(count, NAN);
      float* recv = inPlace ? in.data() : out.data();
      CHECK_OK(spyrecclAllReduce(in.data(), recv, count, spyrecclFloat32, spyrecclSum, comm));
      for (size_t i = 0; i < count; ++i) {
        EXPECT(recv[i] == static_cast<float>(ref[i]), "count %zu inplace %d i %zu: %f vs %f", count,
               inPlace, i, recv[i], ref[i]);
      }
    }
  }
  // int32 max and avg (truncation toward zero).
  std::vector<int32_t> a(1001), o(1001, -7);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<int32_t>(i) * (R.rank + 1) - 500;
  CHECK_OK(spyrecclAllReduce(a.data(), o.data(), a.size(), spyrecclInt32, spyrecclMax, comm));
  for (size_t i = 0; i < a.size(); ++i) {
    int32_t want = a[i];
    for (int q = 0; q < R.nranks; ++q)
      want = std::max(want, static_cast<int32_t>(i) * (q + 1) - 500);
    EXPECT(o[i] == want, "max i %zu: %d vs %d", i, o[i], want);
  }
  CHECK_OK(spyrecclAllReduce(a.data(), o.data(), a.size(), spyrecclInt32, spyrecclAvg, comm));
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t sum = 0;
    for (int q = 0; q < R.nranks; ++q) sum += static_cast<int32_t>(i) * (q + 1) - 500;
    EXPECT(o[i] == static_cast<int32_t>(sum / R.nranks), "avg i %zu: %d vs %lld", i, o[i],
           static_cast<long long>(sum / R.nranks));
  }
  // PreMulSum on float64.
  spyrecclRedOp_t pm;
  CHECK_OK(spyrecclRedOpCreatePreMulSum(&pm, 0.5, spyrecclFloat64, comm));
  std::vector<double> da(300, R.rank + 1.0), dout(300, NAN);
  CHECK_OK(spyrecclAllReduce(da.data(), dout.data(), da.size(), spyrecclFloat64, pm, comm));
  double want = 0.5 * R.nranks * (R.nranks + 1) / 2.0;
  for (double v : dout) EXPECT(v == want, "premul %f vs %f", v, want);
  CHECK_OK(spyrecclRedOpDestroy(pm, comm));
  return true;
}

bool reduceAndBroadcast(Rank& R) {
  spyrecclComm_t comm = R.comm;
  for (size_t count : {size_t{0}, size_t{5}, size_t{300000}, size_t{700001}}) {
    for (int root = 0; root < R.nranks; ++root) {
      auto in = rankData(R.rank, count, 100 + root);
      std::vector<float> out(count, NAN);
      CHECK_OK(spyrecclReduce(in.data(), R.rank == root ? out.data() : nullptr, count,
                              spyrecclFloat32, spyrecclSum, root, comm));
      if (R.rank == root) {
        std::vector<double> ref(count, 0.0);
        for (int q = 0; q < R.nranks; ++q) {
          auto d = rankData(q, count, 100 + root);
          for (size_t i = 0; i < count; ++i) ref[i] += d[i];
        }
        for (size_t i = 0; i < count; ++i) {
          EXPECT(out[i] == static_cast<float>(ref[i]), "reduce root %d i %zu", root, i);
        }
      }
      std::vector<float> b =
          R.rank == root ? rankData(root, count, 200) : std::vector<float>(count, NAN);
      CHECK_OK(spyrecclBroadcast(b.data(), b.data(), count, spyrecclFloat32, root, comm));
      auto ref = rankData(root, count, 200);
      EXPECT(b == ref, "broadcast root %d count %zu", root, count);
    }
  }
  return true;
}

bool gathers(Rank& R) {
  spyrecclComm_t comm = R.comm;
  const int n = R.nranks;
  for (size_t count : {size_t{0}, size_t{3}, size_t{100003}, size_t{600000}}) {
    auto mine = rankData(R.rank, count, 300);
    std::vector<float> all(count * n, NAN);
    CHECK_OK(spyrecclAllGather(mine.data(), all.data(), count, spyrecclFloat32, comm));
    for (int q = 0; q < n; ++q) {
      auto d = rankData(q, count, 300);
      EXPECT(std::equal(d.begin(), d.end(), all.begin() + q * count), "allgather block %d", q);
    }
    // In place.
    std::vector<float> all2(count * n, NAN);
    std::copy(mine.begin(), mine.end(), all2.begin() + R.rank * count);
    CHECK_OK(
        spyrecclAllGather(all2.data() + R.rank * count, all2.data(), count, spyrecclFloat32, comm));
    EXPECT(all2 == all, "allgather in place");
    // gather to the last rank, scatter back from it.
    const int root = n - 1;
    std::vector<float> g(count * n, NAN);
    CHECK_OK(spyrecclGather(mine.data(), g.data(), count, spyrecclFloat32, root, comm));
    if (R.rank == root) EXPECT(g == all, "gather");
    std::vector<float> back(count, NAN);
    CHECK_OK(spyrecclScatter(all.data(), back.data(), count, spyrecclFloat32, root, comm));
    EXPECT(back == mine, "scatter");
    // reduce_scatter: block p of rank q's input is rankData(q, count*n)[p*count..].
    auto rsIn = rankData(R.rank, count * n, 400);
    std::vector<float> rsOut(count, NAN);
    CHECK_OK(spyrecclReduceScatter(rsIn.data(), rsOut.data(), count, spyrecclFloat32, spyrecclSum,
                                   comm));
    std::vector<double> ref(count, 0.0);
    for (int q = 0; q < n; ++q) {
      auto d = rankData(q, count * n, 400);
      for (size_t i = 0; i < count; ++i) ref[i] += d[R.rank * count + i];
    }
    for (size_t i = 0; i < count; ++i)
      EXPECT(rsOut[i] == static_cast<float>(ref[i]), "rs i %zu", i);
    // reduce_scatter in place.
    CHECK_OK(spyrecclReduceScatter(rsIn.data(), rsIn.data() + R.rank * count, count,
                                   spyrecclFloat32, spyrecclSum, comm));
    for (size_t i = 0; i < count; ++i) {
      EXPECT(rsIn[R.rank * count + i] == static_cast<float>(ref[i]), "rs in place i %zu", i);
    }
  }
  return true;
}

bool allToAll(Rank& R) {
  spyrecclComm_t comm = R.comm;
  const int n = R.nranks;
  for (size_t count : {size_t{0}, size_t{1}, size_t{9999}, size_t{200000}}) {
    std::vector<int32_t> in(count * n), out(count * n, -1);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<int32_t>(R.rank * 1000000 + i);
    CHECK_OK(spyrecclAllToAll(in.data(), out.data(), count, spyrecclInt32, comm));
    for (int q = 0; q < n; ++q) {
      for (size_t i = 0; i < count; ++i) {
        EXPECT(out[q * count + i] == static_cast<int32_t>(q * 1000000 + R.rank * count + i),
               "alltoall from %d i %zu", q, i);
      }
    }
  }
  // alltoallv: rank r sends (r + 1) * (p + 1) * 1000 + p elements to p.
  auto cnt = [](int src, int dst) {
    return static_cast<size_t>((src + 1) * (dst + 1) * 1000 + dst);
  };
  std::vector<size_t> sc(n), sd(n), rc(n), rd(n);
  size_t stot = 0, rtot = 0;
  for (int p = 0; p < n; ++p) {
    sc[p] = cnt(R.rank, p);
    sd[p] = stot;
    stot += sc[p] + 3;  // gaps between blocks
    rc[p] = cnt(p, R.rank);
    rd[p] = rtot;
    rtot += rc[p] + 5;
  }
  std::vector<int64_t> in(stot), out(rtot, -1);
  for (int p = 0; p < n; ++p) {
    for (size_t i = 0; i < sc[p]; ++i) in[sd[p] + i] = R.rank * 100000000LL + p * 1000000LL + i;
  }
  CHECK_OK(spyrecclAllToAllv(in.data(), sc.data(), sd.data(), out.data(), rc.data(), rd.data(),
                             spyrecclInt64, comm));
  for (int q = 0; q < n; ++q) {
    for (size_t i = 0; i < rc[q]; ++i) {
      EXPECT(out[rd[q] + i] == q * 100000000LL + R.rank * 1000000LL + static_cast<long long>(i),
             "alltoallv from %d i %zu", q, i);
    }
  }
  // Mismatched counts: every rank must report spyrecclMismatch.
  if (R.rank == 0) rc[n - 1] += 1;
  spyrecclResult_t rcode = spyrecclAllToAllv(in.data(), sc.data(), sd.data(), out.data(), rc.data(),
                                             rd.data(), spyrecclInt64, comm);
  EXPECT(rcode == spyrecclMismatch, "alltoallv mismatch -> %s", spyrecclGetErrorString(rcode));
  return true;
}

// ---- point-to-point ----------------------------------------------------------------------

bool pointToPoint(Rank& R) {
  spyrecclComm_t comm = R.comm;
  const int n = R.nranks;
  const int right = (R.rank + 1) % n, left = (R.rank + n - 1) % n;
  for (size_t count : {size_t{0}, size_t{17}, size_t{1000000}}) {
    auto mine = rankData(R.rank, count, 500);
    std::vector<float> got(count, NAN);
    // Ring exchange: needs a group (a blocking send of a large message would deadlock).
    CHECK_OK(spyrecclGroupStart());
    CHECK_OK(spyrecclSend(mine.data(), count, spyrecclFloat32, right, 5, comm));
    CHECK_OK(spyrecclRecv(got.data(), count, spyrecclFloat32, left, 5, comm));
    CHECK_OK(spyrecclGroupEnd());
    EXPECT(got == rankData(left, count, 500), "ring count %zu", count);
  }
  // FIFO: several messages back to back from rank 0 to 1.
  if (R.rank == 0) {
    for (int m = 0; m < 5; ++m) {
      std::vector<int32_t> v(100000 + m, m);
      CHECK_OK(spyrecclSend(v.data(), v.size(), spyrecclInt32, 1, m, comm));
    }
  } else if (R.rank == 1) {
    for (int m = 0; m < 5; ++m) {
      std::vector<int32_t> v(100000 + m, -1);
      CHECK_OK(spyrecclRecv(v.data(), v.size(), spyrecclInt32, 0, m, comm));
      for (int32_t x : v) EXPECT(x == m, "fifo message %d", m);
    }
  }
  // Any source: every other rank sends its rank to rank 0.
  if (R.rank == 0) {
    std::vector<bool> seen(n, false);
    for (int k = 1; k < n; ++k) {
      int32_t v = -1;
      int src = -1;
      CHECK_OK(spyrecclRecvAnySource(&v, 1, spyrecclInt32, 9, &src, comm));
      EXPECT(src >= 1 && src < n && v == src && !seen[src], "any source %d value %d", src, v);
      seen[src] = true;
    }
  } else {
    int32_t v = R.rank;
    CHECK_OK(spyrecclSend(&v, 1, spyrecclInt32, 0, 9, comm));
  }
  CHECK_OK(spyrecclBarrier(comm));
  // Receive with the wrong count: mismatch on the receiver (and the sender).
  if (R.rank < 2) {
    std::vector<int32_t> v(10, 1);
    spyrecclResult_t rc = R.rank == 0 ? spyrecclSend(v.data(), 10, spyrecclInt32, 1, 3, comm)
                                      : spyrecclRecv(v.data(), 9, spyrecclInt32, 0, 3, comm);
    if (R.rank == 1)
      EXPECT(rc == spyrecclMismatch, "recv mismatch -> %s", spyrecclGetErrorString(rc));
    if (R.rank == 1)
      EXPECT(std::strstr(spyrecclGetLastError(comm), "count=10") != nullptr, "%s",
             spyrecclGetLastError(comm));
  }
  return true;
}

// ---- failure paths -------------------------------------------------------------------------

bool mismatch(Rank& R) {
  spyrecclComm_t comm = R.comm;
  std::vector<float> v(1000, 1.0f), w(1000, 0.0f);
  spyrecclResult_t rc =
      R.rank == R.nranks - 1
          ? spyrecclAllGather(v.data(), w.data(), 10, spyrecclFloat32, comm)
          : spyrecclAllReduce(v.data(), v.data(), 1000, spyrecclFloat32, spyrecclSum, comm);
  EXPECT(rc == spyrecclMismatch, "got %s", spyrecclGetErrorString(rc));
  const char* msg = spyrecclGetLastError(comm);
  EXPECT(std::strstr(msg, "allreduce(count=1000, float32, sum)") &&
             std::strstr(msg, "allgather(count=10, float32)"),
         "message: %s", msg);
  rc = spyrecclBarrier(comm);
  EXPECT(rc == spyrecclInvalidUsage, "after failure: %s", spyrecclGetErrorString(rc));
  spyrecclResult_t async;
  CHECK_OK(spyrecclCommGetAsyncError(comm, &async));
  EXPECT(async == spyrecclMismatch, "async %d", async);
  return true;
}

bool invalidArguments(Rank& R) {
  spyrecclComm_t comm = R.comm;
  // Once every rank attached, the name is gone although the communicator lives on.
  EXPECT(!segmentExists(R.id), "segment name still present after init");
  float x[4] = {1, 2, 3, 4};
  spyrecclResult_t rc =
      spyrecclAllReduce(x, x, 4, static_cast<spyrecclDataType_t>(42), spyrecclSum, comm);
  EXPECT(rc == spyrecclInvalidArgument, "dtype -> %d", rc);
  EXPECT(std::strstr(spyrecclGetLastError(comm), "argument 'datatype' = 42") != nullptr, "%s",
         spyrecclGetLastError(comm));
  rc = spyrecclBroadcast(x, x, 4, spyrecclFloat32, R.nranks + 2, comm);
  EXPECT(rc == spyrecclInvalidArgument, "root -> %d", rc);
  EXPECT(std::strstr(spyrecclGetLastError(comm), "out of range") != nullptr, "%s",
         spyrecclGetLastError(comm));
  rc = spyrecclAllReduce(x, x + 1, 3, spyrecclFloat32, spyrecclSum, comm);
  EXPECT(rc == spyrecclInvalidArgument, "overlap -> %d", rc);
  rc = spyrecclAllReduce(nullptr, x, 3, spyrecclFloat32, spyrecclSum, comm);
  EXPECT(rc == spyrecclInvalidArgument, "null -> %d", rc);
  rc = spyrecclAllReduce(x, x, 4, spyrecclFloat32, static_cast<spyrecclRedOp_t>(-3), comm);
  EXPECT(rc == spyrecclInvalidArgument, "op -3 -> %d", rc);
  rc = spyrecclAllReduce(x, x, 4, spyrecclFloat32, static_cast<spyrecclRedOp_t>(spyrecclNumOps + 5),
                         comm);
  EXPECT(rc == spyrecclInvalidArgument, "dead handle -> %d", rc);
  rc = spyrecclAllReduce(x, x, 4, spyrecclFloat32, spyrecclBand, comm);
  EXPECT(rc == spyrecclInvalidArgument, "band on float -> %d", rc);
  // The communicator is still usable.
  CHECK_OK(spyrecclAllReduce(x, x, 4, spyrecclFloat32, spyrecclSum, comm));
  EXPECT(x[3] == 4.0f * R.nranks, "after invalid args %f", x[3]);
  return true;
}

bool timeout(Rank& R) {
  spyrecclComm_t comm = R.comm;
  if (R.rank == 0) {
    auto t0 = std::chrono::steady_clock::now();
    spyrecclResult_t rc = spyrecclBarrier(comm);
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    EXPECT(rc == spyrecclTimeout, "got %s", spyrecclGetErrorString(rc));
    EXPECT(ms >= 250 && ms < 2000, "timed out after %.0f ms", ms);
    const char* msg = spyrecclGetLastError(comm);
    EXPECT(std::strstr(msg, "rank(s) 1") != nullptr, "%s", msg);
    EXPECT(std::strstr(msg, "spyreccl state of rank 0/2 'smoke-timeout'") != nullptr,
           "no state dump in: %s", msg);
    // SPYRECCL_DUMP_DIR (set by main) received the same text.
    std::string path =
        std::string(std::getenv("SPYRECCL_DUMP_DIR")) + "/spyreccl-smoke-timeout-rank0.txt";
    FILE* f = std::fopen(path.c_str(), "r");
    EXPECT(f != nullptr, "no dump file %s", path.c_str());
    char line[256] = {};
    bool read = std::fgets(line, sizeof(line), f) != nullptr;
    std::fclose(f);
    std::remove(path.c_str());
    EXPECT(read && std::strstr(line, "timed out"), "dump: %s", line);
    // DumpState from another thread while this one is idle.
    char buf[4096] = {};
    std::thread t([&] { spyrecclCommDumpState(comm, buf, sizeof(buf)); });
    t.join();
    EXPECT(std::strstr(buf, "barrier()") != nullptr, "dump: %s", buf);
  } else {
    usleep(900 * 1000);  // never calls the barrier
  }
  return true;
}

bool abortFromThread(Rank& R) {
  spyrecclComm_t comm = R.comm;
  if (R.rank == 0) {
    std::thread t([comm] {
      usleep(150 * 1000);
      spyrecclCommAbort(comm);
    });
    auto t0 = std::chrono::steady_clock::now();
    spyrecclResult_t rc = spyrecclBarrier(comm);
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    t.join();
    EXPECT(rc == spyrecclAborted, "got %s: %s", spyrecclGetErrorString(rc),
           spyrecclGetLastError(comm));
    EXPECT(ms < 1000, "abort took %.0f ms", ms);
  } else {
    usleep(400 * 1000);
    // Rank 0 entered the first barrier before it was aborted, so that one completes; the
    // next one waits for an aborted rank and must fail promptly.
    CHECK_OK(spyrecclBarrier(comm));
    auto t0 = std::chrono::steady_clock::now();
    spyrecclResult_t rc = spyrecclBarrier(comm);
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    EXPECT(rc == spyrecclRemoteError, "got %s", spyrecclGetErrorString(rc));
    EXPECT(std::strstr(spyrecclGetLastError(comm), "aborted") != nullptr, "%s",
           spyrecclGetLastError(comm));
    EXPECT(ms < 500, "remote abort noticed after %.0f ms", ms);
  }
  return true;
}

bool killedPeer(Rank& R) {
  spyrecclComm_t comm = R.comm;
  CHECK_OK(spyrecclBarrier(comm));
  if (R.rank == 1) {
    usleep(100 * 1000);
    kill(getpid(), SIGKILL);
  }
  auto t0 = std::chrono::steady_clock::now();
  std::vector<float> v(100000, 1.0f);
  spyrecclResult_t rc =
      spyrecclAllReduce(v.data(), v.data(), v.size(), spyrecclFloat32, spyrecclSum, comm);
  double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT(rc == spyrecclRemoteError, "got %s", spyrecclGetErrorString(rc));
  EXPECT(std::strstr(spyrecclGetLastError(comm), "died") != nullptr, "%s",
         spyrecclGetLastError(comm));
  EXPECT(ms < 2100, "death noticed after %.0f ms", ms);
  return true;
}

bool split(Rank& R) {
  spyrecclComm_t comm = R.comm;
  spyrecclComm_t sub = nullptr;
  int color = R.rank == 0 ? SPYRECCL_SPLIT_NOCOLOR : R.rank % 2;
  CHECK_OK(spyrecclCommSplit(comm, color, -R.rank, &sub, nullptr));
  if (color == SPYRECCL_SPLIT_NOCOLOR) {
    EXPECT(sub == nullptr, "nocolor got a communicator");
  } else {
    int n = 0, r = 0;
    CHECK_OK(spyrecclCommCount(sub, &n));
    CHECK_OK(spyrecclCommUserRank(sub, &r));
    int expectN = 0, expectR = 0;
    for (int q = R.nranks - 1; q >= 1; --q) {  // key = -rank: descending old rank
      if (q % 2 != color) continue;
      if (q > R.rank) ++expectR;
      ++expectN;
    }
    EXPECT(n == expectN && r == expectR, "split size %d rank %d, expected %d %d", n, r, expectN,
           expectR);
    int32_t v = R.rank;
    CHECK_OK(spyrecclAllReduce(&v, &v, 1, spyrecclInt32, spyrecclSum, sub));
    int32_t want = 0;
    for (int q = 1; q < R.nranks; ++q) want += q % 2 == color ? q : 0;
    EXPECT(v == want, "split allreduce %d vs %d", v, want);
    spyrecclCommDestroy(sub);
  }
  CHECK_OK(spyrecclBarrier(comm));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  for (int n : {2, 3, 4}) {
    runRanks("allreduce (float32/int32/premul)", n, allReduce);
    runRanks("reduce + broadcast", n, reduceAndBroadcast);
    runRanks("allgather/gather/scatter/reduce_scatter", n, gathers);
    runRanks("alltoall/alltoallv", n, allToAll);
    runRanks("send/recv/group/any-source", n, pointToPoint);
  }
  spyrecclConfig_t small = SPYRECCL_CONFIG_INITIALIZER;
  small.chunkBytes = 16384;
  small.p2pChunkBytes = 4096;
  runRanks("allreduce, 16 KiB chunks", 3, allReduce, &small);
  runRanks("gathers, 16 KiB chunks", 3, gathers, &small);
  runRanks("p2p, 4 KiB chunks", 3, pointToPoint, &small);
  runRanks("mismatch", 3, mismatch);
  runRanks("invalid arguments", 2, invalidArguments);
  spyrecclConfig_t fast = SPYRECCL_CONFIG_INITIALIZER;
  fast.timeoutMs = 300;
  fast.name = "smoke-timeout";
  char dumpDir[] = "/tmp/spyreccl-smoke-XXXXXX";
  if (mkdtemp(dumpDir) != nullptr) setenv("SPYRECCL_DUMP_DIR", dumpDir, 1);
  runRanks("timeout (+ state dump file)", 2, timeout, &fast);
  unsetenv("SPYRECCL_DUMP_DIR");
  rmdir(dumpDir);
  runRanks("abort from another thread", 2, abortFromThread);
  runRanks("killed peer", 3, killedPeer, nullptr, 1);
  runRanks("comm split", 4, split);
  std::printf("%s (%d failures)\n", gFailures ? "FAILED" : "ALL OK", gFailures);
  return gFailures ? 1 : 0;
}
