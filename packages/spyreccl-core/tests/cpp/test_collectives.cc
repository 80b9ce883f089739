// Collectives × data types × reduce ops × sizes × world sizes, against references that
// every rank computes itself (see data.h).
//
// One registered test per (collective, data type, world size) runs one set of forked
// ranks and loops over its cases inside them, so that the matrix costs a few hundred
// forks rather than thousands. Test names are "coll.<collective>/<dtype>/ws<N>".
//
// Sizes are 0, 1, 7, 1023 and "large": more than three staging chunks (the tests use
// 16 KiB chunks), which exercises the pipelined paths (0 and 7 at world size 3 only). Large cases
// run for a subset of the reduce ops (sum and max, plus avg/premul_sum for float32) to keep the
// suite fast.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "data.h"
#include "multiproc.h"

namespace {

using namespace spyreccl_test;

constexpr int kWorldSizes[] = {2, 3, 4};

size_t largeCount(const TypeInfo& t) { return 3 * 16 * 1024 / t.size + 13; }

// World size 3 (odd, the most likely to expose uneven splits) runs every size; 2 and 4 skip
// the sizes 0 and 7, which exercise the same paths there, to keep the suite fast.
std::vector<size_t> sizesFor(const TypeInfo& t, int nranks) {
  if (nranks == 3) return {0, 1, 7, 1023, largeCount(t)};
  return {1, 1023, largeCount(t)};
}

bool runsLarge(const TypeInfo& t, Red red) {
  if (red == Red::Sum || red == Red::Max) return true;
  return t.dtype == spyrecclFloat32 && (red == Red::Avg || red == Red::PreMulSum);
}

// A reduce op for `red`: a built-in value or a PreMulSum handle, destroyed at scope exit.
class ScopedOp {
 public:
  ScopedOp(RankContext& ctx, const TypeInfo& t, Red red, double scalar) : comm_(ctx.comm) {
    if (red == Red::PreMulSum) {
      SPY_REQUIRE_OK(spyrecclRedOpCreatePreMulSum(&op_, scalar, t.dtype, comm_), comm_);
      created_ = true;
    } else {
      op_ = builtinOp(red);
    }
  }
  ~ScopedOp() {
    if (created_) SPY_CHECK_OK(spyrecclRedOpDestroy(op_, comm_), comm_);
  }
  spyrecclRedOp_t get() const { return op_; }

