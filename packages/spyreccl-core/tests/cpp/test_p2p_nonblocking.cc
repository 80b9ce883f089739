// Non-blocking point-to-point (spyrecclIsend/Irecv/Test/Wait/CommPoll): unbatched ring
// exchanges larger than the staging area (which deadlock with blocking calls), FIFO order
// across blocking and non-blocking calls, requests left pending across a collective (in
// both directions), polling with a wake-up from another thread, the timeout of a request
// whose peer never posts, and argument errors. Test names are "p2p_nb.<what>/ws<N>".
#include <signal.h>

#include <atomic>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "data.h"
#include "multiproc.h"

namespace {

using namespace spyreccl_test;

// More than three p2p staging chunks (the tests use 16 KiB).
size_t largeCount(const TypeInfo& t) { return 3 * 16 * 1024 / t.size + 5; }

// Every rank posts Isend to its right neighbour, then Irecv from its left one, outside any
// group, and completes them with Wait (even cases) or a Test/CommPoll loop (odd cases).
void ringBody(RankContext& ctx) {
  const int next = (ctx.rank + 1) % ctx.nranks;
  const int prev = (ctx.rank + ctx.nranks - 1) % ctx.nranks;
  uint64_t caseNo = 0;
  for (const TypeInfo& t : allTypes()) {
    for (size_t count : {size_t(0), size_t(7), largeCount(t), 5 * largeCount(t) + 3}) {
      const uint64_t seed = mix(ctx.seed, ++caseNo);
      const std::string what =
          format("unbatched ring %s count=%zu from rank %d", t.name, count, prev);
      Buffer send(t, count), recv(t, count);
      fillAnyBits(t, seed, ctx.rank, send.data(), count);
      poisonMessage(t, recv.data(), count, seed, prev);
      spyrecclRequest_t sreq = nullptr, rreq = nullptr;
      SPY_REQUIRE_OK(spyrecclIsend(send.data(), count, t.dtype, next, 5, ctx.comm, &sreq),
                     ctx.comm);
      SPY_REQUIRE_OK(spyrecclIrecv(recv.data(), count, t.dtype, prev, 5, ctx.comm, &rreq),
                     ctx.comm);
      SPY_REQUIRE(sreq != nullptr && rreq != nullptr, "requests must be set");
      if (caseNo % 2 == 0) {
        SPY_REQUIRE_OK(spyrecclWait(rreq), ctx.comm);
        SPY_REQUIRE_OK(spyrecclWait(sreq), ctx.comm);
      } else {
        int sdone = 0, rdone = 0;
        while (!sdone || !rdone) {
          if (!sdone) SPY_REQUIRE_OK(spyrecclTest(sreq, &sdone), ctx.comm);
          if (!rdone) SPY_REQUIRE_OK(spyrecclTest(rreq, &rdone), ctx.comm);
          int pending = -1;
          SPY_REQUIRE_OK(spyrecclCommPoll(ctx.comm, 1000, &pending), ctx.comm);
          SPY_REQUIRE(pending >= 0 && pending <= 2, "pending = %d", pending);
        }
      }
      checkMessage(t, recv.data(), count, seed, prev, what);
    }
  }
}

// Rank 0 sends messages 0..3 to rank 1 alternating Isend and blocking Send (a blocking
// send queues behind a pending Isend to the same peer); rank 1 receives them alternating
// Irecv and blocking Recv. Each message must land in its own buffer.
void fifoBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclInt64);
  constexpr int kMessages = 4;
  const size_t count = largeCount(t);
  std::vector<Buffer> bufs;
  for (int m = 0; m < kMessages; ++m) bufs.emplace_back(t, count);
  std::vector<spyrecclRequest_t> reqs;
  if (ctx.rank == 0) {
    for (int m = 0; m < kMessages; ++m) {
      Buffer& b = bufs[size_t(m)];
      fillAnyBits(t, mix(ctx.seed, uint64_t(m)), 0, b.data(), count);
      if (m % 2 == 0) {
        spyrecclRequest_t r = nullptr;
        SPY_REQUIRE_OK(spyrecclIsend(b.data(), count, t.dtype, 1, 2, ctx.comm, &r), ctx.comm);
        reqs.push_back(r);
      } else {
        SPY_REQUIRE_OK(spyrecclSend(b.data(), count, t.dtype, 1, 2, ctx.comm), ctx.comm);
      }
    }
  } else if (ctx.rank == 1) {
    for (int m = 0; m < kMessages; ++m) {
      Buffer& b = bufs[size_t(m)];
      poisonMessage(t, b.data(), count, mix(ctx.seed, uint64_t(m)), 0);
      if (m % 2 == 1) {
        spyrecclRequest_t r = nullptr;
        SPY_REQUIRE_OK(spyrecclIrecv(b.data(), count, t.dtype, 0, 2, ctx.comm, &r), ctx.comm);
        reqs.push_back(r);
      } else {
        SPY_REQUIRE_OK(spyrecclRecv(b.data(), count, t.dtype, 0, 2, ctx.comm), ctx.comm);
      }
    }
  }
  for (spyrecclRequest_t r : reqs) SPY_REQUIRE_OK(spyrecclWait(r), ctx.comm);
  if (ctx.rank == 1) {
    for (int m = 0; m < kMessages; ++m) {
      checkMessage(t, bufs[size_t(m)].data(), count, mix(ctx.seed, uint64_t(m)), 0,
                   format("message %d of %d (FIFO order across Isend/Send)", m, kMessages));
    }
  }
}

