// flight_ring.h — the flight recorder's ring and entries (flight_recorder.cpp records into
// it, flight_dump.cpp writes it in torch's format). Internal to the backend.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <c10/core/ScalarType.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Utils.hpp>

namespace spyreccl_torch::flight::detail {

// The counters torch dumps as pg_status.
struct GroupStatus {
  int64_t lastEnqueued = -1;
  int64_t lastStarted = -1;
  int64_t lastCompleted = -1;
};

// One recorded operation: the fields of torch's FlightRecorder<>::Entry that the dump holds,
// kept as cheaply as torch keeps them (no allocation for the usual few small tensors; names
// are spelled out at dump time), since every operation writes one.
struct Entry {
  size_t id = 0;
  size_t epoch = 0;
  size_t pgId = 0;
  size_t collectiveSeq = 0;
  size_t p2pSeq = 0;
  size_t opId = 0;
  // The op: a backend's profiling title (a string literal, spelled for the analyzer at dump
  // time), or where that is null, `name` (groups implemented in Python).
  const char* title = nullptr;
  std::string name;
  c10d::OpType type = c10d::OpType::UNKNOWN;
  int rank = -1;  // group ranks of a send's / receive's two ends
  int peer = -1;
  std::shared_ptr<torch::CapturedTraceback> traceback;
  int64_t created = 0;
  int64_t timeoutMs = 0;
  bool isP2P = false;
  bool retired = false;
  std::optional<int64_t> started;
  std::optional<int64_t> completed;
  // As torch keeps them: each tensor's number of dims, and all dims one after the other.
  c10::SmallVector<int64_t, 8> sizes;
  c10::SmallVector<int64_t, 4> inputDims;
  c10::SmallVector<int64_t, 4> outputDims;
  c10::SmallVector<c10::ScalarType, 4> inputDtypes;
  c10::SmallVector<c10::ScalarType, 4> outputDtypes;
  std::thread::id thread;
};

// The process-wide ring: torch's FlightRecorder layout (a vector filled up to max, then
// overwritten from next), with torch's settings. torch's own instance is out of reach (see
// flight_recorder.h), and its member functions are defined in a header the wheel does not
// ship (FlightRecorderDetail.hpp needs nlohmann/json), so the few that matter are here.
struct Ring {
  Ring()
      : maxEntries(static_cast<size_t>(std::max(
            0, c10d::getCvarInt({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000)))),
        captureCppStack(
            c10d::getCvarBool({"TORCH_FR_CPP_STACK", "TORCH_NCCL_TRACE_CPP_STACK"}, false)) {}
  const size_t maxEntries;
  const bool captureCppStack;
  std::mutex mutex;
  std::vector<Entry> entries;
  size_t next = 0;
  size_t nextId = 0;
  size_t epoch = 0;
  std::map<std::tuple<std::string, std::string>, std::vector<uint64_t>> pgRanks;
  std::map<size_t, std::tuple<std::string, std::string>> pgNames;
  std::map<size_t, std::shared_ptr<GroupStatus>> pgStatus;
  std::map<std::thread::id, std::string> threadNames;

  // Under mutex.
  Entry* find(const Ref& ref) {
    if (ref.epoch != epoch || ref.id % maxEntries >= entries.size()) {
      return nullptr;
    }
    Entry& entry = entries[ref.id % maxEntries];
    return entry.id == ref.id ? &entry : nullptr;
  }
};

// The process-wide ring (leaked on purpose, like torch's: the watcher and late Works may use
// it during exit).
Ring& ring();

// Whether entries carry the Python stack (SPYRECCL_FR_STACKS=1).
bool captureStacks();

}  // namespace spyreccl_torch::flight::detail
