#include "common/error.h"

#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace spyreccl {
namespace {

std::string vformat(const char* fmt, va_list ap) {
  va_list copy;
  va_copy(copy, ap);
  char small[256];
  int n = std::vsnprintf(small, sizeof(small), fmt, copy);
  va_end(copy);
  if (n < 0) return fmt;
  if (static_cast<size_t>(n) < sizeof(small)) return std::string(small, n);
  std::string out(static_cast<size_t>(n) + 1, '\0');
  std::vsnprintf(out.data(), out.size(), fmt, ap);
  out.resize(n);
  return out;
}

}  // namespace

std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  return s;
}

void throwError(spyrecclResult_t code, const char* file, int line, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  throw Error(code, std::move(s), file, line);
}

void throwArgError(const char* op, const char* file, int line, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = std::string(op) + ": " + vformat(fmt, ap);
  va_end(ap);
  throw Error(spyrecclInvalidArgument, std::move(s), file, line);
}

void throwSystemError(int err, const char* file, int line, const std::string& what) {
  char buf[128];
  // GNU strerror_r returns the message pointer (possibly not buf).
  const char* text = strerror_r(err, buf, sizeof(buf));
  throw Error(spyrecclSystemError, format("%s failed: %s (errno %d)", what.c_str(), text, err),
              file, line);
}

}  // namespace spyreccl
