#include "common/env.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "common/error.h"

namespace spyreccl {

std::optional<std::string> envString(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

size_t envBytes(const char* name, size_t fallback) {
  auto value = envString(name);
  if (!value) return fallback;
  const char* s = value->c_str();
  char* end = nullptr;
  errno = 0;
  unsigned long long n = std::strtoull(s, &end, 10);
  bool ok = errno == 0 && end != s && *s != '-';
  unsigned long long scale = 1;
  if (ok && *end != '\0') {
    switch (*end) {
      case 'k':
      case 'K':
        scale = 1ULL << 10;
        break;
      case 'm':
      case 'M':
        scale = 1ULL << 20;
        break;
      case 'g':
      case 'G':
        scale = 1ULL << 30;
        break;
      default:
        ok = false;
    }
    if (ok) {
      ++end;
      if (*end == 'i' || *end == 'I') ++end;  // "KiB"
      if (*end == 'b' || *end == 'B') ++end;
      ok = *end == '\0';
    }
  }
  if (!ok || n > (~0ULL) / scale) {
    SPYRECCL_THROW(spyrecclInvalidUsage,
                   "environment variable %s='%s' is not a byte count (expected e.g. 65536, "
                   "64K, 1M)",
                   name, s);
  }
  return static_cast<size_t>(n * scale);
}

bool envFlag(const char* name, bool fallback) {
  auto value = envString(name);
  if (!value) return fallback;
  std::string v;
  for (char ch : *value) v += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (v == "1" || v == "on" || v == "true" || v == "yes") return true;
  if (v == "0" || v == "off" || v == "false" || v == "no") return false;
  SPYRECCL_THROW(spyrecclInvalidUsage,
                 "environment variable %s='%s' is not a switch (expected 1/0, on/off, "
                 "true/false or yes/no)",
                 name, value->c_str());
}

}  // namespace spyreccl
