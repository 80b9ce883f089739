// errors.h — turning spyreccl result codes into torch exceptions.
//
// Every failed core call becomes an exception whose message names the c10d operation, the
// core's result code and spyrecclGetLastError's detailed text (which already names the
// argument or the peer at fault). Errors that mean "the communicator is broken" (timeouts,
// peer failures, aborts, mismatches, system errors) are c10::DistBackendError, which Python
// sees as torch.distributed.DistBackendError; argument errors the core rejected without
// communicating are plain c10::Error (RuntimeError).
#pragma once

#include <exception>
#include <string>

#include <spyreccl/spyreccl.h>

namespace spyreccl_torch {

// Builds the exception for `result`. `comm` may be null for calls that have no
// communicator yet (then the calling thread's last error is used).
std::exception_ptr makeCoreError(spyrecclResult_t result, spyrecclComm_t comm,
                                 const std::string& what);

[[noreturn]] void throwCoreError(spyrecclResult_t result, spyrecclComm_t comm,
                                 const std::string& what);

// Throws unless `result` is spyrecclSuccess. `what` names the failing operation, e.g.
// "allreduce" or "communicator initialisation".
inline void checkCore(spyrecclResult_t result, spyrecclComm_t comm, const std::string& what) {
  if (result != spyrecclSuccess) {
    throwCoreError(result, comm, what);
  }
}

// A DistBackendError carrying `message` (timeouts and aborts detected by the backend itself).
std::exception_ptr makeDistBackendError(const std::string& message);

}  // namespace spyreccl_torch
