// Scope of one collective: assigns its sequence number, records it in the flight recorder
// and marks it done or failed when the scope ends.
#pragma once

#include <cstddef>

#include "comm.h"

namespace spyreccl::algorithms {

class OpScope {
 public:
  OpScope(Communicator& c, const transport::Descriptor& d) : c_(c), d_(c.beginOp(d)) {}
  ~OpScope() { c_.endOp(ok_); }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

  const transport::Descriptor* desc() const { return &d_; }
  void succeed() { ok_ = true; }

 private:
  Communicator& c_;
  transport::Descriptor d_;
  bool ok_ = false;
};

inline size_t ceilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

// Bytes of a chunk that each rank may use when a step carries one slot per rank: a
// cache-line multiple so that slots never share lines and stay vector aligned.
inline size_t slotBytes(const Communicator& c) {
  return c.layout().chunkBytes() / c.nranks() / transport::kCacheLine * transport::kCacheLine;
}

}  // namespace spyreccl::algorithms
