// Communicator lifecycle and failure paths.
//
//   lifecycle.*  barrier semantics, split, queries
//   errors.*     mismatch detection, timeouts, abort from another thread, a SIGKILLed rank,
//                invalid arguments (and that the communicator survives them)
//
// The harness checks after every test that no /dev/shm/spyreccl-* segment was left.
#include <sched.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "data.h"
#include "multiproc.h"

namespace {

using namespace spyreccl_test;

void registerRanks(const std::string& name, int ws, std::function<void(RankContext&)> body,
                   std::function<void(RunOptions&)> tweak = nullptr) {
  registerTest(name, [=] {
    RunOptions opts;
    opts.nranks = ws;
    opts.label = name;
    if (tweak) tweak(opts);
    runRanks(opts, body);
  });
}

// A small successful allreduce (sum of ranks) proving that `comm` still works.
void expectUsable(RankContext& ctx, const char* after) {
  int64_t v = ctx.rank + 1;
  int64_t sum = 0;
  if (!SPY_CHECK_OK(spyrecclAllReduce(&v, &sum, 1, spyrecclInt64, spyrecclSum, ctx.comm),
                    ctx.comm)) {
    return;
  }
  const int64_t n = ctx.nranks;
  SPY_CHECK(sum == n * (n + 1) / 2, "allreduce after %s: got %lld, expected %lld", after,
            (long long)sum, (long long)(n * (n + 1) / 2));
}

// ---------------------------------------------------------------------------------------
// lifecycle
// ---------------------------------------------------------------------------------------

// Nobody leaves a barrier before the last rank entered it. Ranks enter staggered; the entry
// times (CLOCK_MONOTONIC is shared by the processes of a machine) are exchanged afterwards.
void barrierBody(RankContext& ctx) {
  for (int round = 0; round < 3; ++round) {
    sleepMs(20 * ((ctx.rank + round) % ctx.nranks));
    const int64_t entered = monotonicNs();
    SPY_REQUIRE_OK(spyrecclBarrier(ctx.comm), ctx.comm);
    const int64_t left = monotonicNs();
    std::vector<int64_t> all(size_t(ctx.nranks));
    SPY_REQUIRE_OK(spyrecclAllGather(&entered, all.data(), 1, spyrecclInt64, ctx.comm), ctx.comm);
    for (int r = 0; r < ctx.nranks; ++r) {
      SPY_CHECK(left >= all[size_t(r)],
                "round %d: left the barrier %lld ns before rank %d entered it", round,
                (long long)(all[size_t(r)] - left), r);
    }
  }
}

void queryBody(RankContext& ctx) {
  int count = -1, rank = -1, version = 0;
  SPY_CHECK_OK(spyrecclCommCount(ctx.comm, &count), ctx.comm);
  SPY_CHECK_OK(spyrecclCommUserRank(ctx.comm, &rank), ctx.comm);
  SPY_CHECK_OK(spyrecclGetVersion(&version), nullptr);
  SPY_CHECK(count == ctx.nranks, "spyrecclCommCount = %d, expected %d", count, ctx.nranks);
  SPY_CHECK(rank == ctx.rank, "spyrecclCommUserRank = %d, expected %d", rank, ctx.rank);
  SPY_CHECK(version == SPYRECCL_VERSION_CODE, "spyrecclGetVersion = %d, expected %d", version,
            SPYRECCL_VERSION_CODE);
  spyrecclResult_t async = spyrecclInternalError;
  SPY_CHECK_OK(spyrecclCommGetAsyncError(ctx.comm, &async), ctx.comm);
  SPY_CHECK(async == spyrecclSuccess, "async error of a healthy communicator: %s",
            spyrecclGetErrorString(async));
  SPY_CHECK_OK(spyrecclCommSetTimeout(ctx.comm, 20000), ctx.comm);
  SPY_REQUIRE_OK(spyrecclBarrier(ctx.comm), ctx.comm);
  char dump[8192];
  SPY_CHECK_OK(spyrecclCommDumpState(ctx.comm, dump, sizeof dump), ctx.comm);
  SPY_CHECK(std::strlen(dump) > 0, "spyrecclCommDumpState wrote nothing");
  for (int r = 0; r < 2; ++r) {
    SPY_CHECK(std::string(spyrecclGetErrorString(spyrecclResult_t(r))).size() > 0,
              "empty error string for %d", r);
  }
}

// Colors by parity, keys reversing the order; the last rank of an even world opts out.
void splitBody(RankContext& ctx) {
  const int n = ctx.nranks;
  const bool optOut = n % 2 == 0 && ctx.rank == n - 1;
  const int color = optOut ? SPYRECCL_SPLIT_NOCOLOR : ctx.rank % 2;
  const int key = -ctx.rank;
  spyrecclComm_t sub = nullptr;
  SPY_REQUIRE_OK(spyrecclCommSplit(ctx.comm, color, key, &sub, nullptr), ctx.comm);
  if (optOut) {
    SPY_CHECK(sub == nullptr, "SPYRECCL_SPLIT_NOCOLOR must give a NULL communicator");
  } else {
    SPY_REQUIRE(sub != nullptr, "spyrecclCommSplit returned a NULL communicator");
    // Members of my color, in the new order: by key (= -old rank), i.e. old rank descending.
    std::vector<int> members;
    for (int r = n - 1; r >= 0; --r) {
      if (r % 2 == color && !(n % 2 == 0 && r == n - 1)) members.push_back(r);
    }
    int subCount = -1, subRank = -1;
    SPY_CHECK_OK(spyrecclCommCount(sub, &subCount), sub);
    SPY_CHECK_OK(spyrecclCommUserRank(sub, &subRank), sub);
    SPY_CHECK(subCount == int(members.size()), "split size %d, expected %zu", subCount,
              members.size());
    int expectedRank = -1;
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i] == ctx.rank) expectedRank = int(i);
    }
    SPY_CHECK(subRank == expectedRank, "split rank %d, expected %d", subRank, expectedRank);
    // Gather the old ranks in new rank order through the child communicator.
    int32_t mine = ctx.rank;
    std::vector<int32_t> gathered(members.size(), -1);
    if (SPY_CHECK_OK(spyrecclAllGather(&mine, gathered.data(), 1, spyrecclInt32, sub), sub)) {
      for (size_t i = 0; i < members.size(); ++i) {
        SPY_CHECK(gathered[i] == members[i], "child rank %zu is old rank %d, expected %d", i,
                  gathered[i], members[i]);
      }
    }
    SPY_CHECK_OK(spyrecclCommDestroy(sub), nullptr);
  }
  // The parent is still usable afterwards.
  expectUsable(ctx, "spyrecclCommSplit");
}

