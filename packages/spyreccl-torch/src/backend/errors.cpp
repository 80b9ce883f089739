// errors.cpp — see errors.h.
#include "backend/errors.h"

#include <c10/util/Exception.h>

#include "backend/flight_recorder.h"

namespace spyreccl_torch {
namespace {

// True for failures after which the communicator cannot be trusted any more; these are the
// ones torch users handle as backend errors (restart / re-create the group).
bool breaksCommunicator(spyrecclResult_t result) {
  return result != spyrecclInvalidArgument && result != spyrecclUnsupported;
}

}  // namespace

std::exception_ptr makeCoreError(spyrecclResult_t result, spyrecclComm_t comm,
                                 const std::string& what) {
  const char* detail = spyrecclGetLastError(comm);
  if ((detail == nullptr || detail[0] == '\0') && comm != nullptr) {
    // Group calls (spyrecclGroupEnd) report on the calling thread rather than a comm.
    detail = spyrecclGetLastError(nullptr);
  }
  std::string message = "spyreccl " + what + " failed: " + spyrecclGetErrorString(result);
  if (detail != nullptr && detail[0] != '\0') {
    message += "\n";
    message += detail;
  }
  if (breaksCommunicator(result)) {
    flight::onBreakingError();  // dumps the flight recorder for the operation running here
    return std::make_exception_ptr(c10::DistBackendError(
        c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message));
  }
  return std::make_exception_ptr(c10::Error(
      c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message));
}

void throwCoreError(spyrecclResult_t result, spyrecclComm_t comm, const std::string& what) {
  std::rethrow_exception(makeCoreError(result, comm, what));
}

std::exception_ptr makeDistBackendError(const std::string& message) {
  flight::onBreakingError();
  return std::make_exception_ptr(c10::DistBackendError(
      c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message));
}

}  // namespace spyreccl_torch
