// op_execution.cpp — the step runner and OpJob (see op_execution.h).
#include "backend/op_execution.h"

#include <algorithm>
#include <exception>
#include <string>

#include <c10/util/Exception.h>

#include "backend/peer_pipeline.h"
#include "backend/staging.h"

namespace spyreccl_torch {
namespace {

// What a failed send/recv is called in its error message: the operation, its sequence
// number and the peer, like the core names collectives ("allreduce seq 12").
std::string describePeerCall(const PeerCall& call, uint64_t seq) {
  const std::string tag = " (tag " + std::to_string(call.tag) + ")";
  switch (call.kind) {
    case PeerCall::Kind::kSend:
      return "send seq " + std::to_string(seq) + " to rank " + std::to_string(call.peer) + tag;
    case PeerCall::Kind::kRecv:
      return "recv seq " + std::to_string(seq) + " from rank " + std::to_string(call.peer) + tag;
    case PeerCall::Kind::kRecvAnySource:
      return "recvAnysource seq " + std::to_string(seq) + " from any rank" + tag;
  }
  return "point-to-point seq " + std::to_string(seq);
}

// The operations of one spyrecclGroupStart/End, for the message of a failed group.
std::string describePeerGroup(const std::vector<Step>& steps, size_t begin, size_t end) {
  constexpr size_t kMaxNamed = 4;
  std::string text = "batched send/recv (";
  for (size_t i = begin; i < end && i < begin + kMaxNamed; ++i) {
    text += (i == begin ? "" : ", ") + describePeerCall(*steps[i].peerCall, steps[i].seq);
  }
  if (end - begin > kMaxNamed) {
    text += ", and " + std::to_string(end - begin - kMaxNamed) + " more";
  }
  return text + ")";
}

void issuePeerCall(const Step& step, spyrecclComm_t comm) {
  const PeerCall& call = *step.peerCall;
  const CommBuffer& b = step.buffers.at(0);
  spyrecclResult_t result = spyrecclSuccess;
  switch (call.kind) {
    case PeerCall::Kind::kSend:
      result = spyrecclSend(b.data(), b.count(), b.dtype(), call.peer, call.tag, comm);
      break;
    case PeerCall::Kind::kRecv:
      result = spyrecclRecv(b.data(), b.count(), b.dtype(), call.peer, call.tag, comm);
      break;
    case PeerCall::Kind::kRecvAnySource:
      result =
          spyrecclRecvAnySource(b.data(), b.count(), b.dtype(), call.tag, call.source.get(), comm);
      break;
  }
  if (result != spyrecclSuccess) {
    throwCoreError(result, comm, describePeerCall(call, step.seq));
  }
  if (call.kind == PeerCall::Kind::kRecvAnySource) {
    flight::setPeer(step.trace, *call.source);  // the recorded receive names its sender now
  }
}

// Posts the send or receive of `step` without waiting for it (spyrecclIsend/Irecv).
spyrecclRequest_t postPeerCall(const Step& step, spyrecclComm_t comm) {
  const PeerCall& call = *step.peerCall;
  const CommBuffer& b = step.buffers.at(0);
  spyrecclRequest_t request = nullptr;
  const spyrecclResult_t result =
      call.kind == PeerCall::Kind::kSend
          ? spyrecclIsend(b.data(), b.count(), b.dtype(), call.peer, call.tag, comm, &request)
          : spyrecclIrecv(b.data(), b.count(), b.dtype(), call.peer, call.tag, comm, &request);
  if (result != spyrecclSuccess) {
    throwCoreError(result, comm, describePeerCall(call, step.seq));
  }
  return request;
}

void issue(const Step& step, spyrecclComm_t comm) {
  if (step.peerCall) {
    issuePeerCall(step, comm);
  } else {
    const OpSeqScope seqScope(step.seq);  // named by staged pipelines' errors (staging.h)
    step.issue(step.buffers, comm);
  }
}

// Runs what precedes a step's core call (see Step): before(), then prepare() per buffer.
void prepareStep(Step& step) {
  if (step.before) {
    step.before();
  }
  for (auto& buffer : step.buffers) {
    buffer.prepare();
  }
}

// Runs what follows a step's successful core call: commit() per buffer, then after().
void finishStep(Step& step) {
  for (const auto& buffer : step.buffers) {
    buffer.commit();
  }
  if (step.after) {
    step.after();
  }
}

void runSingleStep(Step& step, spyrecclComm_t comm) {
  prepareStep(step);
  issue(step, comm);
  finishStep(step);
}

// Consecutive point-to-point steps are issued inside one spyrecclGroupStart/End so that
// they progress together (the sends and receives of batch_isend_irecv would otherwise
// deadlock once messages exceed the staging area).
void runP2PGroup(std::vector<Step>& steps, size_t begin, size_t end, spyrecclComm_t comm) {
  for (size_t i = begin; i < end; ++i) {
    prepareStep(steps[i]);
  }
  checkCore(spyrecclGroupStart(), nullptr, "batched send/recv (group start)");
  std::exception_ptr issueError;
  for (size_t i = begin; i < end && !issueError; ++i) {
    try {
      issuePeerCall(steps[i], comm);
    } catch (...) {
      issueError = std::current_exception();
    }
  }
  // Always close the group: its state is per thread and would swallow later calls.
  const spyrecclResult_t endResult = spyrecclGroupEnd();
  if (issueError) {
    std::rethrow_exception(issueError);
  }
  if (endResult != spyrecclSuccess) {
    throwCoreError(endResult, comm, describePeerGroup(steps, begin, end));
  }
  for (size_t i = begin; i < end; ++i) {
    finishStep(steps[i]);
  }
}

// A step of runPostedPeerSteps: a pipeline, or one posted request.
struct PostedPeerStep {
  std::unique_ptr<PeerPipeline> pipeline;
  spyrecclRequest_t request = nullptr;
  bool done = false;
};

bool pollPosted(PostedPeerStep& posted, const Step& step, spyrecclComm_t comm) {
  if (posted.pipeline) {
    return posted.pipeline->poll();
  }
  return testPosted(posted.request, comm,
                    [&] { return describePeerCall(*step.peerCall, step.seq); });
}

// How long a wait for the peers of posted steps sleeps at most; a peer's move, the timeout
// and a peer's death end it earlier (the core reports those through the requests).
constexpr int64_t kPostedWaitUs = 10000;

// The point-to-point steps [begin, end) of which one at least runs as a PeerPipeline: every
// step posted as requests (in batch order, so each pair's messages keep their order), then
// progressed together until all completed. Requests progress together like a group's
// operations (the core moves every pending request whenever one is polled), so a ring of
// sends and receives completes as inside spyrecclGroupStart/End; a group itself cannot
// hold a pipeline, whose later copies wait for its earlier messages.
void runPostedPeerSteps(std::vector<Step>& steps, size_t begin, size_t end, Communicator& comm) {
  for (size_t i = begin; i < end; ++i) {
    prepareStep(steps[i]);
  }
  std::vector<PostedPeerStep> posted(end - begin);
  for (size_t i = begin; i < end; ++i) {
    PostedPeerStep& entry = posted[i - begin];
    try {
      if (pipelinedPeerStep(steps[i])) {
        entry.pipeline = std::make_unique<PeerPipeline>(
            steps[i], comm, describePeerCall(*steps[i].peerCall, steps[i].seq));
        entry.pipeline->post();
      } else {
        entry.request = postPeerCall(steps[i], comm.get());
      }
    } catch (const std::exception& e) {
      if (i > begin) {
        // The steps posted before this one would wait for peers that may never match them.
        comm.abort(std::string("spyreccl: ") + describePeerGroup(steps, begin, end) +
                   " failed part-way: " + e.what());
      }
      throw;
    }
  }
  for (;;) {
    bool all = true;
    for (size_t i = begin; i < end; ++i) {
      PostedPeerStep& entry = posted[i - begin];
      entry.done = entry.done || pollPosted(entry, steps[i], comm.get());
      all = all && entry.done;
    }
    if (all) {
      break;
    }
    (void)spyrecclCommPoll(comm.get(), kPostedWaitUs, nullptr);  // errors: the requests'
  }
  for (size_t i = begin; i < end; ++i) {
    finishStep(steps[i]);
  }
}

bool anyPipelined(const std::vector<Step>& steps, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    if (pipelinedPeerStep(steps[i])) {
      return true;
    }
  }
  return false;
}

}  // namespace

