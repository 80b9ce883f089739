// Direct point-to-point messages: once a collective on arena buffers has established
// direct transfers, a send whose buffer lies in the sender's memory arena is copied by the
// receiver straight out of that arena (one copy) and completes only when the receiver has
// taken it. Covered here: every size class and several data types with the sender's and
// the receiver's buffers in either kind of memory, groups exchanging in both directions,
// FIFO order across direct and staged messages, spyrecclRecvAnySource, mismatches, and a
// rank killed during a direct transfer. Test names are "p2p_direct.<what>/ws<N>".
//
// Every test runs with SPYRECCL_DIRECT_MIN_BYTES=1 (so that one element already qualifies)
// and starts with a small allreduce on arena buffers, which maps the peers' arenas.
#include <signal.h>

#include <set>
#include <string>
#include <thread>
#include <vector>

#include "data.h"
#include "multiproc.h"

namespace {

using namespace spyreccl_test;

// A buffer of `count` elements of `t` in the given kind of memory.
Buffer bufferIn(Memory memory, const TypeInfo& t, size_t count) {
  const Memory saved = bufferMemory();
  bufferMemory() = memory;
  Buffer b(t, count);
  bufferMemory() = saved;
  return b;
}

const char* memoryName(Memory m) { return m == Memory::kArena ? "arena" : "host"; }

// More than three p2p chunks (the tests use 16 KiB), and several MiB.
size_t beyondChunksCount(const TypeInfo& t) { return 3 * 16 * 1024 / t.size + 5; }
size_t severalMiBCount(const TypeInfo& t) { return (3u << 20) / t.size + 3; }

std::vector<size_t> sizesFor(const TypeInfo& t) {
  return {1, 7, 1023, beyondChunksCount(t), severalMiBCount(t)};
}

std::vector<const TypeInfo*> directTypes() {
  return {&typeInfo(spyrecclInt8), &typeInfo(spyrecclFloat16), &typeInfo(spyrecclFloat32),
          &typeInfo(spyrecclUint64), &typeInfo(spyrecclFloat64)};
}

// An allreduce on arena buffers: the collective that maps every peer's arena, after which
// point-to-point may go direct. Its result is checked too.
void establishDirect(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclInt32);
  const size_t count = 1000;
  Buffer in = bufferIn(Memory::kArena, t, count), out = bufferIn(Memory::kArena, t, count);
  for (size_t i = 0; i < count; ++i) storeBits(t, in.data(), i, uint64_t(ctx.rank + 1) * i);
  std::memset(out.data(), 0xA5, out.size());
  SPY_REQUIRE_OK(spyrecclAllReduce(in.data(), out.data(), count, t.dtype, spyrecclSum, ctx.comm),
                 ctx.comm);
  const uint64_t factor = uint64_t(ctx.nranks) * uint64_t(ctx.nranks + 1) / 2;
  OutputChecker check(t, "warm-up allreduce on arena buffers");
  for (size_t i = 0; i < count; ++i) check.expectBits(out.data(), i, (factor * i) & mask(t));
  check.report(__FILE__, __LINE__);
}

// Registers `body` at each world size, run with the direct threshold at 1 byte.
void registerDirect(const char* name, void (*body)(RankContext&), std::vector<int> worldSizes,
                    std::set<int> mayDie = {}) {
  for (int ws : worldSizes) {
    const std::string testName = format("p2p_direct.%s/ws%d", name, ws);
    registerTest(testName, [=] {
      RunOptions opts;
      opts.nranks = ws;
      opts.label = testName;
      opts.mayDie = mayDie;
      // The data-path cases move tens of MiB per rank: ~1 s in a release build, ~16 s under
      // ThreadSanitizer on an idle 2-core machine, more when it is busy.
      opts.deadlineMs = 120000;
      ::setenv("SPYRECCL_DIRECT_MIN_BYTES", "1", 1);
      runRanks(opts, [body](RankContext& ctx) {
        establishDirect(ctx);
        body(ctx);
      });
      ::unsetenv("SPYRECCL_DIRECT_MIN_BYTES");
    });
  }
}

// ---------------------------------------------------------------------------------------
// Data paths
// ---------------------------------------------------------------------------------------

