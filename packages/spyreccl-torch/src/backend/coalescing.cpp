// coalescing.cpp — ProcessGroupSpyreccl's coalescing batches: startCoalescing opens one,
// submit() (submission.cpp) adds the operations issued meanwhile to it, endCoalescing queues
// them as one job with one Work.
#include <memory>
#include <vector>

#include <c10/util/Exception.h>

#include "backend/op_execution.h"
#include "backend/process_group_spyreccl.hpp"
#include "backend/work.h"

namespace spyreccl_torch {

void ProcessGroupSpyreccl::startCoalescing() {
  checkUsable("startCoalescing");
  TORCH_CHECK(!coalescing_, "spyreccl startCoalescing: a coalescing batch is already open on ",
              label(), "; call endCoalescing first");
  coalescing_ = true;
  batchWork_.reset();
  batch_ = OpRecord{};
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::endCoalescing() {
  TORCH_CHECK(coalescing_, "spyreccl endCoalescing: no coalescing batch is open on ", label(),
              "; call startCoalescing first");
  coalescing_ = false;
  checkUsable("endCoalescing");
  c10::intrusive_ptr<WorkSpyreccl> work = std::move(batchWork_);
  batchWork_.reset();
  if (!work) {
    // An empty batch still returns a Work (callers append and wait on it); it completes in
    // queue order without touching the communicator.
    const uint64_t seq = ++seq_;
    work = c10::make_intrusive<WorkSpyreccl>(
        rank_, c10d::OpType::COALESCED, seq, "spyreccl:coalesced", std::nullopt,
        std::vector<c10::Device>{}, comm_, "coalesced batch", label_, "empty ");
  }
  work->markSubmitted();
  uint64_t ticket = 0;
  {
    std::lock_guard<std::mutex> submitting(submitMutex_);
    const bool lone = lonePeerCall(batch_.steps);
    ticket = post(work,
                  std::make_unique<OpJob>(work, std::move(batch_.steps),
                                          effectiveTimeout(batch_.timeout), comm_),
                  lone);
  }
  batch_ = OpRecord{};
  if (progress_->runningHere()) {
    (void)progress_->runNested(ticket);  // issued by a completion callback: see submit()
  }
  return work;
}

}  // namespace spyreccl_torch