// ---------------------------------------------------------------------------------------
// lifecycle: the flight recorder (lock-free: written by the owner, read by any thread)
// ---------------------------------------------------------------------------------------

struct DumpLine {
  unsigned long long seq = 0;
  size_t count = 0;
  std::string state;
};

// The collectives listed in a state dump ("    seq 7  allreduce(count=3, float64, sum)
// from step 9  done  1.2 us"), in order.
std::vector<DumpLine> parseDump(const std::string& dump) {
  std::vector<DumpLine> lines;
  size_t pos = 0;
  while ((pos = dump.find("\n    seq ", pos)) != std::string::npos) {
    const size_t end = dump.find('\n', pos + 1);
    const std::string line = dump.substr(pos + 1, end - pos - 1);
    pos = end;
    DumpLine l;
    l.seq = std::strtoull(line.c_str() + 8, nullptr, 10);
    const size_t c = line.find("count=");
    if (c != std::string::npos) l.count = std::strtoull(line.c_str() + c + 6, nullptr, 10);
    for (const char* state : {" running ", " done ", " failed "}) {
      if (line.find(state) != std::string::npos)
        l.state = std::string(state + 1, std::strlen(state) - 2);
    }
    lines.push_back(l);
  }
  return lines;
}

// The count of the k-th allreduce of flightRecorderBody: consecutive records must follow
// this pattern, which a torn read (fields of two different records) would break.
size_t recorderCount(int k) { return size_t(1) + size_t(k % 7); }

