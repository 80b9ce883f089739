// allreduce and reduce.
//
// Small messages (<= SPYRECCL_ALLREDUCE_ONESHOT_MAX; default 64 KiB at 2 ranks, 16 KiB at
// more, see CommConfig) use one-shot: one step in which every rank posts its whole input
// and then reduces all n staging buffers in rank order. Latency is one synchronisation;
// the n-fold read is cheap at these sizes.
//
// Larger messages use a pipelined reduce-scatter + allgather through the staging buffers.
// Data is cut into blocks of n segments (one chunk of staging per rank); rank p owns
// segment p of every block. Step j of the pipeline (j = 0 .. nblocks):
//   before publishing: copy segments p != rank of block j into staging slot p
//                      (slot `rank` already holds our reduced segment of block j - 1)
//   after the wait:    copy every peer's reduced segment of block j - 1 (its slot q)
//                      reduce our segment of block j over all ranks, in rank order, into
//                      our slot of the *next* step's buffer, then copy it to the output
// so each input byte is copied once, each segment is reduced exactly once (by its owner:
// results are bitwise identical everywhere) and each output byte is written once.
//
// The pipeline is memory-bound, so how its copies are done matters as much as how many:
//  - Every copy between staging and user buffers goes through kernels::copy, a plain vector
//    loop, not memcpy: glibc's memcpy uses `rep movsb` from 2 KiB to about the L2 size, and
//    on AMD Zen that runs ~20x slower when the destination lies a few bytes above the source
//    modulo 4 KiB, which is exactly page-aligned staging -> new[]'ed output (16 bytes past a
//    page). At 2 ranks, 512 KiB messages (256 KiB segments) went from ~1 to ~5 GB/s busbw.
//  - Once the ranks' inputs and outputs (2 n times the message) fill half the last-level
//    cache, the outputs are written with non-temporal stores: they would not stay cached
//    anyway, and streaming saves the read-for-ownership and keeps staging and inputs in
//    cache. At 2 ranks on a 32 MiB L3 that is >= 4 MiB: +15-35% busbw there; at 2 MiB it
//    cost ~10%, hence the threshold. (The 3- and 4-rank pipelines gain more still: their
//    segments, chunk / n, are always in the slow `rep movsb` range.) In place (one tensor
//    reduced back to back, as in IBM's benchmark loop) every output line was just read, so
//    streaming waits until the inputs alone exceed the cache (it made 5-10 MB 2x slower).
// Measured and not kept (no difference beyond the noise of a shared 2-core machine): a
// fused reduce that writes staging and output in one pass (saves one L2 re-read of our
// segment), reducing before copying the peers' segments, software prefetch, AVX copies,
// and staging chunks of 256 KiB .. 2 MiB (CommConfig::chunkBytes stays at 1 MiB).
//
// Large messages whose buffers live in the ranks' memory arenas skip the staging buffers
// altogether (algorithms/direct.h): rank p reduces segment p straight from every peer's
// input, then copies the other reduced segments from their owners' outputs.
#include <cstring>

#include "algorithms/collectives.h"
#include "algorithms/direct.h"
#include "algorithms/op_scope.h"

