// Point-to-point over the mailbox of each ordered pair (src -> dst): two slots of
// p2pChunkBytes written by the sender only (`posted` counts chunks) and drained by the
// receiver only (`consumed`), so each side owns one counter and a chunk is never read
// while it is written. Two slots let the sender fill chunk i + 1 while the receiver
// copies chunk i. Every chunk carries a header {message number, count, dtype, tag,
// offset, bytes}; the receiver checks (count, dtype, tag) on the first chunk of each
// message before touching its buffer, and a refusal is published in the mailbox so the
// sender fails with the same mismatch instead of waiting for its peer to time out.
//
// Direct (rendezvous) messages: once an earlier collective established direct transfers
// (every rank mapped every peer's memory arena, algorithms/direct.h), a message of at
// least directMinBytes and larger than the two staging slots (so that its send would wait
// for the receiver anyway) whose send buffer lies in the sender's arena is posted as a single
// payload-less chunk flagged kChunkDirect that carries the buffer's arena offset. The
// receiver validates it like any first chunk and then copies the whole message straight
// out of the sender's arena: one copy instead of two. Because the receiver reads the
// sender's buffer in place, such a send completes only once its chunk is consumed (a
// staged send completes once its last chunk is posted). Point-to-point never probes for
// direct transfers itself: that is a collective step, and a send involves one peer only.
// A send buffer outside the arena goes the same way when the communicator uses
// cross-memory attach (Communicator::cmaOn) and the sender's vote chooses the single copy
// (directSource, path_advisor.h): the chunk (kChunkCma) then carries the buffer's address, and
// the receiver reads exactly the announced bytes with process_vm_readv.
//
// Blocked senders and receivers sleep on their own rank's doorbell, which every peer
// bumps after posting to or draining from one of this rank's mailboxes; one word covers
// any number of pending operations (groups, receive from any source).
#include "algorithms/p2p.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "algorithms/direct.h"
#include "algorithms/path_advisor.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "memory/arena.h"
#include "transport/wait.h"

