// alltoall and alltoallv. Each step carries one slot per destination in every rank's
// staging buffer: rank r puts the next slice of its message for p into slot p, and after
// the wait copies slot r of every peer into its output. alltoallv first exchanges every
// rank's send and receive counts so that all ranks derive the same number of steps (the
// largest message decides) and every disagreement is reported on every rank.
#include <cstring>

#include "algorithms/collectives.h"
#include "algorithms/direct.h"
#include "algorithms/op_scope.h"

namespace spyreccl::algorithms {
namespace {

struct Span {
  size_t off;  // bytes
  size_t len;  // bytes
};

// Moves message p of `send` (sendSpan(p)) to every peer p and message q of every peer into
// recvSpan(q), `nsteps` slices of `slot` bytes. The first step announces `desc` if given.
template <class SendSpan, class RecvSpan>
void transfer(Communicator& c, const uint8_t* send, uint8_t* recv, size_t nsteps, SendSpan sendSpan,
              RecvSpan recvSpan, const transport::Descriptor* desc) {
  const int n = c.nranks();
  const int r = c.rank();
  const size_t slot = slotBytes(c);
  // Out of staging through kernels::copy (see its comment on memcpy's slow case); every
  // rank's inputs and outputs hold up to n * nsteps * slot bytes each.
  const bool stream = kernels::streamingPays(2 * static_cast<size_t>(n) * n * nsteps * slot);
  for (size_t j = 0; j < nsteps; ++j) {
    const uint32_t s = c.beginStep();
    uint8_t* mine = c.staging(r, s);
    const size_t off = j * slot;
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      Span m = sendSpan(p);
      if (m.len > off)
        kernels::copy(mine + p * slot, send + m.off + off, std::min(slot, m.len - off));
    }
    c.exchange(s, j == 0 ? desc : nullptr);
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      Span m = recvSpan(q);
      if (m.len > off) {
        kernels::copy(recv + m.off + off, c.staging(q, s) + r * slot, std::min(slot, m.len - off),
                      stream);
      }
    }
  }
}

}  // namespace

void allToAll(Communicator& c, const void* sendbuff, void* recvbuff, size_t count,
              spyrecclDataType_t dtype) {
  OpScope scope(c, makeDescriptor(Kind::kAllToAll, dtype, count));
  const int r = c.rank();
  const size_t block = count * kernels::dtypeSize(dtype);
  const auto* send = static_cast<const uint8_t*>(sendbuff);
  auto* recv = static_cast<uint8_t*>(recvbuff);
  std::optional<DirectTransfer> x;
  const size_t n = static_cast<size_t>(c.nranks());
  const bool stream = kernels::streamingPays(2 * n * n * block);
  if (beginDirect(c, scope, block * n, x, send, block * n) && x->allHave(0)) {
    // Block r of every peer's input is ours; alltoall is never in place.
    for (int q = 0; q < c.nranks(); ++q) {
      if (q != r) x->copyFrom(q, 0, r * block, recv + q * block, block, stream);
    }
    kernels::copy(recv + r * block, send + r * block, block, stream);
    x->close();
    scope.succeed();
    return;
  }
  const size_t nsteps = std::max<size_t>(1, ceilDiv(block, slotBytes(c)));
  transfer(
      c, send, recv, nsteps, [&](int p) { return Span{p * block, block}; },
      [&](int q) { return Span{q * block, block}; }, scope.desc());
  // Own block last: the first exchange inside transfer() validates the descriptors.
  if (block) kernels::copy(recv + r * block, send + r * block, block, stream);
  scope.succeed();
}

void allToAllv(Communicator& c, const void* sendbuff, const size_t* sendcounts,
               const size_t* sdispls, void* recvbuff, const size_t* recvcounts,
               const size_t* rdispls, spyrecclDataType_t dtype) {
  OpScope scope(c, makeDescriptor(Kind::kAllToAllv, dtype, 0));
  const int n = c.nranks();
  const int r = c.rank();
  const size_t esize = kernels::dtypeSize(dtype);
  const auto* send = static_cast<const uint8_t*>(sendbuff);
  auto* recv = static_cast<uint8_t*>(recvbuff);

  // Step 1: publish [sendcounts..., recvcounts...] and check the full matrix, so that every
  // rank reaches the same verdict.
  const uint32_t s = c.beginStep();
  auto* counts = reinterpret_cast<uint64_t*>(c.staging(r, s));
  for (int p = 0; p < n; ++p) {
    counts[p] = sendcounts[p];
    counts[n + p] = recvcounts[p];
  }
  c.exchange(s, scope.desc());
  size_t maxBytes = 0;
  for (int i = 0; i < n; ++i) {
    const auto* ci = reinterpret_cast<const uint64_t*>(c.staging(i, s));
    for (int j = 0; j < n; ++j) {
      const auto* cj = reinterpret_cast<const uint64_t*>(c.staging(j, s));
      if (ci[j] != cj[n + i]) {
        SPYRECCL_THROW(spyrecclMismatch,
                       "%s: rank %d sends %llu elements to rank %d but rank %d expects %llu "
                       "from rank %d (recvcounts[%d] must equal the sender's sendcounts[%d])",
                       c.opLabel().c_str(), i, static_cast<unsigned long long>(ci[j]), j, j,
                       static_cast<unsigned long long>(cj[n + i]), i, i, j);
      }
      if (i != j) maxBytes = std::max<size_t>(maxBytes, ci[j] * esize);
    }
  }
  if (sendcounts[r]) {
    kernels::copy(recv + rdispls[r] * esize, send + sdispls[r] * esize, sendcounts[r] * esize);
  }
  transfer(
      c, send, recv, ceilDiv(maxBytes, slotBytes(c)),
      [&](int p) { return Span{sdispls[p] * esize, sendcounts[p] * esize}; },
      [&](int q) { return Span{rdispls[q] * esize, recvcounts[q] * esize}; }, nullptr);
  scope.succeed();
}

}  // namespace spyreccl::algorithms
