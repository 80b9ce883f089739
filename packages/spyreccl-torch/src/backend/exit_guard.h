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
//   * every live spyreccl group's progress thread finishes what it queued and stops (as when
//     the group is shut down or destroyed), with the GIL released so that callbacks of those
//     operations can still run; afterwards no progress thread runs a job;
//   * the gate of guarded callbacks (addGuardedCallback) closes: a Work that completes later
//     (an operation abandoned after a failure, still pending in gloo until its timeout) skips
//     its Python callback instead of asking for the GIL.
#pragma once

#include <memory>

#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace spyreccl_torch {

class ProgressThread;

// Remembers a group's progress thread for prepareForExit(). A std::weak_ptr: it neither
// keeps the thread alive nor delays its destruction (a c10::weak_intrusive_ptr to the group
// would delay the group's destructor, and with it the release of its shared memory, until
// the weak reference went).
void registerProgressThread(const std::shared_ptr<ProgressThread>& thread);

// Called once at exit, with the GIL held: releases it, stops every live progress thread
// after its queued operations (bounded by the group's timeout; the group then refuses new
// ones, as after shutdown()), then closes the gate of guarded callbacks and waits for the
// ones running. Later calls do nothing.
void prepareForExit();

// Runs `fn(error)` when `work` completes: error is None, or the message of the Work's
// exception. Until prepareForExit() it runs on the completing thread with the GIL taken;
// afterwards it is skipped (and `fn` deliberately leaked: dropping it needs the GIL too).
void addGuardedCallback(c10d::Work& work, pybind11::object fn);

}  // namespace spyreccl_torch
