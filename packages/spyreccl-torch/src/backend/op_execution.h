// op_execution.h — how the steps of an operation reach the core (each core call in order,
// consecutive sends and receives inside one spyrecclGroupStart/End) and OpJob, the
// progress-thread job that runs a queued operation and completes its Work. Shared by
// ProcessGroupSpyreccl's submission (submission.cpp) and coalescing (coalescing.cpp).
#pragma once

#include <chrono>
#include <exception>
#include <memory>
#include <vector>

#include <ATen/ThreadLocalState.h>

#include "backend/communicator.h"
#include "backend/errors.h"
#include "backend/peer_pipeline.h"
#include "backend/process_group_spyreccl.hpp"
#include "backend/progress_thread.h"
#include "backend/work.h"

namespace spyreccl_torch {

bool groupable(const Step& step);

// A lone send or receive: OpJob::run() posts it and leaves it in flight.
bool lonePeerCall(const std::vector<Step>& steps);

// Bytes an operation moves per rank: the larger of its input and its output.
size_t payloadBytes(const OpRecord& op);

void runSteps(std::vector<Step>& steps, Communicator& comm);

// Refuses to start an operation on an aborted communicator, saying why; `description()`
// names the operation, built only then.
template <typename Description>
void checkNotAborted(const Communicator& comm, Description&& description) {
  if (comm.aborted()) {
    std::rethrow_exception(makeDistBackendError("spyreccl: " + description() +
                                                " was not run because the communicator was "
                                                "aborted: " +
                                                comm.abortReason()));
  }
}

void checkNotAborted(const WorkSpyreccl& work, const Communicator& comm);

// Runs the steps of one operation against `comm` under `timeout` (checkNotAborted first)
// and throws its errors: the part that executeOp and ProcessGroupSpyreccl::runWaited share.
template <typename Description>
void runOp(std::vector<Step>& steps, std::chrono::milliseconds timeout, Communicator& comm,
           Description&& description) {
  checkNotAborted(comm, description);
  comm.useTimeout(timeout);
  runSteps(steps, comm);
}

// Runs the steps of one operation against `comm` and completes `work` with the outcome, on
// whichever thread executes the operation (the progress thread, or the caller for the
// inline fast path). Errors never escape: wait() rethrows them.
void executeOp(WorkSpyreccl& work, std::vector<Step>& steps, std::chrono::milliseconds timeout,
               Communicator& comm, const std::shared_ptr<int>& sourceRank) noexcept;

// A queued operation: executes its steps on the progress thread and completes its Work.
//
// A lone send or receive (dist.isend / dist.irecv / dist.send / dist.recv) is posted
// without blocking and stays in flight on the progress thread until the core reports it
// complete: jobs queued after it (the matching receive of a ring exchange, say) then run
// while it waits for its peer, as with NCCL or gloo. Blocking here would deadlock every
// rank of an unbatched ring whose messages exceed the staging slots: each progress thread
// would wait in its send for a peer whose receive is queued behind that peer's own send.
// A staged one larger than a chunk is posted as a PeerPipeline (peer_pipeline.h), in flight
// the same way.
class OpJob : public ProgressThread::Job {
 public:
  OpJob(c10::intrusive_ptr<WorkSpyreccl> work, std::vector<Step> steps,
        std::chrono::milliseconds timeout, std::shared_ptr<Communicator> comm,
        std::shared_ptr<int> sourceRank = nullptr)
      : work_(std::move(work)),
        steps_(std::move(steps)),
        timeout_(timeout),
        comm_(std::move(comm)),
        sourceRank_(std::move(sourceRank)),
        tls_() {}

  // The inline start of a lone send or receive (see ProcessGroupSpyreccl::postsInline): posts
  // it on the calling thread and completes it there when the core already finished it (a
  // send that fit the staging slot, a receive whose message had arrived). Returns true when
  // the job is finished; otherwise it is parked (ProgressThread::park) and poll(), on its
  // waiter's thread or on the progress thread, completes it; run() is not called then.
  bool startInline() noexcept;

  bool run() noexcept override;

  bool finishesInRun() const noexcept override { return !postedInline_ && !lonePeerCall(steps_); }

  bool poll() noexcept override;

  void cancel(std::exception_ptr reason) noexcept override;

 private:
  // Starts the lone point-to-point step; poll() finishes it. Returns whether the job
  // already finished (it failed to start).
  bool postRequest() noexcept;

  c10::intrusive_ptr<WorkSpyreccl> work_;
  spyrecclRequest_t request_ = nullptr;     // the posted send/receive, until it completes
  std::unique_ptr<PeerPipeline> pipeline_;  // instead of request_: a pipelined one
  bool postedInline_ = false;               // startInline() posted request_
  std::vector<Step> steps_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<int> sourceRank_;
  at::ThreadLocalState tls_;
  flight::Ref trace_;  // set once the request is posted: failures before that are not its own
};

}  // namespace spyreccl_torch
