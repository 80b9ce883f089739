// communicator.h — ownership of one spyrecclComm_t, shared by a process group, its progress
// thread and the Work objects it handed out.
//
// Why shared: a Work may outlive its process group and still needs to abort the
// communicator when a wait() on it times out (the NCCL-watchdog behaviour). The core allows
// spyrecclCommAbort and spyrecclCommSetTimeout from any thread, while communication happens
// on one thread at a time: the group's progress thread, or the calling thread for an inline
// operation while the progress thread is idle; spyrecclCommDestroy runs when the last owner
// lets go, which is after the progress thread has been joined.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include <spyreccl/spyreccl.h>

namespace spyreccl_torch {

class Communicator {
 public:
  // Takes ownership of `comm` (non-null). `timeout` is the one it was configured with.
  Communicator(spyrecclComm_t comm, std::chrono::milliseconds timeout, std::string label);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  spyrecclComm_t get() const { return comm_; }
  const std::string& label() const { return label_; }

  // Marks the communicator aborted and wakes any thread blocked in it (its call returns
  // spyrecclAborted). Thread-safe and idempotent; the first reason is kept.
  void abort(const std::string& reason);
  bool aborted() const { return aborted_.load(); }
  std::string abortReason() const;

  // Bounds the waits of the next core calls (cheap when unchanged). Called by the thread
  // that runs the group's operations: the progress thread, or the caller on the inline
  // fast path, which only runs while the progress thread is idle (ProgressThread::idle()
  // orders it after the progress thread's last use).
  void useTimeout(std::chrono::milliseconds timeout);

  // Human readable state dump from the core (recent operations, what peers announced).
  std::string dumpState() const;

 private:
  spyrecclComm_t comm_;
  std::string label_;
  std::chrono::milliseconds currentTimeout_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex mutex_;  // guards abortReason_
  std::string abortReason_;
};

}  // namespace spyreccl_torch
