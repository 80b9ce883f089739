// communicator.cpp — see communicator.h.
#include "backend/communicator.h"

#include <vector>

#include "backend/errors.h"

namespace spyreccl_torch {

Communicator::Communicator(spyrecclComm_t comm, std::chrono::milliseconds timeout,
                           std::string label)
    : comm_(comm), label_(std::move(label)), currentTimeout_(timeout) {}

Communicator::~Communicator() {
  // Local release; peers still waiting on us get spyrecclRemoteError from the core.
  (void)spyrecclCommDestroy(comm_);
}

void Communicator::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (abortReason_.empty()) {
      abortReason_ = reason;
    }
  }
  aborted_.store(true);
  (void)spyrecclCommAbort(comm_);
}

std::string Communicator::abortReason() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return abortReason_;
}

void Communicator::useTimeout(std::chrono::milliseconds timeout) {
  if (timeout == currentTimeout_ || timeout.count() <= 0) {
    return;
  }
  checkCore(spyrecclCommSetTimeout(comm_, timeout.count()), comm_,
            "setting the communicator timeout to " + std::to_string(timeout.count()) + " ms");
  currentTimeout_ = timeout;
}

std::string Communicator::dumpState() const {
  std::vector<char> buffer(1 << 16, '\0');
  if (spyrecclCommDumpState(comm_, buffer.data(), buffer.size()) != spyrecclSuccess) {
    return std::string("(state dump failed: ") + spyrecclGetLastError(comm_) + ")";
  }
  return std::string(buffer.data());
}

}  // namespace spyreccl_torch
