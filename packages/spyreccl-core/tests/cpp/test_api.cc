// Contracts of the C API surface itself (rather than of one algorithm).
//
//   api.datatype_names     spyrecclGetDataTypeName / spyrecclGetDataTypeSize: torch's
//                          spellings and the element sizes, NULL / 0 outside the enum, and
//                          the same spelling in the library's own error messages
//   api.error_routing      where a failed call's message is recorded: on the communicator
//                          when one is given (queries and setters included), in the
//                          calling thread's slot only for comm == NULL
//   api.late_rank_*        a rank arriving late to a collective whose peers posted their
//                          part and then failed completes it correctly (one-step sizes) or
//                          fails it with spyrecclRemoteError (never wrong data), and its
//                          next call fails promptly with spyrecclRemoteError
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "data.h"
#include "multiproc.h"

namespace {

using namespace spyreccl_test;

// A C caller may pass any int where an enum is expected.
spyrecclDataType_t rawDataType(int v) {
  spyrecclDataType_t t;
  static_assert(sizeof(t) == sizeof(v), "C API enums are int sized");
  std::memcpy(&t, &v, sizeof(v));
  return t;
}

// Leaves a known message in the calling thread's error slot, so that a test can tell
// whether a later call overwrote it.
std::string plantThreadError() {
  spyrecclGetVersion(nullptr);
  return spyrecclGetLastError(nullptr);
}

// ---------------------------------------------------------------------------------------
// api.datatype_names
// ---------------------------------------------------------------------------------------

void dataTypeNamesBody(RankContext& ctx) {
  // data.h spells every type like torch does (the test's independent table).
  SPY_CHECK(allTypes().size() == size_t(spyrecclNumTypes), "data.h lists %zu types, the API %d",
            allTypes().size(), int(spyrecclNumTypes));
  const std::string planted = plantThreadError();
  std::set<std::string> seen;
  for (const TypeInfo& t : allTypes()) {
    const char* name = spyrecclGetDataTypeName(t.dtype);
    SPY_CHECK(name != nullptr && std::string(name) == t.name,
              "spyrecclGetDataTypeName(%d) = %s, expected %s", int(t.dtype), name ? name : "NULL",
              t.name);
    if (name != nullptr) seen.insert(name);
    const size_t size = spyrecclGetDataTypeSize(t.dtype);
    SPY_CHECK(size == t.size, "spyrecclGetDataTypeSize(%s) = %zu, expected %zu", t.name, size,
              t.size);
  }
  SPY_CHECK(seen.size() == allTypes().size(), "the names are not distinct (%zu distinct)",
            seen.size());
  for (int invalid : {-1, int(spyrecclNumTypes), 99, INT_MIN, INT_MAX}) {
    const char* name = spyrecclGetDataTypeName(rawDataType(invalid));
    SPY_CHECK(name == nullptr, "spyrecclGetDataTypeName(%d) = \"%s\", expected NULL", invalid,
              name);
    SPY_CHECK(spyrecclGetDataTypeSize(rawDataType(invalid)) == 0,
              "spyrecclGetDataTypeSize(%d) = %zu, expected 0", invalid,
              spyrecclGetDataTypeSize(rawDataType(invalid)));
  }
  SPY_CHECK(planted == spyrecclGetLastError(nullptr),
            "spyrecclGetDataTypeName changed the thread's last error to \"%s\"",
            spyrecclGetLastError(nullptr));

  // The library's messages use the same spelling as the API.
  std::vector<uint8_t> a(16, 0), b(16, 0);
  spyrecclRedOp_t op;
  SPY_REQUIRE_OK(spyrecclRedOpCreatePreMulSum(&op, 2.0, spyrecclFloat8e4m3, ctx.comm), ctx.comm);
  SPY_CHECK_RC(spyrecclAllReduce(a.data(), b.data(), 16, spyrecclUint8, op, ctx.comm),
               spyrecclInvalidArgument, ctx.comm);
  const std::string msg = spyrecclGetLastError(ctx.comm);
  for (spyrecclDataType_t t : {spyrecclFloat8e4m3, spyrecclUint8}) {
    SPY_CHECK(contains(msg, spyrecclGetDataTypeName(t)), "the message should name %s: \"%s\"",
              spyrecclGetDataTypeName(t), msg.c_str());
  }
  SPY_CHECK_OK(spyrecclRedOpDestroy(op, ctx.comm), ctx.comm);
}

// ---------------------------------------------------------------------------------------
// api.error_routing
// ---------------------------------------------------------------------------------------

// `rc`, the result of `call`, must be spyrecclInvalidArgument with a message naming `api`
// and `argument` recorded on `comm` (the thread's slot for comm == NULL).
void expectInvalidRecordedOn(spyrecclResult_t rc, const char* call, spyrecclComm_t comm,
                             const char* api, const char* argument) {
  SPY_CHECK(rc == spyrecclInvalidArgument, "%s returned %s, expected spyrecclInvalidArgument", call,
            spyrecclGetErrorString(rc));
  const std::string msg = spyrecclGetLastError(comm);
  SPY_CHECK(contains(msg, std::string(api) + ": ") && contains(msg, argument),
            "%s: the message on %s should name %s and '%s': \"%s\"", call,
            comm ? "the communicator" : "the thread", api, argument, msg.c_str());
}

void errorRoutingBody(RankContext& ctx) {
  spyrecclComm_t comm = ctx.comm;
  char dump[64];

  // Queries and setters with a communicator: the message goes to the communicator and the
  // thread's slot keeps what was planted there.
  struct WithComm {
    const char* call;
    const char* api;
    const char* argument;
    std::function<spyrecclResult_t()> run;
  };
  const std::vector<WithComm> withComm = {
      {"CommCount(comm, NULL)", "spyrecclCommCount", "count",
       [&] { return spyrecclCommCount(comm, nullptr); }},
      {"CommUserRank(comm, NULL)", "spyrecclCommUserRank", "rank",
       [&] { return spyrecclCommUserRank(comm, nullptr); }},
      {"CommGetAsyncError(comm, NULL)", "spyrecclCommGetAsyncError", "asyncError",
       [&] { return spyrecclCommGetAsyncError(comm, nullptr); }},
      {"CommDumpState(comm, NULL, 0)", "spyrecclCommDumpState", "buf",
       [&] { return spyrecclCommDumpState(comm, nullptr, 0); }},
      {"CommDumpState(comm, buf, 0)", "spyrecclCommDumpState", "len",
       [&] { return spyrecclCommDumpState(comm, dump, 0); }},
      {"CommSetTimeout(comm, -5)", "spyrecclCommSetTimeout", "timeoutMs",
       [&] { return spyrecclCommSetTimeout(comm, -5); }},
      {"RedOpDestroy(Sum, comm)", "spyrecclRedOpDestroy", "op",
       [&] { return spyrecclRedOpDestroy(spyrecclSum, comm); }},
  };
  for (const WithComm& c : withComm) {
    const std::string planted = plantThreadError();
    const spyrecclResult_t rc = c.run();
    expectInvalidRecordedOn(rc, c.call, comm, c.api, c.argument);
    SPY_CHECK(planted == spyrecclGetLastError(nullptr),
              "%s overwrote the thread's last error with \"%s\"", c.call,
              spyrecclGetLastError(nullptr));
  }

  // The same calls with comm == NULL: the thread's slot, the communicator's untouched.
  struct WithoutComm {
    const char* call;
    const char* api;
    std::function<spyrecclResult_t()> run;
  };
  int value = 0;
  spyrecclResult_t async = spyrecclSuccess;
  const std::vector<WithoutComm> withoutComm = {
      {"CommCount(NULL, &n)", "spyrecclCommCount",
       [&] { return spyrecclCommCount(nullptr, &value); }},
      {"CommUserRank(NULL, &r)", "spyrecclCommUserRank",
       [&] { return spyrecclCommUserRank(nullptr, &value); }},
      {"CommGetAsyncError(NULL, &e)", "spyrecclCommGetAsyncError",
       [&] { return spyrecclCommGetAsyncError(nullptr, &async); }},
      {"CommDumpState(NULL, buf, len)", "spyrecclCommDumpState",
       [&] { return spyrecclCommDumpState(nullptr, dump, sizeof dump); }},
      {"CommSetTimeout(NULL, 10)", "spyrecclCommSetTimeout",
       [&] { return spyrecclCommSetTimeout(nullptr, 10); }},
      {"CommAbort(NULL)", "spyrecclCommAbort", [&] { return spyrecclCommAbort(nullptr); }},
      {"Barrier(NULL)", "spyrecclBarrier", [&] { return spyrecclBarrier(nullptr); }},
  };
  // Plant a message on the communicator first.
  SPY_CHECK_RC(spyrecclCommCount(comm, nullptr), spyrecclInvalidArgument, comm);
  const std::string onComm = spyrecclGetLastError(comm);
  for (const WithoutComm& c : withoutComm) {
    const spyrecclResult_t rc = c.run();
    expectInvalidRecordedOn(rc, c.call, nullptr, c.api, "comm");
    SPY_CHECK(onComm == spyrecclGetLastError(comm),
              "%s overwrote the communicator's last error with \"%s\"", c.call,
              spyrecclGetLastError(comm));
  }

  // None of it broke the communicator, and the queries still answer.
  SPY_CHECK_OK(spyrecclCommGetAsyncError(comm, &async), comm);
  SPY_CHECK(async == spyrecclSuccess, "async error after invalid arguments: %s",
            spyrecclGetErrorString(async));
  SPY_CHECK_OK(spyrecclCommCount(comm, &value), comm);
  SPY_CHECK(value == ctx.nranks, "spyrecclCommCount = %d, expected %d", value, ctx.nranks);
  SPY_CHECK_OK(spyrecclBarrier(comm), comm);
}

// ---------------------------------------------------------------------------------------
// api.late_rank_*
// ---------------------------------------------------------------------------------------

// Process-shared flags of one late-rank run (mapped before the ranks are forked).
struct LateRankFlags {
  std::atomic<int> failedPeers{0};  // early ranks whose collective has failed
  std::atomic<int> lateDone{0};     // the late rank has finished its checks
};

enum class PeerFailure { kTimeout, kAbort };

// Element counts (int64) of the late allreduce: far below the one-step threshold, and
// several times the test's 16 KiB staging chunk (a multi-step pipeline). Both odd.
constexpr size_t kSmallCount = 13;
constexpr size_t kLargeCount = 5 * 2048 + 7;
// Above SPYRECCL_DIRECT_MIN_BYTES (256 KiB by default) in spyrecclMemAlloc memory: peers
// read each other's buffers in place, so a failed peer's reused buffer must never leak
// into a late rank's successful result.
constexpr size_t kDirectCount = 40961;

// `count` int64 elements on the heap, or from spyrecclMemAlloc.
class Int64Buffer {
 public:
  Int64Buffer(size_t count, bool arena) : count_(count) {
    if (!arena) {
      heap_.resize(count);
      data_ = heap_.data();
      return;
    }
    void* p = nullptr;
    const spyrecclResult_t rc = spyrecclMemAlloc(&p, count * sizeof(int64_t));
    SPY_REQUIRE(rc == spyrecclSuccess, "spyrecclMemAlloc(%zu bytes) returned %s: \"%s\"",
                count * sizeof(int64_t), spyrecclGetErrorString(rc), spyrecclGetLastError(nullptr));
    data_ = static_cast<int64_t*>(p);
    arena_ = true;
  }
  ~Int64Buffer() {
    if (arena_) spyrecclMemFree(data_);
  }
  Int64Buffer(const Int64Buffer&) = delete;
  Int64Buffer& operator=(const Int64Buffer&) = delete;