// Many collectives while another thread dumps the state in a loop: every dump lists
// consecutive, consistent records (never half of one), at most 16; afterwards exactly the
// last 16 show as done; a failed collective shows as failed. Results are checked against a
// float64 reference (random inputs, poisoned outputs) so the recorder cannot hide a
// broken call.
void flightRecorderBody(RankContext& ctx) {
  constexpr int kCalls = 400;
  const int n = ctx.nranks;
  std::atomic<bool> stop{false};
  std::atomic<int> dumps{0};
  std::string readerError;  // written by the reader, read after join()
  std::atomic<bool> readerFailed{false};
  std::thread reader([&] {
    std::vector<char> buf(1 << 16);
    while (!stop.load(std::memory_order_relaxed)) {
      if (spyrecclCommDumpState(ctx.comm, buf.data(), buf.size()) != spyrecclSuccess) {
        readerError = "spyrecclCommDumpState failed";
        readerFailed = true;
        return;
      }
      const std::vector<DumpLine> lines = parseDump(buf.data());
      if (lines.size() > 16) readerError = format("%zu records in one dump", lines.size());
      for (size_t i = 1; i < lines.size() && readerError.empty(); ++i) {
        const DumpLine& a = lines[i - 1];
        const DumpLine& b = lines[i];
        // Records the owner overwrote while this dump read them are left out (a slow reader,
        // e.g. under ThreadSanitizer), so seqs may skip, but never go back, and the count of
        // each record must still follow the loop's pattern from the previous one.
        const unsigned long long skip = b.seq - a.seq;
        if (b.seq <= a.seq || skip > 16) {
          readerError = format("records seq %llu then %llu", a.seq, b.seq);
        } else if (b.count != (a.count - 1 + skip) % 7 + 1) {
          readerError = format("seq %llu count %zu followed by seq %llu count %zu", a.seq, a.count,
                               b.seq, b.count);
        } else if (a.state != "done") {
          readerError = format("seq %llu is '%s' before the latest record", a.seq, a.state.c_str());
        }
      }
      if (!readerError.empty()) {
        readerError += ":\n" + std::string(buf.data());
        readerFailed = true;
        return;
      }
      dumps.fetch_add(1, std::memory_order_relaxed);
    }
  });
  std::vector<double> send(8), recv(8);
  for (int k = 0; k < kCalls; ++k) {
    const size_t count = recorderCount(k);
    for (size_t i = 0; i < count; ++i) {
      send[i] = double(randomBits(uint64_t(k), ctx.rank, i) >> 11) * 0x1p-53;
    }
    std::fill(recv.begin(), recv.end(), std::nan(""));
    if (!SPY_CHECK_OK(spyrecclAllReduce(send.data(), recv.data(), count, spyrecclFloat64,
                                        spyrecclSum, ctx.comm),
                      ctx.comm)) {
      break;
    }
    for (size_t i = 0; i < count; ++i) {
      double expected = 0.0;
      for (int r = 0; r < n; ++r) expected += double(randomBits(uint64_t(k), r, i) >> 11) * 0x1p-53;
      SPY_CHECK(std::fabs(recv[i] - expected) <= 1e-15 * n,
                "call %d element %zu: got %.17g, "
                "expected %.17g",
                k, i, recv[i], expected);
    }
  }
  // Let the reader see the final state at least once before stopping it.
  const int seen = dumps.load();
  while (dumps.load() < seen + 2 && !readerFailed.load()) std::this_thread::yield();
  stop = true;
  reader.join();
  SPY_CHECK(readerError.empty(), "concurrent dump: %s", readerError.c_str());

  std::vector<char> buf(1 << 16);
  SPY_REQUIRE_OK(spyrecclCommDumpState(ctx.comm, buf.data(), buf.size()), ctx.comm);
  std::vector<DumpLine> lines = parseDump(buf.data());
  SPY_REQUIRE(lines.size() == 16, "%zu records after %d calls, expected 16:\n%s", lines.size(),
              kCalls, buf.data());
  for (size_t i = 0; i < lines.size(); ++i) {
    const int k = kCalls - 16 + int(i);
    SPY_CHECK(lines[i].state == "done" && lines[i].count == recorderCount(k),
              "record %zu: '%s' count %zu, expected done count %zu:\n%s", i, lines[i].state.c_str(),
              lines[i].count, recorderCount(k), buf.data());
  }
  // A failing collective (rank n-1 passes another count) is recorded as failed.
  const size_t count = ctx.rank == n - 1 ? 5 : 6;
  SPY_CHECK_RC(
      spyrecclAllReduce(send.data(), recv.data(), count, spyrecclFloat64, spyrecclSum, ctx.comm),
      spyrecclMismatch, ctx.comm);
  SPY_REQUIRE_OK(spyrecclCommDumpState(ctx.comm, buf.data(), buf.size()), ctx.comm);
  lines = parseDump(buf.data());
  SPY_REQUIRE(lines.size() == 16, "%zu records after the failure:\n%s", lines.size(), buf.data());
  SPY_CHECK(lines.back().state == "failed" && lines.back().count == count &&
                lines.back().seq == lines[14].seq + 1,
            "the mismatched call should be the last record, failed:\n%s", buf.data());
}

// spyrecclSetBlockingHook: fires once, on the calling thread, when a wait outlasts the
// spin; a disarmed hook does not fire.
void blockingHookBody(RankContext& ctx) {
  static thread_local int fired = 0;
  auto hook = [](void* arg) { ++*static_cast<int*>(arg); };
  // Rank 0 waits ~100 ms for rank 1 in each barrier below.
  auto lateBarrier = [&] {
    if (ctx.rank != 0) sleepMs(100);
    return spyrecclBarrier(ctx.comm);
  };
  SPY_CHECK_OK(spyrecclSetBlockingHook(hook, &fired), nullptr);
  SPY_REQUIRE_OK(lateBarrier(), ctx.comm);
  if (ctx.rank == 0) SPY_CHECK(fired == 1, "hook fired %d times in a long wait, expected 1", fired);
  // One-shot: the next long wait does not fire it again.
  SPY_REQUIRE_OK(lateBarrier(), ctx.comm);
  if (ctx.rank == 0)
    SPY_CHECK(fired == 1, "hook fired %d times after the first, expected 1", fired);
  // Disarmed before the call: never fires.
  SPY_CHECK_OK(spyrecclSetBlockingHook(hook, &fired), nullptr);
  SPY_CHECK_OK(spyrecclSetBlockingHook(nullptr, nullptr), nullptr);
  SPY_REQUIRE_OK(lateBarrier(), ctx.comm);
  SPY_CHECK(fired <= 1, "a disarmed hook fired (%d)", fired);
  expectUsable(ctx, "the blocking hook");
}

// ---------------------------------------------------------------------------------------
// errors: mismatches
// ---------------------------------------------------------------------------------------

