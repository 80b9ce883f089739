// Layout of the shared-memory segment of one communicator.
//
//   [SegmentHeader]                       identity + attach bookkeeping + futex sleepers
//   [RankControl x nranks]                step counter, announced descriptors, published
//                                         arena offsets, status flags
//   [staging: nranks x 2 x chunkBytes]    collective data, double-buffered by step parity
//   [mailbox: nranks x nranks pairs]      send/recv: control + 2 slots of p2pChunkBytes
//   [eager: nranks]                       one-way small broadcasts: each rank's ring of
//                                         slots as a root, its recent calls, and how many
//                                         of every root's slots it has read
//
// Every structure that one rank writes and others poll is cache-line aligned so that
// unrelated updates never share a line; staging buffers are page aligned (memcpy/AVX
// friendly and no false sharing at all). All fields are fixed-size types: the segment is
// shared between processes built from the same library version (checked by the header).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace spyreccl::transport {

constexpr size_t kCacheLine = 64;
constexpr size_t kPage = 4096;
constexpr uint32_t kSegmentMagic = 0x53505347u;  // "SPSG"
constexpr uint32_t kSegmentVersion = 8;

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters must be lock-free");

struct alignas(kCacheLine) SegmentHeader {
  uint32_t magic;
  uint32_t version;
  uint8_t nonce[16];
  uint32_t nranks;
  uint32_t ownerUid;
  uint64_t chunkBytes;
  uint64_t p2pChunkBytes;
  uint64_t totalBytes;
  std::atomic<uint32_t> ready;     // rank 0 finished writing the header
  std::atomic<uint32_t> attached;  // number of ranks that attached
  // Waiters currently blocked in FUTEX_WAIT on a word without a counter of its own (a
  // root's wait for its ring's read counts): posters of those words only pay for the
  // FUTEX_WAKE syscall when this is non-zero. The hot words (step, doorbell, a ring's
  // posted count) have their own counters beside them.
  alignas(kCacheLine) std::atomic<uint32_t> sleepers;
};

// What a rank announces for the collective it is running: every rank compares every
// peer's descriptor with its own in the first step of each collective.
struct Descriptor {
  uint64_t seq;   // collective sequence number on this communicator (1, 2, ...)
  uint32_t kind;  // algorithms::Kind
  int32_t dtype;
  uint64_t count;
  int32_t root;    // -1 when the collective has none
  int32_t redop;   // -1 when the collective does not reduce
  uint64_t extra;  // kind specific; 0 when unused
  // Digest of the one-way small broadcasts this rank completed before this collective
  // (algorithms/eager.h): compared like the arguments, so that small broadcasts whose
  // mismatch no rank could see in the call itself fail at the next collective that waits
  // for every rank. Not part of the call's arguments (algorithms::sameCall ignores it).
  uint64_t eagerDigest;
};
constexpr int kDescriptorWords = sizeof(Descriptor) / sizeof(uint64_t);
static_assert(sizeof(Descriptor) % sizeof(uint64_t) == 0, "a descriptor is whole words");

// Values of RankControl::status (a rank only ever moves away from kStatusActive).
enum : uint32_t {
  kStatusActive = 0,
  kStatusAborted = 1,   // spyrecclCommAbort was called
  kStatusFailed = 2,    // a call failed (result code in failCode)
  kStatusDeparted = 3,  // spyrecclCommDestroy was called
};

constexpr int kXferWords = 8;
// CPU affinity masks published at bootstrap: 1024 CPUs (glibc's cpu_set_t).
constexpr int kCpuMaskWords = 16;
constexpr size_t kFailTextBytes = 512;

struct alignas(kCacheLine) RankControl {
  // Collective progress: the last step this rank published. Own cache line: it is the
  // hottest word of the protocol (polled by every peer).
  alignas(kCacheLine) std::atomic<uint32_t> step;
  // Peers blocked in FUTEX_WAIT on `step`: this rank's publication pays for FUTEX_WAKE only
  // when non-zero. Per word rather than per segment, so that a rank asleep elsewhere (in a
  // later collective, on its doorbell) costs the others no system call; on the line the
  // poster has just written.
  std::atomic<uint32_t> stepSleepers;
  // Point-to-point doorbell: bumped by a peer that posted a chunk to this rank or
  // consumed a chunk this rank posted; blocked senders/receivers futex-wait on it.
  alignas(kCacheLine) std::atomic<uint32_t> doorbell;
  // This rank's threads blocked in FUTEX_WAIT on `doorbell` (as stepSleepers).
  std::atomic<uint32_t> doorbellSleepers;
  // Descriptors double-buffered by step parity, like the staging buffers (see design.md).
  alignas(kCacheLine) Descriptor desc[2];
  // Direct transfers (algorithms/direct.h): arena offsets, addresses and lengths of this
  // rank's buffers for the current collective (or a probe value), published with the step
  // like the descriptors and double-buffered by step parity for the same reason.
  alignas(kCacheLine) uint64_t xfer[2][kXferWords];
  alignas(kCacheLine) std::atomic<uint32_t> attached;
  std::atomic<uint32_t> status;
  std::atomic<int32_t> failCode;
  std::atomic<int32_t> pid;
  // Written once at bootstrap, before the rank counts itself attached: the CPUs this
  // rank's process may run on (cpuMaskKnown 0: sched_getaffinity failed), so that every
  // rank can tell whether the ranks oversubscribe the CPUs they have between them
  // (rendezvous/bootstrap.cc: ranks bound to a core each do not).
  uint32_t cpuMaskKnown;
  uint64_t cpuMask[kCpuMaskWords];
  // The first line of the error that failed this rank, written before status becomes
  // kStatusFailed (release): a peer that finds this rank failed names the cause, which
  // matters where this rank saw a mismatch that the peer could not (algorithms/eager.h).
  char failText[kFailTextBytes];
};

