// process_group_spyreccl.cpp — lifecycle of ProcessGroupSpyreccl: rendezvous, progress
// thread and job execution, coalescing, split, abort/shutdown, timeouts and sequence numbers.
// The collectives themselves (validation + steps) are in collectives.cpp.
#include "backend/process_group_spyreccl.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <future>
#include <unordered_map>

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include "backend/communicator.h"
#include "backend/errors.h"
#include "backend/exit_guard.h"
#include "backend/functional_scope.h"
#include "backend/input_checks.h"
#include "backend/progress_thread.h"
#include "backend/work.h"

namespace spyreccl_torch {
namespace {

// Store key under which rank 0 publishes the id of the communicator of one group instance.
// The group name alone is not unique: split_group derives names from the member ranks, so
// re-creating a group with the same members reuses the name (and the store prefix). Every
// member creates its groups in the same order, so a per-name creation counter kept in each
// process agrees across the ranks and makes the key unique per instance.
std::string rendezvousKey(const std::string& groupName) {
  static std::mutex mutex;
  static std::unordered_map<std::string, uint64_t> creations;
  uint64_t instance;
  {
    std::lock_guard<std::mutex> lock(mutex);
    instance = creations[groupName]++;
  }
  return "spyreccl/unique_id/" + groupName + "/" + std::to_string(instance);
}

spyrecclConfig_t makeConfig(const ProcessGroupSpyreccl::Options& options, const char* name) {
  spyrecclConfig_t config = SPYRECCL_CONFIG_INITIALIZER;
  config.timeoutMs = options.timeout.count();
  config.chunkBytes = options.chunk_bytes;
  config.p2pChunkBytes = options.p2p_chunk_bytes;
  config.name = name;
  config.yieldNs = options.yield_ns;
  return config;
}

void checkTimeout(std::chrono::milliseconds timeout, const char* what) {
  TORCH_CHECK(timeout.count() > 0, "spyreccl: ", what, " must be positive, got ", timeout.count(),
              " ms");
}

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

bool groupable(const Step& step) { return step.peerCall && step.peerCall->groupable(); }

// A lone send or receive: OpJob::run() posts it and leaves it in flight.
bool lonePeerCall(const std::vector<Step>& steps) {
  return steps.size() == 1 && groupable(steps[0]);
}

// Bytes an operation moves per rank: the larger of its input and its output.
size_t payloadBytes(const OpRecord& op) {
  return static_cast<size_t>(std::max(op.inNelems, op.outNelems)) *
         static_cast<size_t>(c10::elementSize(op.dtype));
}

void runSteps(std::vector<Step>& steps, spyrecclComm_t comm) {
  size_t i = 0;
  while (i < steps.size()) {
    if (!groupable(steps[i])) {
      runSingleStep(steps[i], comm);
      ++i;
      continue;
    }
    size_t end = i;
    while (end < steps.size() && groupable(steps[end])) {
      ++end;
    }
    if (end - i == 1) {
      runSingleStep(steps[i], comm);
    } else {
      runP2PGroup(steps, i, end, comm);
    }
    i = end;
  }
}

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

void checkNotAborted(const WorkSpyreccl& work, const Communicator& comm) {
  checkNotAborted(comm, [&] { return work.description(); });
}

// Runs the steps of one operation against `comm` under `timeout` (checkNotAborted first)
// and throws its errors: the part that executeOp and ProcessGroupSpyreccl::runWaited share.
template <typename Description>
void runOp(std::vector<Step>& steps, std::chrono::milliseconds timeout, Communicator& comm,
           Description&& description) {
  checkNotAborted(comm, description);
  comm.useTimeout(timeout);
  runSteps(steps, comm.get());
}

// Runs the steps of one operation against `comm` and completes `work` with the outcome, on
// whichever thread executes the operation (the progress thread, or the caller for the
// inline fast path). Errors never escape: wait() rethrows them.
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

// A queued operation: executes its steps on the progress thread and completes its Work.
//
// A lone send or receive (dist.isend / dist.irecv / dist.send / dist.recv) is posted
// without blocking and stays in flight on the progress thread until the core reports it
// complete: jobs queued after it (the matching receive of a ring exchange, say) then run
// while it waits for its peer, as with NCCL or gloo. Blocking here would deadlock every
// rank of an unbatched ring whose messages exceed the staging slots: each progress thread
// would wait in its send for a peer whose receive is queued behind that peer's own send.
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
  bool startInline() noexcept {
    if (postRequest()) {
      return true;
    }
    postedInline_ = true;
    return poll();
  }

