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
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace spyreccl_torch {

class ProgressThread : public std::enable_shared_from_this<ProgressThread> {
 public:
  // One unit of queued work. run() executes it and returns true when it finished, or
  // false when it left work in flight on the communicator (a posted send or receive) that
  // poll() drives from then on, until poll() returns true. cancel() fails a queued job
  // without running it (used when the group is aborted with operations still queued).
  // None of them may throw.
  class Job {
   public:
    virtual ~Job() = default;
    virtual bool run() noexcept = 0;
    virtual bool poll() noexcept { return true; }
    virtual void cancel(std::exception_ptr reason) noexcept = 0;
    // Whether run() always finishes the job (a collective), never leaving it in flight:
    // only such jobs are run nested (runNested).
    virtual bool finishesInRun() const noexcept { return true; }
  };

  // How the thread sleeps while jobs are in flight and nothing is queued: waitForPeers(max)
  // blocks until an in-flight job may have moved, wake() was called, or `max` passed; wake()
  // (any thread) ends such a wait early. Both must not throw.
  struct InFlightWaiter {
    std::function<void(std::chrono::microseconds max)> waitForPeers;
    std::function<void()> wake;
  };

  // A parked job (park()) is left to its waiter for at least kParkGrace: a caller that
  // waits right away (dist.send, dist.recv) claims it within microseconds. The thread does
  // not wake for each park: after a park it sleeps in slices of kParkTick for as long as
  // parks keep coming (kParkWatch after the last one), and adopts, at the first tick after
  // kParkGrace, a parked job that nobody claimed; so a send or receive whose caller
  // computes before waiting (or waits with a timeout, or polls) still moves within about a
  // tick, at the cost of a few thousand idle wake-ups per second while sends and receives
  // are in use (instead of two thread wake-ups per operation).
  static constexpr std::chrono::microseconds kParkGrace{50};
  static constexpr std::chrono::microseconds kParkTick{500};
  static constexpr std::chrono::milliseconds kParkWatch{50};
  // Longest sleep in waitForPeers: post() and stop() wake it earlier; the bound only limits
  // the cost of a lost wake-up.
  static constexpr std::chrono::microseconds kMaxPeersWait{10000};

  explicit ProgressThread(std::string name, InFlightWaiter waiter = {});
  ~ProgressThread();  // stops, draining the queue
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // Queues `job`; throws if the thread was stopped (the message names `name`). Returns the
  // job's ticket (for runIfNext).
  uint64_t post(std::unique_ptr<Job> job);

  // Runs the job with `ticket` on the calling thread when it is the next one to run and the
  // thread is doing nothing else (no job running, none in flight), and returns true; false
  // otherwise (it already ran, is running, or others run first). For a caller that waits on
  // the job's result anyway: it then needs neither the wake-up of the progress thread nor
  // the wake-up back, which on a loaded machine can cost more than the operation itself.
  // Issue order and "one thread at a time on the communicator" hold as for the thread's own
  // jobs. Only for jobs whose run() finishes them (collectives), never for a lone send or
  // receive that run() leaves in flight.
  bool runIfNext(uint64_t ticket);

  // Whether the calling thread is inside the run() of one of this thread's jobs: the
  // thread itself, or a caller in runIfNext. A job's completion runs its Future's
  // callbacks there, and a callback may issue an operation of the same group and wait for
  // it (DDP's PowerSGD hook does: an all_reduce inside the then() of the previous one);
  // only this thread could run that operation, so waiting for it would never end.
  bool runningHere() const noexcept;

  // On a thread where runningHere(): runs, nested in the job that is running, the queued
  // jobs up to and including the one with `ticket`, in issue order, and returns true once
  // that one has finished. The running job's thread holds the right to run jobs (busy_),
  // so issue order and "one thread at a time on the communicator" hold as for the
  // thread's own jobs: everything issued before `ticket` runs before it. Returns false,
  // running nothing more, where that cannot be done: another thread's job, `ticket`
  // already taken, or a job that would stay in flight (a lone send or receive, whose peer
  // may need jobs behind it to make progress).
  bool runNested(uint64_t ticket);

  // Parks `job`, which the calling thread started itself and which left work in flight (a
  // send or receive posted inline, OpJob::startInline), for the thread that will wait on
  // it: drive(ticket) then progresses it on that waiter's thread, without the two thread
  // wake-ups of a hand-off (the thread's to poll, the waiter's when it completes). One that
  // no waiter claims is adopted by the thread (kParkGrace). Only while idle() and with no
  // other thread posting (the caller holds its submission lock): at most one job is
  // parked. Throws like post() once stopped. Returns the job's ticket.
  uint64_t park(std::unique_ptr<Job> job);

  // For the thread that waits on the job with `ticket`, a lone send or receive: when it is
  // parked, or next in the queue and not started, and the thread is doing nothing else (no
  // job running, none in flight), starts it if needed and polls it on the calling thread,
  // sleeping in waitForPeers between polls, until it finished: returns true. Hands the job
  // to the thread (and returns false) as soon as another job is posted or the thread is
  // stopped, so that issue order and progress hold for everyone; returns false at once when
  // it cannot claim the job. The caller then waits for the job's completion as usual.
  bool drive(uint64_t ticket);

  // Stops accepting jobs and joins the thread. With drain, queued jobs run first; without,
  // they are cancelled with `reason`. Idempotent. On the thread itself (a job's completion
  // ran a Python callback that dropped the last reference to the group) it cannot join: the
  // thread then keeps the object alive until its loop has finished, and the object is
  // destroyed on the thread (which detaches itself) when that reference goes.
  void stop(bool drain, std::exception_ptr reason = nullptr);

  bool stopped() const;

  // True when every posted job has finished (nothing queued, running or in flight).
  // Lock-free. A true answer is stable as long as the caller posts nothing: only post()
  // adds work. It also orders the caller after the last job (acquire), so the caller may
  // then use the communicator that job used.
  bool idle() const { return outstanding_.load(std::memory_order_acquire) == 0; }

 private:
  void loop();
  // Polls every in-flight job once, retiring the finished ones; returns how many finished.
  size_t pollInFlight();
  void retire();
  // Counts a new job in and returns its ticket; throws once stopped. Under mutex_.
  uint64_t admit();
  // Ends a caller's claim (runIfNext, drive) on a job that finished: clears busy_, retires
  // the job, and wakes the thread when it has work waiting for busy_ to clear.
  void releaseFinished();
  // Sleeps in waitForPeers until a peer may have moved an in-flight job or post()/stop()
  // woke it (the caller set waitingForPeers_ under mutex_), then clears waitingForPeers_.
  void sleepForPeers();
  // Moves the parked job in flight (on the thread). Under mutex_, with busy_ false.
  void adoptParked();
  // drive()'s loop over the claimed `job` (busy_ held by the caller).
  bool driveClaimed(std::unique_ptr<Job> job);

  struct Queued {
    uint64_t ticket;
    std::unique_ptr<Job> job;
  };

  const std::string name_;
  const InFlightWaiter waiter_;
  // Jobs whose run() left work in flight, in issue order. Touched by the thread, or by a
  // caller in drive() that holds busy_ while the thread has none in flight; inFlightCount_
  // (under mutex_) mirrors its size for runIfNext and drive.
  std::deque<std::unique_ptr<Job>> inFlight_;
  size_t inFlightCount_ = 0;
  // Set (under mutex_) while the thread is about to sleep in waiter_.waitForPeers: post()
  // must then wake it.
  bool waitingForPeers_ = false;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;
  uint64_t nextTicket_ = 0;
  // A job taken from the queue is running (on the thread, or on a caller in runIfNext or
  // drive): nothing else may start until it finished or went in flight.
  bool busy_ = false;
  // The job park() left for its waiter (nullptr: none), its ticket and when it was parked.
  std::unique_ptr<Job> parked_;
  uint64_t parkedTicket_ = 0;
  std::chrono::steady_clock::time_point parkedAt_;
  // The thread sleeps in kParkTick slices (park() then need not wake it).
  bool ticking_ = false;
  // park() woke the thread to start ticking.
  bool parkWake_ = false;
  // When the latest park happened.
  std::chrono::steady_clock::time_point lastPark_;
  bool stopping_ = false;
  bool accepting_ = true;
  // Jobs posted and not yet finished (run or cancelled).
  std::atomic<size_t> outstanding_{0};
  // Set by stop() on the thread itself (see stop); dropped on the thread once loop() ended.
  std::shared_ptr<ProgressThread> keepAlive_;
  std::thread thread_;
};

}  // namespace spyreccl_torch
