// flight_recorder.cpp — see flight_recorder.h.
#include "backend/flight_recorder.h"
#include "backend/flight_ring.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>

#include <c10/util/ApproximateClock.h>
#include <c10/util/SmallVector.h>
#include <c10/util/irange.h>
#include <c10/util/thread_name.h>
#include <torch/csrc/distributed/c10d/TraceUtils.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
#include <torch/csrc/distributed/c10d/Utils.hpp>

#include <spyreccl/spyreccl.h>

namespace spyreccl_torch::flight {
namespace detail {

Ring& ring() {
  // Leaked on purpose, like torch's: the watcher and late Works may use it during exit.
  static Ring* instance = new Ring();
  return *instance;
}

// Python stacks cost microseconds per call (a frame walk under the GIL): opt-in.
bool captureStacks() {
  static const bool value = c10d::getCvarBool({"SPYRECCL_FR_STACKS"}, false);
  return value;
}

}  // namespace detail

using detail::captureStacks;
using detail::Entry;
using detail::GroupStatus;
using detail::Ring;
using detail::ring;

namespace {

// Store key (in the group's own prefix store) a rank sets when it saw the group fail.
constexpr const char* kFailedKey = "spyreccl/flight_recorder/failed";
constexpr std::chrono::milliseconds kWatchInterval{250};

std::string dumpPrefix() {
  for (const char* name : {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && value[0] != '\0') {
      return value;
    }
  }
  return {};
}

// Writes the dump to <prefix><global rank>, as torch's DebugInfoWriter names it. Not through
// that writer: it keeps the first prefix it saw for the life of the process.
void writeDump(int globalRank) noexcept {
  try {
    const std::filesystem::path path = dumpPrefix() + std::to_string(globalRank);
    if (path.has_parent_path()) {
      std::filesystem::create_directories(path.parent_path());
    }
    const std::string data = dumpPickle(true, true, false);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    out.close();
    if (!out) {
      throw std::runtime_error("could not write " + path.string());
    }
    LOG(WARNING) << "spyreccl: wrote the flight recorder dump to " << path.string();
  } catch (const std::exception& e) {
    LOG(ERROR) << "spyreccl: writing the flight recorder dump failed: " << e.what();
  }
}

}  // namespace

class GroupTrace {
 public:
  GroupTrace(size_t id, std::tuple<std::string, std::string> name, int rank, int globalRank,
             std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Store> store)
      : id_(id),
        name_(std::move(name)),
        rank_(rank),
        globalRank_(globalRank),
        timeout_(timeout),
        store_(std::move(store)),
        status_(std::make_shared<GroupStatus>()) {}

  // Dumps once per group and tells the others (through the store) when `tell`; a stage
  // group's failure is its parent's (see GroupSlot::setParent).
  void fail(bool tell) noexcept;

  // Whether another rank reported the group failed (store poll by the watcher).
  bool peerFailed() const {
    if (!store_ || failed_.load()) {
      return false;
    }
    try {
      return store_->check({kFailedKey});
    } catch (const std::exception&) {
      return false;
    }
  }

  bool hasStore() const { return static_cast<bool>(store_); }

  std::atomic<int64_t> parent_{-1};

  const size_t id_;
  const std::tuple<std::string, std::string> name_;
  const int rank_;
  const int globalRank_;
  const std::chrono::milliseconds timeout_;
  // Guarded by the recorder's mutex.
  size_t collectiveSeq_ = 0;
  size_t p2pSeq_ = 0;
  size_t opId_ = 0;

 private:
  const c10::intrusive_ptr<c10d::Store> store_;
  std::mutex dumpMutex_;
  std::atomic<bool> failed_{false};

 public:
  const std::shared_ptr<GroupStatus> status_;
};

namespace {

// Every registered group (by pg id), for markFailed and the watcher.
struct Registry {
  std::mutex mutex;
  std::map<size_t, std::weak_ptr<GroupTrace>> groups;
  size_t nextId = 0;
  bool watching = false;
  // Groups implemented in Python (multinode) live as long as the process.
  std::vector<std::shared_ptr<GroupTrace>> pythonGroups;
  // The watcher: polls the stores of live groups for a peer's failure report.
  std::mutex stopMutex;
  std::condition_variable stopCv;
  bool stopping = false;
  std::thread watcher;
};

Registry& registry() {
  static Registry* instance = new Registry();  // leaked: used during exit
  return *instance;
}

std::shared_ptr<GroupTrace> findGroup(size_t id) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  const auto it = reg.groups.find(id);
  return it == reg.groups.end() ? nullptr : it->second.lock();
}

}  // namespace