namespace spyreccl::algorithms {

using transport::ChunkHeader;
using transport::kChunkCma;
using transport::kChunkDirect;
using transport::MailboxControl;

namespace {

void ringDoorbell(Communicator& c, int peer) {
  std::atomic<uint32_t>* db = &c.control(peer)->doorbell;
  db->fetch_add(1, std::memory_order_release);
  transport::notify(db, &c.control(peer)->doorbellSleepers);
}

MailboxControl* outbox(Communicator& c, int peer) {
  return c.layout().mailbox(c.base(), c.rank(), peer);
}
MailboxControl* inbox(Communicator& c, int peer) {
  return c.layout().mailbox(c.base(), peer, c.rank());
}

std::string signature(uint64_t count, int dtype, int tag) {
  return format("count=%llu, %s, tag=%d", static_cast<unsigned long long>(count),
                kernels::dtypeName(static_cast<spyrecclDataType_t>(dtype)), tag);
}

bool rejected(const P2POp& op) {
  return op.started &&
         outbox(*op.comm, op.peer)->rejectedSeq.load(std::memory_order_acquire) == op.msgSeq + 1;
}

// Whether the receiver consumed the direct chunk of `op` (and so is done with its buffer).
// The sender posts nothing more to this peer until then, so the count stops right there.
bool directConsumed(const P2POp& op) {
  return outbox(*op.comm, op.peer)->consumed.load(std::memory_order_acquire) == op.directChunk + 1;
}

// True when trySend/tryRecv would make progress (or fail) now.
bool canProgress(const P2POp& op) {
  Communicator& c = *op.comm;
  if (op.isSend) {
    if (op.direct) return directConsumed(op) || rejected(op);
    uint32_t consumed = outbox(c, op.peer)->consumed.load(std::memory_order_acquire);
    return c.p2p(op.peer).postedChunks - consumed < 2 || rejected(op);
  }
  return inbox(c, op.peer)->posted.load(std::memory_order_acquire) != c.p2p(op.peer).consumedChunks;
}

// How the whole send buffer of `op` may go direct: its arena offset (flags kChunkDirect),
// its address (kChunkDirect | kChunkCma), or not at all (flags 0).
struct DirectSource {
  uint32_t flags = 0;
  uint64_t where = 0;
};

// Smallest message of up to two chunks that may go single-copy to a waiting receiver, and
// the longest a sender waits for its receiver to start waiting.
constexpr size_t kSmallP2PMinBytes = 32 << 10;
constexpr int64_t kSmallP2PWaitNs = 5 * 1000;

DirectSource directSource(P2POp& op, size_t total) {
  Communicator& c = *op.comm;
  if (total == 0 || !c.config().direct) return {};
  const size_t twoChunks = 2 * c.layout().p2pChunkBytes();
  if (total <= twoChunks) {
    // A staged send of up to two chunks returns without its receiver, and code that sends
    // before it receives relies on that; a single copy makes the send wait until the
    // receiver has read it. So only when the receiver is already blocked waiting for this
    // very message (it consumes it right away), and the single copy is the faster path by
    // the sender's estimates (PathAdvisor::kSmallP2P: the staged side timed as the copies
    // into the staging slots, the single copy from posting to consumption).
    // From kSmallP2PMinBytes, or from the communicator's vote floor where its init probe
    // found the single copy faster at smaller sizes (Communicator::cmaVoteFloor).
    if (!c.cmaOn() || c.config().cmaMinBytes != 0 || !c.pathAdvisor().enabled() ||
        total < std::min(kSmallP2PMinBytes, c.cmaVoteFloor())) {
      return {};
    }
    op.timedKind = PathAdvisor::kSmallP2P + 1;
    const int64_t now = nowNs();
    // Contended CPUs count from kSmallP2PMinBytes, as before the floor could be lower.
    if (!PathAdvisor::decide(
            cmaVote(c, PathAdvisor::kSmallP2P, total, now, false, total >= kSmallP2PMinBytes))) {
      return {};
    }
    const std::atomic<uint64_t>& waitingSeq = outbox(c, op.peer)->waitingSeq;
    auto waiting = [&] { return waitingSeq.load(std::memory_order_acquire) == op.msgSeq + 1; };
    if (!waiting() && c.spin().spin) {
      // A receiver that is on its way (a ping-pong's peer returning from its own send) is
      // worth a short wait: at most what the single copy saves by the estimates, and never
      // more than kSmallP2PWaitNs, after which the send is staged and returns as ever. Not
      // when ranks share CPUs (no spinning there): the receiver could not run meanwhile.
      const double kib = static_cast<double>(total) / 1024.0;
      const double saves = (c.pathAdvisor().estimate(PathAdvisor::kSmallP2P, total, false) -
                            c.pathAdvisor().estimate(PathAdvisor::kSmallP2P, total, true)) *
                           kib;
      const int64_t until = now + std::min<int64_t>(kSmallP2PWaitNs, static_cast<int64_t>(saves));
      while (!waiting() && nowNs() < until) transport::cpuRelax();
    }
    if (!waiting()) return {};
    return {kChunkDirect | kChunkCma, reinterpret_cast<uintptr_t>(op.sendBuf)};
  }
  // Larger messages: their staged send waits for the receiver anyway, as a direct one does.
  if (total >= c.config().directMinBytes && c.directOn()) {
    const int64_t off = memory::Arena::sharedOffsetOf(op.sendBuf, total);
    if (off >= 0) return {kChunkDirect, static_cast<uint64_t>(off)};
  }
  if (!c.cmaOn()) return {};
  if (cmaFixed(c, total)) {
    return {kChunkDirect | kChunkCma, reinterpret_cast<uintptr_t>(op.sendBuf)};
  }
  if (total < cmaBusyThreshold(c, Kind::kNone)) return {};
  // From the contended threshold up, at every size, the sender alone chooses (PathAdvisor:
  // contended CPUs, or the faster path by its running estimates; with the advisor off, the
  // quiet threshold), and times the message on the chosen path.
  const uint64_t vote = cmaVote(c, static_cast<uint32_t>(Kind::kNone), total, nowNs(),
                                total >= cmaThreshold(c, Kind::kNone));
  if (c.pathAdvisor().enabled()) op.timedKind = static_cast<uint32_t>(Kind::kNone) + 1;
  if (!PathAdvisor::decide(vote)) return {};
  return {kChunkDirect | kChunkCma, reinterpret_cast<uintptr_t>(op.sendBuf)};
}

// Records the time of a message `op` sent on the path the advisor chose (timedKind set).
// Single copy: from posting to consumption. Staged, up to two chunks: the time of the
// copies into the slots. Staged, larger: the send finishes when its last chunk is posted,
// while the receiver still has the last two chunks to drain, so its time covers about the
// transfer of all but two chunks.
void recordPath(P2POp& op, size_t total, bool cma) {
  if (op.timedKind == 0) return;
  Communicator& c = *op.comm;
  const int64_t now = nowNs();
  int64_t elapsed = now - op.timedNs;
  const size_t twoChunks = 2 * c.layout().p2pChunkBytes();
  if (!cma && total <= twoChunks) {
    elapsed = op.copyNs;
  } else if (!cma) {
    elapsed = static_cast<int64_t>(static_cast<double>(elapsed) * static_cast<double>(total) /
                                   static_cast<double>(total - twoChunks));
  }
  c.pathAdvisor().record(op.timedKind - 1, total, cma, elapsed, now);
  op.timedNs = 0;
  op.timedKind = 0;
}

// Posts the single chunk of a direct message (a free slot was checked by the caller).
void postDirect(P2POp& op, uint32_t posted, DirectSource src, size_t total) {
  Communicator& c = *op.comm;
  ChunkHeader* h = c.layout().slot(c.base(), c.rank(), op.peer, posted);
  h->msgSeq = op.msgSeq;
  h->count = op.count;
  h->totalBytes = total;
  h->offset = 0;
  h->bytes = 0;
  h->dtype = op.dtype;
  h->tag = op.tag;
  h->flags = src.flags;
  h->arenaOffset = src.where;
  op.direct = true;
  op.directChunk = posted;
  c.p2p(op.peer).postedChunks = posted + 1;
  outbox(c, op.peer)->posted.store(posted + 1, std::memory_order_release);
  ringDoorbell(c, op.peer);
}

bool trySend(P2POp& op) {
  Communicator& c = *op.comm;
  MailboxControl* mb = outbox(c, op.peer);
  Communicator::PeerP2P& st = c.p2p(op.peer);
  if (rejected(op)) {
    SPYRECCL_THROW(spyrecclMismatch,
                   "send to rank %d: rank %d sent message #%llu as send(%s) but rank %d posted "
                   "recv(%s) for it",
                   op.peer, c.rank(), static_cast<unsigned long long>(op.msgSeq),
                   signature(op.count, op.dtype, op.tag).c_str(), op.peer,
                   signature(mb->expectCount, mb->expectDtype, mb->expectTag).c_str());
  }
  const size_t total = op.count * kernels::dtypeSize(op.dtype);
  if (op.direct) {
    // Our buffer stays untouched until the receiver has copied it out of our arena.
    if (!directConsumed(op)) return false;
    op.done = total;
    op.finished = true;
    recordPath(op, total, true);
    return true;
  }
  const uint32_t posted = st.postedChunks;
  if (posted - mb->consumed.load(std::memory_order_acquire) >= 2) return false;
  if (!op.started) {
    op.msgSeq = st.sendMsgs++;
    op.started = true;
    const DirectSource src = directSource(op, total);
    if (op.timedKind != 0) op.timedNs = nowNs();
    if (src.flags != 0) {
      postDirect(op, posted, src, total);
      return true;
    }
  }
  const size_t len = std::min(c.layout().p2pChunkBytes(), total - op.done);
  ChunkHeader* h = c.layout().slot(c.base(), c.rank(), op.peer, posted);
  h->msgSeq = op.msgSeq;
  h->count = op.count;
  h->totalBytes = total;
  h->offset = op.done;
  h->bytes = len;
  h->dtype = op.dtype;
  h->tag = op.tag;
  h->flags = 0;
  h->arenaOffset = 0;
  if (len && op.timedKind == PathAdvisor::kSmallP2P + 1) {
    const int64_t t0 = nowNs();
    kernels::copy(transport::Layout::payload(h), op.sendBuf + op.done, len);
    op.copyNs += nowNs() - t0;
  } else if (len) {
    kernels::copy(transport::Layout::payload(h), op.sendBuf + op.done, len);
  }
  st.postedChunks = posted + 1;
  mb->posted.store(posted + 1, std::memory_order_release);
  ringDoorbell(c, op.peer);
  op.done += len;
  op.finished = op.done == total;
  if (op.finished) recordPath(op, total, false);
  return true;
}

// Receives the direct message announced by `h` (validated against `op` already): copies it
// from the sender's arena (or, kChunkCma, its ordinary memory) into our buffer.
void copyDirect(P2POp& op, const ChunkHeader& h, size_t total) {
  Communicator& c = *op.comm;
  const int p = op.peer;
  if (h.flags & kChunkCma) {
    if (op.done != 0 || !c.cmaOn()) {
      SPYRECCL_THROW(spyrecclInternalError,
                     "internal error: recv from rank %d got a single-copy chunk for message #%llu "
                     "while cross-memory attach is %s (%zu bytes received already)",
                     p, static_cast<unsigned long long>(h.msgSeq), c.cmaOn() ? "on" : "off",
                     op.done);
    }
    // Exactly the bytes the sender announced (h.totalBytes == total was checked).
    c.cmaRead(p, op.recvBuf, h.arenaOffset, total, op.describe().c_str());
  } else if (op.done != 0 || !c.directOn() || c.peerArena(p) == nullptr ||
             h.arenaOffset > c.peerArenaBytes(p) || total > c.peerArenaBytes(p) - h.arenaOffset) {
    SPYRECCL_THROW(spyrecclInternalError,
                   "internal error: recv from rank %d got a direct chunk for message #%llu (arena "
                   "offset %llu, %zu bytes) that this rank cannot read (direct transfers %s, "
                   "rank %d's arena mapped with %zu bytes, %zu bytes received already)",
                   p, static_cast<unsigned long long>(h.msgSeq),
                   static_cast<unsigned long long>(h.arenaOffset), total,
                   c.directOn() ? "on" : "off", p, c.peerArenaBytes(p), op.done);
  } else {
    kernels::copy(op.recvBuf, c.peerArena(p) + h.arenaOffset, total,
                  kernels::streamingPays(2 * total));
  }
  // A sender that failed (or aborted) while its direct send was pending has returned and
  // may have reused its buffer while we copied it: report the peer's failure rather than
  // a message that may be torn. Our loads of its buffer must not pass the status load.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (c.control(p)->status.load(std::memory_order_acquire) != transport::kStatusActive) {
    const std::vector<int> sender{p};
    c.checkWait(
        0, true, &sender, [] { return false; }, [&] { return op.describe(); },
        [](int) { return true; });
  }
  op.done = total;
}

bool tryRecv(P2POp& op) {
  Communicator& c = *op.comm;
  MailboxControl* mb = inbox(c, op.peer);
  Communicator::PeerP2P& st = c.p2p(op.peer);
  const uint32_t consumed = st.consumedChunks;
  if (mb->posted.load(std::memory_order_acquire) == consumed) return false;
  const ChunkHeader* h = c.layout().slot(c.base(), op.peer, c.rank(), consumed);
  const size_t total = op.count * kernels::dtypeSize(op.dtype);
  if (!op.started) {
    if (h->msgSeq != st.recvMsgs || h->offset != 0) {
      SPYRECCL_THROW(spyrecclInternalError,
                     "internal error: recv from rank %d expected the start of message #%llu, "
                     "found message #%llu at offset %llu",
                     op.peer, static_cast<unsigned long long>(st.recvMsgs),
                     static_cast<unsigned long long>(h->msgSeq),
                     static_cast<unsigned long long>(h->offset));
    }
    if (h->count != op.count || h->dtype != op.dtype || h->tag != op.tag ||
        h->totalBytes != total) {
      mb->expectCount = op.count;
      mb->expectDtype = op.dtype;
      mb->expectTag = op.tag;
      mb->rejectedSeq.store(h->msgSeq + 1, std::memory_order_release);
      ringDoorbell(c, op.peer);
      SPYRECCL_THROW(spyrecclMismatch,
                     "recv from rank %d: rank %d posted recv(%s) but rank %d sent message #%llu "
                     "as send(%s)",
                     op.peer, c.rank(), signature(op.count, op.dtype, op.tag).c_str(), op.peer,
                     static_cast<unsigned long long>(h->msgSeq),
                     signature(h->count, h->dtype, h->tag).c_str());
    }
    op.msgSeq = st.recvMsgs++;
    op.started = true;
  }
  if (h->offset != op.done || h->bytes > total - op.done || h->msgSeq != op.msgSeq) {
    SPYRECCL_THROW(spyrecclInternalError,
                   "internal error: recv from rank %d got chunk (message #%llu, offset %llu, %llu "
                   "bytes) while expecting message #%llu offset %zu",
                   op.peer, static_cast<unsigned long long>(h->msgSeq),
                   static_cast<unsigned long long>(h->offset),
                   static_cast<unsigned long long>(h->bytes),
                   static_cast<unsigned long long>(op.msgSeq), op.done);
  }
  if (h->flags & kChunkDirect) {
    copyDirect(op, *h, total);
  } else {
    // kernels::copy, not memcpy: see its comment on memcpy's slow case.
    if (h->bytes) {
      kernels::copy(op.recvBuf + op.done, transport::Layout::payload(h), h->bytes,
                    kernels::streamingPays(2 * total));
    }
    op.done += h->bytes;
  }
  st.consumedChunks = consumed + 1;
  mb->consumed.store(consumed + 1, std::memory_order_release);
  ringDoorbell(c, op.peer);
  op.finished = op.done == total;
  return true;
}

// Removes the finished `op` from the pending list; its successor on the same stream
// becomes eligible.
void retire(Communicator& c, P2POp* op) {
  std::vector<P2POp*>& pending = c.pendingP2P();
  for (P2POp* other : pending) {
    if (other->pred == op) other->pred = nullptr;
  }
  pending.erase(std::find(pending.begin(), pending.end(), op));
}

// Abandons every operation pending on `c` with `e` and marks `c` failed.
void abandonPending(Communicator& c, const Error& e) {
  for (P2POp* op : c.pendingP2P()) {
    op->finished = true;
    op->pred = nullptr;
    op->result = e.code();
    op->error = e.message();
  }
  c.pendingP2P().clear();
  c.markFailed(e.code(), e.message());
  c.setLastError(e.message());
}

bool anyCanProgress(Communicator& c) {
  for (const P2POp* op : c.pendingP2P()) {
    if (op->pred == nullptr && canProgress(*op)) return true;
  }
  return false;
}

// The bounded-wait checks of the operations pending on `c`: abort, the failure of the peer
// an operation needs, and the group timeout counted from each operation's posting.
void checkPending(Communicator& c, int64_t now, bool full, const std::function<bool()>& ready) {
  std::vector<int> peer(1);  // the peer list checkWait wants, one operation at a time
  for (const P2POp* op : c.pendingP2P()) {
    peer[0] = op->peer;
    c.checkWait(
        now - op->postedNs, full, &peer, ready, [op] { return op->describe(); },
        [](int) { return true; });
  }
}

// Sleeps on `c`'s doorbell until `ready`, checking every pending operation of `comms`.
void waitDoorbell(Communicator& c, const std::vector<Communicator*>& comms,
                  const std::function<bool()>& ready) {
  transport::waitUntil(transport::pairwise(c.spin()), &c.control(c.rank())->doorbell,
                       &c.control(c.rank())->doorbellSleepers, ready, [&](int64_t, bool full) {
                         const int64_t now = nowNs();
                         for (Communicator* other : comms) checkPending(*other, now, full, ready);
                       });
}

// Publishes (on) or withdraws that this thread is blocked waiting for the receive `op`
// (MailboxControl::waitingSeq): only a receive at the head of its stream that has not
// started waits for a known message number, the next one from its peer.
void markWaiting(P2POp& op, bool on) {
  if (op.isSend || op.comm == nullptr || op.peer < 0) return;
  Communicator& c = *op.comm;
  std::atomic<uint64_t>& word = inbox(c, op.peer)->waitingSeq;
  const uint64_t next = c.p2p(op.peer).recvMsgs + 1;
  if (on && !op.finished && !op.started && op.pred == nullptr) {
    word.store(next, std::memory_order_release);
  } else if (!on) {
    // Ours only: the word may name a later receive that another thread waits for.
    uint64_t mine = op.started ? op.msgSeq + 1 : next;
    word.compare_exchange_strong(mine, 0, std::memory_order_acq_rel);
  }
}

// Withdraws the marks of `ops` when the wait ends, however it ends.
template <class ForEachOp>
struct WaitingMarks {
  ForEachOp forEach;
  bool marked = false;
  void mark() {
    forEach([](P2POp& op) { markWaiting(op, true); });
    marked = true;
  }
  ~WaitingMarks() {
    if (marked) forEach([](P2POp& op) { markWaiting(op, false); });
  }
};

// Progresses everything pending on `comms` until finished(), sleeping on the doorbell of
// sleepOn() whenever nothing could move. On an error every communicator in `comms` abandons
// its pending operations (a no-op where progress() did so already) and the error is rethrown.
// While it waits, the receives among `waitedOps` are marked as waited for (markWaiting).
template <class Finished, class SleepOn, class ForEachOp>
void driveUntil(const std::vector<Communicator*>& comms, Finished&& finished, SleepOn&& sleepOn,
                ForEachOp&& waitedOps) {
  const std::function<bool()> ready = [&] {
    for (Communicator* c : comms) {
      if (anyCanProgress(*c)) return true;
    }
    return false;
  };
  WaitingMarks<ForEachOp&> marks{waitedOps};
  try {
    for (;;) {
      bool progressed = false;
      for (Communicator* c : comms) progressed = progress(*c) || progressed;
      if (finished()) return;
      if (progressed) continue;
      marks.mark();
      waitDoorbell(sleepOn(), comms, ready);
    }
  } catch (const Error& e) {
    for (Communicator* c : comms) abandonPending(*c, e);
    throw;
  }
}

}  // namespace

