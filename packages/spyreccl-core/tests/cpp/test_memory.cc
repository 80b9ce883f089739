// spyrecclMemAlloc / spyrecclMemFree and the memory arena behind them (src/memory), plus
// the failure behaviour of direct transfers between arena buffers. The numerical checks
// of every collective on arena buffers are the "/arena" and "/mixed" variants in
// test_collectives.cc.
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "data.h"
#include "multiproc.h"

namespace {

using namespace spyreccl_test;

// One process, no communicator: the allocator needs none.
RunOptions single() {
  RunOptions opts;
  opts.nranks = 1;
  opts.initComm = false;
  return opts;
}

const TypeInfo& float32() {
  for (const TypeInfo& t : allTypes()) {
    if (t.dtype == spyrecclFloat32) return t;
  }
  std::abort();
}

// Fills `n` bytes at p with a pattern derived from `seed`.
void fill(void* p, size_t n, uint8_t seed) {
  auto* b = static_cast<uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + i * 31);
}
bool holds(const void* p, size_t n, uint8_t seed) {
  const auto* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) {
    if (b[i] != static_cast<uint8_t>(seed + i * 31)) return false;
  }
  return true;
}

// Blocks are page aligned, disjoint, keep their contents, and freed space is reused.
SPY_TEST(memory_alloc_free) {
  runRanks(single(), [](RankContext&) {
    const size_t sizes[] = {0, 1, 4095, 4096, 4097, 65536, 3 << 20, 12345};
    std::vector<void*> blocks;
    for (size_t i = 0; i < std::size(sizes); ++i) {
      void* p = nullptr;
      if (!SPY_CHECK_OK(spyrecclMemAlloc(&p, sizes[i]), nullptr)) return;
      SPY_CHECK(reinterpret_cast<uintptr_t>(p) % 4096 == 0, "block %p is not page aligned", p);
      fill(p, std::max<size_t>(sizes[i], 1), static_cast<uint8_t>(i));
      blocks.push_back(p);
    }
    for (size_t i = 0; i < blocks.size(); ++i) {
      SPY_CHECK(holds(blocks[i], std::max<size_t>(sizes[i], 1), static_cast<uint8_t>(i)),
                "block %zu (%zu bytes) lost its contents: blocks overlap", i, sizes[i]);
    }
    // Free every other block, then the rest: neighbours coalesce, so a block as large as
    // all of them together fits where they were.
    for (size_t i = 0; i < blocks.size(); i += 2) SPY_CHECK_OK(spyrecclMemFree(blocks[i]), nullptr);
    for (size_t i = 1; i < blocks.size(); i += 2) SPY_CHECK_OK(spyrecclMemFree(blocks[i]), nullptr);
    void* big = nullptr;
    SPY_CHECK_OK(spyrecclMemAlloc(&big, 64 << 20), nullptr);
    fill(big, 64 << 20, 7);
    SPY_CHECK(holds(big, 64 << 20, 7), "a 64 MiB block does not keep its contents");
    SPY_CHECK_OK(spyrecclMemFree(big), nullptr);
    SPY_CHECK_OK(spyrecclMemFree(nullptr), nullptr);
  });
}

// Pages of [p, p + n) resident in this process's memory (mincore), or SIZE_MAX on error.
size_t residentPages(const void* p, size_t n) {
  const size_t page = 4096;
  std::vector<unsigned char> flags((n + page - 1) / page);
  if (::mincore(const_cast<void*>(p), n, flags.data()) != 0) return SIZE_MAX;
  return static_cast<size_t>(
      std::count_if(flags.begin(), flags.end(), [](unsigned char f) { return (f & 1) != 0; }));
}

// A freed 64 MiB block keeps its pages (within the default budget of freed memory), so the
// next block placed there costs no page faults; spyrecclMemTrim gives them back.
SPY_TEST(memory_retain_and_trim) {
  runRanks(single(), [](RankContext&) {
    const size_t big = size_t{64} << 20;
    void* p = nullptr;
    if (!SPY_CHECK_OK(spyrecclMemAlloc(&p, big), nullptr)) return;
    fill(p, big, 7);
    SPY_CHECK_OK(spyrecclMemFree(p), nullptr);
    size_t resident = residentPages(p, big);
    SPY_CHECK(resident == big / 4096, "a freed 64 MiB block kept %zu of %zu pages", resident,
              big / 4096);
    size_t released = 0;
    SPY_CHECK_OK(spyrecclMemTrim(&released), nullptr);
    SPY_CHECK(released >= big, "spyrecclMemTrim released %zu bytes, expected >= %zu", released,
              big);
    resident = residentPages(p, big);
    SPY_CHECK(resident == 0, "%zu pages still resident after spyrecclMemTrim", resident);
    SPY_CHECK_OK(spyrecclMemTrim(nullptr), nullptr);  // nothing left; NULL allowed
    void* q = nullptr;                                // the arena still works after a trim
    if (!SPY_CHECK_OK(spyrecclMemAlloc(&q, big), nullptr)) return;
    fill(q, big, 9);
    SPY_CHECK(holds(q, big, 9), "a block allocated after spyrecclMemTrim lost data");
    SPY_CHECK_OK(spyrecclMemFree(q), nullptr);
  });
}

