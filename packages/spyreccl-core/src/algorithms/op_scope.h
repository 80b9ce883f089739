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
  void succeed() {
    ok_ = true;
    if (timedNs_ != 0) {
      const int64_t now = nowNs();
      c_.pathAdvisor().record(d_.kind, timedBytes_, timedCma_, now - timedNs_, now);
    }
  }
  // From `startNs` to succeed(), the collective ran on the path chosen by the ranks' votes:
  // its time is a sample of that path's speed (algorithms/path_advisor.h).
  void timePath(size_t bytes, bool cma, int64_t startNs) {
    timedNs_ = startNs;
    timedBytes_ = bytes;
    timedCma_ = cma;
  }

 private:
  Communicator& c_;
  transport::Descriptor d_;
  bool ok_ = false;
  bool timedCma_ = false;
  int64_t timedNs_ = 0;
  size_t timedBytes_ = 0;
};

inline size_t ceilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

// Bytes of a chunk that each rank may use when a step carries one slot per rank: a
// cache-line multiple so that slots never share lines and stay vector aligned.
inline size_t slotBytes(const Communicator& c) {
  return c.layout().chunkBytes() / c.nranks() / transport::kCacheLine * transport::kCacheLine;
}

}  // namespace spyreccl::algorithms