// A request left pending across a collective. Case A: rank 0 posts Isend (large), runs an
// allreduce, then waits; rank 1 runs the allreduce, then receives. Case B, which needs the
// collective's wait to progress the request: rank 0 posts Irecv (large) and runs the
// allreduce; rank 1 first sends with a blocking Send (which returns only once rank 0 has
// drained most of the message), then joins the allreduce.
void acrossCollectiveBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclFloat32);
  const size_t count = 8 * largeCount(t);
  for (int variant = 0; variant < 2; ++variant) {
    const uint64_t seed = mix(ctx.seed, uint64_t(variant));
    Buffer msg(t, count);
    std::vector<float> vec(1000);
    for (size_t i = 0; i < vec.size(); ++i) vec[i] = float(ctx.rank + 1) * float(i % 17);
    auto allreduce = [&] {
      SPY_REQUIRE_OK(spyrecclAllReduce(vec.data(), vec.data(), vec.size(), spyrecclFloat32,
                                       spyrecclSum, ctx.comm),
                     ctx.comm);
      double expectedFactor = ctx.nranks * (ctx.nranks + 1) / 2.0;
      for (size_t i = 0; i < vec.size(); ++i) {
        SPY_REQUIRE(vec[i] == float(expectedFactor * double(i % 17)), "allreduce[%zu] = %g", i,
                    double(vec[i]));
      }
    };
    const bool zeroSends = variant == 0;
    if (ctx.rank == 0) {
      spyrecclRequest_t r = nullptr;
      if (zeroSends) {
        fillAnyBits(t, seed, 0, msg.data(), count);
        SPY_REQUIRE_OK(spyrecclIsend(msg.data(), count, t.dtype, 1, 1, ctx.comm, &r), ctx.comm);
      } else {
        poisonMessage(t, msg.data(), count, seed, 1);
        SPY_REQUIRE_OK(spyrecclIrecv(msg.data(), count, t.dtype, 1, 1, ctx.comm, &r), ctx.comm);
      }
      allreduce();
      SPY_REQUIRE_OK(spyrecclWait(r), ctx.comm);
      if (!zeroSends) checkMessage(t, msg.data(), count, seed, 1, "Irecv across an allreduce");
    } else if (ctx.rank == 1) {
      if (zeroSends) {
        allreduce();
        poisonMessage(t, msg.data(), count, seed, 0);
        SPY_REQUIRE_OK(spyrecclRecv(msg.data(), count, t.dtype, 0, 1, ctx.comm), ctx.comm);
        checkMessage(t, msg.data(), count, seed, 0, "Isend across an allreduce");
      } else {
        fillAnyBits(t, seed, 1, msg.data(), count);
        SPY_REQUIRE_OK(spyrecclSend(msg.data(), count, t.dtype, 0, 1, ctx.comm), ctx.comm);
        allreduce();
      }
    } else {
      allreduce();
    }
  }
}

