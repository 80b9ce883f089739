// functional_scope.h — marks the calling thread as running a `_c10d_functional` collective.
//
// The functional ops (DTensor, FSDP2, compiled graphs) reach the backend as asynchronous
// calls, just like dist.*(async_op=True). Unlike those, their Work is only ever waited on by
// wait_tensor (no timeout of its own, no is_completed() polling), so a small one may run on
// the calling thread (ProcessGroupSpyreccl::runsInline). functional_kernels.cpp opens a scope
// around each of them for spyre tensors.
#pragma once

#include <cstdint>

namespace spyreccl_torch {

// A flag of the calling thread that is true while a scope of it lives (scopes nest: each
// restores the value it found). `Tag` names the flag.
template <typename Tag>
class ThreadFlagScope {
 public:
  ThreadFlagScope() : previous_(flag()) { flag() = true; }
  ~ThreadFlagScope() { flag() = previous_; }
  ThreadFlagScope(const ThreadFlagScope&) = delete;
  ThreadFlagScope& operator=(const ThreadFlagScope&) = delete;

  // The calling thread's flag.
  static bool& flag() {
    thread_local bool value = false;
    return value;
  }

 private:
  bool previous_;
};

// Marks the calling thread as running a functional collective (see above).
using FunctionalCallScope = ThreadFlagScope<struct FunctionalCallTag>;

// Whether the calling thread is inside a FunctionalCallScope.
inline bool inFunctionalCall() { return FunctionalCallScope::flag(); }

// Marks the calling thread as issuing functional collectives whose wait_tensor comes next,
// with nothing in between: inductor's wrapper for spyre knows it from the graph
// (spyreccl_torch.device._inductor) and says so through the functions direct_ops.cpp binds.
// No computation can overlap such a collective, so it runs inline up to the bound of
// synchronous calls (SPYRECCL_INLINE_MAX_BYTES) instead of the functional one
// (ProcessGroupSpyreccl::runsInline).
using WaitFollowsScope = ThreadFlagScope<struct WaitFollowsTag>;

// Whether the calling thread is inside a WaitFollowsScope.
inline bool waitFollows() { return WaitFollowsScope::flag(); }

// Opened by the functional kernels around the backend call of a collective waited at once
// (WaitFollowsScope) whose Work they would only register for that wait: the backend may
// then run it without a Work (ProcessGroupSpyreccl::submit, runWaited) and return
// ranWithoutWork() instead, which they do not register. Only those kernels open it: any
// other caller of the backend gets a real Work, whatever the wait_follows flag says.
using WorkOptionalScope = ThreadFlagScope<struct WorkOptionalTag>;

// The lean path of functional_kernels.cpp: on by default; off, every functional collective
// runs torch's implementation (for comparisons: spyreccl_torch._C._set_lean_functional).
void setLeanFunctional(bool enabled);
bool leanFunctional();
// How many functional collectives took the lean path in this process (tests).
uint64_t leanFunctionalCalls();
// How many of those, waited at once, ran without a Work (ProcessGroupSpyreccl::runWaited).
uint64_t waitedFunctionalCalls();
// How many collectives waited at once would have run without a Work but for the progress
// thread having work at that moment (ProcessGroupSpyreccl::runWaited): they took a Work.
// Which calls those are depends on thread scheduling; tests count them beside the others.
uint64_t waitedBehindProgressThreadCalls();
void countWaitedBehindProgressThread();
// On by default; off, collectives waited at once create their Work like the others (for
// comparisons: spyreccl_torch._C._set_waited_without_work).
void setWaitedWithoutWork(bool enabled);

}  // namespace spyreccl_torch