 private:
  spyrecclComm_t comm_;
  spyrecclRedOp_t op_ = spyrecclSum;
  bool created_ = false;
};

// Expected value of reducing element `index` of every rank's input.
Expected expectedReduction(const TypeInfo& t, Red red, uint64_t seed, int nranks, uint64_t index,
                           double scalar) {
  uint64_t values[16];
  for (int r = 0; r < nranks; ++r) values[r] = inputBits(t, red, seed, r, index);
  return reduceReference(t, red, values, nranks, scalar);
}

// Poisons `count` output elements given their expected values.
void poison(const TypeInfo& t, void* buf, const std::vector<Expected>& ex) {
  for (size_t i = 0; i < ex.size(); ++i) storeBits(t, buf, i, poisonBits(t, ex[i].bits));
}

// The input must be left alone by an out-of-place collective.
void checkInputIntact(const TypeInfo& t, Red red, uint64_t seed, int rank, const void* buf,
                      size_t count, const std::string& what) {
  OutputChecker check(t, what + ": input buffer modified");
  for (size_t i = 0; i < count; ++i) check.expectBits(buf, i, inputBits(t, red, seed, rank, i));
  check.report(__FILE__, __LINE__);
}

// Iterates the reduction cases of one (data type, world size); calls fn(red, count,
// inPlace, root, caseSeed, description).
template <class Fn>
void forEachReductionCase(const TypeInfo& t, const RankContext& ctx, const char* coll, Fn fn) {
  uint64_t caseNo = 0;
  for (Red red : validReds(t)) {
    for (size_t count : sizesFor(t, ctx.nranks)) {
      if (count == largeCount(t) && !runsLarge(t, red)) continue;
      for (bool inPlace : {false, true}) {
        ++caseNo;
        const int root = int(caseNo % uint64_t(ctx.nranks));
        const uint64_t seed = mix(ctx.seed, caseNo);
        fn(red, count, inPlace, root, seed,
           format("%s %s %s count=%zu %s root=%d", coll, t.name, redName(red), count,
                  inPlace ? "in-place" : "out-of-place", root));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// allreduce / reduce / reduce_scatter
// ---------------------------------------------------------------------------------------

void allReduceBody(const TypeInfo& t, RankContext& ctx) {
  forEachReductionCase(
      t, ctx, "allreduce",
      [&](Red red, size_t count, bool inPlace, int, uint64_t seed, const std::string& what) {
        const double scalar = premulScalar(seed);
        std::vector<Expected> ex(count);
        for (size_t i = 0; i < count; ++i) {
          ex[i] = expectedReduction(t, red, seed, ctx.nranks, i, scalar);
        }
        Buffer send(t, count), recvStorage(t, count);
        fillInput(t, red, seed, ctx.rank, send.data(), count);
        void* recv = inPlace ? send.data() : recvStorage.data();
        if (!inPlace) poison(t, recv, ex);

        ScopedOp op(ctx, t, red, scalar);
        SPY_REQUIRE_OK(spyrecclAllReduce(send.data(), recv, count, t.dtype, op.get(), ctx.comm),
                       ctx.comm);
        OutputChecker check(t, what);
        for (size_t i = 0; i < count; ++i) check.expect(recv, i, ex[i]);
        check.report(__FILE__, __LINE__);
        if (!inPlace) checkInputIntact(t, red, seed, ctx.rank, send.data(), count, what);
      });
}

void reduceBody(const TypeInfo& t, RankContext& ctx) {
  forEachReductionCase(
      t, ctx, "reduce",
      [&](Red red, size_t count, bool inPlace, int root, uint64_t seed, const std::string& what) {
        const double scalar = premulScalar(seed);
        const bool isRoot = ctx.rank == root;
        std::vector<Expected> ex(isRoot ? count : 0);
        for (size_t i = 0; i < ex.size(); ++i) {
          ex[i] = expectedReduction(t, red, seed, ctx.nranks, i, scalar);
        }
        Buffer send(t, count), recvStorage(t, count);
        fillInput(t, red, seed, ctx.rank, send.data(), count);
        void* recv = nullptr;  // ignored on non-root ranks
        if (isRoot) {
          recv = inPlace ? send.data() : recvStorage.data();
          if (!inPlace) poison(t, recv, ex);
        } else if (inPlace) {
          recv = send.data();  // allowed, and must not be written by a non-root rank
        }

        ScopedOp op(ctx, t, red, scalar);
        SPY_REQUIRE_OK(spyrecclReduce(send.data(), recv, count, t.dtype, op.get(), root, ctx.comm),
                       ctx.comm);
        if (isRoot) {
          OutputChecker check(t, what);
          for (size_t i = 0; i < count; ++i) check.expect(recv, i, ex[i]);
          check.report(__FILE__, __LINE__);
        }
        if (!isRoot || !inPlace) checkInputIntact(t, red, seed, ctx.rank, send.data(), count, what);
      });
}

void reduceScatterBody(const TypeInfo& t, RankContext& ctx) {
  forEachReductionCase(
      t, ctx, "reduce_scatter",
      [&](Red red, size_t count, bool inPlace, int, uint64_t seed, const std::string& what) {
        const double scalar = premulScalar(seed);
        const size_t total = count * size_t(ctx.nranks);
        const size_t mine = count * size_t(ctx.rank);
        std::vector<Expected> ex(count);
        for (size_t i = 0; i < count; ++i) {
          ex[i] = expectedReduction(t, red, seed, ctx.nranks, mine + i, scalar);
        }
        Buffer send(t, total), recvStorage(t, count);
        fillInput(t, red, seed, ctx.rank, send.data(), total);
        void* recv = inPlace ? send.at(t, mine) : recvStorage.data();
        if (!inPlace) poison(t, recv, ex);

        ScopedOp op(ctx, t, red, scalar);
        SPY_REQUIRE_OK(spyrecclReduceScatter(send.data(), recv, count, t.dtype, op.get(), ctx.comm),
                       ctx.comm);
        OutputChecker check(t, what);
        for (size_t i = 0; i < count; ++i) check.expect(recv, i, ex[i]);
        check.report(__FILE__, __LINE__);
        if (!inPlace) checkInputIntact(t, red, seed, ctx.rank, send.data(), total, what);
      });
}

// ---------------------------------------------------------------------------------------
// Data movement: outputs must be bit-exact copies, so inputs are arbitrary bit patterns
// (NaNs and all) rather than values.
// ---------------------------------------------------------------------------------------

template <class Fn>
void forEachMovementCase(const TypeInfo& t, const RankContext& ctx, const char* coll,
                         bool hasInPlace, Fn fn) {
  uint64_t caseNo = 0;
  for (size_t count : sizesFor(t, ctx.nranks)) {
    for (bool inPlace : {false, true}) {
      if (inPlace && !hasInPlace) continue;
      ++caseNo;
      const int root = int((caseNo + uint64_t(count)) % uint64_t(ctx.nranks));
      fn(count, inPlace, root, mix(ctx.seed, caseNo),
         format("%s %s count=%zu %s root=%d", coll, t.name, count,
                inPlace ? "in-place" : "out-of-place", root));
    }
  }
}

void broadcastBody(const TypeInfo& t, RankContext& ctx) {
  forEachMovementCase(
      t, ctx, "broadcast", true,
      [&](size_t count, bool inPlace, int root, uint64_t seed, const std::string& what) {
        const bool isRoot = ctx.rank == root;
        Buffer send(t, count), recv(t, count);
        if (isRoot) fillAnyBits(t, seed, root, send.data(), count);
        void* out = inPlace && isRoot ? send.data() : recv.data();
        if (out == recv.data()) {
          for (size_t i = 0; i < count; ++i) {
            storeBits(t, out, i, ~anyBits(t, seed, root, i) & mask(t));
          }
        }
        // sendbuff is read on the root only: others pass NULL, or their output in place.
        const void* in = isRoot ? send.data() : (inPlace ? out : nullptr);
        SPY_REQUIRE_OK(spyrecclBroadcast(in, out, count, t.dtype, root, ctx.comm), ctx.comm);
        OutputChecker check(t, what);
        for (size_t i = 0; i < count; ++i) check.expectBits(out, i, anyBits(t, seed, root, i));
        check.report(__FILE__, __LINE__);
      });
}

void allGatherBody(const TypeInfo& t, RankContext& ctx) {
  forEachMovementCase(
      t, ctx, "allgather", true,
      [&](size_t count, bool inPlace, int, uint64_t seed, const std::string& what) {
        const size_t n = size_t(ctx.nranks);
        Buffer send(t, count), recv(t, n * count);
        for (size_t r = 0; r < n; ++r) {
          for (size_t i = 0; i < count; ++i) {
            storeBits(t, recv.data(), r * count + i, ~anyBits(t, seed, int(r), i) & mask(t));
          }
        }
        void* in = send.data();
        if (inPlace) in = recv.at(t, size_t(ctx.rank) * count);
        fillAnyBits(t, seed, ctx.rank, in, count);
        SPY_REQUIRE_OK(spyrecclAllGather(in, recv.data(), count, t.dtype, ctx.comm), ctx.comm);
        OutputChecker check(t, what);
        for (size_t r = 0; r < n; ++r) {
          for (size_t i = 0; i < count; ++i) {
            check.expectBits(recv.data(), r * count + i, anyBits(t, seed, int(r), i));
          }
        }
        check.report(__FILE__, __LINE__);
      });
}

void gatherBody(const TypeInfo& t, RankContext& ctx) {
  forEachMovementCase(
      t, ctx, "gather", true,
      [&](size_t count, bool inPlace, int root, uint64_t seed, const std::string& what) {
        const size_t n = size_t(ctx.nranks);
        const bool isRoot = ctx.rank == root;
        Buffer send(t, count), recv(t, n * count);
        void* in = send.data();
        void* out = nullptr;  // ignored on non-root ranks
        if (isRoot) {
          out = recv.data();
          for (size_t r = 0; r < n; ++r) {
            for (size_t i = 0; i < count; ++i) {
              storeBits(t, out, r * count + i, ~anyBits(t, seed, int(r), i) & mask(t));
            }
          }
          if (inPlace) in = recv.at(t, size_t(root) * count);
        }
        fillAnyBits(t, seed, ctx.rank, in, count);
        SPY_REQUIRE_OK(spyrecclGather(in, out, count, t.dtype, root, ctx.comm), ctx.comm);
        if (isRoot) {
          OutputChecker check(t, what);
          for (size_t r = 0; r < n; ++r) {
            for (size_t i = 0; i < count; ++i) {
              check.expectBits(out, r * count + i, anyBits(t, seed, int(r), i));
            }
          }
          check.report(__FILE__, __LINE__);
        }
      });
}

void scatterBody(const TypeInfo& t, RankContext& ctx) {
  forEachMovementCase(
      t, ctx, "scatter", true,
      [&](size_t count, bool inPlace, int root, uint64_t seed, const std::string& what) {
        const size_t n = size_t(ctx.nranks);
        const size_t mine = size_t(ctx.rank) * count;
        const bool isRoot = ctx.rank == root;
        Buffer send(t, n * count), recv(t, count);
        const void* in = nullptr;  // read on the root only
        void* out = recv.data();
        if (isRoot) {
          fillAnyBits(t, seed, root, send.data(), n * count);
          in = send.data();
          if (inPlace) out = send.at(t, mine);
        }
        if (out == recv.data()) {
          for (size_t i = 0; i < count; ++i) {
            storeBits(t, out, i, ~anyBits(t, seed, root, mine + i) & mask(t));
          }
        }
        SPY_REQUIRE_OK(spyrecclScatter(in, out, count, t.dtype, root, ctx.comm), ctx.comm);
        OutputChecker check(t, what);
        for (size_t i = 0; i < count; ++i)
          check.expectBits(out, i, anyBits(t, seed, root, mine + i));
        check.report(__FILE__, __LINE__);
      });
}

void allToAllBody(const TypeInfo& t, RankContext& ctx) {
  forEachMovementCase(
      t, ctx, "alltoall", false,
      [&](size_t count, bool, int, uint64_t seed, const std::string& what) {
        const size_t n = size_t(ctx.nranks);
        const size_t me = size_t(ctx.rank);
        Buffer send(t, n * count), recv(t, n * count);
        fillAnyBits(t, seed, ctx.rank, send.data(), n * count);
        // Block q of our output comes from block `me` of rank q's input.
        for (size_t q = 0; q < n; ++q) {
          for (size_t i = 0; i < count; ++i) {
            storeBits(t, recv.data(), q * count + i,
                      ~anyBits(t, seed, int(q), me * count + i) & mask(t));
          }
        }
        SPY_REQUIRE_OK(spyrecclAllToAll(send.data(), recv.data(), count, t.dtype, ctx.comm),
                       ctx.comm);
        OutputChecker check(t, what);
        for (size_t q = 0; q < n; ++q) {
          for (size_t i = 0; i < count; ++i) {
            check.expectBits(recv.data(), q * count + i, anyBits(t, seed, int(q), me * count + i));
          }
        }
        check.report(__FILE__, __LINE__);
      });
}

// alltoallv: rank s sends cnt(s, d) elements to rank d, with `base` bounding the counts
// (some are zero). Blocks are laid out with gaps in both buffers, and the gaps of the
// output must stay untouched.
void allToAllvBody(const TypeInfo& t, RankContext& ctx) {
  forEachMovementCase(
      t, ctx, "alltoallv", false,
      [&](size_t base, bool, int, uint64_t seed, const std::string& what) {
        const int n = ctx.nranks;
        const int me = ctx.rank;
        auto cnt = [&](int s, int d) -> size_t {
          return size_t(splitmix64(seed + uint64_t(s) * 131 + uint64_t(d)) % (base + 1));
        };
        constexpr size_t kSendGap = 3, kRecvGap = 2;
        // Send layout of rank s, computable by every rank: blocks in destination order.
        auto sendDispl = [&](int s, int d) {
          size_t off = 0;
          for (int q = 0; q < d; ++q) off += cnt(s, q) + kSendGap;
          return off;
        };
        const size_t nn = static_cast<size_t>(n);
        std::vector<size_t> sendcounts(nn), sdispls(nn), recvcounts(nn), rdispls(nn);
        size_t recvTotal = 0;
        for (int p = 0; p < n; ++p) {
          sendcounts[size_t(p)] = cnt(me, p);
          sdispls[size_t(p)] = sendDispl(me, p);
          recvcounts[size_t(p)] = cnt(p, me);
          rdispls[size_t(p)] = recvTotal + kRecvGap;  // a gap before every block
          recvTotal += kRecvGap + recvcounts[size_t(p)];
        }
        recvTotal += kRecvGap;
        const size_t sendTotal = sendDispl(me, n);
        Buffer send(t, sendTotal), recv(t, recvTotal);
        fillAnyBits(t, seed, me, send.data(), sendTotal);
        std::memset(recv.data(), 0xA5, recv.size());
        for (int p = 0; p < n; ++p) {
          for (size_t i = 0; i < recvcounts[size_t(p)]; ++i) {
            storeBits(t, recv.data(), rdispls[size_t(p)] + i,
                      ~anyBits(t, seed, p, sendDispl(p, me) + i) & mask(t));
          }
        }
        SPY_REQUIRE_OK(
            spyrecclAllToAllv(send.data(), sendcounts.data(), sdispls.data(), recv.data(),
                              recvcounts.data(), rdispls.data(), t.dtype, ctx.comm),
            ctx.comm);
        OutputChecker check(t, what);
        size_t next = 0;  // first element not yet checked
        uint64_t gapBits = 0;
        std::memset(&gapBits, 0xA5, sizeof gapBits);
        for (int p = 0; p < n; ++p) {
          for (; next < rdispls[size_t(p)]; ++next) check.expectBits(recv.data(), next, gapBits);
          for (size_t i = 0; i < recvcounts[size_t(p)]; ++i, ++next) {
            check.expectBits(recv.data(), next, anyBits(t, seed, p, sendDispl(p, me) + i));
          }
        }
        for (; next < recvTotal; ++next) check.expectBits(recv.data(), next, gapBits);
        check.report(__FILE__, __LINE__);
      });
}

// ---------------------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------------------

using CollectiveBody = void (*)(const TypeInfo&, RankContext&);

[[maybe_unused]] const bool registered = [] {
  const std::pair<const char*, CollectiveBody> collectives[] = {
      {"allreduce", allReduceBody},
      {"reduce", reduceBody},
      {"reduce_scatter", reduceScatterBody},
      {"broadcast", broadcastBody},
      {"allgather", allGatherBody},
      {"gather", gatherBody},
      {"scatter", scatterBody},
      {"alltoall", allToAllBody},
      {"alltoallv", allToAllvBody},
  };
  // Memory variants: "" host buffers (staged transfers); "/arena" every buffer from
  // spyrecclMemAlloc with the direct-transfer threshold at 1 byte, so every non-empty case
  // takes the direct path; "/mixed" arena buffers on even ranks only, so that the ranks
  // agree to fall back to the staged path after the direct path's first step.
  // "/cma": host buffers with the cross-memory-attach threshold at 1 byte, so every
  // non-empty case reads peers' ordinary memory with process_vm_readv (the allreduce's
  // included); "/nocma": the same with SPYRECCL_CMA=0, the forced fallback to staging,
  // checked against the same references.
  enum class Variant { kHost, kArena, kMixed, kCma, kNoCma };
  const std::pair<Variant, const char*> variants[] = {{Variant::kHost, ""},
                                                      {Variant::kArena, "/arena"},
                                                      {Variant::kMixed, "/mixed"},
                                                      {Variant::kCma, "/cma"},
                                                      {Variant::kNoCma, "/nocma"}};
  for (const auto& [name, body] : collectives) {
    for (const TypeInfo& t : allTypes()) {
      for (int ws : kWorldSizes) {
        for (const auto& [variant, suffix] : variants) {
          // The arena variants run at 2 and 3 ranks; mixed needs an odd rank, and one
          // data type per collective exercises its fallback.
          if (variant != Variant::kHost && ws == 4) continue;
          if ((variant == Variant::kMixed || variant == Variant::kNoCma) &&
              (ws != 3 || t.dtype != spyrecclFloat32)) {
            continue;
          }
          const std::string testName = format("coll.%s/%s/ws%d%s", name, t.name, ws, suffix);
          CollectiveBody fn = body;
          const TypeInfo* type = &t;
          const Variant v = variant;
          registerTest(testName, [=] {
            RunOptions opts;
            opts.nranks = ws;
            opts.label = testName;
            if (v != Variant::kHost) ::setenv("SPYRECCL_DIRECT_MIN_BYTES", "1", 1);
            if (v == Variant::kCma || v == Variant::kNoCma) {
              ::setenv("SPYRECCL_CMA_MIN_BYTES", "1", 1);
            }
            if (v == Variant::kNoCma) ::setenv("SPYRECCL_CMA", "0", 1);
            runRanks(opts, [=](RankContext& ctx) {
              const bool arena =
                  v == Variant::kArena || (v == Variant::kMixed && ctx.rank % 2 == 0);
              bufferMemory() = arena ? Memory::kArena : Memory::kHost;
              fn(*type, ctx);
            });
            ::unsetenv("SPYRECCL_DIRECT_MIN_BYTES");
            ::unsetenv("SPYRECCL_CMA_MIN_BYTES");
            ::unsetenv("SPYRECCL_CMA");
          });
        }
      }
    }
  }
  return true;
}();

}  // namespace
