// process_group_spyreccl.cpp — lifecycle of ProcessGroupSpyreccl: rendezvous, progress
// thread, per-group constants, abort/shutdown, timeouts, sequence numbers and errors.
// Elsewhere: submission.cpp (how operations are queued or run inline), op_execution.cpp (how
// their steps reach the core), coalescing.cpp, group_split.cpp, and the collectives
// themselves (validation + steps) in collectives.cpp.
#include "backend/process_group_spyreccl.hpp"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <c10/util/Exception.h>

#include "backend/communicator.h"
#include "backend/errors.h"
#include "backend/exit_guard.h"
#include "backend/group_config.h"
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
  trace_.init(options_->group_name, rank, size, options_->global_ranks_in_group, options_->timeout,
              store);
  startProgressThread();
  setSequenceNumberForGroup();
}

ProcessGroupSpyreccl::ProcessGroupSpyreccl(SplitTag, std::shared_ptr<Communicator> comm, int rank,
                                           int size, c10::intrusive_ptr<Options> options)
    : c10d::Backend(rank, size), options_(std::move(options)), comm_(std::move(comm)) {
  init();
  cacheConstants();
  trace_.init(options_->group_name, rank, size, options_->global_ranks_in_group, options_->timeout,
              nullptr);
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