// Per ordered pair (src -> dst). `posted` is written by the sender only, `consumed` by
// the receiver only; slot i % 2 holds chunk i.
struct alignas(kCacheLine) MailboxControl {
  alignas(kCacheLine) std::atomic<uint32_t> posted;
  alignas(kCacheLine) std::atomic<uint32_t> consumed;
  // The receiver is blocked in a wait for message `waitingSeq - 1` (0: not waiting): a
  // sender may then hand it a message of up to two chunks as a single copy
  // (algorithms/p2p.cc), since it will be consumed right away.
  std::atomic<uint64_t> waitingSeq;
  // The receiver refused message `rejectedSeq - 1` (0: none) because it expected
  // (expectCount, expectDtype, expectTag): lets the sender report both sides.
  alignas(kCacheLine) std::atomic<uint64_t> rejectedSeq;
  uint64_t expectCount;
  int32_t expectDtype;
  int32_t expectTag;
};

// ChunkHeader::flags
enum : uint32_t {
  // The chunk carries no payload: the receiver copies the whole message from the sender's
  // memory arena at `arenaOffset`, and the sender waits until the chunk is consumed.
  kChunkDirect = 1u << 0,
  // With kChunkDirect: the buffer is ordinary memory of the sender and `arenaOffset` holds
  // its address, read with process_vm_readv (transport/cma.h) for exactly totalBytes.
  kChunkCma = 1u << 1,
};

// Header of one p2p chunk, followed by its payload in the same slot.
struct alignas(kCacheLine) ChunkHeader {
  uint64_t msgSeq;      // per-pair message number (0, 1, ...)
  uint64_t count;       // elements of the whole message
  uint64_t totalBytes;  // bytes of the whole message
  uint64_t offset;      // byte offset of this chunk in the message
  uint64_t bytes;       // payload bytes in this chunk
  int32_t dtype;
  int32_t tag;
  uint32_t flags;        // kChunk* bits
  uint64_t arenaOffset;  // kChunkDirect: the message's offset in the sender's arena
};
static_assert(sizeof(ChunkHeader) == kCacheLine, "a chunk header fills one cache line");

// ---- one-way small broadcasts (algorithms/eager.h) ----------------------------------------

// Slots in each rank's ring: how many small broadcasts a root may run ahead of the slowest
// receiver.
constexpr uint32_t kEagerSlots = 256;
// Largest payload of a one-way broadcast (bytes); larger ones take the step protocol.
constexpr size_t kEagerMaxBytes = 256;
// Calls of each rank kept readable by its peers (EagerControl::history).
constexpr uint32_t kHistoryCalls = 16;

// One slot of a root's ring: the broadcast's descriptor, then its payload.
struct alignas(kCacheLine) EagerSlot {
  Descriptor desc;
  uint64_t bytes;
  alignas(kCacheLine) uint8_t payload[kEagerMaxBytes];
};

// One call of a rank, readable by its peers while they wait: words of a Descriptor,
// atomics because the owner may overwrite an entry while a peer reads it (the reader then
// finds opSeq moved on by kHistoryCalls and discards what it read).
struct alignas(kCacheLine) HistoryEntry {
  std::atomic<uint64_t> words[kDescriptorWords];

  void store(const Descriptor& d) {
    uint64_t w[kDescriptorWords];
    std::memcpy(w, &d, sizeof d);
    for (int i = 0; i < kDescriptorWords; ++i) words[i].store(w[i], std::memory_order_relaxed);
  }
  Descriptor load() const {
    uint64_t w[kDescriptorWords];
    for (int i = 0; i < kDescriptorWords; ++i) w[i] = words[i].load(std::memory_order_relaxed);
    Descriptor d;
    std::memcpy(&d, w, sizeof d);
    return d;
  }
};

