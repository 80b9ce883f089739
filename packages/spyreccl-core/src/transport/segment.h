// POSIX shared-memory segment of one communicator: exclusive creation by rank 0,
// validated attachment by the other ranks, unlink once everyone is attached.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "transport/layout.h"

namespace spyreccl::transport {

class Segment {
 public:
  // Creates `name` with O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, sizes and maps it, and
  // constructs the header and every shared object in place. `ready` is NOT yet published:
  // the caller does that (publishReady) after registering itself.
  static std::unique_ptr<Segment> create(const std::string& name, const Layout& layout,
                                         const uint8_t nonce[16]);

  // Opens the segment rank 0 creates, retrying (100 us .. 1 ms sleeps) until it exists and
  // is ready or `deadlineNs` (CLOCK_MONOTONIC) passes (spyrecclTimeout). Checks that the
  // file is owned by this user with mode 0600 and that the header matches `expected` and
  // `nonce` (spyrecclInvalidUsage "stale or foreign segment" otherwise). `who` ("rank 2")
  static std::unique_ptr<Segment> attach(const std::string& name, const Layout& expected,
                                         const uint8_t nonce[16], int64_t deadlineNs,
                                         const std::string& who);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  uint8_t* base() const { return base_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base_); }

  void publishReady() { header()->ready.store(1, std::memory_order_release); }

  // Removes the name from /dev/shm (the mapping stays valid). Idempotent; ENOENT (another
  // rank was first) is not an error.
  void unlink();

 private:
  Segment(std::string name, uint8_t* base, size_t size)
      : name_(std::move(name)), base_(base), size_(size) {}

  std::string name_;
  uint8_t* base_;
  size_t size_;
  bool unlinked_ = false;
};

// "/spyreccl-<32 hex digits of the nonce>"
std::string segmentName(const uint8_t nonce[16]);

}  // namespace spyreccl::transport