bool groupable(const Step& step) { return step.peerCall && step.peerCall->groupable(); }

bool lonePeerCall(const std::vector<Step>& steps) {
  return steps.size() == 1 && groupable(steps[0]);
}

size_t payloadBytes(const OpRecord& op) {
  return static_cast<size_t>(std::max(op.inNelems, op.outNelems)) *
         static_cast<size_t>(c10::elementSize(op.dtype));
}

void runSteps(std::vector<Step>& steps, Communicator& comm) {
  flight::Running<std::vector<Step>> traced(steps);
  size_t i = 0;
  while (i < steps.size()) {
    if (!groupable(steps[i])) {
      if (pipelinedPeerStep(steps[i])) {
        runPostedPeerSteps(steps, i, i + 1, comm);  // a receive from any source
      } else {
        runSingleStep(steps[i], comm.get());
      }
      ++i;
      continue;
    }
    size_t end = i;
    while (end < steps.size() && groupable(steps[end])) {
      ++end;
    }
    if (anyPipelined(steps, i, end)) {
      runPostedPeerSteps(steps, i, end, comm);
    } else if (end - i == 1) {
      runSingleStep(steps[i], comm.get());
    } else {
      runP2PGroup(steps, i, end, comm.get());
    }
    i = end;
  }
  traced.done();
}

