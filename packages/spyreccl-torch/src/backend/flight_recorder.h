// flight_recorder.h — a flight recorder of every spyreccl operation, in the dump format that
// torch's analyzer (`python -m torch.distributed.flight_recorder.fr_trace`, torchfrtrace)
// reads.
//
// Why our own ring: torch's FlightRecorder<c10::Event>::get() is a static local of a template
// instantiated inside libtorch with hidden visibility, so a backend outside torch cannot reach
// the instance that torch's _dump_fr_trace reads. The template itself is in torch's headers:
// this file instantiates it for spyreccl (one process-wide ring, sized by
// TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE like torch's), so the dump is torch's
// own pickle, written by torch's own code.
//
// Life of an entry: scheduled when the operation takes its sequence number
// (ProcessGroupSpyreccl::numberOp), started when a thread begins its core calls, completed
// when they return. An operation that fails stays "started" (that is what the analyzer
// expects of a collective that never finished) and dumps the recorder: once per group, on
// every rank that sees the failure, to TORCH_FR_DUMP_TEMP_FILE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE
// + global rank. A rank that sees no failure itself (it waits in Python outside any
// collective, say) learns of it through the group's store, which a watcher thread polls.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace spyreccl_torch::flight {

// Where an operation's entry lives in the ring; empty (valid false) when recording is off.
struct Ref {
  size_t id = 0;
  size_t epoch = 0;  // reset() starts a new one
  size_t group = 0;  // the group's pg_id
  bool valid = false;
  size_t seq = 0;  // the entry's collective (or p2p) sequence number in its group
};

// Whether recording is on (buffer size > 0). Read once.
bool enabled();

// One process group's identity in the dump (pg_config) and its sequence counters.
class GroupTrace;

// A group's place in the recorder. c10d names and describes a group only after its backend
// was constructed, so the group is registered with its first recorded operation.
class GroupSlot {
 public:
  // `name`: the group's name when c10d gives it none (a group made directly);
  // `globalRanks`: the members' global ranks (empty: 0..size-1); `store`: the group's store,
  // through which a failure is told to the other ranks (may be null).
  void init(std::string name, int rank, int size, std::vector<uint64_t> globalRanks,
            std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Store> store);

  // Stops recording this group's operations (a group that is plumbing of another one).
  void disable() noexcept { disabled_.store(true); }
  // Makes this group a stage of the Python group `parent` (registerPythonGroup): a failure
  // seen here is that group's failure, dumped once for both and told through its store.
  void setParent(int64_t parent) noexcept;

  // Records one operation of `backend` as scheduled. `profilingTitle` is the backend's title
  // ("spyreccl:all_reduce"); `peer` the group rank of a send's destination or a receive's
  // source (-1 for collectives and for a receive from any source, whose source is filled in
  // by setPeer once it is known).
  Ref record(const c10d::Backend& backend, const char* profilingTitle, c10d::OpType type,
             const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
             int peer);

 private:
  std::string name_;
  int rank_ = 0;
  int size_ = 0;
  std::vector<uint64_t> globalRanks_;
  std::chrono::milliseconds timeout_{0};
  c10::intrusive_ptr<c10d::Store> store_;
  std::atomic<bool> disabled_{false};
  std::atomic<int64_t> parent_{-1};
  std::once_flag registered_;
  std::atomic<bool> registeredDone_{false};
  std::shared_ptr<GroupTrace> group_;
};

// Groups implemented in Python (the multinode HierarchicalProcessGroup): registered by
// hand (returns the group's id, -1 when recording is off), their operations recorded with
// a ready analyzer op name ("all_reduce", "send 0->1"; the library prefix is added), and
// their failures reported by groupFailed (dumps once, tells the other ranks).
int64_t registerPythonGroup(const std::string& name, const std::string& desc, int rank, int size,
                            const std::vector<uint64_t>& globalRanks,
                            std::chrono::milliseconds timeout,
                            c10::intrusive_ptr<c10d::Store> store);
// Forgets a Python group (its Python object is gone): its entries stay in the ring, and its
// store, which holds a connection to the job's store server, is released.
void unregisterPythonGroup(int64_t group) noexcept;
Ref recordPython(int64_t group, const std::string& name, bool isP2P, bool flattenInputs,
                 bool flattenOutputs, const std::vector<at::Tensor>& inputs,
                 const std::vector<at::Tensor>& outputs);
void groupFailed(int64_t group) noexcept;

void markStarted(const Ref& ref) noexcept;
// The source of a receive from any source, once it is known (the entry then reads as a
// plain receive from `peer`, which the analyzer pairs with the sender's send).
void setPeer(const Ref& ref, int peer) noexcept;
void markCompleted(const Ref& ref) noexcept;
// The operation ended with `error`. A c10d DistBackendError (the group is broken: timeout,
// mismatch, peer failure, abort) dumps the recorder, once per group, and tells the group's
// other ranks; anything else (an argument the core rejected) only retires the entry.
void markFailed(const Ref& ref, const std::exception_ptr& error) noexcept;
// Called where a broken-group error is raised (errors.cpp): dumps for the operation that the
// calling thread is running (see Running), if any.
void onBreakingError() noexcept;

// The operation the calling thread runs (invalid: none); set by Running.
Ref& currentOperation() noexcept;

// RAII over the core calls of a list of steps (any type with a `trace` Ref): started on
// construction, completed by done(). While it lives, the calling thread's breaking errors
// (onBreakingError) belong to these steps' group. Destroyed without done() (an exception),
// the entries stay "started": what the analyzer expects of a call that never finished.
template <typename StepList>
class Running {
 public:
  explicit Running(const StepList& steps) : steps_(steps), previous_(current()) {
    for (const auto& step : steps_) {
      markStarted(step.trace);
    }
    if (!steps_.empty()) {
      current() = steps_.front().trace;
    }
  }
  void done() noexcept {
    for (const auto& step : steps_) {
      markCompleted(step.trace);
    }
  }
  ~Running() { current() = previous_; }
  Running(const Running&) = delete;
  Running& operator=(const Running&) = delete;

 private:
  static Ref& current() noexcept { return currentOperation(); }
  const StepList& steps_;
  const Ref previous_;
};

// This process's ring in torch's pickle format (what torch._C._distributed_c10d._dump_fr_trace
// returns for NCCL's). Stacks only when SPYRECCL_FR_STACKS=1 captured them.
std::string dumpPickle(bool includeCollectives, bool includeStackTraces, bool onlyActive);

// Forgets the recorded entries (groups stay known); record ids start again at 0, as the
// analyzer aligns the ranks' dumps by record id.
void reset() noexcept;

}  // namespace spyreccl_torch::flight
