// Point-to-point: send/recv of every data type and size, ring exchanges inside
// spyrecclGroupStart/End (which would deadlock as plain blocking calls once a message is
// larger than the staging area), FIFO order, spyrecclRecvAnySource, and a receive that
// does not match its send. Test names are "p2p.<what>/ws<N>".
#include <set>
#include <string>
#include <vector>

#include "data.h"
#include "multiproc.h"

namespace {

using namespace spyreccl_test;

// More than three p2p staging chunks (the tests use 16 KiB).
size_t largeCount(const TypeInfo& t) { return 3 * 16 * 1024 / t.size + 5; }

std::vector<size_t> sizesFor(const TypeInfo& t) { return {0, 1, 7, 1023, largeCount(t)}; }

// Rank 0 sends to the last rank, then the last rank answers; ranks in between stay idle
// (and must not be disturbed).
void sendRecvBody(RankContext& ctx) {
  const int last = ctx.nranks - 1;
  uint64_t caseNo = 0;
  for (const TypeInfo& t : allTypes()) {
    for (size_t count : sizesFor(t)) {
      const uint64_t seed = mix(ctx.seed, ++caseNo);
      const int tag = int(caseNo % 97);
      const std::string what = format("send/recv %s count=%zu tag=%d", t.name, count, tag);
      Buffer buf(t, count);
      if (ctx.rank == 0) {
        fillAnyBits(t, seed, 0, buf.data(), count);
        SPY_REQUIRE_OK(spyrecclSend(buf.data(), count, t.dtype, last, tag, ctx.comm), ctx.comm);
        poisonMessage(t, buf.data(), count, seed, last);
        SPY_REQUIRE_OK(spyrecclRecv(buf.data(), count, t.dtype, last, tag + 1, ctx.comm), ctx.comm);
        checkMessage(t, buf.data(), count, seed, last, what + " (reply)");
      } else if (ctx.rank == last) {
        poisonMessage(t, buf.data(), count, seed, 0);
        SPY_REQUIRE_OK(spyrecclRecv(buf.data(), count, t.dtype, 0, tag, ctx.comm), ctx.comm);
        checkMessage(t, buf.data(), count, seed, 0, what);
        fillAnyBits(t, seed, last, buf.data(), count);
        SPY_REQUIRE_OK(spyrecclSend(buf.data(), count, t.dtype, 0, tag + 1, ctx.comm), ctx.comm);
      }
    }
  }
}

// Every rank sends to its right neighbour and receives from its left one, in one group.
void ringBody(RankContext& ctx) {
  const int next = (ctx.rank + 1) % ctx.nranks;
  const int prev = (ctx.rank + ctx.nranks - 1) % ctx.nranks;
  uint64_t caseNo = 0;
  for (const TypeInfo& t : allTypes()) {
    for (size_t count : {size_t(0), size_t(7), largeCount(t)}) {
      const uint64_t seed = mix(ctx.seed, ++caseNo);
      Buffer send(t, count), recv(t, count);
      fillAnyBits(t, seed, ctx.rank, send.data(), count);
      poisonMessage(t, recv.data(), count, seed, prev);
      SPY_REQUIRE_OK(spyrecclGroupStart(), ctx.comm);
      SPY_REQUIRE_OK(spyrecclSend(send.data(), count, t.dtype, next, 3, ctx.comm), ctx.comm);
      SPY_REQUIRE_OK(spyrecclRecv(recv.data(), count, t.dtype, prev, 3, ctx.comm), ctx.comm);
      SPY_REQUIRE_OK(spyrecclGroupEnd(), ctx.comm);
      checkMessage(t, recv.data(), count, seed, prev,
                   format("ring exchange %s count=%zu from rank %d", t.name, count, prev));
    }
  }
}

// Several messages with the same tag between one pair arrive in the order they were sent,
// also when posted together in one group.
void fifoBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclInt32);
  constexpr int kMessages = 4;
  const size_t count = largeCount(t) / 2;
  std::vector<Buffer> bufs;
  for (int m = 0; m < kMessages; ++m) bufs.emplace_back(t, count);
  if (ctx.rank == 0) {
    SPY_REQUIRE_OK(spyrecclGroupStart(), ctx.comm);
    for (int m = 0; m < kMessages; ++m) {
      fillAnyBits(t, mix(ctx.seed, uint64_t(m)), 0, bufs[size_t(m)].data(), count);
      SPY_REQUIRE_OK(spyrecclSend(bufs[size_t(m)].data(), count, t.dtype, 1, 9, ctx.comm),
                     ctx.comm);
    }
    SPY_REQUIRE_OK(spyrecclGroupEnd(), ctx.comm);
  } else if (ctx.rank == 1) {
    for (int m = 0; m < kMessages; ++m) {
      poisonMessage(t, bufs[size_t(m)].data(), count, mix(ctx.seed, uint64_t(m)), 0);
      SPY_REQUIRE_OK(spyrecclRecv(bufs[size_t(m)].data(), count, t.dtype, 0, 9, ctx.comm),
                     ctx.comm);
      checkMessage(t, bufs[size_t(m)].data(), count, mix(ctx.seed, uint64_t(m)), 0,
                   format("message %d of %d (FIFO order)", m, kMessages));
    }
  }
}

