// work.h — WorkSpyreccl, the c10d::Work handed out for every spyreccl operation.
//
// Lifecycle: created on the calling thread when an operation is enqueued (which also opens
// its profiler range, via the c10d::Work constructor's profilingTitle), completed on the
// group's progress thread with either the output tensors or the error. Its future is
// created with the spyre device list so that completing it with spyre tensors passes the
// future's device checks.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace spyreccl_torch {

class Communicator;

// "<prefix><opName> #<seq> on <group>": how messages name an operation (the Work's
// description(), and the calls that run without a Work, ProcessGroupSpyreccl::runWaited).
std::string describeOperation(const char* prefix, const char* opName, uint64_t seq,
                              const std::string& groupLabel);

class WorkSpyreccl : public c10d::Work {
 public:
  // The operation is described lazily (only messages need the text): `prefix` + `opName`
  // + " #" + seq + " on " + *groupLabel, e.g. "allreduce #12 on process group 'default_pg'
  // (rank 0 of 2)". `submitted` is false for operations recorded inside
  // startCoalescing/endCoalescing: they only run once endCoalescing submits the batch.
  WorkSpyreccl(int rank, c10d::OpType opType, uint64_t seq, const char* profilingTitle,
               const std::optional<std::vector<at::Tensor>>& inputs,
               std::vector<c10::Device> devices, std::shared_ptr<Communicator> comm,
               const char* opName, std::shared_ptr<const std::string> groupLabel,
               const char* prefix = "", bool submitted = true);
  ~WorkSpyreccl() override;

  std::vector<at::Tensor> result() override;
  // Waits for completion. A queued collective that the progress thread has not started yet
  // is run on the calling thread instead (see setRunner). With a timeout, a wait that expires
  // aborts the communicator (the operation can no longer finish consistently on all ranks) and
  // throws DistBackendError. On the Work of an operation recorded inside a coalescing batch that
  // has not been submitted yet, returns at once (like NCCL's): torch waits on the Work of every
  // synchronous call inside _coalescing_manager, and the results only exist once the batch
  // has run (wait on the Work returned by endCoalescing for them).
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // Spyre memory is written by the host: once completed, results are visible to everyone.
  void synchronize() override {}
  void abort() override;
  int sourceRank() const override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override { return seq_; }

  // --- owner side (process group / progress thread) ---
  void addOutputs(const std::vector<at::Tensor>& outputs);
  void markSubmitted() { submitted_.store(true); }
  // For a queued collective: `runner` runs it on the calling thread if it is still next in
  // line (ProgressThread::runIfNext) and says whether it did; for a lone send or receive,
  // it drives the request on the calling thread until it completes, while nothing else
  // needs the communicator (ProgressThread::drive). wait() calls it once before
  // blocking when it has no timeout of its own, so a caller that waits right away (wait_tensor
  // after a functional collective, Work.wait() after async_op=True) pays for no thread hand-off,
  // while a caller that computes first leaves the operation to the progress thread and overlaps
  // with it.
  void setRunner(std::function<bool()> runner);
  void setSourceRank(int rank) { sourceRank_.store(rank); }
  void finishSuccess();
  void finishError(std::exception_ptr error);
  std::string description() const;

 private:
  const uint64_t seq_;
  std::vector<at::Tensor> outputs_;  // immutable once submitted
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<Communicator> comm_;
  const char* const opName_;
  const char* const prefix_;
  const std::shared_ptr<const std::string> groupLabel_;
  std::atomic<bool> submitted_;
  std::atomic<int> sourceRank_{-1};
  std::function<bool()> runner_;  // guarded by mutex_; taken by the first wait()
};

}  // namespace spyreccl_torch