std::string P2POp::describe() const {
  return format("%s(%s) %s rank %d", isSend ? "send" : "recv", signature(count, dtype, tag).c_str(),
                isSend ? "to" : "from", peer);
}

GroupState& threadGroup() {
  thread_local GroupState state;
  return state;
}

void post(P2POp& op) {
  std::vector<P2POp*>& pending = op.comm->pendingP2P();
  op.pred = nullptr;
  for (size_t k = pending.size(); k-- > 0;) {
    if (pending[k]->peer == op.peer && pending[k]->isSend == op.isSend) {
      op.pred = pending[k];
      break;
    }
  }
  op.postedNs = nowNs();
  pending.push_back(&op);
  if (logLevel() >= LogLevel::kTrace) {
    SPYRECCL_LOG(kTrace, op.comm->who().c_str(), "post %s", op.describe().c_str());
  }
}

bool progress(Communicator& c) {
  std::vector<P2POp*>& pending = c.pendingP2P();
  if (pending.empty()) return false;
  bool progressed = false;
  try {
    c.ensureUsable("point-to-point");
    for (size_t i = 0; i < pending.size();) {
      P2POp* op = pending[i];
      // One chunk per operation per pass keeps concurrent streams fair.
      if (op->pred == nullptr && (op->isSend ? trySend(*op) : tryRecv(*op))) {
        progressed = true;
        if (op->finished) {
          retire(c, op);  // erases pending[i]: the next operation moved into slot i
          continue;
        }
      }
      ++i;
    }
  } catch (const Error& e) {
    abandonPending(c, e);
    throw;
  }
  return progressed;
}

