// progress_thread.cpp — see progress_thread.h.
#include "backend/progress_thread.h"

#include <pthread.h>

#include <stdexcept>
#include <utility>

namespace spyreccl_torch {
namespace {

// The ProgressThread whose job's run() the calling thread is inside (see runningHere).
thread_local const ProgressThread* tlsRunning = nullptr;

// Marks the calling thread as running a job of `thread` for the guard's scope; nests.
class RunningGuard {
 public:
  explicit RunningGuard(const ProgressThread* thread) noexcept : previous_(tlsRunning) {
    tlsRunning = thread;
  }
  ~RunningGuard() { tlsRunning = previous_; }
  RunningGuard(const RunningGuard&) = delete;
  RunningGuard& operator=(const RunningGuard&) = delete;

 private:
  const ProgressThread* const previous_;
};

}  // namespace

ProgressThread::ProgressThread(std::string name, InFlightWaiter waiter)
    : name_(std::move(name)), waiter_(std::move(waiter)) {
  thread_ = std::thread([this] {
    loop();
    std::shared_ptr<ProgressThread> keep;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      keep = std::move(keepAlive_);
    }
    // `keep` may hold the last reference: the object is then destroyed here, on its own
    // thread, and nothing of it is used after this line.
  });
  // Visible in top/gdb; Linux limits thread names to 15 characters.
  (void)pthread_setname_np(thread_.native_handle(), "spyreccl-prog");
}

ProgressThread::~ProgressThread() {
  stop(/*drain=*/true);
  if (thread_.joinable()) {
    // Only on the thread itself (stop joins otherwise): it is about to return.
    thread_.detach();
  }
}

uint64_t ProgressThread::admit() {
  if (!accepting_) {
    throw std::runtime_error("spyreccl: " + name_ +
                             " has been shut down or aborted; it accepts no more operations");
  }
  outstanding_.fetch_add(1, std::memory_order_relaxed);
  return nextTicket_++;
}

uint64_t ProgressThread::post(std::unique_ptr<Job> job) {
  bool wakePeersWait = false;
  uint64_t ticket = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ticket = admit();
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

uint64_t ProgressThread::park(std::unique_ptr<Job> job) {
  uint64_t ticket = 0;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ticket = admit();
    parked_ = std::move(job);
    parkedTicket_ = ticket;
    parkedAt_ = std::chrono::steady_clock::now();
    lastPark_ = parkedAt_;
    // A thread that sleeps without a deadline must start ticking (once per burst of parks).
    wake = !ticking_;
    parkWake_ = parkWake_ || wake;
  }
  if (wake) {
    cv_.notify_one();
  }
  return ticket;
}

bool ProgressThread::drive(uint64_t ticket) {
  std::unique_ptr<Job> job;
  bool start = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (busy_ || inFlightCount_ != 0 || stopping_) {
      return false;
    }
    if (parked_ && parkedTicket_ == ticket) {
      job = std::move(parked_);
    } else if (!parked_ && !queue_.empty() && queue_.front().ticket == ticket) {
      job = std::move(queue_.front().job);
      queue_.pop_front();
      start = true;
    } else {
      return false;
    }
    busy_ = true;
  }
  if (start && job->run()) {
    // It finished when it started (it failed to post).
    job.reset();
    releaseFinished();
    return true;
  }
  return driveClaimed(std::move(job));
}

bool ProgressThread::driveClaimed(std::unique_ptr<Job> job) {
  for (;;) {
    if (job->poll()) {
      job.reset();
      releaseFinished();
      return true;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!queue_.empty() || stopping_) {
        // Others need the communicator (or the thread must drain): the thread takes over.
        inFlight_.push_back(std::move(job));
        ++inFlightCount_;
        busy_ = false;
      } else {
        waitingForPeers_ = true;  // post() and stop() end the sleep below
      }
    }
    if (!job) {
      cv_.notify_one();
      return false;
    }
    sleepForPeers();
  }
}

void ProgressThread::releaseFinished() {
  bool others = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ = false;
    retire();
    others = !queue_.empty() || stopping_;
  }
  if (others) {
    cv_.notify_one();  // the thread waits for busy_ to clear to start the next job
  }
}

void ProgressThread::sleepForPeers() {
  if (waiter_.waitForPeers) {
    waiter_.waitForPeers(kMaxPeersWait);
  } else {
    std::this_thread::yield();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  waitingForPeers_ = false;
}

void ProgressThread::adoptParked() {
  inFlight_.push_back(std::move(parked_));
  ++inFlightCount_;
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
  {
    const RunningGuard running(this);
    (void)job->run();
  }
  job.reset();
  releaseFinished();
  return true;
}

bool ProgressThread::runningHere() const noexcept { return tlsRunning == this; }

bool ProgressThread::runNested(uint64_t ticket) {
  if (!runningHere()) {
    return false;
  }
  for (;;) {
    std::unique_ptr<Job> job;
    uint64_t taken = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // busy_ is held by the job this thread is inside: nobody else takes queued jobs.
      if (queue_.empty() || queue_.front().ticket > ticket ||
          !queue_.front().job->finishesInRun()) {
        return false;
      }
      taken = queue_.front().ticket;
      job = std::move(queue_.front().job);
      queue_.pop_front();
    }
    (void)job->run();  // still runningHere(): its own callbacks may nest in turn
    job.reset();
    retire();
    if (taken == ticket) {
      return true;
    }
  }
}

void ProgressThread::stop(bool drain, std::exception_ptr reason) {
  std::deque<Queued> cancelled;
  const bool onThread = thread_.get_id() == std::this_thread::get_id();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (onThread && !keepAlive_) {
      // Null when called from the destructor (the last reference is already gone).
      keepAlive_ = weak_from_this().lock();
    }
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
  if (thread_.joinable() && !onThread) {
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
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (inFlight_.empty()) {
        // A job a caller runs in runIfNext or drives (busy_) must finish, or be handed
        // over, before the next one starts.
        const auto work = [this] { return (stopping_ || !queue_.empty()) && !busy_; };
        const auto now = std::chrono::steady_clock::now();
        if (parked_ || now - lastPark_ < kParkWatch) {
          // Parks are in use: sleep in ticks, so park() need not wake us (kParkTick).
          ticking_ = true;
          cv_.wait_for(lock, kParkTick, work);
          ticking_ = false;
        } else {
          cv_.wait(lock,
                   [this] { return ((stopping_ || !queue_.empty()) && !busy_) || parkWake_; });
          parkWake_ = false;
        }
        if (busy_) {
          continue;  // a caller runs or drives a job
        }
        if (parked_ && (stopping_ || !queue_.empty() ||
                        std::chrono::steady_clock::now() - parkedAt_ >= kParkGrace)) {
          // Unclaimed past the grace period, or others are queued behind it, or stopping.
          adoptParked();
        }
        if (inFlight_.empty() && queue_.empty()) {
          if (stopping_) {
            return;  // stopping and drained
          }
          continue;
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
      bool finished = false;
      {
        const RunningGuard running(this);
        finished = job->run();
      }
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
    sleepForPeers();
  }
}

}  // namespace spyreccl_torch