  int64_t* data() { return data_; }
  int64_t& operator[](size_t i) { return data_[i]; }
  void fill(int64_t v) { std::fill(data_, data_ + count_, v); }

 private:
  size_t count_;
  std::vector<int64_t> heap_;
  int64_t* data_ = nullptr;
  bool arena_ = false;
};

int64_t lateInput(uint64_t seed, int rank, size_t i) {
  return static_cast<int64_t>(randomBits(seed, rank, i) % 2001) - 1000;
}

// Every rank but the last enters an allreduce of `count` elements and fails in it (its
// timeout expires, or another thread aborts it) after having posted its input, then reuses
// its buffers (poisons them); the last rank arrives only then. Its allreduce must return
// the correct sum or spyrecclRemoteError (the small size, one step, must succeed), and its
// next collective must fail with spyrecclRemoteError within a fraction of a second, naming
// a failed rank.
void lateRankBody(RankContext& ctx, PeerFailure how, size_t count, bool arena,
                  LateRankFlags* flags) {
  const int late = ctx.nranks - 1;
  const int64_t poison = INT64_MIN + 12345;
  Int64Buffer in(count, arena), out(count, arena);
  if (arena) {
    // The first large collective of a communicator sets the direct path up (peers map
    // each other's arenas); warm it up so that the late collective itself reads in place.
    in.fill(1);
    SPY_REQUIRE_OK(
        spyrecclAllReduce(in.data(), out.data(), count, spyrecclInt64, spyrecclSum, ctx.comm),
        ctx.comm);
  }
  out.fill(poison);
  for (size_t i = 0; i < count; ++i) in[i] = lateInput(ctx.seed, ctx.rank, i);

  if (ctx.rank != late) {
    std::thread aborter;
    spyrecclResult_t abortRc = spyrecclSuccess;
    spyrecclResult_t own = spyrecclTimeout;  // this rank's own failure
    if (how == PeerFailure::kTimeout) {
      // The timeout can only expire inside the wait, i.e. after the input was posted.
      SPY_REQUIRE_OK(spyrecclCommSetTimeout(ctx.comm, 300), ctx.comm);
    } else {
      own = spyrecclAborted;
      aborter = std::thread([&] {
        sleepMs(400);  // posting the input takes microseconds
        abortRc = spyrecclCommAbort(ctx.comm);
      });
    }
    const spyrecclResult_t rc =
        spyrecclAllReduce(in.data(), out.data(), count, spyrecclInt64, spyrecclSum, ctx.comm);
    if (aborter.joinable()) aborter.join();
    SPY_CHECK(abortRc == spyrecclSuccess, "spyrecclCommAbort returned %s",
              spyrecclGetErrorString(abortRc));
    // With several early ranks, one may notice another's failure before its own.
    SPY_CHECK(rc == own || (ctx.nranks > 2 && rc == spyrecclRemoteError),
              "the early allreduce returned %s, expected %s: \"%s\"", spyrecclGetErrorString(rc),
              spyrecclGetErrorString(own), spyrecclGetLastError(ctx.comm));
    // The call has returned: the application owns its buffers again and may reuse them.
    in.fill(poison);
    out.fill(poison);
    flags->failedPeers.fetch_add(1);
    // Stay (failed, not departed) until the late rank is done.
    const int64_t deadline = monotonicNs() + 20000 * int64_t(1000000);
    while (flags->lateDone.load() == 0 && monotonicNs() < deadline) sleepMs(5);
    return;
  }

  const int64_t deadline = monotonicNs() + 20000 * int64_t(1000000);
  while (flags->failedPeers.load() < late && monotonicNs() < deadline) sleepMs(5);
  SPY_REQUIRE(flags->failedPeers.load() == late, "the other ranks never failed");
  const spyrecclResult_t rc =
      spyrecclAllReduce(in.data(), out.data(), count, spyrecclInt64, spyrecclSum, ctx.comm);
  if (count == kSmallCount) {
    // One step, which every peer published before failing: it must complete.
    SPY_CHECK(rc == spyrecclSuccess, "the late one-step allreduce returned %s: \"%s\"",
              spyrecclGetErrorString(rc), spyrecclGetLastError(ctx.comm));
  } else {
    SPY_CHECK(rc == spyrecclSuccess || rc == spyrecclRemoteError,
              "the late multi-step allreduce returned %s: \"%s\"", spyrecclGetErrorString(rc),
              spyrecclGetLastError(ctx.comm));
  }
  if (rc == spyrecclSuccess) {
    // Success promises the complete, correct result (no stale or poisoned peer data).
    size_t wrong = 0;
    for (size_t i = 0; i < count; ++i) {
      int64_t want = 0;
      for (int r = 0; r < ctx.nranks; ++r) want += lateInput(ctx.seed, r, i);
      if (out[i] != want && ++wrong <= 3) {
        SPY_CHECK(out[i] == want, "late allreduce: out[%zu] = %lld, expected %lld", i,
                  (long long)out[i], (long long)want);
      }
    }
    SPY_CHECK(wrong == 0, "the late allreduce succeeded with %zu wrong elements of %zu", wrong,
              count);
  }
  // After a late success, the next collective needs the failed peers: it fails promptly
  // with spyrecclRemoteError, not after the timeout. After a late failure the communicator
  // is already failed: the next call is refused, quoting the peer failure.
  const spyrecclResult_t next = rc == spyrecclSuccess ? spyrecclRemoteError : spyrecclInvalidUsage;
  const int64_t start = monotonicNs();
  SPY_CHECK_RC(spyrecclBarrier(ctx.comm), next, ctx.comm);
  const int64_t ms = (monotonicNs() - start) / 1000000;
  SPY_CHECK(ms < 2000, "the failed peers were noticed only after %lld ms", (long long)ms);
  const std::string msg = spyrecclGetLastError(ctx.comm);
  SPY_CHECK(contains(msg, "spyrecclRemoteError") || rc == spyrecclSuccess,
            "the refusal should quote the peer failure: \"%s\"", msg.c_str());
  bool namesPeer = false;
  for (int r = 0; r < late; ++r) namesPeer = namesPeer || contains(msg, format("rank %d ", r));
  SPY_CHECK(namesPeer, "the message should name a failed rank: \"%s\"", msg.c_str());
  flags->lateDone.store(1);
}

RunOptions optionsFor(int ws, const std::string& name) {
  RunOptions opts;
  opts.nranks = ws;
  opts.label = name;
  return opts;
}

void runLateRank(int ws, PeerFailure how, size_t count, bool arena, const std::string& name) {
  void* mem = mmap(nullptr, sizeof(LateRankFlags), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    SPY_CHECK(mem != MAP_FAILED, "mmap of the shared flags failed: %s", std::strerror(errno));
    return;
  }
  auto* flags = new (mem) LateRankFlags;
  runRanks(optionsFor(ws, name),
           [=](RankContext& ctx) { lateRankBody(ctx, how, count, arena, flags); });
  flags->~LateRankFlags();
  munmap(mem, sizeof(LateRankFlags));
}

void registerRanks(const std::string& name, int ws, std::function<void(RankContext&)> body) {
  registerTest(name, [=] { runRanks(optionsFor(ws, name), body); });
}

[[maybe_unused]] const bool registered = [] {
  registerRanks("api.datatype_names/ws2", 2, dataTypeNamesBody);
  registerRanks("api.error_routing/ws2", 2, errorRoutingBody);
  const std::pair<PeerFailure, const char*> failures[] = {{PeerFailure::kTimeout, "timeout"},
                                                          {PeerFailure::kAbort, "abort"}};
  struct Size {
    size_t count;
    bool arena;
    const char* name;
  };
  const Size sizes[] = {{kSmallCount, false, "one_step"},
                        {kLargeCount, false, "multi_step"},
                        {kDirectCount, true, "direct"}};
  for (int ws : {2, 3}) {
    for (const auto& [how, howName] : failures) {
      for (const Size& size : sizes) {
        const std::string name =
            format("api.late_rank_after_peer_%s/%s/ws%d", howName, size.name, ws);
        registerTest(name, [=] { runLateRank(ws, how, size.count, size.arena, name); });
      }
    }
  }
  return true;
}();

}  // namespace