void waitProgress(Communicator& c, int64_t maxWaitNs) {
  const int64_t deadline = nowNs() + maxWaitNs;
  bool expired = false;
  const std::function<bool()> ready = [&] {
    return expired || c.progressWake().load(std::memory_order_acquire) || anyCanProgress(c);
  };
  try {
    transport::waitUntil(c.spin(), &c.control(c.rank())->doorbell,
                         &c.control(c.rank())->doorbellSleepers, ready, [&](int64_t, bool full) {
                           const int64_t now = nowNs();
                           // Polls are short (the caller bounds them, c10d's progress
                           // thread to 10 ms), shorter than the interval of the full checks
                           // within one wait: keep that interval across polls, or a dead
                           // peer and the timeout would never be looked for.
                           if (now - c.lastPollFullCheckNs() >= transport::kCheckIntervalNs) {
                             full = true;
                           }
                           if (full) c.lastPollFullCheckNs() = now;
                           checkPending(c, now, full, ready);
                           expired = now >= deadline;
                         });
  } catch (const Error& e) {
    abandonPending(c, e);
    throw;
  }
  c.progressWake().store(false, std::memory_order_relaxed);
}

void wakeProgress(Communicator& c) {
  c.progressWake().store(true, std::memory_order_release);
  std::atomic<uint32_t>* db = &c.control(c.rank())->doorbell;
  db->fetch_add(1, std::memory_order_release);
  transport::notify(db, &c.control(c.rank())->doorbellSleepers);
}

