// exit_guard.h — what must happen before the Python interpreter finalizes.
//
// Python 3.11 (and every version before 3.14) ends any thread that asks for the GIL once
// finalization has begun, with pthread_exit. In a C++ thread that unwinds the stack by force;
// reaching a noexcept frame (a progress thread's job, a Work's completion, a future's
// callback, a destructor) calls std::terminate, and the process dies with "terminate called
// without an active exception" after the user's script has ended normally. torch's gloo
// backend has the same defect: a Python callback on a gloo Work that completes during
// finalization aborts the process.
//
// So, at exit (Python's atexit, before finalization; see spyreccl_torch/_lifecycle.py):
//   * every live spyreccl group finishes what it queued (shutdown(), as when it is destroyed),
//     with the GIL released so that callbacks of those operations can still run; afterwards
//     no progress thread runs a job;
//   * the gate of guarded callbacks (addGuardedCallback) closes: a Work that completes later
//     (an operation abandoned after a failure, still pending in gloo until its timeout) skips
//     its Python callback instead of asking for the GIL.
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace spyreccl_torch {

class ProcessGroupSpyreccl;

// Remembers a live group for shutdownLiveGroups() (a weak reference: the group's lifetime is
// its owners').
void registerLiveGroup(const c10::intrusive_ptr<ProcessGroupSpyreccl>& group);

// Called once at exit, with the GIL held: releases it, shuts every live group down (each
// waits for its queued operations, bounded by the group's timeout), then closes the gate of
// guarded callbacks and waits for the ones running. Later calls do nothing.
void prepareForExit();

// Runs `fn(error)` when `work` completes: error is None, or the message of the Work's
// exception. Until prepareForExit() it runs on the completing thread with the GIL taken;
// afterwards it is skipped (and `fn` deliberately leaked: dropping it needs the GIL too).
void addGuardedCallback(c10d::Work& work, pybind11::object fn);

}  // namespace spyreccl_torch
