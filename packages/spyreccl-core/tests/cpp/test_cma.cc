// Single-copy transfers of ordinary memory (cross-memory attach, transport/cma.h): the
// init-time probe and its agreement, the forced fallback, a real denial (a seccomp filter
// that makes process_vm_readv fail with EPERM on one rank) and ranks that die while peers
// read their buffers. The data path of every collective is covered by the "/cma" variants
// of test_collectives.cc. Test names are "cma.<what>/ws<N>".
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "data.h"
#include "multiproc.h"

namespace {

using namespace spyreccl_test;

std::string dump(RankContext& ctx) {
  std::vector<char> buf(1 << 16);
  SPY_CHECK_OK(spyrecclCommDumpState(ctx.comm, buf.data(), buf.size()), ctx.comm);
  return buf.data();
}

// The transfers line of the state dump: "... (CMA) on, 3 reads, 12345 bytes".
std::string cmaLine(RankContext& ctx) {
  const std::string d = dump(ctx);
  const size_t at = d.find("(CMA) ");
  if (at == std::string::npos) return "";
  return d.substr(at, d.find('\n', at) - at);
}

unsigned long long cmaReads(RankContext& ctx) {
  const std::string line = cmaLine(ctx);
  const size_t comma = line.find(", ");
  return comma == std::string::npos ? 0 : std::strtoull(line.c_str() + comma + 2, nullptr, 10);
}

// Makes every later process_vm_readv of this process fail with EPERM, as a container's
// seccomp profile would.
void denyProcessVmReadv() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_process_vm_readv, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
  SPY_REQUIRE(::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS: %s",
              std::strerror(errno));
  SPY_REQUIRE(::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0, "seccomp: %s",
              std::strerror(errno));
}

// An allgather of `count` int32 per rank at a non-aligned offset of ordinary buffers,
// checked element by element. With the test's CMA threshold of 1 byte it goes single-copy
// whenever the probe allowed it.
void checkedAllGather(RankContext& ctx, size_t count) {
  const TypeInfo& t = typeInfo(spyrecclInt32);
  std::vector<char> in(count * t.size + 3), out(count * t.size * ctx.nranks + 3);
  void* send = in.data() + 3;
  void* recv = out.data() + 3;
  fillAnyBits(t, ctx.seed, ctx.rank, send, count);
  std::memset(recv, 0xA5, count * t.size * ctx.nranks);
  SPY_REQUIRE_OK(spyrecclAllGather(send, recv, count, t.dtype, ctx.comm), ctx.comm);
  OutputChecker check(t, format("allgather of %zu int32 at offset 3", count));
  for (int q = 0; q < ctx.nranks; ++q) {
    for (size_t i = 0; i < count; ++i) {
      check.expectBits(recv, q * count + i, anyBits(t, ctx.seed, q, i));
    }
  }
  check.report(__FILE__, __LINE__);
}

void probeOnBody(RankContext& ctx) {
  const std::string line = cmaLine(ctx);
  SPY_CHECK(line.rfind("(CMA) on,", 0) == 0, "expected CMA on after the probe, dump says \"%s\"",
            line.c_str());
  checkedAllGather(ctx, 1001);
  SPY_CHECK(cmaReads(ctx) >= unsigned(ctx.nranks - 1),
            "the allgather should have read every peer with process_vm_readv: \"%s\"",
            cmaLine(ctx).c_str());
}

// SPYRECCL_CMA=0 on rank 1 only: every rank agrees to stage.
void envOffBody(RankContext& ctx) {
  const std::string line = cmaLine(ctx);
  SPY_CHECK(line.find("off (SPYRECCL_CMA=0 on some rank)") != std::string::npos,
            "expected CMA off everywhere, dump says \"%s\"", line.c_str());
  checkedAllGather(ctx, 1001);
  SPY_CHECK(cmaReads(ctx) == 0, "no process_vm_readv expected: \"%s\"", cmaLine(ctx).c_str());
}