// Beyond SPYRECCL_ARENA_RETAIN_BYTES of freed memory, freed pages go back at once.
SPY_TEST(memory_retain_budget) {
  runRanks(single(), [](RankContext&) {
    ::setenv("SPYRECCL_ARENA_RETAIN_BYTES", "1M", 1);  // read when the arena is created
    const size_t small = 512 << 10;
    const size_t big = size_t{4} << 20;
    void* a = nullptr;
    void* b = nullptr;
    if (!SPY_CHECK_OK(spyrecclMemAlloc(&a, small), nullptr)) return;
    if (!SPY_CHECK_OK(spyrecclMemAlloc(&b, big), nullptr)) return;
    fill(a, small, 1);
    fill(b, big, 2);
    SPY_CHECK_OK(spyrecclMemFree(a), nullptr);
    SPY_CHECK_OK(spyrecclMemFree(b), nullptr);
    SPY_CHECK(residentPages(a, small) == small / 4096,
              "a freed block within the budget lost pages");
    size_t resident = residentPages(b, big);
    SPY_CHECK(resident == 0, "a freed block beyond the 1 MiB budget kept %zu pages", resident);
  });
}

// Bad arguments get spyrecclInvalidArgument and a message naming the argument.
SPY_TEST(memory_bad_arguments) {
  runRanks(single(), [](RankContext&) {
    SPY_CHECK_RC(spyrecclMemAlloc(nullptr, 16), spyrecclInvalidArgument, nullptr);
    SPY_CHECK(contains(spyrecclGetLastError(nullptr), "'ptr'"), "message: %s",
              spyrecclGetLastError(nullptr));
    int local = 0;
    SPY_CHECK_RC(spyrecclMemFree(&local), spyrecclInvalidArgument, nullptr);
    SPY_CHECK(contains(spyrecclGetLastError(nullptr), "spyrecclMemAlloc"), "message: %s",
              spyrecclGetLastError(nullptr));
    void* p = nullptr;
    if (!SPY_CHECK_OK(spyrecclMemAlloc(&p, 100), nullptr)) return;
    SPY_CHECK_RC(spyrecclMemFree(static_cast<char*>(p) + 64), spyrecclInvalidArgument, nullptr);
    SPY_CHECK_OK(spyrecclMemFree(p), nullptr);
    SPY_CHECK_RC(spyrecclMemFree(p), spyrecclInvalidArgument, nullptr);  // double free
    SPY_CHECK(contains(spyrecclGetLastError(nullptr), "freed already"), "message: %s",
              spyrecclGetLastError(nullptr));
  });
}

// After fork() the child sees its parent's data at the same addresses, but privately:
// neither process's writes reach the other, both keep allocating, and the child freeing
// an inherited block leaves the parent's memory alone.
SPY_TEST(memory_fork_private) {
  runRanks(single(), [](RankContext&) {
    const size_t n = 1 << 20;
    void* p = nullptr;
    if (!SPY_CHECK_OK(spyrecclMemAlloc(&p, n), nullptr)) return;
    fill(p, n, 1);
    // Large enough that freeing it gives its pages back to the system — which the child,
    // whose arena maps the parent's file privately, must never do to the parent.
    const size_t big = 32 << 20;
    void* shared = nullptr;
    if (!SPY_CHECK_OK(spyrecclMemAlloc(&shared, big), nullptr)) return;
    fill(shared, big, 5);
    pid_t child = ::fork();
    if (child == 0) {
      int bad = holds(p, n, 1) ? 0 : 1;
      if (spyrecclMemFree(shared) != spyrecclSuccess) bad |= 8;
      fill(p, n, 2);  // must not reach the parent
      void* q = nullptr;
      if (spyrecclMemAlloc(&q, n) != spyrecclSuccess) bad |= 2;
      if (q != nullptr) fill(q, n, 3);
      ::usleep(200 * 1000);  // the parent writes meanwhile
      if (!holds(p, n, 2)) bad |= 4;
      ::_exit(bad);
    }
    ::usleep(50 * 1000);
    SPY_CHECK(holds(p, n, 1), "the forked child's writes reached the parent's block");
    fill(p, n, 4);  // must not reach the child
    int status = 0;
    ::waitpid(child, &status, 0);
    SPY_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "child: status 0x%x (1: did not inherit the data, 2: cannot allocate, 4: saw the "
              "parent's writes, 8: cannot free an inherited block)",
              status);
    SPY_CHECK(holds(shared, big, 5), "the child's free of an inherited block cleared the parent's");
    SPY_CHECK_OK(spyrecclMemFree(shared), nullptr);
    SPY_CHECK_OK(spyrecclMemFree(p), nullptr);
  });
}

// A rank SIGKILLed while its peers run a direct (arena) allreduce: the survivors get
// spyrecclRemoteError naming it within 2 s, as on the staged path.
void killedDuringDirect(RankContext& ctx) {
  const size_t count = 1 << 20;  // 4 MiB: above the direct threshold
  Buffer buf(float32(), count);
  std::memset(buf.data(), 0, count * 4);
  auto* x = static_cast<float*>(buf.data());
  // A first direct allreduce that succeeds (maps the arenas), then the victim dies.
  if (!SPY_CHECK_OK(spyrecclAllReduce(x, x, count, spyrecclFloat32, spyrecclSum, ctx.comm),
                    ctx.comm)) {
    return;
  }
  const int victim = ctx.nranks - 1;
  if (ctx.rank == victim) {
    sleepMs(100);
    ::raise(SIGKILL);
  }
  const int64_t start = monotonicNs();
  expectDeathReported(ctx, spyrecclAllReduce(x, x, count, spyrecclFloat32, spyrecclSum, ctx.comm),
                      victim, start);
}

[[maybe_unused]] const bool registered = [] {
  for (int ws : {2, 3}) {
    const std::string name = format("memory.killed_rank_direct/ws%d", ws);
    registerTest(name, [=] {
      RunOptions opts;
      opts.nranks = ws;
      opts.label = name;
      opts.mayDie = {ws - 1};
      runRanks(opts, [](RankContext& ctx) {
        bufferMemory() = Memory::kArena;
        killedDuringDirect(ctx);
      });
    });
  }
  return true;
}();

}  // namespace
