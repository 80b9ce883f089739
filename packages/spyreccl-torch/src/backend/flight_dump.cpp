// flight_dump.cpp — the flight recorder's ring in torch's pickle format (see flight_recorder.h,
// dumpPickle): the names the analyzer parses, the groups' pg_config and pg_status, the entries.
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <c10/util/irange.h>
#include <torch/csrc/distributed/c10d/TraceUtils.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>

#include <spyreccl/spyreccl.h>

#include "backend/flight_recorder.h"
#include "backend/flight_ring.h"

namespace spyreccl_torch::flight {
namespace {

using detail::captureStacks;
using detail::Entry;
using detail::Ring;
using detail::ring;

// The analyzer accepts only a fixed list of library prefixes in profiling names
// ("nccl:all_reduce"); spyreccl's collectives have NCCL's semantics, so they use its prefix.
constexpr const char* kLibraryPrefix = "nccl:";

// "all_reduce" from "spyreccl:all_reduce", in the analyzer's spelling.
std::string analyzerOpName(const char* profilingTitle) {
  std::string name(profilingTitle);
  const auto colon = name.find(':');
  if (colon != std::string::npos) {
    name = name.substr(colon + 1);
  }
  static const std::map<std::string, std::string> renamed = {
      {"_allgather_base", "_all_gather_base"},
      {"all_gather_coalesced", "ALLGATHER_coalesced"},
      {"all_reduce_coalesced", "allreduce_coalesced"},
      // NCCL's name for its barrier (an all_reduce of one element): every analyzer from torch
      // 2.10 on knows it, while torch 2.10's rejects "barrier" ("not a supported operation").
      {"barrier", "all_reduce_barrier"},
      // A barrier too (the core's barrier, bounded by the given timeout); the second word,
      // which the analyzer ignores for collectives, tells the two apart in its report.
      {"monitoredBarrier", "all_reduce_barrier monitored"},
  };
  const auto it = renamed.find(name);
  return it == renamed.end() ? name : it->second;
}

// "[0, 1, 2]", as torch's ranks_str writes it (not called: it needs fmt's compiled part,
// which libtorch does not export).
std::string ranksText(const std::vector<uint64_t>& ranks) {
  std::string text = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    text += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  }
  return text + "]";
}

// The profiling name the analyzer parses: "nccl:all_reduce", "nccl:send 0->1" (group ranks).
std::string profilingName(const Entry& e) {
  if (e.title == nullptr) {
    return kLibraryPrefix + e.name;
  }
  if (e.type == c10d::OpType::SEND) {
    return std::string(kLibraryPrefix) + "send " + std::to_string(e.rank) + "->" +
           std::to_string(e.peer);
  }
  // A receive from any source whose source is not known yet reads "recv 1<--1" (c10d's -1
  // for "any"): the analyzer parses it, and pairs it with no send.
  if (e.type == c10d::OpType::RECV || e.type == c10d::OpType::RECVANYSOURCE) {
    return std::string(kLibraryPrefix) + "recv " + std::to_string(e.rank) + "<-" +
           std::to_string(e.peer);
  }
  return kLibraryPrefix + analyzerOpName(e.title);
}

}  // namespace