// Rank 1 cannot call process_vm_readv: it reports the failure, the others learn it in the
// agreement step, and the collectives are staged (and correct) everywhere.
void deniedBody(RankContext& ctx) {
  const std::string line = cmaLine(ctx);
  SPY_CHECK(line.rfind("(CMA) off", 0) == 0, "expected CMA off, dump says \"%s\"", line.c_str());
  if (ctx.rank == 1) {
    SPY_CHECK(line.find("Operation not permitted") != std::string::npos,
              "rank 1 should name the refused call: \"%s\"", line.c_str());
  }
  checkedAllGather(ctx, 1001);
  SPY_CHECK(cmaReads(ctx) == 0, "no process_vm_readv expected: \"%s\"", cmaLine(ctx).c_str());
}

// The root of a large broadcast dies while the others copy its buffer with
// process_vm_readv: each gets spyrecclRemoteError naming it, within 2 s.
void killedRootBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclFloat32);
  const size_t count = (64u << 20) / t.size;
  Buffer buf(t, count);
  std::memset(buf.data(), 0x3C, buf.size());
  const int victim = 0;
  if (ctx.rank == victim) {
    std::thread killer([] {
      sleepMs(2);
      ::raise(SIGKILL);
    });
    spyrecclBroadcast(buf.data(), buf.data(), count, t.dtype, victim, ctx.comm);
    sleepMs(10000);  // never reached: the killer fires first
    killer.join();
    return;
  }
  // Several broadcasts, so that the kill lands in one of them whatever the timing.
  const int64_t start = monotonicNs();
  spyrecclResult_t rc = spyrecclSuccess;
  for (int i = 0; i < 1000 && rc == spyrecclSuccess; ++i) {
    rc = spyrecclBroadcast(buf.data(), buf.data(), count, t.dtype, victim, ctx.comm);
  }
  SPY_CHECK(rc == spyrecclRemoteError, "expected spyrecclRemoteError, got %s: \"%s\"",
            spyrecclGetErrorString(rc), spyrecclGetLastError(ctx.comm));
  const std::string msg = spyrecclGetLastError(ctx.comm);
  SPY_CHECK(contains(msg, "rank 0"), "the message should name the dead rank 0: \"%s\"",
            msg.c_str());
  SPY_CHECK((monotonicNs() - start) / 1000000 < 5000, "the death was reported too late");
}

// A single-copy send waits for its receiver; its sender dies meanwhile. The receiver's
// read of the dead process fails (ESRCH), which is reported as the sender's death, not as
// a crash or a torn message.
void killedSenderBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclInt64);
  const size_t count = (3u << 20) / t.size + 3;
  Buffer buf(t, count);
  const int victim = 0;
  if (ctx.rank == victim) {
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
  sleepMs(400);  // the sender is dead by now
  const int64_t start = monotonicNs();
  const spyrecclResult_t rc = spyrecclRecv(buf.data(), count, t.dtype, victim, 1, ctx.comm);
  expectDeathReported(ctx, rc, victim, start);
}

// Send/recv of ordinary buffers at odd sizes and offsets, single-copy in both directions.
void sendRecvBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclFloat16);
  const int last = ctx.nranks - 1;
  for (size_t count : {size_t{1}, size_t{7}, size_t{40000}, size_t{(5u << 20) / 2 + 1}}) {
    std::vector<char> storage(count * t.size + 1);
    void* buf = storage.data() + 1;
    if (ctx.rank == 0) {
      fillAnyBits(t, ctx.seed, 0, buf, count);
      SPY_REQUIRE_OK(spyrecclSend(buf, count, t.dtype, last, 5, ctx.comm), ctx.comm);
    } else if (ctx.rank == last) {
      poisonMessage(t, buf, count, ctx.seed, 0);
      SPY_REQUIRE_OK(spyrecclRecv(buf, count, t.dtype, 0, 5, ctx.comm), ctx.comm);
      checkMessage(t, buf, count, ctx.seed, 0, format("message of %zu float16", count));
    }
  }
  if (ctx.rank == last) {
    SPY_CHECK(cmaReads(ctx) >= 1, "the large messages should have gone single-copy: \"%s\"",
              cmaLine(ctx).c_str());
  }
}