namespace spyreccl::algorithms {
namespace {

void oneShot(Communicator& c, const OpScope& scope, const uint8_t* send, uint8_t* recv,
             size_t count, size_t esize, const kernels::ReduceSpec& spec, bool writes) {
  const int n = c.nranks();
  const uint32_t s = c.beginStep();
  if (count) kernels::copy(c.staging(c.rank(), s), send, count * esize);
  c.exchange(s, scope.desc());
  if (!writes || count == 0) return;
  const void** srcs = c.sourceScratch();
  // Our own contribution is read from our staging copy too: same bits, and the output may
  // alias the input (in place), which kernels::reduce allows for srcs[0] only.
  for (int q = 0; q < n; ++q) srcs[q] = c.staging(q, s);
  kernels::reduce(spec, recv, srcs, n, count);
}

void pipelined(Communicator& c, const OpScope& scope, const uint8_t* send, uint8_t* recv,
               size_t count, size_t esize, const kernels::ReduceSpec& spec, bool writes) {
  const int n = c.nranks();
  const int r = c.rank();
  const size_t slot = slotBytes(c);
  const size_t slotElems = slot / esize;
  const size_t blockElems = slotElems * n;
  const size_t nblocks = ceilDiv(count, blockElems);
  // Element quantum that keeps segment boundaries cache-line aligned.
  const size_t quantum = transport::kCacheLine / esize;

  // Segment p of block k: [*off, *off + *len) in elements. The last block is split evenly
  // (in quanta) so that every rank shares the reduction work.
  auto segment = [&](size_t k, int p, size_t* off, size_t* len) {
    size_t start = k * blockElems;
    size_t blockLen = std::min(blockElems, count - start);
    size_t per = ceilDiv(ceilDiv(blockLen, n), quantum) * quantum;
    size_t a = std::min(blockLen, per * p);
    size_t b = std::min(blockLen, per * (p + 1));
    *off = start + a;
    *len = b - a;
  };

  // Non-temporal stores for the output once the ranks' inputs and outputs (2 n times the
  // message) fill half the last-level cache that they share (see the header comment; in
  // place, once the n inputs fill all of it: kernels::streamingPays).
  const bool stream = kernels::streamingPaysFor(send, recv, n, count * esize);
  const void** srcs = c.sourceScratch();
  for (size_t j = 0; j <= nblocks; ++j) {
    const uint32_t s = c.beginStep();
    uint8_t* mine = c.staging(r, s);
    size_t off, len;
    if (j < nblocks) {
      for (int p = 0; p < n; ++p) {
        if (p == r) continue;
        segment(j, p, &off, &len);
        kernels::copy(mine + p * slot, send + off * esize, len * esize);
      }
    }
    c.exchange(s, j == 0 ? scope.desc() : nullptr);
    if (j >= 1 && writes) {
      for (int q = 0; q < n; ++q) {
        if (q == r) continue;
        segment(j - 1, q, &off, &len);
        kernels::copy(recv + off * esize, c.staging(q, s) + q * slot, len * esize, stream);
      }
    }
    if (j < nblocks) {
      segment(j, r, &off, &len);
      if (len == 0) continue;
      for (int q = 0; q < n; ++q) {
        srcs[q] = q == r ? static_cast<const void*>(send + off * esize)
                         : static_cast<const void*>(c.staging(q, s) + r * slot);
      }
      // The next step's buffer: peers finished reading it (step s - 1) before publishing
      // s, which we just observed.
      uint8_t* reduced = c.staging(r, s + 1) + r * slot;
      kernels::reduce(spec, reduced, srcs, n, len);
      if (writes) kernels::copy(recv + off * esize, reduced, len * esize, stream);
    }
  }
}

void reduceImpl(Communicator& c, Kind kind, const void* sendbuff, void* recvbuff, size_t count,
                spyrecclDataType_t dtype, spyrecclRedOp_t op, const kernels::ReduceSpec& spec,
                int root) {
  OpScope scope(c, makeDescriptor(kind, dtype, count, root, static_cast<int>(op)));
  const size_t esize = kernels::dtypeSize(dtype);
  const bool writes = root < 0 || c.rank() == root;
  const auto* send = static_cast<const uint8_t*>(sendbuff);
  auto* recv = static_cast<uint8_t*>(recvbuff);
  const size_t oneShotMax = std::min(c.config().oneshotMax(c.nranks()), c.layout().chunkBytes());
  std::optional<DirectTransfer> x;
  if (beginDirect(c, scope, count * esize, x, send, count * esize, recv,
                  writes ? count * esize : 0) &&
      // allreduce reads every peer's input and output; reduce the non-roots' inputs.
      (root < 0 ? x->allHave(0) && x->allHave(1) : x->allHave(0, root))) {
    directReduce(c, *x, spec, send, recv, count, esize, root);
    scope.succeed();
    return;
  }
  if (count * esize <= oneShotMax) {
    oneShot(c, scope, send, recv, count, esize, spec, writes);
  } else {
    pipelined(c, scope, send, recv, count, esize, spec, writes);
  }
  scope.succeed();
}

}  // namespace

void allReduce(Communicator& c, const void* send, void* recv, size_t count,
               spyrecclDataType_t dtype, spyrecclRedOp_t op, const kernels::ReduceSpec& spec) {
  reduceImpl(c, Kind::kAllReduce, send, recv, count, dtype, op, spec, -1);
}

void reduce(Communicator& c, const void* send, void* recv, size_t count, spyrecclDataType_t dtype,
            spyrecclRedOp_t op, const kernels::ReduceSpec& spec, int root) {
  reduceImpl(c, Kind::kReduce, send, recv, count, dtype, op, spec, root);
}

}  // namespace spyreccl::algorithms
