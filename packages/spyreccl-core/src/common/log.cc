#include "common/log.h"

#include <strings.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace spyreccl {

LogLevel logLevel() {
  static const LogLevel level = [] {
    const char* v = std::getenv("SPYRECCL_DEBUG");
    if (v == nullptr || *v == '\0') return LogLevel::kNone;
    if (strcasecmp(v, "TRACE") == 0) return LogLevel::kTrace;
    if (strcasecmp(v, "INFO") == 0) return LogLevel::kInfo;
    if (strcasecmp(v, "WARN") == 0) return LogLevel::kWarn;
    std::fprintf(stderr,
                 "[spyreccl pid %d] WARN  SPYRECCL_DEBUG='%s' is not one of WARN, INFO, "
                 "TRACE; logging stays off\n",
                 static_cast<int>(getpid()), v);
    return LogLevel::kNone;
  }();
  return level;
}

void logMessage(LogLevel level, const char* who, const char* fmt, ...) {
  static const char* const kNames[] = {"", "WARN ", "INFO ", "TRACE"};
  char body[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(body, sizeof(body), fmt, ap);
  va_end(ap);
  // One fprintf per line so that lines of concurrent ranks do not interleave mid-line.
  std::fprintf(stderr, "[spyreccl pid %d%s%s] %s %s\n", static_cast<int>(getpid()), who ? " " : "",
               who ? who : "", kNames[static_cast<int>(level)], body);
}

}  // namespace spyreccl