// Default thresholds; rank 1 reports contended CPUs (SPYRECCL_CMA_CONTENDED=1), the others
// do not: a 768 KiB allgather (above the contended threshold, below the quiet one) goes
// single-copy on every rank, because every rank sees rank 1's vote. Without the vote it is
// staged.
void contendedVoteBody(RankContext& ctx) {
  const unsigned long long before = cmaReads(ctx);
  checkedAllGather(ctx, (768u << 10) / 4 / ctx.nranks + 1);
  SPY_CHECK(cmaReads(ctx) > before, "rank 1's contention vote should have chosen CMA: \"%s\"",
            cmaLine(ctx).c_str());
}

void quietBody(RankContext& ctx) {
  checkedAllGather(ctx, (768u << 10) / 4 / ctx.nranks + 1);
  SPY_CHECK(cmaReads(ctx) == 0, "no rank is contended: expected staging, \"%s\"",
            cmaLine(ctx).c_str());
}

// The running-estimate votes (algorithms/path_advisor.h), forced per rank through
// SPYRECCL_CMA_ADAPTIVE ("cma": this rank's estimate says single copy is faster, "staged":
// the staged path is): a 768 KiB allgather (between the thresholds) goes single-copy on
// every rank as soon as one rank votes for it (contendedVoteBody), and is staged when none
// does (quietBody), whatever the other ranks' estimates; results are exact either way.

// A broadcast of `count` int32 at a non-aligned offset of ordinary buffers, checked element
// by element on every rank.
void checkedBroadcast(RankContext& ctx, size_t count, int root) {
  const TypeInfo& t = typeInfo(spyrecclInt32);
  std::vector<char> buf(count * t.size + 5);
  void* data = buf.data() + 5;
  if (ctx.rank == root) {
    fillAnyBits(t, ctx.seed, root, data, count);
  } else {
    std::memset(data, 0xA5, count * t.size);
  }
  SPY_REQUIRE_OK(spyrecclBroadcast(data, data, count, t.dtype, root, ctx.comm), ctx.comm);
  OutputChecker check(t, format("broadcast of %zu int32 from rank %d", count, root));
  for (size_t i = 0; i < count; ++i) check.expectBits(data, i, anyBits(t, ctx.seed, root, i));
  check.report(__FILE__, __LINE__);
}

// A message of `count` float16 from rank `from` to rank `to`, checked element by element;
// on the receiver, whether it went single-copy must be `single`.
void checkedMessage(RankContext& ctx, size_t count, int from, int to, bool single) {
  const TypeInfo& t = typeInfo(spyrecclFloat16);
  std::vector<uint8_t> buf(count * t.size);
  const unsigned long long start = cmaReads(ctx);
  if (ctx.rank == from) {
    fillAnyBits(t, ctx.seed, from, buf.data(), count);
    SPY_REQUIRE_OK(spyrecclSend(buf.data(), count, t.dtype, to, 13, ctx.comm), ctx.comm);
  } else if (ctx.rank == to) {
    poisonMessage(t, buf.data(), count, ctx.seed, from);
    SPY_REQUIRE_OK(spyrecclRecv(buf.data(), count, t.dtype, from, 13, ctx.comm), ctx.comm);
    checkMessage(t, buf.data(), count, ctx.seed, from,
                 format("message of %zu float16 from rank %d", count, from));
    SPY_CHECK((cmaReads(ctx) > start) == single,
              "message of %zu B from rank %d: expected it %s, \"%s\"", count * t.size, from,
              single ? "single-copy" : "staged", cmaLine(ctx).c_str());
  }
}