// Rank 0 sends to the last rank, which answers with a message of its own; every
// combination of memory kinds for the two buffers (direct when the sender's is in its
// arena, staged otherwise). Ranks in between stay idle.
void sendRecvBody(RankContext& ctx) {
  const int last = ctx.nranks - 1;
  const Memory kinds[] = {Memory::kArena, Memory::kHost};
  uint64_t caseNo = 0;
  for (const TypeInfo* tp : directTypes()) {
    const TypeInfo& t = *tp;
    for (size_t count : sizesFor(t)) {
      for (Memory sendMem : kinds) {
        for (Memory recvMem : kinds) {
          const uint64_t seed = mix(ctx.seed, ++caseNo);
          const int tag = int(caseNo % 89);
          const std::string what = format("send/recv %s count=%zu from %s to %s memory", t.name,
                                          count, memoryName(sendMem), memoryName(recvMem));
          if (ctx.rank == 0) {
            Buffer send = bufferIn(sendMem, t, count), reply = bufferIn(recvMem, t, count);
            fillAnyBits(t, seed, 0, send.data(), count);
            SPY_REQUIRE_OK(spyrecclSend(send.data(), count, t.dtype, last, tag, ctx.comm),
                           ctx.comm);
            poisonMessage(t, reply.data(), count, seed, last);
            SPY_REQUIRE_OK(spyrecclRecv(reply.data(), count, t.dtype, last, tag + 1, ctx.comm),
                           ctx.comm);
            checkMessage(t, reply.data(), count, seed, last, what + " (reply)");
          } else if (ctx.rank == last) {
            Buffer recv = bufferIn(recvMem, t, count), reply = bufferIn(sendMem, t, count);
            poisonMessage(t, recv.data(), count, seed, 0);
            SPY_REQUIRE_OK(spyrecclRecv(recv.data(), count, t.dtype, 0, tag, ctx.comm), ctx.comm);
            checkMessage(t, recv.data(), count, seed, 0, what);
            fillAnyBits(t, seed, last, reply.data(), count);
            SPY_REQUIRE_OK(spyrecclSend(reply.data(), count, t.dtype, 0, tag + 1, ctx.comm),
                           ctx.comm);
          }
        }
      }
    }
  }
}

// A send that fits in the two staging slots returns before its receiver posts the
// receive, whatever memory it comes from: only messages larger than that (whose staged
// send waits for the receiver anyway) take the direct path, so code that sends before it
// receives keeps working. Rank 1 starts receiving 1 s after rank 0 starts sending.
// (That large arena messages really go direct is shown by killed_sender below, which only
// the direct path survives.)
void rendezvousBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclInt32);
  const size_t count = 5;
  for (Memory mem : {Memory::kArena, Memory::kHost}) {
    const uint64_t seed = mix(ctx.seed, uint64_t(mem));
    SPY_REQUIRE_OK(spyrecclBarrier(ctx.comm), ctx.comm);
    if (ctx.rank == 0) {
      Buffer send = bufferIn(mem, t, count);
      fillAnyBits(t, seed, 0, send.data(), count);
      const int64_t start = monotonicNs();
      SPY_REQUIRE_OK(spyrecclSend(send.data(), count, t.dtype, 1, 2, ctx.comm), ctx.comm);
      const int64_t ms = (monotonicNs() - start) / 1000000;
      SPY_CHECK(ms < 800, "a small send from %s memory waited %lld ms for its receiver",
                memoryName(mem), (long long)ms);
    } else if (ctx.rank == 1) {
      Buffer recv = bufferIn(Memory::kHost, t, count);
      poisonMessage(t, recv.data(), count, seed, 0);
      sleepMs(1000);
      SPY_REQUIRE_OK(spyrecclRecv(recv.data(), count, t.dtype, 0, 2, ctx.comm), ctx.comm);
      checkMessage(t, recv.data(), count, seed, 0, format("message from %s", memoryName(mem)));
    }
  }
}