void checkNotAborted(const WorkSpyreccl& work, const Communicator& comm) {
  checkNotAborted(comm, [&] { return work.description(); });
}

void executeOp(WorkSpyreccl& work, std::vector<Step>& steps, std::chrono::milliseconds timeout,
               Communicator& comm, const std::shared_ptr<int>& sourceRank) noexcept {
  try {
    runOp(steps, timeout, comm, [&] { return work.description(); });
    steps.clear();  // drop staging buffers before waking waiters
    if (sourceRank) {
      work.setSourceRank(*sourceRank);
    }
    work.finishSuccess();
  } catch (...) {
    steps.clear();
    work.finishError(std::current_exception());
  }
}

bool OpJob::startInline() noexcept {
  if (postRequest()) {
    return true;
  }
  postedInline_ = true;
  return poll();
}

bool OpJob::run() noexcept {
  if (postedInline_) {
    return false;  // already posted by startInline(): in flight from here on
  }
  // Grad mode, profiler state, ... of the thread that issued the operation.
  at::ThreadLocalStateGuard tlsGuard(tls_);
  if (lonePeerCall(steps_)) {
    return postRequest();
  }
  executeOp(*work_, steps_, timeout_, *comm_, sourceRank_);
  return true;
}

bool OpJob::poll() noexcept {
  try {
    if (pipeline_) {
      at::ThreadLocalStateGuard tlsGuard(tls_);  // its last copies and their counts
      if (!pipeline_->poll()) {
        return false;
      }
      pipeline_.reset();
    } else if (!testPosted(request_, comm_->get(), [this] {
                 return describePeerCall(*steps_[0].peerCall, steps_[0].seq);
               })) {
      return false;
    }
    at::ThreadLocalStateGuard tlsGuard(tls_);
    finishStep(steps_[0]);
    flight::markCompleted(steps_[0].trace);
    steps_.clear();  // drop staging buffers before waking waiters
    work_->finishSuccess();
  } catch (...) {
    flight::markFailed(trace_, std::current_exception());
    pipeline_.reset();  // waits for its copies: none may outlive the buffers
    steps_.clear();
    work_->finishError(std::current_exception());
  }
  return true;
}

void OpJob::cancel(std::exception_ptr reason) noexcept {
  work_->finishError(
      reason ? reason
             : makeDistBackendError("spyreccl: " + work_->description() + " was cancelled"));
}

bool OpJob::postRequest() noexcept {
  try {
    checkNotAborted(*work_, *comm_);
    comm_->useTimeout(timeout_);
    prepareStep(steps_[0]);
    flight::markStarted(trace_ = steps_[0].trace);
    if (pipelinedPeerStep(steps_[0])) {
      pipeline_ = std::make_unique<PeerPipeline>(
          steps_[0], *comm_, describePeerCall(*steps_[0].peerCall, steps_[0].seq));
      pipeline_->post();
    } else {
      request_ = postPeerCall(steps_[0], comm_->get());
    }
    return false;
  } catch (...) {
    flight::markFailed(trace_, std::current_exception());
    pipeline_.reset();
    steps_.clear();
    work_->finishError(std::current_exception());
    return true;
  }
}

}  // namespace spyreccl_torch