// Only rank 1's estimate prefers the single copy: a broadcast from rank 0 goes single-copy
// on every rank (every non-root reads the root with process_vm_readv), and a message that
// rank 0 sends (its own estimate prefers staging) is staged, while one rank 1 sends goes
// single-copy: the sender alone chooses for point-to-point.
void adaptiveMixedBody(RankContext& ctx) {
  const int last = 1;
  const unsigned long long before = cmaReads(ctx);
  checkedBroadcast(ctx, (768u << 10) / 4 + 1, 0);
  if (ctx.rank != 0) {
    SPY_CHECK(cmaReads(ctx) > before, "rank 1's vote should have chosen CMA: \"%s\"",
              cmaLine(ctx).c_str());
  }
  const size_t count = (1u << 20) / 2 + 7;  // float16, above two p2p chunks
  for (int from : {0, last}) {
    // Single-copy only when its sender (rank 1) votes so.
    checkedMessage(ctx, count, from, from == 0 ? last : 0, from == last);
  }
}

// Messages of up to two p2p chunks (32 KiB with the tests' 16 KiB chunks) go single-copy
// only to a receiver already blocked waiting for them, and only when the sender's estimate
// prefers it (rank 1's does, rank 0's does not). A send to a receiver that is not waiting
// stays staged and returns without it.
void adaptiveSmallBody(RankContext& ctx) {
  if (ctx.rank > 1) return;
  const TypeInfo& t = typeInfo(spyrecclFloat16);
  const size_t count = (32u << 10) / t.size;
  std::vector<uint8_t> buf(count * t.size);
  struct Case {
    int from;
    bool receiverWaits;
    bool single;
  };
  for (const Case& k : {Case{1, true, true}, Case{0, true, false}, Case{1, false, false}}) {
    const int to = 1 - k.from;
    const unsigned long long start = cmaReads(ctx);
    if (ctx.rank == k.from) {
      fillAnyBits(t, ctx.seed, k.from, buf.data(), count);
      if (k.receiverWaits) sleepMs(200);  // the receiver is blocked in its recv by then
      const int64_t t0 = monotonicNs();
      SPY_REQUIRE_OK(spyrecclSend(buf.data(), count, t.dtype, to, 11, ctx.comm), ctx.comm);
      if (!k.receiverWaits) {
        SPY_CHECK(monotonicNs() - t0 < 150 * 1000 * 1000,
                  "a send of two chunks must not wait for its receiver");
      }
    } else {
      poisonMessage(t, buf.data(), count, ctx.seed, k.from);
      if (!k.receiverWaits) sleepMs(300);  // the sender has returned by then
      SPY_REQUIRE_OK(spyrecclRecv(buf.data(), count, t.dtype, k.from, 11, ctx.comm), ctx.comm);
      checkMessage(t, buf.data(), count, ctx.seed, k.from,
                   format("message of %zu float16 from rank %d", count, k.from));
      const bool single = cmaReads(ctx) > start;
      SPY_CHECK(single == k.single, "message from rank %d (receiver %s): expected it %s, \"%s\"",
                k.from, k.receiverWaits ? "waiting" : "not waiting",
                k.single ? "single-copy" : "staged", cmaLine(ctx).c_str());
    }
  }
}

// A receiver dies while blocked waiting for a small message (its mailbox still says it
// waits): the sender, whose estimate prefers the single copy, posts it single-copy and must
// then report the receiver's death within the usual bound instead of waiting forever.
void killedWaitingReceiverBody(RankContext& ctx) {
  const TypeInfo& t = typeInfo(spyrecclFloat16);
  const size_t count = (32u << 10) / t.size;
  std::vector<uint8_t> buf(count * t.size);
  const int victim = 1;
  if (ctx.rank == victim) {
    std::thread killer([] {
      sleepMs(100);
      ::raise(SIGKILL);
    });
    spyrecclRecv(buf.data(), count, t.dtype, 0, 3, ctx.comm);  // never returns
    killer.join();
    return;
  }
  if (ctx.rank != 0) return;
  fillAnyBits(t, ctx.seed, 0, buf.data(), count);
  sleepMs(400);  // the receiver is dead by now
  const int64_t start = monotonicNs();
  const spyrecclResult_t rc = spyrecclSend(buf.data(), count, t.dtype, victim, 3, ctx.comm);
  expectDeathReported(ctx, rc, victim, start);
}

