// The process's shareable memory arena: host memory that peer ranks can map and read
// directly, so that collectives on it move every byte between processes once.
//
// Why an arena and not per-buffer registration: a staged transfer through the
// communicator's segment copies each byte twice, and the kernel's cross-memory attach
// (process_vm_readv) copies page by page at about half of memcpy speed on the machines we
// measured (docs/notes/core-copies.md) — no better than two copies. Memory that is *born*
// shareable avoids both: the arena is one sparse memfd; peers map it once (read-only)
// and then read any buffer in it with plain loads.
//
// Layout: one memfd the size of physical memory (sparse: pages exist only once touched),
// mapped at a fixed address for the process's lifetime; a best-fit allocator with
// coalescing hands out page-aligned blocks. Freed blocks stay resident for reuse up to a
// budget (SPYRECCL_ARENA_RETAIN_BYTES, default an eighth of physical memory, at most
// 1 GiB); beyond it their pages are punched out of the file and go back to the system, so
// the footprint is live memory plus the budget; trim() returns every freed page.
//
// fork(): a child must not share its parent's arena (tensors would silently alias across
// the two processes, where fork promises a private copy). A pthread_atfork handler remaps
// the arena MAP_PRIVATE at the same address in the child: every inherited pointer stays
// valid, pages become copy-on-write, and nothing the child writes reaches the parent, at
// no cost at fork time (a DataLoader worker forked after the model was built copies
// nothing). The child's arena is then private — never shared with peers, so collectives
// there are staged — and, as with any MAP_PRIVATE file mapping, a page the child has not
// written yet still shows the parent's later writes to it.
//
// Thread-safety: every member function may be called from any thread.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace spyreccl::memory {

class Arena {
 public:
  // The process-wide arena, created on first use. nullptr when the system refuses a
  // memfd or the reservation (then callers fall back to ordinary memory).
  static Arena* instance();
  // The arena if it has been created already; never creates one.
  static Arena* existing();

  // A block of at least `bytes` (page aligned), or nullptr when the arena is exhausted.
  void* allocate(size_t bytes);
  // Frees a block returned by allocate(). Returns false (and does nothing) when `p` is
  // not the start of a live block.
  bool release(void* p);

  // Offset of [p, p + bytes) in the arena, or -1 when the range is not inside it.
  int64_t offsetOf(const void* p, size_t bytes) const {
    auto a = reinterpret_cast<uintptr_t>(p);
    auto b = reinterpret_cast<uintptr_t>(base_);
    if (a < b || a - b > size_ || bytes > size_ - (a - b)) return -1;
    return static_cast<int64_t>(a - b);
  }
  // Offset of [p, p + bytes) in this process's arena when peers may read it there (the
  // arena exists, is not a forked child's private copy, and holds the whole range); -1
  // otherwise, including for p == NULL.
  static int64_t sharedOffsetOf(const void* p, size_t bytes) {
    const Arena* a = existing();
    return a != nullptr && a->shareable() && p != nullptr ? a->offsetOf(p, bytes) : -1;
  }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  // False in a forked child (see above): peers must not map this arena then.
  bool shareable() const { return shareable_; }
  // Bytes currently handed out (for tests and diagnostics).
  size_t bytesInUse() const;
  // Returns the pages of every freed block to the system (those kept resident for reuse);
  // the number of bytes of free address space below the high-water mark it punched (0 in
  // a forked child, whose pages are its parent's).
  size_t trim();
  // The budget of freed memory kept resident (see above).
  size_t retainBudget() const { return retainBudget_; }

 private:
  Arena(int fd, uint8_t* base, size_t size);
  ~Arena() = default;  // lives until the process exits: peers may still map it
  static std::atomic<Arena*>& existingArena();

  struct Impl;
  static void lockForFork();
  static void unlockAfterFork();
  static void privatizeInChild();
  // Gives the pages of [off, off + len) back to the system (the caller holds the lock and
  // has checked that this arena is shareable).
  void punch(size_t off, size_t len) const;
  int fd_;
  bool shareable_ = true;
  size_t retainBudget_ = 0;
  uint8_t* const base_;
  const size_t size_;
  Impl* impl_;
};

// Maps the arena of process `pid` (whose memfd is its descriptor `fd`) read-only into
// this process. Returns the address, or nullptr with *err set to the errno of the failing
// step (pidfd_open / pidfd_getfd / open of /proc/<pid>/fd/<fd> / fstat / mmap). The
// caller owns the mapping (munmap(addr, *bytes)).
const uint8_t* mapPeerArena(pid_t pid, int fd, size_t* bytes, int* err);

}  // namespace spyreccl::memory