// Rank `odd` calls something different; every rank must get spyrecclMismatch and the
// communicator is unusable afterwards (spyrecclInvalidUsage).
void mismatchBody(RankContext& ctx, const std::string& variant) {
  const int odd = ctx.nranks - 1;
  const bool me = ctx.rank == odd;
  // 128 floats: above the largest one-way broadcast (transport::kEagerMaxBytes), so the
  // broadcast variant takes the step protocol, in which every rank fails in the call.
  std::vector<float> send(128, 1.0f), recv(128 * size_t(ctx.nranks));
  spyrecclResult_t rc;
  if (variant == "count") {
    rc = spyrecclAllReduce(send.data(), recv.data(), me ? 63 : 64, spyrecclFloat32, spyrecclSum,
                           ctx.comm);
  } else if (variant == "op") {
    rc = spyrecclAllReduce(send.data(), recv.data(), 64, spyrecclFloat32,
                           me ? spyrecclMax : spyrecclSum, ctx.comm);
  } else if (variant == "dtype") {
    rc = spyrecclAllReduce(send.data(), recv.data(), 64, me ? spyrecclInt32 : spyrecclFloat32,
                           spyrecclSum, ctx.comm);
  } else if (variant == "root") {
    rc = spyrecclBroadcast(send.data(), recv.data(), 128, spyrecclFloat32, me ? 1 : 0, ctx.comm);
  } else {  // "collective"
    rc = me ? spyrecclAllGather(send.data(), recv.data(), 64, spyrecclFloat32, ctx.comm)
            : spyrecclAllReduce(send.data(), recv.data(), 64, spyrecclFloat32, spyrecclSum,
                                ctx.comm);
  }
  const std::string msg = spyrecclGetLastError(ctx.comm);
  SPY_CHECK(rc == spyrecclMismatch, "%s mismatch: got %s (\"%s\"), expected spyrecclMismatch",
            variant.c_str(), spyrecclGetErrorString(rc), msg.c_str());
  SPY_CHECK(contains(msg, "rank " + std::to_string(odd)),
            "the mismatch message should name rank %d: \"%s\"", odd, msg.c_str());
  spyrecclResult_t async = spyrecclSuccess;
  SPY_CHECK_OK(spyrecclCommGetAsyncError(ctx.comm, &async), ctx.comm);
  SPY_CHECK(async == spyrecclMismatch, "async error after a mismatch: %s",
            spyrecclGetErrorString(async));
  SPY_CHECK_RC(spyrecclBarrier(ctx.comm), spyrecclInvalidUsage, ctx.comm);
}

// One-way small broadcasts (algorithms/eager.h) whose calls do not match: a receiver that
// can see the mismatch fails in the call; every other rank (a root returns before anyone
// reads its slot) fails at its next collective that waits for every rank, here a barrier.
// Either way the message names both calls, and a failed receiver's output is untouched.
// A float drawn from the test's seed: the same on every rank that computes it.
float seededValue(uint64_t seed, int rank, uint64_t index) {
  return float(int64_t(randomBits(seed, rank, index) % 2000001) - 1000000) * 0.001f;
}

void eagerMismatchBody(RankContext& ctx, const std::string& variant) {
  const int odd = ctx.nranks - 1;
  const bool me = ctx.rank == odd;
  std::vector<float> send(16), recv(16, -7.0f);
  for (size_t i = 0; i < send.size(); ++i) send[i] = seededValue(ctx.seed, ctx.rank, i);
  const int root = me && variant == "root" ? 1 : 0;
  const size_t count = me && variant == "count" ? 15 : 16;
  spyrecclResult_t rc;
  if (variant == "collective" && me) {
    rc = spyrecclAllReduce(send.data(), recv.data(), 16, spyrecclFloat32, spyrecclSum, ctx.comm);
  } else {
    rc = spyrecclBroadcast(send.data(), recv.data(), count, spyrecclFloat32, root, ctx.comm);
  }
  std::string msg = rc == spyrecclSuccess ? "" : spyrecclGetLastError(ctx.comm);
  SPY_CHECK(rc == spyrecclSuccess || rc == spyrecclMismatch, "%s: got %s (\"%s\")", variant.c_str(),
            spyrecclGetErrorString(rc), msg.c_str());
  if (rc == spyrecclMismatch && ctx.rank != root) {
    for (float v : recv) SPY_CHECK(v == -7.0f, "a failed receiver's output was written: %g", v);
  }
  if (rc == spyrecclSuccess) {
    // Deferred to the next synchronising collective: our own mismatch (the digests of the
    // broadcasts differ) or a receiver's, named in its failure.
    rc = spyrecclBarrier(ctx.comm);
    msg = rc == spyrecclSuccess ? "" : spyrecclGetLastError(ctx.comm);
    SPY_CHECK(rc == spyrecclMismatch ||
                  (rc == spyrecclRemoteError && contains(msg, "failed with spyrecclMismatch")),
              "%s: the barrier after a mismatched one-way broadcast got %s (\"%s\")",
              variant.c_str(), spyrecclGetErrorString(rc), msg.c_str());
  }
  SPY_CHECK(contains(msg, " called ") && contains(msg, " but rank "),
            "the mismatch message should name both calls: \"%s\"", msg.c_str());
  SPY_CHECK_RC(spyrecclBarrier(ctx.comm), spyrecclInvalidUsage, ctx.comm);
}