void runP2P(std::vector<P2POp>& ops) {
  std::vector<Communicator*> comms;
  for (P2POp& op : ops) {
    if (std::find(comms.begin(), comms.end(), op.comm) == comms.end()) comms.push_back(op.comm);
    // Short constant labels (no formatting on the fast path); waits name the exact
    // operation they are blocked on.
    op.comm->setOpLabel(ops.size() == 1 ? "point-to-point" : "grouped point-to-point");
    post(op);
  }
  auto allFinished = [&] {
    for (const P2POp& op : ops) {
      if (!op.finished) return false;
    }
    return true;
  };
  // Any communicator with an unfinished operation: the one whose doorbell we sleep on (the
  // others are re-checked at every wake-up, at least every futex slice).
  auto sleepOn = [&]() -> Communicator& {
    for (const P2POp& op : ops) {
      if (!op.finished) return *op.comm;
    }
    return *comms.front();
  };
  driveUntil(comms, allFinished, sleepOn, [&](auto&& f) {
    for (P2POp& op : ops) f(op);
  });
}

void waitFor(P2POp& op) {
  if (op.finished) return;
  Communicator& c = *op.comm;
  try {
    driveUntil(
        {&c}, [&] { return op.finished; }, [&]() -> Communicator& { return c; },
        [&](auto&& f) { f(op); });
  } catch (const Error&) {
    // driveUntil abandoned every pending operation, ours included, with the error.
  }
}