void GroupTrace::fail(bool tell) noexcept {
  // Held while dumping: a second thread that sees the failure (the watcher, or a stage
  // group and its parent) returns once the dump is written, not while it is.
  std::lock_guard<std::mutex> dumping(dumpMutex_);
  if (failed_.exchange(true)) {
    return;
  }
  const int64_t parent = parent_.load();
  if (parent >= 0) {
    if (auto group = findGroup(static_cast<size_t>(parent))) {
      group->fail(tell);  // one dump for the call and its stages
      return;
    }
  }
  if (!dumpPrefix().empty()) {
    writeDump(globalRank_);
  }
  if (tell && store_) {
    try {
      store_->set(kFailedKey, std::string("1"));
    } catch (const std::exception&) {
      // The store may be gone with the rank that hosted it; the dump above still holds.
    }
  }
}

namespace {

void watch() {
  auto& reg = registry();
  while (true) {
    {
      std::unique_lock<std::mutex> lock(reg.stopMutex);
      if (reg.stopCv.wait_for(lock, kWatchInterval, [&] { return reg.stopping; })) {
        return;
      }
    }
    std::vector<std::shared_ptr<GroupTrace>> live;
    {
      std::lock_guard<std::mutex> lock(reg.mutex);
      for (auto it = reg.groups.begin(); it != reg.groups.end();) {
        if (auto group = it->second.lock()) {
          if (group->hasStore()) {
            live.push_back(std::move(group));
          }
          ++it;
        } else {
          it = reg.groups.erase(it);
        }
      }
    }
    for (const auto& group : live) {
      if (group->peerFailed()) {
        group->fail(/*tell=*/false);
      }
    }
  }
}

void stopWatcher() {
  auto& reg = registry();
  {
    std::lock_guard<std::mutex> lock(reg.stopMutex);
    reg.stopping = true;
  }
  reg.stopCv.notify_all();
  if (reg.watcher.joinable()) {
    reg.watcher.join();
  }
}

// Under reg.mutex. Only when dumps are configured: otherwise nobody would act on the report.
void startWatcherLocked(Registry& reg) {
  if (reg.watching || dumpPrefix().empty()) {
    return;
  }
  reg.watching = true;
  reg.watcher = std::thread(watch);
  std::atexit(stopWatcher);
}

}  // namespace

bool enabled() {
  static const bool value = ring().maxEntries > 0;
  return value;
}

