// progress_thread.cpp — see progress_thread.h.
#include "backend/progress_thread.h"

#include <pthread.h>

#include <stdexcept>
#include <utility>

namespace spyreccl_torch {

ProgressThread::ProgressThread(std::string name) : name_(std::move(name)) {
  thread_ = std::thread([this] { loop(); });
  // Visible in top/gdb; Linux limits thread names to 15 characters.
  (void)pthread_setname_np(thread_.native_handle(), "spyreccl-prog");
}

ProgressThread::~ProgressThread() { stop(/*drain=*/true); }

void ProgressThread::post(std::unique_ptr<Job> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!accepting_) {
      throw std::runtime_error("spyreccl: " + name_ +
                               " has been shut down or aborted; it accepts no more operations");
    }
    outstanding_.fetch_add(1, std::memory_order_relaxed);
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void ProgressThread::stop(bool drain, std::exception_ptr reason) {
  std::deque<std::unique_ptr<Job>> cancelled;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    accepting_ = false;
    if (!drain) {
      cancelled.swap(queue_);
    }
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& job : cancelled) {
    job->cancel(reason);
    outstanding_.fetch_sub(1, std::memory_order_release);
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
    thread_.join();
  }
}

bool ProgressThread::stopped() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !accepting_;
}

void ProgressThread::loop() {
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) {
        return;  // stopping and drained
      }
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job->run();
    job.reset();
    // Release: whatever the job did to the communicator happens-before a caller that sees
    // idle() and then runs an operation inline on its own thread.
    outstanding_.fetch_sub(1, std::memory_order_release);
  }
}

}  // namespace spyreccl_torch