  bool run() noexcept override {
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

  bool finishesInRun() const noexcept override { return !postedInline_ && !lonePeerCall(steps_); }

  bool poll() noexcept override {
    try {
      int done = 0;
      const spyrecclResult_t result = spyrecclTest(request_, &done);
      if (result != spyrecclSuccess) {
        request_ = nullptr;  // the core releases a request that reports its error
        throwCoreError(result, comm_->get(), describePeerCall(*steps_[0].peerCall, steps_[0].seq));
      }
      if (!done) {
        return false;
      }
      request_ = nullptr;
      at::ThreadLocalStateGuard tlsGuard(tls_);
      finishStep(steps_[0]);
      steps_.clear();  // drop staging buffers before waking waiters
      work_->finishSuccess();
    } catch (...) {
      steps_.clear();
      work_->finishError(std::current_exception());
    }
    return true;
  }

  void cancel(std::exception_ptr reason) noexcept override {
    work_->finishError(
        reason ? reason
               : makeDistBackendError("spyreccl: " + work_->description() + " was cancelled"));
  }

 private:
  // Starts the lone point-to-point step; poll() finishes it. Returns whether the job
  // already finished (it failed to start).
  bool postRequest() noexcept {
    try {
      checkNotAborted(*work_, *comm_);
      comm_->useTimeout(timeout_);
      prepareStep(steps_[0]);
      request_ = postPeerCall(steps_[0], comm_->get());
      return false;
    } catch (...) {
      steps_.clear();
      work_->finishError(std::current_exception());
      return true;
    }
  }

  c10::intrusive_ptr<WorkSpyreccl> work_;
  spyrecclRequest_t request_ = nullptr;  // the posted send/receive, until it completes
  bool postedInline_ = false;            // startInline() posted request_
  std::vector<Step> steps_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<int> sourceRank_;
  at::ThreadLocalState tls_;
};

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

// --- Options --------------------------------------------------------------------------------

ProcessGroupSpyreccl::Options::Options(std::chrono::milliseconds timeout)
    : c10d::Backend::Options(kBackendName, timeout) {}

// --- construction -------------------------------------------------------------------------

ProcessGroupSpyreccl::ProcessGroupSpyreccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                           int size, c10::intrusive_ptr<Options> options)
    : c10d::Backend(rank, size), options_(options ? std::move(options) : Options::create()) {
  TORCH_CHECK(size >= 1, "spyreccl: a process group needs at least one rank, got size ", size);
  TORCH_CHECK(rank >= 0 && rank < size, "spyreccl: rank ", rank, " is outside the group of size ",
              size);
  TORCH_CHECK(store, "spyreccl: a Store is required to create a process group");
  checkTimeout(options_->timeout, "Options.timeout");
  init();
  cacheConstants();

  // Rank 0 creates the id and publishes it; the others fetch it. A 1-rank group needs no
  // exchange at all.
  spyrecclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  const std::string key = rendezvousKey(options_->group_name);
  if (rank == 0) {
    checkCore(spyrecclGetUniqueId(&id), nullptr, "communicator id creation for " + label());
    if (size > 1) {
      const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
      store->set(key, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
    }
  } else {
    std::vector<uint8_t> bytes;
    try {
      store->wait({key}, options_->timeout);
      bytes = store->get(key);
    } catch (const c10::Error& e) {
      std::rethrow_exception(
          makeDistBackendError("spyreccl: " + label() +
                               " could not fetch the communicator id that rank 0 publishes "
                               "under store key '" +
                               key + "' within " + std::to_string(options_->timeout.count()) +
                               " ms (does rank 0 create the same groups in the same order?): " +
                               e.what_without_backtrace()));
    }
    TORCH_CHECK(bytes.size() == sizeof(id), "spyreccl: store key '", key, "' holds ", bytes.size(),
                " bytes, expected a spyrecclUniqueId of ", sizeof(id),
                " bytes (is another job using the same store?)");
    std::memcpy(&id, bytes.data(), sizeof(id));
    // The last reader removes the key so long-running jobs that create many groups do not
    // grow the store. Best effort: not every Store implements deleteKey.
    try {
      if (store->add(key + "/readers", 1) == size - 1) {
        store->deleteKey(key);
        store->deleteKey(key + "/readers");
      }
    } catch (const std::exception&) {
    }
  }

  const std::string name = label();
  const spyrecclConfig_t config = makeConfig(*options_, name.c_str());
  spyrecclComm_t comm = nullptr;
  checkCore(spyrecclCommInitRank(&comm, size, id, rank, &config), nullptr,
            "communicator initialisation for " + name);
  comm_ = std::make_shared<Communicator>(comm, options_->timeout, name);
  startProgressThread();
  setSequenceNumberForGroup();
}

ProcessGroupSpyreccl::ProcessGroupSpyreccl(SplitTag, std::shared_ptr<Communicator> comm, int rank,
                                           int size, c10::intrusive_ptr<Options> options)
    : c10d::Backend(rank, size), options_(std::move(options)), comm_(std::move(comm)) {
  init();
  cacheConstants();
  startProgressThread();
  setSequenceNumberForGroup();
}

ProcessGroupSpyreccl::~ProcessGroupSpyreccl() {
  if (getpid() != creatorPid_) {
    // Destroyed in a child forked after the group was made (at its exit, say): the progress
    // thread and the communicator's shared memory belong to the parent. Stopping the thread
    // would wait for one that does not exist here (its join, its condition variable's
    // destruction), and releasing the communicator would act on the parent's behalf; both
    // are left alone, deliberately leaked.
    new std::shared_ptr<ProgressThread>(std::move(progress_));
    new std::shared_ptr<Communicator>(std::move(comm_));
    return;
  }
  // A group that is simply dropped finishes what it queued (like gloo); abort() is the way
  // to give up on pending operations.
  if (!aborted_.load()) {
    shutdown();
  }
}

void ProcessGroupSpyreccl::startProgressThread() {
  // While sends/receives are in flight and nothing is queued, the thread sleeps in the core
  // until a peer moves one of them; post() ends that sleep. Errors of the poll are left to
  // the requests, which report them to their Works.
  ProgressThread::InFlightWaiter waiter{
      [comm = comm_](std::chrono::microseconds max) {
        (void)spyrecclCommPoll(comm->get(), max.count(), nullptr);
      },
      [comm = comm_] { (void)spyrecclCommWakePoll(comm->get()); }};
  progress_ = std::make_shared<ProgressThread>(label(), std::move(waiter));
  registerProgressThread(progress_);  // stopped at interpreter exit (exit_guard.h)
}

namespace {

// A byte bound from the environment variable `name`, or `fallback` when it is unset.
size_t byteBoundFromEnv(const char* name, size_t fallback, const char* whatZeroDisables) {
  const char* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') {
    return fallback;
  }
  char* end = nullptr;
  errno = 0;
  const unsigned long long parsed = std::strtoull(value, &end, 10);
  TORCH_CHECK(errno == 0 && end != value && *end == '\0' && value[0] != '-', "spyreccl: ", name,
              "='", value, "' is not a byte count; expected a non-negative integer (0 disables ",
              whatZeroDisables, ")");
  return static_cast<size_t>(parsed);
}

}  // namespace

void ProcessGroupSpyreccl::cacheConstants() {
  const std::string& name = options_->group_name;
  label_ = std::make_shared<const std::string>(
      "process group '" + (name.empty() ? std::string("<unnamed>") : name) + "' (rank " +
      std::to_string(rank_) + " of " + std::to_string(size_) + ")");

  const auto& globalRanks = options_->global_ranks_in_group;
  globalRankStart_ = 0;
  globalRankStride_ = 1;
  if (!globalRanks.empty()) {
    globalRankStart_ = static_cast<int>(globalRanks[0]);
    globalRankStride_ = globalRanks.size() > 1
                            ? static_cast<int>(globalRanks[1]) - static_cast<int>(globalRanks[0])
                            : 0;
    for (size_t i = 2; i < globalRanks.size(); ++i) {
      if (static_cast<int>(globalRanks[i] - globalRanks[i - 1]) != globalRankStride_) {
        globalRankStride_ = -1;  // not an arithmetic progression
        break;
      }
    }
  }
  inlineMaxBytes_ = byteBoundFromEnv(kInlineMaxBytesEnv, kDefaultInlineMaxBytes,
                                     "running small synchronous collectives on the calling thread");
  inlineFunctionalMaxBytes_ =
      byteBoundFromEnv(kInlineFunctionalMaxBytesEnv, kDefaultInlineFunctionalMaxBytes,
                       "running small functional collectives on the calling thread");
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupSpyreccl::getBackendOptions() {
  // A copy: ProcessGroup::splitGroup renames and re-times the options it gets here for the
  // child group, which must not change this group's own options.
  return c10::static_intrusive_pointer_cast<c10d::Backend::Options>(options_->copy());
}

void ProcessGroupSpyreccl::checkUsable(const char* opName) const {
  TORCH_CHECK(!aborted_.load(), "spyreccl ", opName, ": ", label(),
              " was aborted; create a new process group");
  TORCH_CHECK(!shutDown_.load(), "spyreccl ", opName, ": ", label(),
              " was shut down; create a new process group");
}

std::chrono::milliseconds ProcessGroupSpyreccl::effectiveTimeout(
    std::chrono::milliseconds requested) const {
  return requested.count() > 0 ? requested : options_->timeout;
}

// --- submission -----------------------------------------------------------------------------

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
  size_t bound = 0;
  if (!op.asyncOp) {
    bound = inlineMaxBytes_;
  } else if (inFunctionalCall()) {
    bound = waitFollows() ? std::max(inlineMaxBytes_, inlineFunctionalMaxBytes_)
                          : inlineFunctionalMaxBytes_;
  }
  if (bound == 0 || !progress_->idle()) {
    return false;
  }
  for (const Step& step : op.steps) {
    if (step.peerCall) {
      return false;
    }
  }
  return payloadBytes(op) <= bound;
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
  if (!runsInline(op)) {
    return false;
  }
  const uint64_t seq = numberOp(op);
  runOp(op.steps, effectiveTimeout(op.timeout), *comm_,
        [&] { return describeOperation("", op.name, seq, label()); });
  return true;
}

uint64_t ProcessGroupSpyreccl::numberOp(OpRecord& op) {
  const uint64_t seq = ++seq_;
  for (Step& step : op.steps) {
    step.seq = seq;
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

// --- coalescing -----------------------------------------------------------------------------

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

// --- group management -----------------------------------------------------------------------

c10::intrusive_ptr<c10d::Backend> ProcessGroupSpyreccl::split(
    const c10::intrusive_ptr<c10d::Store>& /*store*/, const std::vector<int>& ranks,
    const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  std::vector<int> members = ranks;
  std::sort(members.begin(), members.end());
  TORCH_CHECK(!members.empty(), "spyreccl split: argument 'ranks' is empty");
  TORCH_CHECK(std::adjacent_find(members.begin(), members.end()) == members.end(),
              "spyreccl split: argument 'ranks' contains duplicate ranks");
  for (int member : members) {
    checkRank(member, size_, "split", "ranks");
  }
  const auto self = std::find(members.begin(), members.end(), rank_);
  const bool isMember = self != members.end();
  // The subgroups of one split are disjoint, so the smallest member names each of them.
  const int color = isMember ? members.front() : SPYRECCL_SPLIT_NOCOLOR;
  const int newRank = isMember ? static_cast<int>(self - members.begin()) : -1;

  // The new group's options: ours, overridden by what the caller passed.
  c10::intrusive_ptr<Options> newOptions;
  if (auto* own = dynamic_cast<Options*>(opts.get())) {
    newOptions = own->copy();
  } else {
    newOptions = options_->copy();
    if (opts) {
      newOptions->timeout = opts->timeout;
      newOptions->group_name = opts->group_name;
      newOptions->group_desc = compat::groupDesc(*opts);
      newOptions->global_ranks_in_group = opts->global_ranks_in_group;
    }
  }
  checkTimeout(newOptions->timeout, "the split group's timeout");
  if (newOptions->global_ranks_in_group.empty() ||
      newOptions->global_ranks_in_group.size() != members.size()) {
    newOptions->global_ranks_in_group.clear();
    for (int member : members) {
      const auto& parentGlobal = options_->global_ranks_in_group;
      newOptions->global_ranks_in_group.push_back(
          parentGlobal.size() == static_cast<size_t>(size_) ? parentGlobal[member] : member);
    }
  }

  const std::string name = "process group '" + newOptions->group_name + "' (rank " +
                           std::to_string(newRank) + " of " + std::to_string(members.size()) +
                           ", split from " + label() + ")";
  const spyrecclConfig_t config = makeConfig(*newOptions, name.c_str());
  spyrecclComm_t newComm = nullptr;
  runSynchronously("split", newOptions->timeout, [&](spyrecclComm_t comm) {
    checkCore(spyrecclCommSplit(comm, color, isMember ? newRank : 0, &newComm, &config), comm,
              "split of " + label());
  });
  if (!isMember) {
    if (newComm != nullptr) {
      (void)spyrecclCommDestroy(newComm);
    }
    return nullptr;
  }
  TORCH_CHECK(newComm != nullptr, "spyreccl split: the core returned no communicator for rank ",
              rank_, " of ", label());
  auto communicator = std::make_shared<Communicator>(newComm, newOptions->timeout, name);
  auto group = c10::intrusive_ptr<ProcessGroupSpyreccl>::unsafe_steal_from_new(
      new ProcessGroupSpyreccl(SplitTag{}, std::move(communicator), newRank,
                               static_cast<int>(members.size()), newOptions));
  group->setGroupUid(newOptions->group_name);
  group->setGroupDesc(newOptions->group_desc);
  return group;
}

void ProcessGroupSpyreccl::abort() {
  if (aborted_.exchange(true)) {
    return;
  }
  const std::string reason = "abort() was called on " + label();
  if (comm_) {
    comm_->abort(reason);  // wakes the operation the progress thread may be blocked in
  }
  if (coalescing_ && batchWork_) {
    batchWork_->markSubmitted();
    batchWork_->finishError(makeDistBackendError("spyreccl: " + batchWork_->description() +
                                                 " was discarded: " + reason));
  }
  coalescing_ = false;
  batchWork_.reset();
  if (progress_) {
    progress_->stop(/*drain=*/false,
                    makeDistBackendError("spyreccl: operation not run because " + reason));
  }
}

void ProcessGroupSpyreccl::shutdown() {
  if (shutDown_.exchange(true) || aborted_.load()) {
    return;
  }
  if (progress_) {
    progress_->stop(/*drain=*/true);
  }
  // The communicator itself is released with its last owner (Works may still refer to it).
}

void ProcessGroupSpyreccl::setTimeout(std::chrono::milliseconds timeout) {
  checkTimeout(timeout, "setTimeout's timeout");
  // Operations enqueued from now on use it (the progress thread applies it to the
  // communicator with spyrecclCommSetTimeout before running them).
  options_->timeout = timeout;
}

void ProcessGroupSpyreccl::setSequenceNumberForGroup() {
  // Every rank starts at 0 and counts its operations: no exchange needed because all ranks
  // issue the same operations in the same order.
  seq_.store(0);
}

uint64_t ProcessGroupSpyreccl::getSequenceNumberForGroup() { return seq_.load(); }

c10d::ErrorType ProcessGroupSpyreccl::getError() {
  if (!comm_) {
    return c10d::ErrorType::SUCCESS;
  }
  spyrecclResult_t error = spyrecclSuccess;
  checkCore(spyrecclCommGetAsyncError(comm_->get(), &error), comm_->get(), "getError");
  switch (error) {
    case spyrecclSuccess:
      return c10d::ErrorType::SUCCESS;
    case spyrecclTimeout:
      return c10d::ErrorType::TIMEOUT;
    case spyrecclRemoteError:
      return c10d::ErrorType::REMOTE_ERROR;
    default:
      return c10d::ErrorType::COMM_ERROR;
  }
}

std::string ProcessGroupSpyreccl::dumpState() const {
  return comm_ ? comm_->dumpState() : std::string("(no communicator)");
}

}  // namespace spyreccl_torch