// Every rank measures (SPYRECCL_CMA_ADAPTIVE=1): the first three broadcasts between the
// thresholds are staged (no estimate yet: staged first; a sample needs three calls on a
// path), the next three single-copy, then the faster by the estimates; every result is
// exact whichever path it took.
void adaptiveAutoBody(RankContext& ctx) {
  const unsigned long long before = cmaReads(ctx);
  constexpr int kCalls = 8;
  for (int i = 0; i < kCalls; ++i) checkedBroadcast(ctx, (768u << 10) / 4 + 3, 0);
  if (ctx.rank != 0) {
    const unsigned long long reads = cmaReads(ctx) - before;
    SPY_CHECK(reads >= 1 && reads < unsigned(kCalls),
              "expected both paths to be measured (single-copy reads in %d broadcasts: %llu): "
              "\"%s\"",
              kCalls, reads, cmaLine(ctx).c_str());
  }
}

// Sizes above the quiet thresholds of cmaThreshold (collectives 32 MiB, send/recv 16 MiB),
// where the single copy used to be fixed: they are voted like smaller ones.
constexpr size_t kLargeBroadcastInts = (33u << 20) / 4 + 3;
constexpr size_t kLargeMessageHalves = (17u << 20) / 2 + 5;

// Every rank's estimate prefers staging: the large broadcast and messages are staged.
void largeStagedBody(RankContext& ctx) {
  const unsigned long long before = cmaReads(ctx);
  checkedBroadcast(ctx, kLargeBroadcastInts, 0);
  SPY_CHECK(cmaReads(ctx) == before, "every rank votes staged: expected no single copy, \"%s\"",
            cmaLine(ctx).c_str());
  checkedMessage(ctx, kLargeMessageHalves, 0, ctx.nranks - 1, false);
}

// Rank 1's advisor is off (SPYRECCL_CMA_ADAPTIVE=0: its vote is the quiet threshold), the
// others' estimates prefer staging: the large broadcast goes single-copy on every rank (the
// ranks agree whatever their modes), a large message from rank 1 single-copy, one from rank
// 0 staged.
void largeOffVoteBody(RankContext& ctx) {
  const unsigned long long before = cmaReads(ctx);
  checkedBroadcast(ctx, kLargeBroadcastInts, 0);
  if (ctx.rank != 0) {
    SPY_CHECK(cmaReads(ctx) > before, "rank 1 votes single copy: \"%s\"", cmaLine(ctx).c_str());
  }
  checkedMessage(ctx, kLargeMessageHalves, 1, 0, true);
  checkedMessage(ctx, kLargeMessageHalves, 0, 1, false);
}

// An allreduce (sum) of `count` float32 one element into ordinary buffers (aligned for the
// element type, as C++ requires of a float*, but not to a cache line), checked element by
// element against the float64 reference of every rank's inputs.
void checkedAllReduce(RankContext& ctx, size_t count) {
  const TypeInfo& t = typeInfo(spyrecclFloat32);
  std::vector<float> in(count + 1), out(count + 1);
  void* send = in.data() + 1;
  void* recv = out.data() + 1;
  fillInput(t, Red::Sum, ctx.seed, ctx.rank, send, count);
  for (size_t i = 0; i < count; ++i) storeBits(t, recv, i, nanBits(t));
  SPY_REQUIRE_OK(spyrecclAllReduce(send, recv, count, t.dtype, spyrecclSum, ctx.comm), ctx.comm);
  std::vector<uint64_t> values(ctx.nranks);
  std::string bad;
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    for (int q = 0; q < ctx.nranks; ++q) values[q] = inputBits(t, Red::Sum, ctx.seed, q, i);
    const std::string why = checkElement(
        t, loadBits(t, recv, i), reduceReference(t, Red::Sum, values.data(), ctx.nranks, 0));
    if (!why.empty() && wrong++ == 0) bad = format("element %zu: %s", i, why.c_str());
  }
  SPY_CHECK(wrong == 0, "allreduce of %zu float32: %zu wrong elements, first %s", count, wrong,
            bad.c_str());
}