// Ranks 1..n-1 each send one message to rank 0, which takes them in arrival order.
void anySourceBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclFloat32);
  const size_t count = 33;
  Buffer buf(t, count);
  if (ctx.rank != 0) {
    fillAnyBits(t, ctx.seed, ctx.rank, buf.data(), count);
    SPY_REQUIRE_OK(spyrecclSend(buf.data(), count, t.dtype, 0, 7, ctx.comm), ctx.comm);
    return;
  }
  std::set<int> seen;
  for (int k = 1; k < ctx.nranks; ++k) {
    int source = -1;
    std::memset(buf.data(), 0xA5, buf.size());
    SPY_REQUIRE_OK(spyrecclRecvAnySource(buf.data(), count, t.dtype, 7, &source, ctx.comm),
                   ctx.comm);
    SPY_REQUIRE(source >= 1 && source < ctx.nranks, "source = %d", source);
    SPY_CHECK(seen.insert(source).second, "rank %d was reported as the source twice", source);
    checkMessage(t, buf.data(), count, ctx.seed, source,
                 format("message received from any source (rank %d)", source));
  }
}

// A receive that names a different count than its send fails with spyrecclMismatch on
// the receiving rank; the sender either completed (small message) or saw the refusal.
void mismatchBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclFloat32);
  Buffer buf(t, 11);
  if (ctx.rank == 0) {
    fillAnyBits(t, ctx.seed, 0, buf.data(), 10);
    const spyrecclResult_t rc = spyrecclSend(buf.data(), 10, t.dtype, 1, 4, ctx.comm);
    SPY_CHECK(rc == spyrecclSuccess || rc == spyrecclMismatch, "spyrecclSend returned %s: %s",
              spyrecclGetErrorString(rc), spyrecclGetLastError(ctx.comm));
  } else if (ctx.rank == 1) {
    SPY_CHECK_RC(spyrecclRecv(buf.data(), 11, t.dtype, 0, 4, ctx.comm), spyrecclMismatch, ctx.comm);
    const std::string msg = spyrecclGetLastError(ctx.comm);
    SPY_CHECK(msg.find("10") != std::string::npos && msg.find("11") != std::string::npos,
              "the mismatch message should name both counts (10 and 11): \"%s\"", msg.c_str());
  }
}

void registerP2P(const char* name, void (*body)(RankContext&), std::vector<int> worldSizes) {
  for (int ws : worldSizes) {
    const std::string testName = format("p2p.%s/ws%d", name, ws);
    registerTest(testName, [=] {
      RunOptions opts;
      opts.nranks = ws;
      opts.label = testName;
      runRanks(opts, body);
    });
  }
}

[[maybe_unused]] const bool registered = [] {
  registerP2P("send_recv", sendRecvBody, {2, 3});
  registerP2P("ring_group", ringBody, {2, 3, 4});
  registerP2P("fifo", fifoBody, {2});
  registerP2P("any_source", anySourceBody, {3, 4});
  registerP2P("recv_mismatch", mismatchBody, {2});
  return true;
}();

}  // namespace