namespace {

std::shared_ptr<GroupTrace> registerGroup(const std::string& name, const std::string& desc,
                                          int rank, int size,
                                          const std::vector<uint64_t>& globalRanks,
                                          std::chrono::milliseconds timeout,
                                          c10::intrusive_ptr<c10d::Store> store) {
  std::vector<uint64_t> ranks = globalRanks;
  if (ranks.empty()) {
    for (int r = 0; r < size; ++r) {
      ranks.push_back(static_cast<uint64_t>(r));
    }
  }
  const int globalRank =
      rank < static_cast<int>(ranks.size()) ? static_cast<int>(ranks[rank]) : rank;
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  const size_t id = reg.nextId++;
  auto pgName = std::make_tuple(name.empty() ? "spyreccl_" + std::to_string(id) : name, desc);
  auto group =
      std::make_shared<GroupTrace>(id, pgName, rank, globalRank, timeout, std::move(store));
  {
    Ring& r = ring();
    std::lock_guard<std::mutex> ringLock(r.mutex);
    r.pgRanks[pgName] = std::move(ranks);
    r.pgNames[id] = pgName;
    r.pgStatus[id] = group->status_;
  }
  reg.groups[id] = group;
  if (group->hasStore()) {
    startWatcherLocked(reg);
  }
  return group;
}

// `flatten`: a list of equal tensors is recorded as one [n, *shape] tensor, as NCCL records
// the list forms of all_gather (outputs) and reduce_scatter (inputs): the analyzer checks
// their sizes that way.
void describeTensors(const std::vector<at::Tensor>& tensors, bool flatten,
                     c10::SmallVector<int64_t, 8>& sizes, c10::SmallVector<int64_t, 4>& dims,
                     c10::SmallVector<c10::ScalarType, 4>& dtypes) {
  const bool uniform =
      flatten && tensors.size() > 1 &&
      std::all_of(tensors.begin(), tensors.end(), [&](const at::Tensor& t) {
        return t.sizes() == tensors[0].sizes() && t.scalar_type() == tensors[0].scalar_type();
      });
  if (uniform) {
    const auto shape = tensors[0].sizes();
    sizes.push_back(static_cast<int64_t>(tensors.size()));
    sizes.append(shape.begin(), shape.end());
    dims.push_back(static_cast<int64_t>(shape.size()) + 1);
    dtypes.push_back(tensors[0].scalar_type());
    return;
  }
  for (const auto& tensor : tensors) {
    const auto shape = tensor.sizes();
    sizes.append(shape.begin(), shape.end());
    dims.push_back(static_cast<int64_t>(shape.size()));
    dtypes.push_back(tensor.scalar_type());
  }
}

// Records one operation: `title` (C++ groups) or `name` (Python groups) names it.
Ref recordIn(GroupTrace& group, const char* title, std::string name, c10d::OpType type, int peer,
             bool isP2P, bool flattenInputs, bool flattenOutputs,
             const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
  Ring& r = ring();
  std::shared_ptr<torch::CapturedTraceback> traceback;
  if (captureStacks()) {
    traceback = torch::CapturedTraceback::gather(true, true, r.captureCppStack);
  }
  const int64_t now = c10::getTime();
  thread_local bool threadNamed = false;

  std::lock_guard<std::mutex> lock(r.mutex);
  if (!threadNamed) {
    r.threadNames[std::this_thread::get_id()] = c10::getThreadName();
    threadNamed = true;
  }
  if (isP2P) {
    ++group.p2pSeq_;
  } else {
    ++group.collectiveSeq_;
    group.status_->lastEnqueued = static_cast<int64_t>(group.collectiveSeq_);
  }
  if (r.entries.size() < r.maxEntries) {
    r.entries.emplace_back();
  }
  // Filled in place: a reused slot keeps its buffers.
  Entry& e = r.entries[r.next];
  r.next = (r.next + 1) % r.maxEntries;
  const size_t id = r.nextId++;
  e.id = id;
  e.epoch = r.epoch;
  e.pgId = group.id_;
  e.collectiveSeq = group.collectiveSeq_;
  e.p2pSeq = group.p2pSeq_;
  e.opId = ++group.opId_;
  e.title = title;
  e.name = std::move(name);
  e.type = type;
  e.rank = group.rank_;
  e.peer = peer;
  e.traceback = std::move(traceback);
  e.created = now;
  e.timeoutMs = group.timeout_.count();
  e.isP2P = isP2P;
  e.retired = false;
  e.started.reset();
  e.completed.reset();
  e.sizes.clear();
  e.inputDims.clear();
  e.outputDims.clear();
  e.inputDtypes.clear();
  e.outputDtypes.clear();
  describeTensors(inputs, flattenInputs, e.sizes, e.inputDims, e.inputDtypes);
  describeTensors(outputs, flattenOutputs, e.sizes, e.outputDims, e.outputDtypes);
  e.thread = std::this_thread::get_id();
  return Ref{id, r.epoch, group.id_, true, isP2P ? group.p2pSeq_ : group.collectiveSeq_};
}

}  // namespace

void GroupSlot::init(std::string name, int rank, int size, std::vector<uint64_t> globalRanks,
                     std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Store> store) {
  name_ = std::move(name);
  rank_ = rank;
  size_ = size;
  globalRanks_ = std::move(globalRanks);
  timeout_ = timeout;
  store_ = std::move(store);
}

void GroupSlot::setParent(int64_t parent) noexcept {
  parent_.store(parent);
  if (registeredDone_.load() && group_) {
    group_->parent_.store(parent);
  }
}

Ref GroupSlot::record(const c10d::Backend& backend, const char* profilingTitle, c10d::OpType type,
                      const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                      int peer) {
  if (!enabled() || disabled_.load()) {
    return {};
  }
  std::call_once(registered_, [&] {
    const std::string& uid = backend.getGroupUid();
    group_ = registerGroup(uid.empty() ? name_ : uid, backend.getGroupDesc(), rank_, size_,
                           globalRanks_, timeout_, store_);
    group_->parent_.store(parent_.load());
    registeredDone_.store(true);
  });
  if (!group_) {
    return {};
  }
  const bool isP2P = type == c10d::OpType::SEND || type == c10d::OpType::RECV ||
                     type == c10d::OpType::RECVANYSOURCE;
  return recordIn(*group_, profilingTitle, {}, type, peer, isP2P,
                  type == c10d::OpType::REDUCE_SCATTER, type == c10d::OpType::ALLGATHER, inputs,
                  outputs);
}