// Point-to-point never runs the direct-transfer probe (a collective step) itself: before
// any large collective, a send from the arena is staged and completes without its receiver.
void noProbeBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclFloat32);
  const size_t count = 9;
  if (ctx.rank == 0) {
    Buffer send = bufferIn(Memory::kArena, t, count);
    fillAnyBits(t, ctx.seed, 0, send.data(), count);
    const int64_t start = monotonicNs();
    SPY_REQUIRE_OK(spyrecclSend(send.data(), count, t.dtype, 1, 0, ctx.comm), ctx.comm);
    const int64_t ms = (monotonicNs() - start) / 1000000;
    SPY_CHECK(ms < 800, "a send before any collective waited %lld ms for its receiver",
              (long long)ms);
  } else if (ctx.rank == 1) {
    Buffer recv = bufferIn(Memory::kArena, t, count);
    poisonMessage(t, recv.data(), count, ctx.seed, 0);
    sleepMs(1000);
    SPY_REQUIRE_OK(spyrecclRecv(recv.data(), count, t.dtype, 0, 0, ctx.comm), ctx.comm);
    checkMessage(t, recv.data(), count, ctx.seed, 0, "message sent before any collective");
  }
  // Collectives (direct ones included) still work afterwards.
  establishDirect(ctx);
}

// In one group, every rank sends a message to every peer and receives one from each: both
// directions of every pair at once, small and several-MiB messages, direct from the arena.
void exchangeBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclFloat32);
  const int n = ctx.nranks;
  uint64_t caseNo = 0;
  for (size_t count : {size_t(3), beyondChunksCount(t), severalMiBCount(t)}) {
    const uint64_t seed = mix(ctx.seed, ++caseNo);
    std::vector<Buffer> sends, recvs;
    for (int p = 0; p < n; ++p) {
      sends.push_back(bufferIn(Memory::kArena, t, count));
      // Received into the arena from even peers, into host memory from odd ones.
      recvs.push_back(bufferIn(p % 2 ? Memory::kHost : Memory::kArena, t, count));
      // The message r -> p is rank r's stream shifted by p.
      fillAnyBits(t, mix(seed, uint64_t(p)), ctx.rank, sends.back().data(), count);
      poisonMessage(t, recvs.back().data(), count, mix(seed, uint64_t(ctx.rank)), p);
    }
    SPY_REQUIRE_OK(spyrecclGroupStart(), ctx.comm);
    for (int p = 0; p < n; ++p) {
      if (p == ctx.rank) continue;
      SPY_REQUIRE_OK(spyrecclSend(sends[size_t(p)].data(), count, t.dtype, p, 5, ctx.comm),
                     ctx.comm);
      SPY_REQUIRE_OK(spyrecclRecv(recvs[size_t(p)].data(), count, t.dtype, p, 5, ctx.comm),
                     ctx.comm);
    }
    SPY_REQUIRE_OK(spyrecclGroupEnd(), ctx.comm);
    for (int p = 0; p < n; ++p) {
      if (p == ctx.rank) continue;
      checkMessage(t, recvs[size_t(p)].data(), count, mix(seed, uint64_t(ctx.rank)), p,
                   format("grouped exchange count=%zu from rank %d", count, p));
    }
  }
}

// Messages between one pair arrive in send order when direct and staged ones alternate,
// posted in one group and as separate blocking calls.
void fifoBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclUint32);
  struct Message {
    Memory memory;  // of the send buffer: arena is direct, host is staged
    size_t count;
  };
  const std::vector<Message> messages = {
      {Memory::kArena, severalMiBCount(t)},
      {Memory::kHost, 7},
      {Memory::kArena, 1},
      {Memory::kHost, beyondChunksCount(t)},
      {Memory::kArena, beyondChunksCount(t)},
      {Memory::kHost, 1},
      {Memory::kArena, 1023},
  };
  const int last = ctx.nranks - 1;
  for (bool grouped : {true, false}) {
    const uint64_t seed = mix(ctx.seed, grouped);
    auto messageSeed = [&](size_t m) { return mix(seed, m); };
    if (ctx.rank == 0) {
      std::vector<Buffer> bufs;
      for (size_t m = 0; m < messages.size(); ++m) {
        bufs.push_back(bufferIn(messages[m].memory, t, messages[m].count));
        fillAnyBits(t, messageSeed(m), 0, bufs.back().data(), messages[m].count);
      }
      if (grouped) SPY_REQUIRE_OK(spyrecclGroupStart(), ctx.comm);
      for (size_t m = 0; m < messages.size(); ++m) {
        SPY_REQUIRE_OK(spyrecclSend(bufs[m].data(), messages[m].count, t.dtype, last, 9, ctx.comm),
                       ctx.comm);
      }
      if (grouped) SPY_REQUIRE_OK(spyrecclGroupEnd(), ctx.comm);
    } else if (ctx.rank == last) {
      for (size_t m = 0; m < messages.size(); ++m) {
        // Received alternately into host and arena memory.
        Buffer buf = bufferIn(m % 2 ? Memory::kArena : Memory::kHost, t, messages[m].count);
        poisonMessage(t, buf.data(), messages[m].count, messageSeed(m), 0);
        SPY_REQUIRE_OK(spyrecclRecv(buf.data(), messages[m].count, t.dtype, 0, 9, ctx.comm),
                       ctx.comm);
        checkMessage(t, buf.data(), messages[m].count, messageSeed(m), 0,
                     format("message %zu of %zu (%s send, %s)", m, messages.size(),
                            memoryName(messages[m].memory), grouped ? "grouped" : "blocking"));
      }
    }
  }
}