// Many one-way broadcasts in a row, more than a root's ring holds, from every root in turn
// and with a synchronising allreduce now and then: every receiver gets every payload.
void eagerStreamBody(RankContext& ctx) {
  const int n = ctx.nranks;
  auto value = [&](int call, int root, size_t i) {
    return seededValue(ctx.seed, root, uint64_t(call) * 64 + i);
  };
  for (int call = 0; call < 1800; ++call) {
    // 600 in a row from one root: its ring (transport::kEagerSlots, 256) wraps twice.
    const int root = (call / 600) % n;
    const size_t count = 1 + size_t(call * 13) % 64;  // 4..256 bytes
    std::vector<float> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = ctx.rank == root ? value(call, root, i) : NAN;
    SPY_CHECK_OK(spyrecclBroadcast(buf.data(), buf.data(), count, spyrecclFloat32, root, ctx.comm),
                 ctx.comm);
    for (size_t i = 0; i < count; ++i) {
      SPY_CHECK(buf[i] == value(call, root, i), "call %d root %d element %zu: %g, expected %g",
                call, root, i, buf[i], value(call, root, i));
    }
    if (call % 17 == 16) {
      float x = float(ctx.rank + 1);
      SPY_CHECK_OK(spyrecclAllReduce(&x, &x, 1, spyrecclFloat32, spyrecclSum, ctx.comm), ctx.comm);
      SPY_CHECK(x == float(n * (n + 1) / 2), "allreduce between broadcasts: %g", x);
    }
  }
  SPY_CHECK_OK(spyrecclBarrier(ctx.comm), ctx.comm);
}

// ---------------------------------------------------------------------------------------
// errors: timeouts, abort, a dead peer
// ---------------------------------------------------------------------------------------

// Called by a rank whose peer `gone` failed (timed out or aborted) inside an allreduce that
// this rank had not joined yet. Joining it late may still succeed, because the peer had
// already posted its contribution; but the next collective, which the peer never calls,
// must fail promptly with spyrecclRemoteError rather than wait for the timeout.
void expectPeerGone(RankContext& ctx, int gone) {
  float x = 1.0f;
  const spyrecclResult_t late =
      spyrecclAllReduce(&x, &x, 1, spyrecclFloat32, spyrecclSum, ctx.comm);
  SPY_CHECK(late == spyrecclSuccess || late == spyrecclRemoteError,
            "joining the failed allreduce late returned %s: \"%s\"", spyrecclGetErrorString(late),
            spyrecclGetLastError(ctx.comm));
  if (late == spyrecclSuccess) {
    const int64_t start = monotonicNs();
    SPY_CHECK_RC(spyrecclBarrier(ctx.comm), spyrecclRemoteError, ctx.comm);
    const int64_t ms = (monotonicNs() - start) / 1000000;
    SPY_CHECK(ms < 2000, "the failure of rank %d was noticed only after %lld ms", gone,
              (long long)ms);
  }
  const std::string msg = spyrecclGetLastError(ctx.comm);
  SPY_CHECK(contains(msg, "rank " + std::to_string(gone)),
            "the message should name rank %d: \"%s\"", gone, msg.c_str());
}

// Rank 1 does not take part in rank 0's allreduce: rank 0 times out after ~timeoutMs.
// Rank 1 then finds rank 0 failed (see expectPeerGone).
void timeoutBody(RankContext& ctx) {
  float x = 1.0f;
  if (ctx.rank == 0) {
    const int64_t start = monotonicNs();
    SPY_CHECK_RC(spyrecclAllReduce(&x, &x, 1, spyrecclFloat32, spyrecclSum, ctx.comm),
                 spyrecclTimeout, ctx.comm);
    const int64_t ms = (monotonicNs() - start) / 1000000;
    SPY_CHECK(ms >= ctx.config.timeoutMs - 20 && ms < ctx.config.timeoutMs + 3000,
              "timed out after %lld ms with timeoutMs = %lld", (long long)ms,
              (long long)ctx.config.timeoutMs);
  } else {
    sleepMs(ctx.config.timeoutMs + 500);
    expectPeerGone(ctx, 0);
  }
}

// Only rank 0 calls spyrecclCommInitRank: it must give up after timeoutMs and remove the
// segment it created.
void initTimeoutBody(RankContext& ctx) {
  if (ctx.rank != 0) return;
  spyrecclConfig_t config = ctx.config;
  config.timeoutMs = 300;
  spyrecclComm_t comm = reinterpret_cast<spyrecclComm_t>(&config);  // must be reset to NULL
  const int64_t start = monotonicNs();
  SPY_CHECK_RC(spyrecclCommInitRank(&comm, ctx.nranks, ctx.id, 0, &config), spyrecclTimeout,
               nullptr);
  const int64_t ms = (monotonicNs() - start) / 1000000;
  SPY_CHECK(comm == nullptr, "*comm must be NULL after a failed spyrecclCommInitRank");
  SPY_CHECK(ms >= 250 && ms < 5000, "init timed out after %lld ms with timeoutMs = 300",
            (long long)ms);
  const std::string msg = spyrecclGetLastError(nullptr);
  SPY_CHECK(contains(msg, "1"), "the init timeout message should name the missing rank 1: \"%s\"",
            msg.c_str());
}

