#include "algorithms/eager.h"

#include <cstring>
#include <vector>

#include "algorithms/descriptor.h"
#include "common/error.h"
#include "transport/wait.h"

namespace spyreccl::algorithms {
namespace {

using transport::Descriptor;
using transport::kEagerSlots;

// Wrap-aware: the ring counters are 32-bit (futex words).
bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Folds broadcast `d` into this rank's digest of one-way broadcasts, and records it as the
// latest for mismatch messages.
void complete(Communicator& c, const Descriptor& d) {
  Communicator::EagerState& st = c.eagerState();
  const uint64_t call = d.seq * 0x9e3779b97f4a7c15ull ^
                        static_cast<uint64_t>(static_cast<uint32_t>(d.root)) << 48 ^
                        static_cast<uint64_t>(static_cast<uint32_t>(d.dtype)) << 40 ^ d.count;
  st.digest = mix64(st.digest ^ mix64(call));
  transport::EagerControl* e = c.eager(c.rank());
  e->lastEager.store(d);
  // Written by this rank only: no read-modify-write needed.
  e->completed.store(e->completed.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

const char* const kRootLater =
    " (the root of a one-way small broadcast returns before its receivers read it, so it "
    "learns of a mismatch at a later call)";

// As a root, waits until every receiver has read the slot that index `i` reuses.
void waitForSlot(Communicator& c, uint32_t i) {
  const int me = c.rank();
  Communicator::EagerState& st = c.eagerState();
  const uint32_t need = i + 1 - kEagerSlots;  // receivers must have read this many
  // The call the slot holds (0 while the ring has not wrapped yet; then no wait below).
  const Descriptor& held = c.eager(me)->slots[i % kEagerSlots].desc;
  const uint64_t heldSeq = held.seq;
  uint32_t minRead = need + kEagerSlots;  // the smallest count read, once all have `need`
  for (int p = 0; p < c.nranks(); ++p) {
    if (p == me) continue;
    std::atomic<uint32_t>* word = c.eagerConsumed(p, me);
    auto ready = [word, need] { return reached(word->load(std::memory_order_acquire), need); };
    if (!ready()) {
      const std::vector<int> peers{p};
      auto waitingFor = [&] {
        return format("rank %d to read this rank's one-way broadcast seq %llu", p,
                      static_cast<unsigned long long>(heldSeq));
      };
      auto awaited = [p](int q) { return q == p; };
      transport::waitUntil(c.spin(), word, c.sleepers(), ready, [&](int64_t waited, bool full) {
        if (!c.pendingP2P().empty()) c.progressPendingP2P();
        c.checkWait(waited, full, &peers, ready, waitingFor, awaited);
        if (!full) return;
        // A receiver that began a later call without reading the slot called something
        // else as that call (opSeq is released after the slot's read count).
        if (c.eager(p)->opSeq.load(std::memory_order_acquire) <= heldSeq || ready()) return;
        SPYRECCL_THROW(spyrecclMismatch,
                       "%s: rank %d called %s as its collective seq %llu but %s%s",
                       c.opLabel().c_str(), me, describe(held).c_str(),
                       static_cast<unsigned long long>(heldSeq),
                       c.describePeerCall(p, heldSeq).c_str(), kRootLater);
      });
    }
    const uint32_t read = word->load(std::memory_order_acquire);
    if (static_cast<int32_t>(read - minRead) < 0) minRead = read;
  }
  st.freeUntil = minRead + kEagerSlots;
}

void post(Communicator& c, const Descriptor& d, const uint8_t* send, uint8_t* recv, size_t bytes) {
  const int me = c.rank();
  // A receiver that failed (say, on a mismatch it saw in one of our earlier broadcasts)
  // fails this call rather than the one that next needs its slot.
  for (int p = 0; p < c.nranks(); ++p) {
    if (p != me &&
        c.control(p)->status.load(std::memory_order_acquire) != transport::kStatusActive) {
      c.throwPeerFailure(p, format("its receivers to read one-way broadcast seq %llu",
                                   static_cast<unsigned long long>(d.seq)));
    }
  }
  Communicator::EagerState& st = c.eagerState();
  const uint32_t i = st.index[me];
  if (static_cast<int32_t>(i - st.freeUntil) >= 0) waitForSlot(c, i);
  transport::EagerControl* e = c.eager(me);
  transport::EagerSlot& slot = e->slots[i % kEagerSlots];
  slot.desc = d;
  slot.bytes = bytes;
  if (bytes != 0) std::memcpy(slot.payload, send, bytes);
  e->posted.store(i + 1, std::memory_order_release);
  transport::notify(&e->posted, &e->postedSleepers);
  st.index[me] = i + 1;
  if (bytes != 0 && send != recv) std::memcpy(recv, send, bytes);
  complete(c, d);
}

void receive(Communicator& c, const Descriptor& d, uint8_t* recv, size_t bytes, int root) {
  const int me = c.rank();
  Communicator::EagerState& st = c.eagerState();
  const uint32_t i = st.index[root];
  transport::EagerControl* rc = c.eager(root);
  auto ready = [rc, i] { return reached(rc->posted.load(std::memory_order_acquire), i + 1); };
  if (!ready()) {
    const std::vector<int> peers{root};
    auto waitingFor = [&] {
      return format("rank %d to send one-way broadcast seq %llu", root,
                    static_cast<unsigned long long>(d.seq));
    };
    auto awaited = [root](int q) { return q == root; };
    transport::waitUntil(
        c.spin(), &rc->posted, &rc->postedSleepers, ready, [&](int64_t waited, bool full) {
          if (!c.pendingP2P().empty()) c.progressPendingP2P();
          c.checkWait(waited, full, &peers, ready, waitingFor, awaited);
          if (!full) return;
          // The root has begun this call or a later one without posting our slot: unless it is
          // this very broadcast (its root may wait for a free slot), it called something else.
          const uint64_t rootSeq = rc->opSeq.load(std::memory_order_acquire);
          if (rootSeq < d.seq || ready()) return;
          Descriptor theirs{};
          if (rootSeq == d.seq && c.peerCall(root, d.seq, &theirs) && sameCall(theirs, d)) return;
          SPYRECCL_THROW(spyrecclMismatch, "%s: rank %d called %s but %s", c.opLabel().c_str(), me,
                         describe(d).c_str(), c.describePeerCall(root, d.seq).c_str());
        });
  }
  const transport::EagerSlot& slot = rc->slots[i % kEagerSlots];
  if (!sameCall(slot.desc, d)) {
    SPYRECCL_THROW(spyrecclMismatch,
                   "%s: rank %d called %s but rank %d called %s as its collective seq %llu",
                   c.opLabel().c_str(), me, describe(d).c_str(), root, describe(slot.desc).c_str(),
                   static_cast<unsigned long long>(slot.desc.seq));
  }
  if (bytes != 0) std::memcpy(recv, slot.payload, bytes);
  std::atomic<uint32_t>* readCount = c.eagerConsumed(me, root);
  readCount->store(i + 1, std::memory_order_release);
  transport::notify(readCount, c.sleepers());
  st.index[root] = i + 1;
  complete(c, d);
}

}  // namespace

void eagerBroadcast(Communicator& c, const Descriptor& d, const void* send, void* recv,
                    size_t bytes, int root) {
  if (c.rank() == root) {
    post(c, d, static_cast<const uint8_t*>(send), static_cast<uint8_t*>(recv), bytes);
  } else {
    receive(c, d, static_cast<uint8_t*>(recv), bytes, root);
  }
}

}  // namespace spyreccl::algorithms