// Every other rank sends one direct message to rank 0, which takes them from any source.
void anySourceBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclFloat64);
  const size_t count = beyondChunksCount(t);
  if (ctx.rank != 0) {
    Buffer buf = bufferIn(Memory::kArena, t, count);
    fillAnyBits(t, ctx.seed, ctx.rank, buf.data(), count);
    SPY_REQUIRE_OK(spyrecclSend(buf.data(), count, t.dtype, 0, 7, ctx.comm), ctx.comm);
    return;
  }
  std::set<int> seen;
  for (int k = 1; k < ctx.nranks; ++k) {
    Buffer buf = bufferIn(Memory::kHost, t, count);
    std::memset(buf.data(), 0xA5, buf.size());  // no source's message has this pattern
    int source = -1;
    SPY_REQUIRE_OK(spyrecclRecvAnySource(buf.data(), count, t.dtype, 7, &source, ctx.comm),
                   ctx.comm);
    SPY_REQUIRE(source >= 1 && source < ctx.nranks, "source = %d", source);
    SPY_CHECK(seen.insert(source).second, "rank %d was reported as the source twice", source);
    checkMessage(t, buf.data(), count, ctx.seed, source,
                 format("direct message received from any source (rank %d)", source));
  }
}

// ---------------------------------------------------------------------------------------
// Failures
// ---------------------------------------------------------------------------------------

// A direct message received with a different count or tag: spyrecclMismatch on both sides
// (the sender waits for its receiver, so it always learns of the refusal), both naming
// the two signatures, and nothing written to the receive buffer.
void mismatchBody(RankContext& ctx, bool wrongCount) {
  const TypeInfo& t = typeInfo(spyrecclFloat32);
  const size_t count = beyondChunksCount(t);
  const size_t recvCount = wrongCount ? count - 1 : count;
  const int tag = 4, recvTag = wrongCount ? 4 : 6;
  if (ctx.rank == 0) {
    Buffer buf = bufferIn(Memory::kArena, t, count);
    fillAnyBits(t, ctx.seed, 0, buf.data(), count);
    SPY_CHECK_RC(spyrecclSend(buf.data(), count, t.dtype, 1, tag, ctx.comm), spyrecclMismatch,
                 ctx.comm);
    const std::string msg = spyrecclGetLastError(ctx.comm);
    const std::string theirs =
        wrongCount ? format("count=%zu", recvCount) : format("tag=%d", recvTag);
    SPY_CHECK(contains(msg, theirs), "the sender's message should name the receiver's %s: \"%s\"",
              theirs.c_str(), msg.c_str());
  } else if (ctx.rank == 1) {
    Buffer buf = bufferIn(Memory::kHost, t, count);
    poisonMessage(t, buf.data(), count, ctx.seed, 0);
    std::vector<char> before(static_cast<char*>(buf.data()),
                             static_cast<char*>(buf.data()) + buf.size());
    SPY_CHECK_RC(spyrecclRecv(buf.data(), recvCount, t.dtype, 0, recvTag, ctx.comm),
                 spyrecclMismatch, ctx.comm);
    const std::string msg = spyrecclGetLastError(ctx.comm);
    const std::string sent = wrongCount ? format("count=%zu", count) : format("tag=%d", tag);
    SPY_CHECK(contains(msg, sent), "the receiver's message should name the sent %s: \"%s\"",
              sent.c_str(), msg.c_str());
    SPY_CHECK(std::memcmp(before.data(), buf.data(), buf.size()) == 0,
              "a refused message was written to the receive buffer");
  }
}

