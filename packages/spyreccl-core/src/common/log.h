// Logging to stderr, controlled by SPYRECCL_DEBUG=WARN|INFO|TRACE (default: silent).
// Every line carries the pid and, when known, the communicator rank:
//   [spyreccl pid 4242 rank 1/4 'tp'] INFO  communicator ready (segment 8.3 MiB)
#pragma once

namespace spyreccl {

enum class LogLevel : int { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };

// Parsed once from SPYRECCL_DEBUG.
LogLevel logLevel();

// `who` identifies the rank ("rank 1/4 'tp'"); may be null.
void logMessage(LogLevel level, const char* who, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));

}  // namespace spyreccl

#define SPYRECCL_LOG(level, who, ...)                                          \
  do {                                                                         \
    if (::spyreccl::logLevel() >= ::spyreccl::LogLevel::level)                 \
      ::spyreccl::logMessage(::spyreccl::LogLevel::level, (who), __VA_ARGS__); \
  } while (0)
