// Errors inside the core.
//
// Internal code reports failures by throwing spyreccl::Error, which carries the result code
// that the C API will return, a complete human readable message, and the source location
// (logged at SPYRECCL_DEBUG=INFO, never shown in the message itself). api.cc is the only
// place that catches: no exception ever crosses the C API.
#pragma once

#include <exception>
#include <string>

#include "spyreccl/spyreccl.h"

namespace spyreccl {

class Error : public std::exception {
 public:
  Error(spyrecclResult_t code, std::string message, const char* file, int line)
      : code_(code), message_(std::move(message)), file_(file), line_(line) {}

  spyrecclResult_t code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  spyrecclResult_t code_;
  std::string message_;
  const char* file_;
  int line_;
};

// printf-style formatting into a std::string.
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

[[noreturn]] void throwError(spyrecclResult_t code, const char* file, int line, const char* fmt,
                             ...) __attribute__((format(printf, 4, 5)));
// `op` names the API call ("spyrecclAllReduce"); the message becomes "<op>: <formatted>".
[[noreturn]] void throwArgError(const char* op, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
// SystemError "<what> failed: <strerror(err)> (errno <err>)".
[[noreturn]] void throwSystemError(int err, const char* file, int line, const std::string& what);

}  // namespace spyreccl

#define SPYRECCL_THROW(code, ...) ::spyreccl::throwError((code), __FILE__, __LINE__, __VA_ARGS__)

// Argument validation: throws spyrecclInvalidArgument "<op>: <message>" unless `cond`.
#define SPYRECCL_CHECK_ARG(cond, op, ...)                                          \
  do {                                                                             \
    if (!(cond)) ::spyreccl::throwArgError((op), __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

// Runs a POSIX call that returns -1 (and sets errno) on failure; evaluates to its result.
#define SPYRECCL_SYSCHECK(call, what)                                                        \
  ({                                                                                         \
    auto spyreccl_rc_ = (call);                                                              \
    if (spyreccl_rc_ == -1) ::spyreccl::throwSystemError(errno, __FILE__, __LINE__, (what)); \
    spyreccl_rc_;                                                                            \
  })

// Internal invariant; a failure is a bug in spyreccl.
#define SPYRECCL_ASSERT(cond)                                                                   \
  do {                                                                                          \
    if (!(cond))                                                                                \
      ::spyreccl::throwError(spyrecclInternalError, __FILE__, __LINE__,                         \
                             "internal error: assertion '%s' failed at %s:%d", #cond, __FILE__, \
                             __LINE__);                                                         \
  } while (0)