// From 2 MiB the allreduce is voted like the other collectives (contended CPUs, or the
// faster path by the estimates): with rank 1's estimate forced to the single copy it reads
// its peers with process_vm_readv (`single`), with every rank's forced to staging it does
// not; below 2 MiB it is always staged. Exact either way.
void allReduceVoteBody(RankContext& ctx, bool single) {
  const unsigned long long before = cmaReads(ctx);
  checkedAllReduce(ctx, (1u << 20) / 4 + 7);
  SPY_CHECK(cmaReads(ctx) == before, "1 MiB allreduce: below the window, expected staging: \"%s\"",
            cmaLine(ctx).c_str());
  checkedAllReduce(ctx, (2u << 20) / 4 + 5);
  SPY_CHECK((cmaReads(ctx) > before) == single, "2 MiB allreduce: expected it %s: \"%s\"",
            single ? "single-copy" : "staged", cmaLine(ctx).c_str());
}

// Arena buffers below the arena threshold (256 KiB), where the peers' arenas are not mapped,
// while rank 0 votes for single copies: they are read with process_vm_readv like any memory.
void arenaBelowThresholdBody(RankContext& ctx) {
  bufferMemory() = Memory::kArena;
  const TypeInfo& t = typeInfo(spyrecclInt32);
  const size_t count = (64u << 10) / t.size + 5;  // n * count below 256 KiB at 2 and 3 ranks
  Buffer in(t, count), out(t, count * ctx.nranks);
  fillAnyBits(t, ctx.seed, ctx.rank, in.data(), count);
  std::memset(out.data(), 0xA5, out.size());
  SPY_REQUIRE_OK(spyrecclAllGather(in.data(), out.data(), count, t.dtype, ctx.comm), ctx.comm);
  OutputChecker check(t, "allgather of arena buffers below the arena threshold");
  for (int q = 0; q < ctx.nranks; ++q) {
    for (size_t i = 0; i < count; ++i) {
      check.expectBits(out.data(), q * count + i, anyBits(t, ctx.seed, q, i));
    }
  }
  check.report(__FILE__, __LINE__);
  SPY_CHECK(cmaReads(ctx) > 0, "expected single-copy reads: \"%s\"", cmaLine(ctx).c_str());
  bufferMemory() = Memory::kHost;
}

void registerCma(const char* name, void (*body)(RankContext&), std::vector<int> worldSizes,
                 std::set<int> mayDie = {}, void (*beforeInit)(int rank) = nullptr,
                 bool defaultThresholds = false) {
  for (int ws : worldSizes) {
    const std::string testName = format("cma.%s/ws%d", name, ws);
    registerTest(testName, [=] {
      RunOptions opts;
      opts.nranks = ws;
      opts.label = testName;
      opts.mayDie = mayDie;
      opts.deadlineMs = 120000;
      opts.initComm = beforeInit == nullptr;
      if (!defaultThresholds) ::setenv("SPYRECCL_CMA_MIN_BYTES", "1", 1);
      runRanks(opts, [=](RankContext& ctx) {
        if (beforeInit == nullptr) {
          body(ctx);
          return;
        }
        beforeInit(ctx.rank);
        SPY_REQUIRE_OK(spyrecclCommInitRank(&ctx.comm, ctx.nranks, ctx.id, ctx.rank, &ctx.config),
                       nullptr);
        body(ctx);
        SPY_CHECK_OK(spyrecclCommDestroy(ctx.comm), nullptr);
        ctx.comm = nullptr;
      });
      ::unsetenv("SPYRECCL_CMA_MIN_BYTES");
    });
  }
}