void countMismatchBody(RankContext& ctx) { mismatchBody(ctx, true); }
void tagMismatchBody(RankContext& ctx) { mismatchBody(ctx, false); }

// The receiver dies while a direct send to it waits for its copy: the sender gets
// spyrecclRemoteError naming it within 2 s.
void killedReceiverBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclFloat32);
  const size_t count = severalMiBCount(t);
  const int victim = 1;
  if (ctx.rank == victim) {
    sleepMs(100);  // let the sender post and block first
    ::raise(SIGKILL);
  }
  if (ctx.rank != 0) return;
  Buffer buf = bufferIn(Memory::kArena, t, count);
  fillAnyBits(t, ctx.seed, 0, buf.data(), count);
  const int64_t start = monotonicNs();
  const spyrecclResult_t rc = spyrecclSend(buf.data(), count, t.dtype, victim, 1, ctx.comm);
  expectDeathReported(ctx, rc, victim, start);
}

// The sender dies (from another thread) while its direct send waits for the receiver: the
// message it posted is complete in its arena, which the receiver still has mapped, so it
// arrives intact; the next receive from the dead rank gets spyrecclRemoteError within 2 s.
void killedSenderBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclInt64);
  const size_t count = severalMiBCount(t);
  const int victim = 0;
  if (ctx.rank == victim) {
    Buffer buf = bufferIn(Memory::kArena, t, count);
    fillAnyBits(t, ctx.seed, 0, buf.data(), count);
    std::thread killer([] {
      sleepMs(100);
      ::raise(SIGKILL);
    });
    spyrecclSend(buf.data(), count, t.dtype, 1, 1, ctx.comm);  // never returns
    killer.join();
    return;
  }
  if (ctx.rank != 1) return;
  Buffer buf = bufferIn(Memory::kHost, t, count);
  poisonMessage(t, buf.data(), count, ctx.seed, 0);
  sleepMs(400);  // the sender is dead by now
  SPY_REQUIRE_OK(spyrecclRecv(buf.data(), count, t.dtype, victim, 1, ctx.comm), ctx.comm);
  checkMessage(t, buf.data(), count, ctx.seed, 0, "message posted before its sender died");
  const int64_t start = monotonicNs();
  const spyrecclResult_t rc = spyrecclRecv(buf.data(), count, t.dtype, victim, 1, ctx.comm);
  expectDeathReported(ctx, rc, victim, start);
}

[[maybe_unused]] const bool registered = [] {
  registerDirect("send_recv", sendRecvBody, {2, 3});
  registerDirect("rendezvous", rendezvousBody, {2, 3});
  registerDirect("exchange_group", exchangeBody, {2, 3});
  registerDirect("fifo_mixed", fifoBody, {2, 3});
  registerDirect("any_source", anySourceBody, {2, 3});
  registerDirect("count_mismatch", countMismatchBody, {2});
  registerDirect("tag_mismatch", tagMismatchBody, {2});
  registerDirect("killed_receiver", killedReceiverBody, {2, 3}, {1});
  registerDirect("killed_sender", killedSenderBody, {2, 3}, {0});
  // Without the warm-up collective: point-to-point alone never turns direct transfers on.
  for (int ws : {2, 3}) {
    const std::string testName = format("p2p_direct.no_probe/ws%d", ws);
    registerTest(testName, [=] {
      RunOptions opts;
      opts.nranks = ws;
      opts.label = testName;
      ::setenv("SPYRECCL_DIRECT_MIN_BYTES", "1", 1);
      runRanks(opts, noProbeBody);
      ::unsetenv("SPYRECCL_DIRECT_MIN_BYTES");
    });
  }
  return true;
}();

}  // namespace
