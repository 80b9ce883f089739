// process_group_spyreccl.cpp — lifecycle of ProcessGroupSpyreccl: rendezvous, progress
// thread and job execution, coalescing, split, abort/shutdown, timeouts and sequence numbers.
// The collectives themselves (validation + steps) are in collectives.cpp.
#include "backend/process_group_spyreccl.hpp"

#include <algorithm>
#include <cstring>
#include <future>
#include <unordered_map>

#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include "backend/communicator.h"
#include "backend/errors.h"
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
  return config;
}

void checkTimeout(std::chrono::milliseconds timeout, const char* what) {
  TORCH_CHECK(timeout.count() > 0, "spyreccl: ", what, " must be positive, got ", timeout.count(),
              " ms");
}

// Runs the core calls of one operation. Consecutive point-to-point steps are issued inside
// one spyrecclGroupStart/End so that they progress together (a ring exchange posted as
// isend + irecv would otherwise deadlock once messages exceed the staging area).
void runSingleStep(Step& step, spyrecclComm_t comm) {
  if (step.before) {
    step.before();
  }
  for (auto& buffer : step.buffers) {
    buffer.prepare();
  }
  step.issue(step.buffers, comm);
  for (const auto& buffer : step.buffers) {
    buffer.commit();
  }
  if (step.after) {
    step.after();
  }
}

void runP2PGroup(std::vector<Step>& steps, size_t begin, size_t end, spyrecclComm_t comm) {
  for (size_t i = begin; i < end; ++i) {
    if (steps[i].before) {
      steps[i].before();
    }
    for (auto& buffer : steps[i].buffers) {
      buffer.prepare();
    }
  }
  checkCore(spyrecclGroupStart(), nullptr, "batched send/recv (group start)");
  std::exception_ptr issueError;
  for (size_t i = begin; i < end && !issueError; ++i) {
    try {
      steps[i].issue(steps[i].buffers, comm);
    } catch (...) {
      issueError = std::current_exception();
    }
  }
  // Always close the group: its state is per thread and would swallow later calls.
  const spyrecclResult_t endResult = spyrecclGroupEnd();
  if (issueError) {
    std::rethrow_exception(issueError);
  }
  checkCore(endResult, comm, "batched send/recv");
  for (size_t i = begin; i < end; ++i) {
    for (const auto& buffer : steps[i].buffers) {
      buffer.commit();
    }
    if (steps[i].after) {
      steps[i].after();
    }
  }
}