// A thread aborts rank 0's communicator while the main thread waits in an allreduce that
// rank 1 never joins (in time): the allreduce returns spyrecclAborted, and rank 1 then
// sees rank 0's abort as spyrecclRemoteError (see expectPeerGone).
void abortBody(RankContext& ctx) {
  float x = 1.0f;
  if (ctx.rank == 0) {
    std::atomic<int64_t> abortedAt{0};
    std::thread aborter([&] {
      sleepMs(200);
      abortedAt = monotonicNs();
      SPY_CHECK_OK(spyrecclCommAbort(ctx.comm), nullptr);
    });
    SPY_CHECK_RC(spyrecclAllReduce(&x, &x, 1, spyrecclFloat32, spyrecclSum, ctx.comm),
                 spyrecclAborted, ctx.comm);
    const int64_t returned = monotonicNs();
    aborter.join();
    SPY_CHECK(abortedAt != 0 && returned - abortedAt < 2000000000ll,
              "the aborted allreduce returned %lld ms after spyrecclCommAbort",
              (long long)((returned - abortedAt) / 1000000));
    SPY_CHECK_OK(spyrecclCommAbort(ctx.comm), nullptr);  // idempotent
  } else {
    sleepMs(700);
    expectPeerGone(ctx, 0);
  }
}

// The last rank SIGKILLs itself after a successful collective; the survivors, blocked in
// the next one, get spyrecclRemoteError naming it within 2 s (the timeout is 30 s).
void killedRankBody(RankContext& ctx) {
  expectUsable(ctx, "initialisation");
  const int victim = ctx.nranks - 1;
  if (ctx.rank == victim) {
    sleepMs(100);  // let the survivors block first
    ::raise(SIGKILL);
  }
  std::vector<float> x(1000, 1.0f);
  const int64_t start = monotonicNs();
  expectDeathReported(
      ctx, spyrecclAllReduce(x.data(), x.data(), x.size(), spyrecclFloat32, spyrecclSum, ctx.comm),
      victim, start);
}

// ---------------------------------------------------------------------------------------
// errors: invalid arguments
// ---------------------------------------------------------------------------------------

// `call` must fail with spyrecclInvalidArgument and a last error that mentions `argument`.
#define EXPECT_INVALID(call, comm, argument)                                                       \
  do {                                                                                             \
    if (SPY_CHECK_RC(call, spyrecclInvalidArgument, comm)) {                                       \
      const std::string msg_ = spyrecclGetLastError(comm);                                         \
      SPY_CHECK(contains(msg_, argument), "%s: message should name '%s': \"%s\"", #call, argument, \
                msg_.c_str());                                                                     \
    }                                                                                              \
  } while (0)

