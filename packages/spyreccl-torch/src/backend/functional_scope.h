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

class FunctionalCallScope {
 public:
  FunctionalCallScope();
  ~FunctionalCallScope();
  FunctionalCallScope(const FunctionalCallScope&) = delete;
  FunctionalCallScope& operator=(const FunctionalCallScope&) = delete;

 private:
  bool previous_;
};

// Whether the calling thread is inside a FunctionalCallScope.
bool inFunctionalCall();

// Marks the calling thread as issuing functional collectives whose wait_tensor comes next,
// with nothing in between: inductor's wrapper for spyre knows it from the graph
// (spyreccl_torch.device._inductor) and says so through the functions direct_ops.cpp binds.
// No computation can overlap such a collective, so it runs inline up to the bound of
// synchronous calls (SPYRECCL_INLINE_MAX_BYTES) instead of the functional one
// (ProcessGroupSpyreccl::runsInline).
class WaitFollowsScope {
 public:
  WaitFollowsScope();
  ~WaitFollowsScope();
  WaitFollowsScope(const WaitFollowsScope&) = delete;
  WaitFollowsScope& operator=(const WaitFollowsScope&) = delete;

 private:
  bool previous_;
};

// Whether the calling thread is inside a WaitFollowsScope.
bool waitFollows();

// The lean path of functional_kernels.cpp: on by default; off, every functional collective
// runs torch's implementation (for comparisons: spyreccl_torch._C._set_lean_functional).
void setLeanFunctional(bool enabled);
bool leanFunctional();
// How many functional collectives took the lean path in this process (tests).
uint64_t leanFunctionalCalls();

}  // namespace spyreccl_torch
