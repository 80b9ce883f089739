// submission.cpp — how ProcessGroupSpyreccl hands an operation over: numbering it, adding it
// to an open coalescing batch, running it on the calling thread (the inline fast path) or
// queueing it on the progress thread, and the profiler's param-comms record.
#include <algorithm>
#include <future>
#include <memory>
#include <mutex>

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include "backend/communicator.h"
#include "backend/errors.h"
#include "backend/functional_scope.h"
#include "backend/op_execution.h"
#include "backend/process_group_spyreccl.hpp"
#include "backend/progress_thread.h"
#include "backend/work.h"

namespace spyreccl_torch {
namespace {

// Runs an arbitrary communicator call in queue order and reports its outcome.
class CallJob : public ProgressThread::Job {
 public:
  CallJob(std::function<void(spyrecclComm_t)> fn, std::chrono::milliseconds timeout,
          std::shared_ptr<Communicator> comm)
      : fn_(std::move(fn)), timeout_(timeout), comm_(std::move(comm)) {}

  std::future<void> result() { return promise_.get_future(); }

  bool run() noexcept override {
    try {
      comm_->useTimeout(timeout_);
      fn_(comm_->get());
      promise_.set_value();
    } catch (...) {
      promise_.set_exception(std::current_exception());
    }
    return true;
  }

  void cancel(std::exception_ptr reason) noexcept override {
    promise_.set_exception(reason ? reason : makeDistBackendError("spyreccl: operation cancelled"));
  }