void invalidArgumentsBody(RankContext& ctx) {
  spyrecclComm_t comm = ctx.comm;
  const int n = ctx.nranks;
  std::vector<float> a(16, 1.0f), b(16 * size_t(n), 0.0f);
  std::vector<int32_t> ia(16, 1), ib(16, 0);
  const auto badType = static_cast<spyrecclDataType_t>(99);
  const auto badOp = static_cast<spyrecclRedOp_t>(12345);

  // Library-level calls.
  EXPECT_INVALID(spyrecclGetVersion(nullptr), nullptr, "version");
  EXPECT_INVALID(spyrecclGetUniqueId(nullptr), nullptr, "uniqueId");
  EXPECT_INVALID(spyrecclAllReduce(a.data(), b.data(), 16, spyrecclFloat32, spyrecclSum, nullptr),
                 nullptr, "comm");
  {
    spyrecclComm_t other = nullptr;
    EXPECT_INVALID(spyrecclCommInitRank(&other, 0, ctx.id, 0, &ctx.config), nullptr, "nranks");
    EXPECT_INVALID(spyrecclCommInitRank(&other, n, ctx.id, n, &ctx.config), nullptr, "rank");
    EXPECT_INVALID(spyrecclCommInitRank(nullptr, n, ctx.id, 0, &ctx.config), nullptr, "comm");
  }

  // Data type, reduce op and their combinations.
  EXPECT_INVALID(spyrecclAllReduce(a.data(), b.data(), 16, badType, spyrecclSum, comm), comm,
                 "datatype");
  EXPECT_INVALID(spyrecclAllReduce(a.data(), b.data(), 16, spyrecclFloat32, badOp, comm), comm,
                 "op");
  EXPECT_INVALID(spyrecclAllReduce(a.data(), b.data(), 16, spyrecclFloat32, spyrecclBand, comm),
                 comm, "band");
  EXPECT_INVALID(spyrecclAllReduce(ia.data(), ib.data(), 16, spyrecclBool, spyrecclAvg, comm), comm,
                 "avg");
  {
    spyrecclRedOp_t op;
    EXPECT_INVALID(spyrecclRedOpCreatePreMulSum(&op, 2.0, spyrecclInt32, comm), comm, "int32");
    EXPECT_INVALID(spyrecclRedOpCreatePreMulSum(nullptr, 2.0, spyrecclFloat32, comm), comm, "op");
    // A handle is valid for its data type only.
    if (SPY_CHECK_OK(spyrecclRedOpCreatePreMulSum(&op, 2.0, spyrecclFloat32, comm), comm)) {
      EXPECT_INVALID(spyrecclAllReduce(a.data(), b.data(), 16, spyrecclFloat64, op, comm), comm,
                     "float");
      SPY_CHECK_OK(spyrecclRedOpDestroy(op, comm), comm);
      EXPECT_INVALID(spyrecclAllReduce(a.data(), b.data(), 16, spyrecclFloat32, op, comm), comm,
                     "op");
    }
  }

  // Roots, peers, buffers.
  EXPECT_INVALID(spyrecclReduce(a.data(), b.data(), 16, spyrecclFloat32, spyrecclSum, n, comm),
                 comm, "root");
  EXPECT_INVALID(spyrecclBroadcast(a.data(), b.data(), 16, spyrecclFloat32, -1, comm), comm,
                 "root");
  EXPECT_INVALID(spyrecclAllReduce(nullptr, b.data(), 16, spyrecclFloat32, spyrecclSum, comm), comm,
                 "sendbuff");
  EXPECT_INVALID(spyrecclAllReduce(a.data(), nullptr, 16, spyrecclFloat32, spyrecclSum, comm), comm,
                 "recvbuff");
  // Overlapping but not in place.
  EXPECT_INVALID(spyrecclAllReduce(b.data(), b.data() + 1, 8, spyrecclFloat32, spyrecclSum, comm),
                 comm, "recvbuff");
  EXPECT_INVALID(spyrecclSend(a.data(), 16, spyrecclFloat32, ctx.rank, 0, comm), comm, "peer");
  EXPECT_INVALID(spyrecclRecv(a.data(), 16, spyrecclFloat32, n, 0, comm), comm, "peer");
  EXPECT_INVALID(spyrecclSend(nullptr, 16, spyrecclFloat32, (ctx.rank + 1) % n, 0, comm), comm,
                 "sendbuff");
  EXPECT_INVALID(spyrecclCommSetTimeout(comm, 0), comm, "timeoutMs");
  EXPECT_INVALID(spyrecclSetThreadYield(-2), nullptr, "yieldNs");
  {
    spyrecclComm_t other = nullptr;
    spyrecclConfig_t bad = ctx.config;
    bad.yieldNs = -2;
    EXPECT_INVALID(spyrecclCommInitRank(&other, n, ctx.id, 0, &bad), nullptr, "yieldNs");
  }
  // The queries report a bad output pointer on the communicator they were given
  // (test_api.cc, api.error_routing, checks the routing of every query and setter).
  EXPECT_INVALID(spyrecclCommCount(comm, nullptr), comm, "count");
  EXPECT_INVALID(spyrecclCommUserRank(comm, nullptr), comm, "rank");

  // None of this communicated or broke the communicator.
  spyrecclResult_t async = spyrecclInternalError;
  SPY_CHECK_OK(spyrecclCommGetAsyncError(comm, &async), comm);
  SPY_CHECK(async == spyrecclSuccess, "async error after invalid arguments: %s",
            spyrecclGetErrorString(async));
  expectUsable(ctx, "invalid arguments");
}

// A communicator's yieldNs decides how long a wait keeps its CPU (sched_yield) before it
// sleeps on a futex: rank 0's thread CPU time while rank 1 arrives 300 ms late is most of
// those 300 ms with a 10 s yield phase, and a few ms with none (a futex wake-up per 1 ms
// slice). The result is right either way.
// threadOverride: the communicator's phase is the long one, and rank 0 sets a phase of 0 for
// its own thread (spyrecclSetThreadYield), which must win.
void yieldBody(RankContext& ctx, bool longYield, bool threadOverride = false) {
  SPY_REQUIRE_OK(spyrecclBarrier(ctx.comm), ctx.comm);
  if (threadOverride && ctx.rank == 0) SPY_CHECK_OK(spyrecclSetThreadYield(0), nullptr);
  if (ctx.rank == 1) sleepMs(300);
  timespec t0{}, t1{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
  std::vector<float> in(5, float(ctx.rank + 1)), out(5, -1.0f);
  SPY_REQUIRE_OK(
      spyrecclAllReduce(in.data(), out.data(), 5, spyrecclFloat32, spyrecclSum, ctx.comm),
      ctx.comm);
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
  if (threadOverride && ctx.rank == 0) SPY_CHECK_OK(spyrecclSetThreadYield(-1), nullptr);
  for (float v : out) SPY_CHECK(v == 3.0f, "all_reduce gave %g, expected 3", double(v));
  if (ctx.rank != 0) return;
  const double cpuMs = double(t1.tv_sec - t0.tv_sec) * 1e3 + double(t1.tv_nsec - t0.tv_nsec) / 1e6;
  if (longYield) {
    // Not all 300 ms: a machine with other runnable tasks takes the core for some of it.
    SPY_CHECK(cpuMs >= 60.0,
              "yieldNs = 10 s: the waiting rank used %.1f ms of CPU, expected "
              ">= 60 (yielding, not sleeping)",
              cpuMs);
  } else {
    SPY_CHECK(cpuMs <= 40.0,
              "yieldNs = 0: the waiting rank used %.1f ms of CPU, expected "
              "<= 40 (sleeping)",
              cpuMs);
  }
}

// Ranks bound to a CPU of their own (as mpirun and Slurm's --cpu-bind place them) do not
// oversubscribe the CPUs even though each process may run on one only: their waits spin
// (`own`). Bound to one CPU together they do, and their waits yield at once. The state dump
// says which ("waits: ..."). With fewer CPUs than ranks, "own" binding shares CPUs too and
// must yield.
void bindingBody(RankContext& ctx, bool own) {
  cpu_set_t set;
  CPU_ZERO(&set);
  SPY_REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0, "sched_getaffinity: %s",
              std::strerror(errno));
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  const int mine = own ? cpus[ctx.rank % cpus.size()] : cpus[0];
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(mine, &one);
  SPY_REQUIRE(sched_setaffinity(0, sizeof one, &one) == 0, "sched_setaffinity: %s",
              std::strerror(errno));
  SPY_REQUIRE_OK(spyrecclCommInitRank(&ctx.comm, ctx.nranks, ctx.id, ctx.rank, &ctx.config),
                 nullptr);
  const int distinct = own ? std::min<int>(ctx.nranks, static_cast<int>(cpus.size())) : 1;
  const bool spinning = distinct >= ctx.nranks;
  std::vector<char> buf(1 << 16);
  SPY_CHECK_OK(spyrecclCommDumpState(ctx.comm, buf.data(), buf.size()), ctx.comm);
  const std::string dump = buf.data();
  const std::string want = format(
      "waits: %s (%d ranks on %d CPUs)",
      spinning ? "spinning" : "yielding, the ranks oversubscribe the CPUs", ctx.nranks, distinct);
  SPY_CHECK(dump.find(want) != std::string::npos, "expected \"%s\" in the state dump:\n%s",
            want.c_str(), dump.c_str());
  SPY_CHECK_OK(spyrecclCommDestroy(ctx.comm), nullptr);
  ctx.comm = nullptr;
}

