// progress_thread.cpp — see progress_thread.h.
#include "backend/progress_thread.h"

#include <pthread.h>

#include <stdexcept>
#include <utility>

namespace spyreccl_torch {

ProgressThread::ProgressThread(std::string name, InFlightWaiter waiter)
    : name_(std::move(name)), waiter_(std::move(waiter)) {
  thread_ = std::thread([this] { loop(); });
  // Visible in top/gdb; Linux limits thread names to 15 characters.
  (void)pthread_setname_np(thread_.native_handle(), "spyreccl-prog");
}

ProgressThread::~ProgressThread() { stop(/*drain=*/true); }

uint64_t ProgressThread::post(std::unique_ptr<Job> job) {
  bool wakePeersWait = false;
  uint64_t ticket = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!accepting_) {
      throw std::runtime_error("spyreccl: " + name_ +
                               " has been shut down or aborted; it accepts no more operations");
    }
    outstanding_.fetch_add(1, std::memory_order_relaxed);
    ticket = nextTicket_++;
    queue_.push_back(Queued{ticket, std::move(job)});
    wakePeersWait = waitingForPeers_;
  }
  if (wakePeersWait) {
    waiter_.wake();
  } else {
    cv_.notify_one();
  }
  return ticket;
}

bool ProgressThread::runIfNext(uint64_t ticket) {
  std::unique_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (busy_ || inFlightCount_ != 0 || queue_.empty() || queue_.front().ticket != ticket) {
      return false;
    }
    job = std::move(queue_.front().job);
    queue_.pop_front();
    busy_ = true;
  }
  // The job runs to completion here (only jobs whose run() finishes them are run this way).
  (void)job->run();
  job.reset();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ = false;
    retire();
  }
  cv_.notify_one();  // the thread may be waiting to start the next job
  return true;
}

void ProgressThread::stop(bool drain, std::exception_ptr reason) {
  std::deque<Queued> cancelled;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    accepting_ = false;
    if (!drain) {
      cancelled.swap(queue_);
    }
    stopping_ = true;
  }
  cv_.notify_all();
  if (waiter_.wake) {
    waiter_.wake();
  }
  for (auto& entry : cancelled) {
    entry.job->cancel(reason);
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

void ProgressThread::retire() {
  // Release: whatever the job did to the communicator happens-before a caller that sees
  // idle() and then runs an operation inline on its own thread.
  outstanding_.fetch_sub(1, std::memory_order_release);
}

size_t ProgressThread::pollInFlight() {
  size_t finished = 0;
  for (auto it = inFlight_.begin(); it != inFlight_.end();) {
    if ((*it)->poll()) {
      it = inFlight_.erase(it);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --inFlightCount_;
      }
      retire();
      ++finished;
    } else {
      ++it;
    }
  }
  return finished;
}

void ProgressThread::loop() {
  // Longest sleep in waitForPeers: post() and stop() wake it earlier; the bound only
  // limits the cost of a lost wake-up.
  constexpr std::chrono::microseconds kMaxPeersWait{10000};
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (inFlight_.empty()) {
        // A job a caller runs in runIfNext (busy_) must finish before the next one starts.
        cv_.wait(lock, [this] { return (stopping_ || !queue_.empty()) && !busy_; });
        if (queue_.empty()) {
          return;  // stopping and drained
        }
      }
      // With jobs in flight nobody else runs jobs (runIfNext refuses), so busy_ is false.
      if (!queue_.empty()) {
        job = std::move(queue_.front().job);
        queue_.pop_front();
        busy_ = true;
      }
    }
    if (job) {
      // Retire the in-flight jobs that completed meanwhile first: the next job may block
      // for long (a large collective), and their Works should not wait for it.
      if (!inFlight_.empty()) {
        pollInFlight();
      }
      const bool finished = job->run();
      if (!finished) {
        inFlight_.push_back(std::move(job));
      }
      job.reset();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        busy_ = false;
        if (!finished) {
          ++inFlightCount_;
        }
      }
      if (finished) {
        retire();
      }
      continue;
    }
    // Nothing queued, jobs in flight: drive them; sleep until a peer moves or a job is
    // posted when none could move.
    if (pollInFlight() > 0) {
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!queue_.empty()) {
        continue;
      }
      waitingForPeers_ = true;
    }
    if (waiter_.waitForPeers) {
      waiter_.waitForPeers(kMaxPeersWait);
    } else {
      std::this_thread::yield();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    waitingForPeers_ = false;
  }
}

}  // namespace spyreccl_torch