int64_t registerPythonGroup(const std::string& name, const std::string& desc, int rank, int size,
                            const std::vector<uint64_t>& globalRanks,
                            std::chrono::milliseconds timeout,
                            c10::intrusive_ptr<c10d::Store> store) {
  if (!enabled()) {
    return -1;
  }
  auto group = registerGroup(name, desc, rank, size, globalRanks, timeout, std::move(store));
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  reg.pythonGroups.push_back(group);
  return static_cast<int64_t>(group->id_);
}

void unregisterPythonGroup(int64_t group) noexcept {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto& groups = reg.pythonGroups;
  groups.erase(std::remove_if(groups.begin(), groups.end(),
                              [group](const std::shared_ptr<GroupTrace>& trace) {
                                return static_cast<int64_t>(trace->id_) == group;
                              }),
               groups.end());
}

Ref recordPython(int64_t group, const std::string& name, bool isP2P, bool flattenInputs,
                 bool flattenOutputs, const std::vector<at::Tensor>& inputs,
                 const std::vector<at::Tensor>& outputs) {
  if (group < 0) {
    return {};
  }
  auto trace = findGroup(static_cast<size_t>(group));
  if (!trace) {
    return {};
  }
  return recordIn(*trace, nullptr, name, c10d::OpType::UNKNOWN, -1, isP2P, flattenInputs,
                  flattenOutputs, inputs, outputs);
}

void groupFailed(int64_t group) noexcept {
  if (group < 0) {
    return;
  }
  if (auto trace = findGroup(static_cast<size_t>(group))) {
    trace->fail(/*tell=*/true);
  }
}

void markStarted(const Ref& ref) noexcept {
  if (!ref.valid) {
    return;
  }
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mutex);
  Entry* entry = r.find(ref);
  if (entry == nullptr || entry->started) {
    return;
  }
  entry->started = c10::getTime();
  if (!entry->isP2P) {
    const auto it = r.pgStatus.find(entry->pgId);
    if (it != r.pgStatus.end()) {
      it->second->lastStarted = static_cast<int64_t>(entry->collectiveSeq);
    }
  }
}

void setPeer(const Ref& ref, int peer) noexcept {
  if (!ref.valid) {
    return;
  }
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (Entry* entry = r.find(ref)) {
    entry->peer = peer;
  }
}

void markCompleted(const Ref& ref) noexcept {
  if (!ref.valid) {
    return;
  }
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mutex);
  Entry* entry = r.find(ref);
  if (entry == nullptr) {
    return;
  }
  const int64_t now = c10::getTime();
  if (!entry->started) {
    entry->started = now;
  }
  entry->completed = now;
  entry->retired = true;
  if (!entry->isP2P) {
    const auto it = r.pgStatus.find(entry->pgId);
    if (it != r.pgStatus.end()) {
      it->second->lastCompleted = static_cast<int64_t>(entry->collectiveSeq);
    }
  }
}

void markFailed(const Ref& ref, const std::exception_ptr& error) noexcept {
  if (!ref.valid) {
    return;
  }
  {
    Ring& r = ring();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (Entry* entry = r.find(ref)) {
      entry->retired = true;  // retired without completing: what a timed-out entry looks like
    }
  }
  bool breaking = false;
  try {
    if (error) {
      std::rethrow_exception(error);
    }
  } catch (const c10::DistBackendError&) {
    breaking = true;
  } catch (...) {
  }
  if (breaking) {
    if (auto group = findGroup(ref.group)) {
      group->fail(/*tell=*/true);
    }
  }
}

Ref& currentOperation() noexcept {
  thread_local Ref ref;
  return ref;
}

void onBreakingError() noexcept {
  const Ref& ref = currentOperation();
  if (!ref.valid) {
    return;
  }
  if (auto group = findGroup(ref.group)) {
    group->fail(/*tell=*/true);
  }
}

void reset() noexcept {
  Ring& r = ring();
  std::lock_guard<std::mutex> lock(r.mutex);
  ++r.epoch;
  r.entries.clear();
  r.next = 0;
  r.nextId = 0;
}

}  // namespace spyreccl_torch::flight