// ---------------------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------------------

[[maybe_unused]] const bool registered = [] {
  for (int ws : {2, 3, 4}) {
    registerRanks(format("lifecycle.barrier/ws%d", ws), ws, barrierBody);
    registerRanks(format("lifecycle.split/ws%d", ws), ws, splitBody);
  }
  registerRanks("lifecycle.queries/ws3", 3, queryBody);
  registerRanks("lifecycle.flight_recorder/ws2", 2, flightRecorderBody);
  registerRanks("lifecycle.blocking_hook/ws2", 2, blockingHookBody);
  registerRanks("lifecycle.flight_recorder/ws3", 3, flightRecorderBody);

  for (const char* variant : {"count", "op", "dtype", "root", "collective"}) {
    const std::string v = variant;
    for (int ws : {2, 3}) {
      registerRanks(format("errors.mismatch_%s/ws%d", variant, ws), ws,
                    [v](RankContext& ctx) { mismatchBody(ctx, v); });
    }
  }
  for (const char* variant : {"count", "root", "collective"}) {
    const std::string v = variant;
    for (int ws : {2, 3}) {
      registerRanks(format("errors.eager_mismatch_%s/ws%d", variant, ws), ws,
                    [v](RankContext& ctx) { eagerMismatchBody(ctx, v); });
    }
  }
  for (int ws : {2, 3, 4})
    registerRanks(format("lifecycle.eager_stream/ws%d", ws), ws, eagerStreamBody);
  registerRanks("errors.timeout/ws2", 2, timeoutBody,
                [](RunOptions& o) { o.config.timeoutMs = 400; });
  registerRanks("errors.init_timeout/ws2", 2, initTimeoutBody,
                [](RunOptions& o) { o.initComm = false; });
  registerRanks("errors.abort/ws2", 2, abortBody);
  for (int ws : {2, 3}) {
    registerRanks(format("errors.killed_rank/ws%d", ws), ws, killedRankBody,
                  [ws](RunOptions& o) { o.mayDie = {ws - 1}; });
  }
  registerRanks(
      "lifecycle.yield_none/ws2", 2, [](RankContext& ctx) { yieldBody(ctx, false); },
      [](RunOptions& o) { o.config.yieldNs = 0; });
  registerRanks(
      "lifecycle.yield_long/ws2", 2, [](RankContext& ctx) { yieldBody(ctx, true); },
      [](RunOptions& o) { o.config.yieldNs = int64_t{10} * 1000 * 1000 * 1000; });
  registerRanks(
      "lifecycle.yield_thread/ws2", 2, [](RankContext& ctx) { yieldBody(ctx, false, true); },
      [](RunOptions& o) { o.config.yieldNs = int64_t{10} * 1000 * 1000 * 1000; });
  for (int ws : {2, 3}) {
    registerRanks(
        format("lifecycle.bound_own_cpu/ws%d", ws), ws,
        [](RankContext& ctx) { bindingBody(ctx, true); },
        [](RunOptions& o) { o.initComm = false; });
    registerRanks(
        format("lifecycle.bound_one_cpu/ws%d", ws), ws,
        [](RankContext& ctx) { bindingBody(ctx, false); },
        [](RunOptions& o) { o.initComm = false; });
  }
  registerRanks("errors.invalid_arguments/ws2", 2, invalidArgumentsBody);
  registerRanks("errors.invalid_arguments/ws3", 3, invalidArgumentsBody);
  return true;
}();

}  // namespace