// Per rank. Written by its owner only; the consumed counters (one per root, after the
// struct) too.
struct alignas(kCacheLine) EagerControl {
  // Slots this rank has posted as a root (slot i % kEagerSlots holds the i-th).
  alignas(kCacheLine) std::atomic<uint32_t> posted;
  // Receivers blocked in FUTEX_WAIT on `posted` (as RankControl::stepSleepers).
  std::atomic<uint32_t> postedSleepers;
  // Sequence number of the latest collective this rank began (0: none): history[seq %
  // kHistoryCalls] holds its descriptor, written before this is released.
  alignas(kCacheLine) std::atomic<uint64_t> opSeq;
  HistoryEntry history[kHistoryCalls];
  // The latest one-way broadcast this rank completed and how many it completed: read by
  // peers in the descriptor exchange of a later collective (ordered by its step) to name
  // both sides when the ranks' broadcast digests differ.
  HistoryEntry lastEager;
  std::atomic<uint64_t> completed;
  EagerSlot slots[kEagerSlots];
};

inline size_t alignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Offsets of every region; a pure function of (nranks, chunkBytes, p2pChunkBytes), so
// every rank derives the same layout and validates the creator's total size against it.
class Layout {
 public:
  Layout() = default;
  Layout(int nranks, size_t chunkBytes, size_t p2pChunkBytes)
      : nranks_(nranks), chunkBytes_(chunkBytes), p2pChunkBytes_(p2pChunkBytes) {
    ranksOff_ = alignUp(sizeof(SegmentHeader), kPage);
    stagingOff_ = alignUp(ranksOff_ + sizeof(RankControl) * nranks, kPage);
    slotBytes_ = alignUp(sizeof(ChunkHeader) + p2pChunkBytes, kCacheLine);
    mailboxBytes_ = alignUp(sizeof(MailboxControl) + 2 * slotBytes_, kCacheLine);
    mailboxOff_ = alignUp(stagingOff_ + 2 * chunkBytes * nranks, kPage);
    eagerOff_ = alignUp(mailboxOff_ + mailboxBytes_ * nranks * nranks, kPage);
    eagerBytes_ =
        alignUp(sizeof(EagerControl) + sizeof(std::atomic<uint32_t>) * nranks, kCacheLine);
    total_ = alignUp(eagerOff_ + eagerBytes_ * nranks, kPage);
  }

  int nranks() const { return nranks_; }
  size_t chunkBytes() const { return chunkBytes_; }
  size_t p2pChunkBytes() const { return p2pChunkBytes_; }
  size_t totalBytes() const { return total_; }

  SegmentHeader* header(uint8_t* base) const { return reinterpret_cast<SegmentHeader*>(base); }
  RankControl* rank(uint8_t* base, int r) const {
    return reinterpret_cast<RankControl*>(base + ranksOff_) + r;
  }
  uint8_t* staging(uint8_t* base, int r, uint32_t parity) const {
    return base + stagingOff_ + (2 * static_cast<size_t>(r) + (parity & 1)) * chunkBytes_;
  }
  MailboxControl* mailbox(uint8_t* base, int src, int dst) const {
    return reinterpret_cast<MailboxControl*>(
        base + mailboxOff_ + mailboxBytes_ * (static_cast<size_t>(src) * nranks_ + dst));
  }
  ChunkHeader* slot(uint8_t* base, int src, int dst, uint32_t index) const {
    auto* mb = reinterpret_cast<uint8_t*>(mailbox(base, src, dst));
    return reinterpret_cast<ChunkHeader*>(mb + sizeof(MailboxControl) + (index & 1) * slotBytes_);
  }
  EagerControl* eager(uint8_t* base, int r) const {
    return reinterpret_cast<EagerControl*>(base + eagerOff_ + eagerBytes_ * static_cast<size_t>(r));
  }
  // How many of rank `root`'s slots rank `r` has read (written by r only).
  std::atomic<uint32_t>* eagerConsumed(uint8_t* base, int r, int root) const {
    return reinterpret_cast<std::atomic<uint32_t>*>(reinterpret_cast<uint8_t*>(eager(base, r)) +
                                                    sizeof(EagerControl)) +
           root;
  }
  static uint8_t* payload(ChunkHeader* h) { return reinterpret_cast<uint8_t*>(h + 1); }
  static const uint8_t* payload(const ChunkHeader* h) {
    return reinterpret_cast<const uint8_t*>(h + 1);
  }

 private:
  int nranks_ = 0;
  size_t chunkBytes_ = 0, p2pChunkBytes_ = 0;
  size_t ranksOff_ = 0, stagingOff_ = 0, mailboxOff_ = 0, slotBytes_ = 0, mailboxBytes_ = 0;
  size_t eagerOff_ = 0, eagerBytes_ = 0;
  size_t total_ = 0;
};

}  // namespace spyreccl::transport
