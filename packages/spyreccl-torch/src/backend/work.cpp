// work.cpp — see work.h.
#include "backend/work.h"

#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>

#include "backend/communicator.h"
#include "backend/errors.h"

namespace spyreccl_torch {

WorkSpyreccl::WorkSpyreccl(int rank, c10d::OpType opType, uint64_t seq, const char* profilingTitle,
                           const std::optional<std::vector<at::Tensor>>& inputs,
                           std::vector<c10::Device> devices, std::shared_ptr<Communicator> comm,
                           const char* opName, std::shared_ptr<const std::string> groupLabel,
                           const char* prefix, bool submitted)
    : c10d::Work(rank, opType, profilingTitle, inputs),
      seq_(seq),
      future_(
          c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(), std::move(devices))),
      comm_(std::move(comm)),
      opName_(opName),
      prefix_(prefix),
      groupLabel_(std::move(groupLabel)),
      submitted_(submitted) {}

WorkSpyreccl::~WorkSpyreccl() = default;

std::string describeOperation(const char* prefix, const char* opName, uint64_t seq,
                              const std::string& groupLabel) {
  return std::string(prefix) + opName + " #" + std::to_string(seq) + " on " + groupLabel;
}

std::string WorkSpyreccl::description() const {
  return describeOperation(prefix_, opName_, seq_, *groupLabel_);
}

void WorkSpyreccl::addOutputs(const std::vector<at::Tensor>& outputs) {
  outputs_.insert(outputs_.end(), outputs.begin(), outputs.end());
}

std::vector<at::Tensor> WorkSpyreccl::result() {
  wait();
  return outputs_;
}

void WorkSpyreccl::setRunner(std::function<bool()> runner) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!completed_) {
    runner_ = std::move(runner);
  }
}

bool WorkSpyreccl::wait(std::chrono::milliseconds timeout) {
  if (!submitted_.load()) {
    // A placeholder until endCoalescing (see work.h); waiting for the batch here would
    // wait forever, since only the caller can submit it.
    return true;
  }
  // Only an unbounded wait may run the operation itself: a wait with its own timeout must
  // be able to give up on it (below), which it could not do from inside the operation.
  std::function<bool()> runner;
  if (timeout == kNoTimeout) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!completed_) {
      runner = std::move(runner_);
    }
    runner_ = nullptr;
  }
  if (runner) {
    // Not under mutex_: running the operation completes this Work, which takes it.
    (void)runner();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout == kNoTimeout) {
    cv_.wait(lock, [this] { return completed_; });
  } else if (!cv_.wait_for(lock, timeout, [this] { return completed_; })) {
    lock.unlock();
    const std::string message = "spyreccl: wait() on " + description() + " timed out after " +
                                std::to_string(timeout.count()) +
                                " ms; the communicator was aborted because the operation can "
                                "no longer complete consistently on all ranks";
    // Like NCCL's watchdog: a rank that gave up must not leave peers blocked forever.
    comm_->abort(message);
    std::rethrow_exception(makeDistBackendError(message));
  }
  if (exception_) {
    std::rethrow_exception(exception_);
  }
  return true;
}

void WorkSpyreccl::abort() {
  comm_->abort("spyreccl: Work.abort() was called on " + description());
}

int WorkSpyreccl::sourceRank() const {
  const int rank = sourceRank_.load();
  TORCH_CHECK(rank >= 0, "spyreccl: sourceRank() is only available on the completed Work of a ",
              "recv from any source (", description(), ")");
  return rank;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkSpyreccl::getFuture() { return future_; }

void WorkSpyreccl::finishSuccess() {
  // Future first (as gloo does): once isCompleted() is true, the future's value is set.
  try {
    future_->markCompleted(c10::IValue(outputs_));
  } catch (...) {
    // E.g. the future's device checks rejected an output; the Work must still complete.
    const std::exception_ptr error = std::current_exception();
    future_->setErrorIfNeeded(error);
    finish(error);
    return;
  }
  finish();
}

void WorkSpyreccl::finishError(std::exception_ptr error) {
  future_->setErrorIfNeeded(error);
  finish(error);
}

}  // namespace spyreccl_torch