int recvAnySource(Communicator& c, void* recv, size_t count, spyrecclDataType_t dtype, int tag) {
  c.setOpLabel("recv from any source");
  // The next message of each incoming stream is the chunk at the receiver's consumed count;
  // pick the lowest rank whose next message carries `tag`. Streams that a pending receive
  // already claims are skipped: their next message is that receive's.
  auto claimed = [&](int p) {
    for (const P2POp* op : c.pendingP2P()) {
      if (!op->isSend && op->peer == p) return true;
    }
    return false;
  };
  auto probe = [&]() -> int {
    for (int p = 0; p < c.nranks(); ++p) {
      if (p == c.rank()) continue;
      const uint32_t consumed = c.p2p(p).consumedChunks;
      if (inbox(c, p)->posted.load(std::memory_order_acquire) == consumed) continue;
      const ChunkHeader* h = c.layout().slot(c.base(), p, c.rank(), consumed);
      if (h->offset == 0 && h->tag == tag && !claimed(p)) return p;
    }
    return -1;
  };
  // Pending requests move meanwhile: the message we wait for may come from a peer that is
  // itself waiting for one of them.
  const std::function<bool()> ready = [&] { return probe() >= 0 || anyCanProgress(c); };
  int source;
  try {
    while ((source = probe()) < 0) {
      if (progress(c)) continue;
      transport::waitUntil(transport::pairwise(c.spin()), &c.control(c.rank())->doorbell,
                           &c.control(c.rank())->doorbellSleepers, ready,
                           [&](int64_t waited, bool full) {
                             c.checkWait(
                                 waited, full, nullptr, ready,
                                 [&] { return format("a message with tag %d from any rank", tag); },
                                 [](int) { return true; });
                             checkPending(c, nowNs(), full, ready);
                           });
    }
  } catch (const Error& e) {
    abandonPending(c, e);
    throw;
  }
  std::vector<P2POp> ops(1);
  ops[0].comm = &c;
  ops[0].isSend = false;
  ops[0].peer = source;
  ops[0].tag = tag;
  ops[0].dtype = dtype;
  ops[0].count = count;
  ops[0].recvBuf = static_cast<uint8_t*>(recv);
  runP2P(ops);
  return source;
}

}  // namespace spyreccl::algorithms

namespace spyreccl {

void Communicator::progressPendingP2P() noexcept {
  try {
    algorithms::progress(*this);
  } catch (...) {
    // progress() abandoned the pending operations with the error; their owners report it.
  }
}

}  // namespace spyreccl