// CommPoll sleeps while the only request waits for a peer that sends late; a wake-up from
// another thread ends the sleep early, and the request completes once the peer sends.
void pollWakeBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclInt32);
  const size_t count = 99;
  Buffer buf(t, count);
  if (ctx.rank == 0) {
    poisonMessage(t, buf.data(), count, ctx.seed, 1);
    spyrecclRequest_t r = nullptr;
    SPY_REQUIRE_OK(spyrecclIrecv(buf.data(), count, t.dtype, 1, 0, ctx.comm, &r), ctx.comm);
    std::thread waker([&] {
      sleepMs(100);
      SPY_CHECK_OK(spyrecclCommWakePoll(ctx.comm), nullptr);
    });
    int pending = -1;
    const int64_t start = monotonicNs();
    SPY_CHECK_OK(spyrecclCommPoll(ctx.comm, 20 * 1000 * 1000, &pending), ctx.comm);
    const int64_t ms = (monotonicNs() - start) / 1000000;
    waker.join();
    SPY_CHECK(ms >= 50 && ms < 5000, "CommPoll returned after %lld ms (woken after 100 ms)",
              (long long)ms);
    SPY_CHECK(pending == 1, "pending = %d before the peer sent", pending);
    SPY_REQUIRE_OK(spyrecclBarrier(ctx.comm), ctx.comm);  // lets rank 1 send
    SPY_REQUIRE_OK(spyrecclWait(r), ctx.comm);
    checkMessage(t, buf.data(), count, ctx.seed, 1, "message received after a woken poll");
  } else if (ctx.rank == 1) {
    fillAnyBits(t, ctx.seed, 1, buf.data(), count);
    SPY_REQUIRE_OK(spyrecclBarrier(ctx.comm), ctx.comm);
    SPY_REQUIRE_OK(spyrecclSend(buf.data(), count, t.dtype, 0, 0, ctx.comm), ctx.comm);
  } else {
    SPY_REQUIRE_OK(spyrecclBarrier(ctx.comm), ctx.comm);
  }
}

// A request whose peer never sends: Wait gives up after the communicator's timeout with
// spyrecclTimeout naming the receive, and the communicator is failed afterwards. A second
// request, pending on the same communicator, reports the same error through Test.
void timeoutBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclFloat32);
  Buffer a(t, 10), b(t, 10);
  if (ctx.rank == 0) {
    spyrecclRequest_t ra = nullptr, rb = nullptr;
    SPY_REQUIRE_OK(spyrecclIrecv(a.data(), 10, t.dtype, 1, 3, ctx.comm, &ra), ctx.comm);
    SPY_REQUIRE_OK(spyrecclIrecv(b.data(), 10, t.dtype, 1, 4, ctx.comm, &rb), ctx.comm);
    const int64_t start = monotonicNs();
    SPY_CHECK_RC(spyrecclWait(ra), spyrecclTimeout, ctx.comm);
    const int64_t ms = (monotonicNs() - start) / 1000000;
    SPY_CHECK(ms >= ctx.config.timeoutMs - 20 && ms < ctx.config.timeoutMs + 3000,
              "timed out after %lld ms with timeoutMs = %lld", (long long)ms,
              (long long)ctx.config.timeoutMs);
    const std::string msg = spyrecclGetLastError(ctx.comm);
    SPY_CHECK(contains(msg, "recv") && contains(msg, "rank 1"),
              "the timeout message should name the receive from rank 1: \"%s\"", msg.c_str());
    int done = 0;
    SPY_CHECK_RC(spyrecclTest(rb, &done), spyrecclTimeout, ctx.comm);
    SPY_CHECK(done == 1, "an abandoned request is done (and released) once reported");
    spyrecclRequest_t rc = nullptr;
    SPY_CHECK_RC(spyrecclIrecv(a.data(), 10, t.dtype, 1, 3, ctx.comm, &rc), spyrecclInvalidUsage,
                 ctx.comm);
  } else {
    sleepMs(ctx.config.timeoutMs + 500);
  }
}

// Rank 1 SIGKILLs itself while rank 0's receive from it is pending and rank 0 only polls
// in short slices (as c10d's progress thread does): the death must be reported within 2 s
// (the timeout is 30 s), by the poll and then by the request.
void pollPeerDeathBody(RankContext& ctx) {
  if (ctx.rank == 1) {
    sleepMs(100);  // let rank 0 post and start polling
    ::raise(SIGKILL);
  }
  const TypeInfo& t = typeInfo(spyrecclFloat32);
  Buffer buf(t, 1000);
  spyrecclRequest_t r = nullptr;
  SPY_REQUIRE_OK(spyrecclIrecv(buf.data(), 1000, t.dtype, 1, 0, ctx.comm, &r), ctx.comm);
  const int64_t start = monotonicNs();
  spyrecclResult_t rc = spyrecclSuccess;
  while (rc == spyrecclSuccess && monotonicNs() - start < 10 * 1000000000ll) {
    rc = spyrecclCommPoll(ctx.comm, 2000, nullptr);
  }
  expectDeathReported(ctx, rc, 1, start);
  int done = 0;
  SPY_CHECK_RC(spyrecclTest(r, &done), spyrecclRemoteError, ctx.comm);
  SPY_CHECK(done == 1, "the abandoned request is released by the Test that reports it");
}