std::string dumpPickle(bool includeCollectives, bool includeStackTraces, bool onlyActive) {
  using c10d::new_dict;
  using c10d::new_list;
  Ring& r = ring();
  std::vector<Entry> entries;
  std::map<size_t, std::tuple<std::string, std::string>> pgNames;
  std::map<std::thread::id, std::string> threadNames;
  auto pgConfig = new_dict();
  auto pgStatus = new_dict();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    // Oldest first, as torch dumps them.
    entries.insert(entries.end(), r.entries.begin() + static_cast<std::ptrdiff_t>(r.next),
                   r.entries.end());
    entries.insert(entries.end(), r.entries.begin(),
                   r.entries.begin() + static_cast<std::ptrdiff_t>(r.next));
    pgNames = r.pgNames;
    threadNames = r.threadNames;
    for (const auto& [pgName, ranks] : r.pgRanks) {
      auto info = new_dict();
      info.insert("name", std::get<0>(pgName));
      info.insert("desc", std::get<1>(pgName));
      info.insert("ranks", ranksText(ranks));
      pgConfig.insert(std::get<0>(pgName), info);
    }
    for (const auto& [pgId, status] : r.pgStatus) {
      auto info = new_dict();
      info.insert("last_enqueued_collective", status->lastEnqueued);
      info.insert("last_started_collective", status->lastStarted);
      info.insert("last_completed_collective", status->lastCompleted);
      pgStatus.insert(std::to_string(pgId), info);
    }
  }
  // Stacks exist only when they were captured (a null traceback cannot be symbolised).
  const bool withStacks = includeStackTraces && captureStacks();
  torch::SymbolizedTracebacks symbolized;
  std::vector<c10::IValue> frames;
  if (includeCollectives && withStacks) {
    std::vector<torch::CapturedTraceback*> tracebacks;
    for (auto& e : entries) {
      tracebacks.push_back(e.traceback.get());
    }
    symbolized = torch::symbolize(tracebacks);
    for (const auto& f : symbolized.all_frames) {
      auto d = new_dict();
      d.insert(c10d::name_key, f.funcname);
      d.insert(c10d::filename_key, f.filename);
      d.insert(c10d::line_key, int64_t(f.lineno));
      frames.emplace_back(std::move(d));
    }
  }
  // Each tensor's sizes from torch's flat layout (see Entry), advancing `it`.
  auto toSizes = [](const c10::SmallVector<int64_t, 4>& dims, const int64_t*& it) {
    auto list = new_list();
    for (const int64_t dim : dims) {
      auto inner = new_list();
      for (int64_t d = 0; d < dim; ++d) {
        inner.push_back(*it++);
      }
      list.push_back(inner);
    }
    return list;
  };
  auto toDtypes = [](const c10::SmallVector<c10::ScalarType, 4>& all) {
    std::vector<std::string> names;
    names.reserve(all.size());
    for (const auto dtype : all) {
      names.emplace_back(c10::toString(dtype));
    }
    return names;
  };
  auto list = new_list();
  for (const auto i : c10::irange(entries.size())) {
    const Entry& e = entries[i];
    if (!includeCollectives || (onlyActive && e.completed)) {
      continue;
    }
    auto dict = new_dict();
    if (withStacks) {
      auto entryFrames = new_list();
      for (const auto frame : symbolized.tracebacks.at(i)) {
        entryFrames.push_back(frames.at(frame));
      }
      dict.insert(c10d::frames_key, entryFrames);
    }
    dict.insert(c10d::record_id_key, int64_t(e.id));
    dict.insert(c10d::pg_id_key, int64_t(e.pgId));
    dict.insert(c10d::pg_name_key, pgNames[e.pgId]);
    dict.insert(c10d::thread_name_key, threadNames[e.thread]);
    dict.insert(c10d::thread_id_key, c10::str(e.thread));
    dict.insert(c10d::collective_seq_id_key, int64_t(e.collectiveSeq));
    dict.insert(c10d::p2p_seq_id_key, int64_t(e.p2pSeq));
    dict.insert(c10d::op_id_key, int64_t(e.opId));
    dict.insert(c10d::profiling_name_key, profilingName(e));
    dict.insert(c10d::time_created_key, e.created);
    if (e.started && e.completed) {
      dict.insert(c10d::duration_key, static_cast<double>(*e.completed - *e.started) / 1e6);
    }
    const int64_t* it = e.sizes.data();
    dict.insert(c10d::input_sizes_key, toSizes(e.inputDims, it));
    dict.insert(c10d::input_dtypes_key, toDtypes(e.inputDtypes));
    dict.insert(c10d::output_sizes_key, toSizes(e.outputDims, it));
    dict.insert(c10d::output_dtypes_key, toDtypes(e.outputDtypes));
    dict.insert(c10d::state_key, e.completed ? c10d::completed_state
                                 : e.started ? c10d::started_state
                                             : c10d::scheduled_state);
    dict.insert(c10d::time_discovered_started_key,
                e.started ? c10::IValue(*e.started) : c10::IValue());
    dict.insert(c10d::time_discovered_completed_key,
                e.completed ? c10::IValue(*e.completed) : c10::IValue());
    dict.insert(c10d::retired_key, e.retired);
    dict.insert(c10d::timeout_key, e.timeoutMs);
    dict.insert(c10d::is_p2p_key, e.isP2P);
    list.push_back(dict);
  }
  auto result = new_dict();
  result.insert(c10d::version_key, c10d::version_val);
  result.insert(c10d::pg_config_key, pgConfig);
  result.insert(c10d::comm_lib_version_key, "spyreccl " + std::to_string(SPYRECCL_MAJOR) + "." +
                                                std::to_string(SPYRECCL_MINOR) + "." +
                                                std::to_string(SPYRECCL_PATCH));
  result.insert(c10d::pg_status_key, pgStatus);
  if (includeCollectives) {
    result.insert(c10d::entries_key, list);
  }
  return c10d::pickle_str(result);
}

}  // namespace spyreccl_torch::flight
