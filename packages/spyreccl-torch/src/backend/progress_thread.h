// progress_thread.h — the per-process-group thread that executes queued operations in
// submission order.
//
// Why a thread: spyreccl collectives are blocking host calls, while c10d's contract is that
// collectives return a Work immediately (async_op=True) and execute in issue order. One
// thread per group keeps the core's "one thread at a time per communicator" rule and
// preserves ordering; different groups progress concurrently. The one exception, small
// synchronous collectives run by the caller, waits for idle() (see ProcessGroupSpyreccl).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace spyreccl_torch {

class ProgressThread {
 public:
  // One unit of queued work. run() executes it; cancel() fails it without running (used
  // when the group is aborted with operations still queued). Neither may throw.
  class Job {
   public:
    virtual ~Job() = default;
    virtual void run() noexcept = 0;
    virtual void cancel(std::exception_ptr reason) noexcept = 0;
  };

  explicit ProgressThread(std::string name);
  ~ProgressThread();  // stops, draining the queue
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // Queues `job`; throws if the thread was stopped (the message names `name`).
  void post(std::unique_ptr<Job> job);

  // Stops accepting jobs and joins the thread. With drain, queued jobs run first; without,
  // they are cancelled with `reason`. Idempotent; must not be called from the thread itself.
  void stop(bool drain, std::exception_ptr reason = nullptr);

  bool stopped() const;

  // True when every posted job has finished running (nothing queued, nothing in flight).
  // Lock-free. A true answer is stable as long as the caller posts nothing: only post()
  // adds work. It also orders the caller after the last job (acquire), so the caller may
  // then use the communicator that job used.
  bool idle() const { return outstanding_.load(std::memory_order_acquire) == 0; }

 private:
  void loop();

  const std::string name_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Job>> queue_;
  bool stopping_ = false;
  bool accepting_ = true;
  // Jobs posted and not yet finished (run or cancelled).
  std::atomic<size_t> outstanding_{0};
  std::thread thread_;
};

}  // namespace spyreccl_torch