 private:
  std::function<void(spyrecclComm_t)> fn_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Communicator> comm_;
  std::promise<void> promise_;
};

}  // namespace

void ProcessGroupSpyreccl::recordParamComms(const OpRecord& op, uint64_t seq) {
  // Emits a "record_param_comms" event carrying the collective's name, sizes and dtype; it
  // spans the enqueueing. Building it costs several microseconds (a shared debug-info
  // object, IValue lists of the tensors), and only record-function callbacks (profiler,
  // execution trace observer) read it: skip it when none is registered.
  if (!at::hasCallbacks()) {
    return;
  }
  SPYRECCL_RECORD_PARAM_COMMS(static_cast<int>(seq), std::make_tuple(pg_uid_, pg_desc_), op.inputs,
                              op.outputs, rank_, op.name, op.inNelems, op.outNelems, op.dtype,
                              op.inSplitSizes, op.outSplitSizes, globalRankStart_,
                              globalRankStride_, size_, op.asyncOp);
}

namespace {

// What runsInline() decides, and why not where it matters: kBusy when `op` would run inline
// but for the progress thread having work.
enum class InlineVerdict { kRun, kBusy, kNo };

// The largest payload that `op`'s kind of call may run inline (0: none; see runsInline()).
size_t inlineBound(const OpRecord& op, size_t syncMaxBytes, size_t functionalMaxBytes) {
  if (!op.asyncOp) {
    return syncMaxBytes;
  }
  if (inFunctionalCall()) {
    return waitFollows() ? std::max(syncMaxBytes, functionalMaxBytes) : functionalMaxBytes;
  }
  return 0;
}

InlineVerdict inlineVerdict(const OpRecord& op, size_t bound, const ProgressThread& progress) {
  if (bound == 0 || payloadBytes(op) > bound) {
    return InlineVerdict::kNo;
  }
  for (const Step& step : op.steps) {
    if (step.peerCall) {
      return InlineVerdict::kNo;
    }
  }
  // Last, and read once: the only condition that depends on thread scheduling (the
  // progress thread retires a job just after completing its Work, so a caller woken by
  // that completion may still find it busy).
  return progress.idle() ? InlineVerdict::kRun : InlineVerdict::kBusy;
}

}  // namespace

bool ProcessGroupSpyreccl::runsInline(const OpRecord& op) const {
  // Inline only when it cannot be observed except as lower latency:
  //  - a collective: an inline blocking send could deadlock an exchange whose matching
  //    receive the caller posts next (point-to-point keeps to the progress thread);
  //  - nothing queued or running on the progress thread, so issue order is kept and the
  //    communicator is used by one thread at a time (idle() orders us after its last job,
  //    and submitMutex_, held by the caller, keeps other threads from posting meanwhile);
  //  - a payload within the bound of its kind:
  //    * synchronous calls (async_op=False) wait on the Work right away, so blocking in the
  //      call instead of in wait() changes nothing for them: up to inlineMaxBytes_
  //      (kDefaultInlineMaxBytes);
  //    * functional collectives (DTensor, FSDP2, compiled graphs) are asynchronous, and
  //      their callers may place computation between the call and its wait_tensor, which
  //      must overlap the transfer: only messages whose transfer takes about as long as the
  //      hand-off it saves run inline, up to inlineFunctionalMaxBytes_ — unless the caller
  //      says that the wait comes next (WaitFollowsScope: a compiled graph with nothing
  //      between the two), which makes them synchronous calls in all but name;
  //    * dist.*(async_op=True) never: its Work may be polled or waited on with a timeout
  //      of its own (WorkSpyreccl::wait runs it on the waiting thread instead, when the
  //      progress thread has not started it yet).
  return inlineVerdict(op, inlineBound(op, inlineMaxBytes_, inlineFunctionalMaxBytes_),
                       *progress_) == InlineVerdict::kRun;
}

bool ProcessGroupSpyreccl::postsInline(const OpRecord& op) const {
  // A lone send or receive is posted without blocking (the core's requests), so posting it
  // on the calling thread can never deadlock, whatever the caller does next; it saves the
  // hand-off to the progress thread, and when the core completes it at once (a send that
  // fits the staging slots, a receive whose message is there) the hand-off back as well;
  // otherwise it is parked for its waiter (submit()). Same conditions as runsInline()
  // otherwise: the progress thread idle (issue order, one thread on the communicator) and
  // a payload within the inline bound. Posting copies at most what fits the two staging
  // slots of the pair (2 x 256 KiB; a larger send from arena memory posts only its
  // address), work that a synchronous send does anyway.
  if (inlineMaxBytes_ == 0 || op.steps.size() != 1 || !groupable(op.steps[0]) ||
      !progress_->idle()) {
    return false;
  }
  return payloadBytes(op) <= inlineMaxBytes_;
}

namespace {

// The Work of operations run without one (runWaited): completed and successful for good.
class CompletedWork final : public c10d::Work {
 public:
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
};

}  // namespace

const c10::intrusive_ptr<c10d::Work>& ranWithoutWork() {
  static const c10::intrusive_ptr<c10d::Work> work = c10::make_intrusive<CompletedWork>();
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::submit(OpRecord op) {
  if (WorkOptionalScope::flag() && runWaited(op)) {
    return ranWithoutWork();
  }
  const uint64_t seq = numberOp(op);
  recordParamComms(op, seq);
  // The Work's constructor opens the asynchronous range named op.profilingTitle, which ends
  // when the operation completes. Without callbacks there is nobody to record it.
  const char* profilingTitle = at::hasCallbacks() ? op.profilingTitle : nullptr;

  if (coalescing_) {
    if (!batchWork_) {
      batch_.devices = op.devices;
      batchWork_ = c10::make_intrusive<WorkSpyreccl>(
          rank_, c10d::OpType::COALESCED, seq, "spyreccl:coalesced", op.inputs, op.devices, comm_,
          op.name, label_, "coalesced batch starting with ", /*submitted=*/false);
      batch_.timeout = op.timeout;
    } else if (!op.devices.empty()) {
      if (batch_.devices.empty()) {
        TORCH_CHECK(false, "spyreccl ", op.name,
                    ": a coalescing batch must start with an operation on tensors when it "
                    "mixes tensor operations with barriers");
      }
      TORCH_CHECK(op.devices == batch_.devices, "spyreccl ", op.name, ": tensors are on ",
                  op.devices[0].str(), " but the open coalescing batch uses ",
                  batch_.devices[0].str(), "; all operations of a batch must use one device");
    }
    for (auto& step : op.steps) {
      batch_.steps.push_back(std::move(step));
    }
    batchWork_->addOutputs(op.outputs);
    return batchWork_;
  }

  auto work = c10::make_intrusive<WorkSpyreccl>(rank_, op.type, seq, profilingTitle, op.inputs,
                                                std::move(op.devices), comm_, op.name, label_);
  work->addOutputs(op.outputs);
  std::unique_lock<std::mutex> submitting(submitMutex_);
  if (runsInline(op)) {
    // The fast path of small synchronous collectives: no hand-off to the progress thread
    // (two thread wake-ups, tens of microseconds on a loaded machine).
    executeOp(*work, op.steps, effectiveTimeout(op.timeout), *comm_, op.sourceRank);
    return work;
  }
  const bool postInline = postsInline(op);
  const bool lone = lonePeerCall(op.steps);
  auto job = std::make_unique<OpJob>(work, std::move(op.steps), effectiveTimeout(op.timeout), comm_,
                                     std::move(op.sourceRank));
  if (postInline) {
    if (job->startInline()) {
      return work;
    }
    // In flight: its waiter drives it (dist.send / dist.recv wait right away), or the
    // progress thread once the park's grace period has passed.
    const uint64_t ticket = progress_->park(std::move(job));
    work->setRunner([thread = std::weak_ptr<ProgressThread>(progress_), ticket] {
      const auto alive = thread.lock();
      return alive && alive->drive(ticket);
    });
    return work;
  }
  const uint64_t ticket = post(work, std::move(job), lone);
  submitting.unlock();
  if (progress_->runningHere()) {
    // Issued by a completion callback of this group's own operation, on the thread that
    // runs them (see ProgressThread::runningHere): run it now, after everything issued
    // before it, so that a callback that waits for it (Work.wait(), its Future's wait())
    // does not wait forever. Not under submitMutex_: its own callbacks may issue more.
    (void)progress_->runNested(ticket);
  }
  return work;
}

bool ProcessGroupSpyreccl::runWaited(OpRecord& op) {
  // What the Work of such a call would carry is unobservable: its caller waits at once (so
  // the registry entry and the Future would be dropped right away) and, without
  // callbacks, nobody records its range. Creating, registering and waiting for it cost
  // about as much as the rest of the call at small sizes.
  if (coalescing_ || at::hasCallbacks()) {
    return false;
  }
  std::lock_guard<std::mutex> submitting(submitMutex_);
  // runsInline(), keeping the reason: one refused only because the progress thread has
  // work is counted (a matter of scheduling, which tests tell apart from a refusal).
  const InlineVerdict verdict =
      inlineVerdict(op, inlineBound(op, inlineMaxBytes_, inlineFunctionalMaxBytes_), *progress_);
  if (verdict != InlineVerdict::kRun) {
    if (verdict == InlineVerdict::kBusy) {
      countWaitedBehindProgressThread();
    }
    return false;
  }
  const uint64_t seq = numberOp(op);
  runOp(op.steps, effectiveTimeout(op.timeout), *comm_,
        [&] { return describeOperation("", op.name, seq, label()); });
  return true;
}

uint64_t ProcessGroupSpyreccl::numberOp(OpRecord& op) {
  const uint64_t seq = ++seq_;
  const flight::Ref trace =
      trace_.record(*this, op.profilingTitle, op.type, op.inputs, op.outputs,
                    op.steps.empty() || !op.steps[0].peerCall ? -1 : op.steps[0].peerCall->peer);
  for (Step& step : op.steps) {
    step.seq = seq;
    step.trace = trace;
  }
  return seq;
}

uint64_t ProcessGroupSpyreccl::post(const c10::intrusive_ptr<WorkSpyreccl>& work,
                                    std::unique_ptr<ProgressThread::Job> job, bool lonePeerCall) {
  const uint64_t ticket = progress_->post(std::move(job));
  // A collective's waiter may run it; a lone send or receive's waiter may start it and
  // drive it to completion; either only while the progress thread has not started it.
  work->setRunner([thread = std::weak_ptr<ProgressThread>(progress_), ticket, lonePeerCall] {
    const auto alive = thread.lock();
    return alive && (lonePeerCall ? alive->drive(ticket) : alive->runIfNext(ticket));
  });
  return ticket;
}

void ProcessGroupSpyreccl::runSynchronously(const char* opName, std::chrono::milliseconds timeout,
                                            std::function<void(spyrecclComm_t)> fn) {
  checkUsable(opName);
  TORCH_CHECK(!coalescing_, "spyreccl ", opName,
              " cannot be called inside a coalescing batch (between startCoalescing and "
              "endCoalescing)");
  auto job = std::make_unique<CallJob>(std::move(fn), effectiveTimeout(timeout), comm_);
  std::future<void> done = job->result();
  {
    std::lock_guard<std::mutex> submitting(submitMutex_);
    progress_->post(std::move(job));
  }
  done.get();
}

}  // namespace spyreccl_torch