[[maybe_unused]] const bool registered = [] {
  registerCma("probe_on", probeOnBody, {2, 3});
  registerCma("env_off_one_rank", envOffBody, {2, 3}, {}, [](int rank) {
    if (rank == 1) ::setenv("SPYRECCL_CMA", "0", 1);
  });
  registerCma("seccomp_denied", deniedBody, {2, 3}, {}, [](int rank) {
    if (rank == 1) denyProcessVmReadv();
  });
  registerCma("send_recv", sendRecvBody, {2, 3});
  registerCma("killed_root", killedRootBody, {2, 3}, {0});
  registerCma("killed_sender", killedSenderBody, {2, 3}, {0});
  registerCma(
      "contended_vote", contendedVoteBody, {2, 3}, {},
      [](int rank) { ::setenv("SPYRECCL_CMA_CONTENDED", rank == 1 ? "1" : "0", 1); }, true);
  registerCma(
      "arena_below_threshold", arenaBelowThresholdBody, {2, 3}, {},
      [](int rank) { ::setenv("SPYRECCL_CMA_CONTENDED", rank == 0 ? "1" : "0", 1); }, true);
  // The load vote alone (the measured one off: it may pick either path).
  registerCma(
      "quiet", quietBody, {2, 3}, {},
      [](int) {
        ::setenv("SPYRECCL_CMA_CONTENDED", "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", "0", 1);
      },
      true);
  registerCma(
      "adaptive_vote", contendedVoteBody, {2, 3}, {},
      [](int rank) {
        ::setenv("SPYRECCL_CMA_CONTENDED", "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", rank == 1 ? "cma" : "staged", 1);
      },
      true);
  registerCma(
      "adaptive_staged", quietBody, {2, 3}, {},
      [](int) {
        ::setenv("SPYRECCL_CMA_CONTENDED", "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", "staged", 1);
      },
      true);
  registerCma(
      "adaptive_off", quietBody, {2}, {},
      [](int) {
        ::setenv("SPYRECCL_CMA_CONTENDED", "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", "0", 1);
      },
      true);
  registerCma(
      "adaptive_mixed", adaptiveMixedBody, {2, 3}, {},
      [](int rank) {
        ::setenv("SPYRECCL_CMA_CONTENDED", "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", rank == 1 ? "cma" : "staged", 1);
      },
      true);
  registerCma(
      "adaptive_small_p2p", adaptiveSmallBody, {2, 3}, {},
      [](int rank) {
        ::setenv("SPYRECCL_CMA_CONTENDED", "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", rank == 1 ? "cma" : "staged", 1);
      },
      true);
  registerCma(
      "adaptive_killed_waiting_receiver", killedWaitingReceiverBody, {2, 3}, {1},
      [](int rank) {
        ::setenv("SPYRECCL_CMA_CONTENDED", "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", rank == 0 ? "cma" : "staged", 1);
      },
      true);
  registerCma(
      "adaptive_large_staged", largeStagedBody, {2, 3}, {},
      [](int) {
        ::setenv("SPYRECCL_CMA_CONTENDED", "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", "staged", 1);
      },
      true);
  registerCma(
      "adaptive_large_off_vote", largeOffVoteBody, {2, 3}, {},
      [](int rank) {
        ::setenv("SPYRECCL_CMA_CONTENDED", "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", rank == 1 ? "0" : "staged", 1);
      },
      true);
  registerCma(
      "adaptive_allreduce_vote", [](RankContext& ctx) { allReduceVoteBody(ctx, true); }, {2, 3}, {},
      [](int rank) {
        ::setenv("SPYRECCL_CMA_CONTENDED", "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", rank == 1 ? "cma" : "staged", 1);
      },
      true);
  registerCma(
      "adaptive_allreduce_staged", [](RankContext& ctx) { allReduceVoteBody(ctx, false); }, {2, 3},
      {},
      [](int) {
        ::setenv("SPYRECCL_CMA_CONTENDED", "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", "staged", 1);
      },
      true);
  registerCma(
      "contended_allreduce", [](RankContext& ctx) { allReduceVoteBody(ctx, true); }, {2, 3}, {},
      [](int rank) {
        ::setenv("SPYRECCL_CMA_CONTENDED", rank == 0 ? "1" : "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", "staged", 1);
      },
      true);
  registerCma(
      "adaptive_auto", adaptiveAutoBody, {2, 3}, {},
      [](int) {
        ::setenv("SPYRECCL_CMA_CONTENDED", "0", 1);
        ::setenv("SPYRECCL_CMA_ADAPTIVE", "1", 1);
      },
      true);
  return true;
}();

}  // namespace