void runSteps(std::vector<Step>& steps, spyrecclComm_t comm) {
  size_t i = 0;
  while (i < steps.size()) {
    if (!steps[i].p2p) {
      runSingleStep(steps[i], comm);
      ++i;
      continue;
    }
    size_t end = i;
    while (end < steps.size() && steps[end].p2p) {
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

// A queued operation: executes its steps on the progress thread and completes its Work.
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

  void run() noexcept override {
    // Grad mode, profiler state, ... of the thread that issued the operation.
    at::ThreadLocalStateGuard tlsGuard(tls_);
    try {
      if (comm_->aborted()) {
        std::rethrow_exception(makeDistBackendError(
            "spyreccl: " + work_->description() +
            " was not run because the communicator was aborted: " + comm_->abortReason()));
      }
      comm_->useTimeout(timeout_);
      runSteps(steps_, comm_->get());
      steps_.clear();  // drop staging buffers before waking waiters
      if (sourceRank_) {
        work_->setSourceRank(*sourceRank_);
      }
      work_->finishSuccess();
    } catch (...) {
      steps_.clear();
      work_->finishError(std::current_exception());
    }
  }

  void cancel(std::exception_ptr reason) noexcept override {
    work_->finishError(
        reason ? reason
               : makeDistBackendError("spyreccl: " + work_->description() + " was cancelled"));
  }

 private:
  c10::intrusive_ptr<WorkSpyreccl> work_;
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

  void run() noexcept override {
    try {
      comm_->useTimeout(timeout_);
      fn_(comm_->get());
      promise_.set_value();
    } catch (...) {
      promise_.set_exception(std::current_exception());
    }
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
  startProgressThread();
  setSequenceNumberForGroup();
}

ProcessGroupSpyreccl::~ProcessGroupSpyreccl() {
  // A group that is simply dropped finishes what it queued (like gloo); abort() is the way
  // to give up on pending operations.
  if (!aborted_.load()) {
    shutdown();
  }
}

void ProcessGroupSpyreccl::startProgressThread() {
  progress_ = std::make_unique<ProgressThread>(label());
}

std::string ProcessGroupSpyreccl::label() const {
  const std::string& name = options_->group_name;
  return "process group '" + (name.empty() ? std::string("<unnamed>") : name) + "' (rank " +
         std::to_string(rank_) + " of " + std::to_string(size_) + ")";
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupSpyreccl::getBackendOptions() {
  // A copy: ProcessGroup::splitGroup renames and re-times the options it gets here for the
  // child group, which must not change this group's own options.
  return c10::static_intrusive_pointer_cast<c10d::Backend::Options>(options_->clone());
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

c10::intrusive_ptr<c10d::Work> ProcessGroupSpyreccl::submit(OpRecord op) {
  const uint64_t seq = ++seq_;

  // Rank layout of the group in the default group, for the profiler's comms metadata.
  int globalRankStart = 0;
  int globalRankStride = 1;
  const auto& globalRanks = options_->global_ranks_in_group;
  if (!globalRanks.empty()) {
    globalRankStart = static_cast<int>(globalRanks[0]);
    globalRankStride = globalRanks.size() > 1
                           ? static_cast<int>(globalRanks[1]) - static_cast<int>(globalRanks[0])
                           : 0;
    for (size_t i = 2; i < globalRanks.size(); ++i) {
      if (static_cast<int>(globalRanks[i] - globalRanks[i - 1]) != globalRankStride) {
        globalRankStride = -1;  // not an arithmetic progression
        break;
      }
    }
  }
  // Emits a "record_param_comms" event carrying the collective's name, sizes and dtype; it
  // spans the enqueueing. The Work below opens the asynchronous range named
  // op.profilingTitle, which ends when the operation completes.
  RECORD_PARAM_COMMS_DATA(static_cast<int>(seq), std::make_tuple(pg_uid_, pg_desc_), op.inputs,
                          op.outputs, rank_, op.name, op.inNelems, op.outNelems, op.dtype,
                          op.inSplitSizes, op.outSplitSizes, globalRankStart, globalRankStride,
                          size_);

  const std::string description =
      std::string(op.name) + " #" + std::to_string(seq) + " on " + label();
  if (coalescing_) {
    if (!batchWork_) {
      batch_.devices = op.devices;
      batchWork_ = c10::make_intrusive<WorkSpyreccl>(
          rank_, c10d::OpType::COALESCED, seq, "spyreccl:coalesced", op.inputs, op.devices, comm_,
          "coalesced batch starting with " + description, /*submitted=*/false);
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

  auto work = c10::make_intrusive<WorkSpyreccl>(rank_, op.type, seq, op.profilingTitle, op.inputs,
                                                op.devices, comm_, description);
  work->addOutputs(op.outputs);
  progress_->post(std::make_unique<OpJob>(work, std::move(op.steps), effectiveTimeout(op.timeout),
                                          comm_, std::move(op.sourceRank)));
  return work;
}

void ProcessGroupSpyreccl::runSynchronously(const char* opName, std::chrono::milliseconds timeout,
                                            std::function<void(spyrecclComm_t)> fn) {
  checkUsable(opName);
  TORCH_CHECK(!coalescing_, "spyreccl ", opName,
              " cannot be called inside a coalescing batch (between startCoalescing and "
              "endCoalescing)");
  auto job = std::make_unique<CallJob>(std::move(fn), effectiveTimeout(timeout), comm_);
  std::future<void> done = job->result();
  progress_->post(std::move(job));
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
        std::vector<c10::Device>{}, comm_,
        "empty coalesced batch #" + std::to_string(seq) + " on " + label());
  }
  work->markSubmitted();
  progress_->post(std::make_unique<OpJob>(work, std::move(batch_.steps),
                                          effectiveTimeout(batch_.timeout), comm_));
  batch_ = OpRecord{};
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
    newOptions = own->clone();
  } else {
    newOptions = options_->clone();
    if (opts) {
      newOptions->timeout = opts->timeout;
      newOptions->group_name = opts->group_name;
      newOptions->group_desc = opts->group_desc;
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