// Argument errors: NULL request/done, a request inside a group; the comm stays usable.
void argumentsBody(RankContext& ctx) {
  float x[4] = {1, 2, 3, 4};
  const int peer = 1 - ctx.rank;
  SPY_CHECK_RC(spyrecclIsend(x, 4, spyrecclFloat32, peer, 0, ctx.comm, nullptr),
               spyrecclInvalidArgument, ctx.comm);
  SPY_CHECK(contains(spyrecclGetLastError(ctx.comm), "spyrecclIsend") &&
                contains(spyrecclGetLastError(ctx.comm), "request"),
            "message: \"%s\"", spyrecclGetLastError(ctx.comm));
  spyrecclRequest_t r = nullptr;
  SPY_CHECK_RC(spyrecclIrecv(x, 4, spyrecclFloat32, ctx.rank, 0, ctx.comm, &r),
               spyrecclInvalidArgument, ctx.comm);
  SPY_CHECK(r == nullptr, "no request on an argument error");
  SPY_CHECK_RC(spyrecclTest(nullptr, nullptr), spyrecclInvalidArgument, nullptr);
  SPY_CHECK_RC(spyrecclWait(nullptr), spyrecclInvalidArgument, nullptr);
  SPY_CHECK_RC(spyrecclCommPoll(ctx.comm, -1, nullptr), spyrecclInvalidArgument, ctx.comm);
  SPY_CHECK_RC(spyrecclCommWakePoll(nullptr), spyrecclInvalidArgument, nullptr);
  SPY_REQUIRE_OK(spyrecclGroupStart(), ctx.comm);
  SPY_CHECK_RC(spyrecclIsend(x, 4, spyrecclFloat32, peer, 0, ctx.comm, &r), spyrecclInvalidUsage,
               ctx.comm);
  SPY_REQUIRE_OK(spyrecclGroupEnd(), ctx.comm);
  // Still usable: a real exchange, and a request never completed is freed by CommDestroy
  // (the leak checker of the sanitizer builds would see it otherwise).
  float y[4] = {0, 0, 0, 0};
  spyrecclRequest_t s = nullptr, q = nullptr;
  SPY_REQUIRE_OK(spyrecclIsend(x, 4, spyrecclFloat32, peer, 8, ctx.comm, &s), ctx.comm);
  SPY_REQUIRE_OK(spyrecclIrecv(y, 4, spyrecclFloat32, peer, 8, ctx.comm, &q), ctx.comm);
  SPY_REQUIRE_OK(spyrecclWait(q), ctx.comm);
  for (int i = 0; i < 4; ++i) SPY_CHECK(y[i] == x[i], "y[%d] = %g", i, double(y[i]));
  SPY_REQUIRE_OK(spyrecclBarrier(ctx.comm), ctx.comm);
  (void)s;  // left to spyrecclCommDestroy
}

void registerNB(const char* name, void (*body)(RankContext&), std::vector<int> worldSizes,
                int64_t timeoutMs = 30000, std::set<int> mayDie = {}) {
  for (int ws : worldSizes) {
    const std::string testName = format("p2p_nb.%s/ws%d", name, ws);
    registerTest(testName, [=] {
      RunOptions opts;
      opts.nranks = ws;
      opts.label = testName;
      opts.config.timeoutMs = timeoutMs;
      opts.mayDie = mayDie;
      runRanks(opts, body);
    });
  }
}

[[maybe_unused]] const bool registered = [] {
  registerNB("ring", ringBody, {2, 3, 4});
  registerNB("fifo", fifoBody, {2});
  registerNB("across_collective", acrossCollectiveBody, {2, 3});
  registerNB("poll_wake", pollWakeBody, {2});
  registerNB("timeout", timeoutBody, {2}, 500);
  registerNB("poll_peer_death", pollPeerDeathBody, {2, 3}, 30000, {1});
  registerNB("arguments", argumentsBody, {2});
  return true;
}();

}  // namespace
