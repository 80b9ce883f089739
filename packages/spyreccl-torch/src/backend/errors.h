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

// Tests a posted send or receive (spyrecclTest) without blocking: true once it completed.
// The core releases a request that completed or failed, so `request` is cleared then; a
// failure throws the core's error, named by `describe()` (built only on that path).
template <class Describe>
bool testPosted(spyrecclRequest_t& request, spyrecclComm_t comm, Describe&& describe) {
  int done = 0;
  const spyrecclResult_t result = spyrecclTest(request, &done);
  if (result != spyrecclSuccess) {
    request = nullptr;
    throwCoreError(result, comm, describe());
  }
  if (done != 0) {
    request = nullptr;
  }
  return done != 0;
}

// A DistBackendError carrying `message` (timeouts and aborts detected by the backend itself).
std::exception_ptr makeDistBackendError(const std::string& message);

}  // namespace spyreccl_torch
