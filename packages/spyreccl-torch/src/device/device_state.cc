#include "device_state.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "local_rank.h"

namespace spyreccl::device {
namespace {

c10::DeviceIndex parse_device_count() noexcept {
  const char* text = std::getenv(kDeviceCountEnv);
  if (text == nullptr || *text == '\0') {
    return kDefaultDeviceCount;
  }
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  constexpr long kMax = std::numeric_limits<c10::DeviceIndex>::max();
  if (errno != 0 || end == text || *end != '\0' || value < 1 || value > kMax) {
    // The Python loader validates the variable before loading this library and
    // raises there; this path only protects direct C++ users.
    std::fprintf(stderr,
                 "spyreccl: ignoring %s='%s' (expected an integer in [1, %ld]); using %d "
                 "emulated spyre devices\n",
                 kDeviceCountEnv, text, kMax, static_cast<int>(kDefaultDeviceCount));
    return kDefaultDeviceCount;
  }
  return static_cast<c10::DeviceIndex>(value);
}

// -1 until the thread selects a device: it then runs on the process's device
// (LOCAL_RANK's, see local_rank.h).
constexpr c10::DeviceIndex kUnset = -1;
thread_local c10::DeviceIndex tls_current_device = kUnset;

}  // namespace

c10::DeviceIndex device_count() noexcept {
  static const c10::DeviceIndex count = parse_device_count();
  return count;
}

void check_device_index(c10::DeviceIndex index, const char* what) {
  TORCH_CHECK(index >= 0 && index < device_count(), what, ": invalid spyre device index ",
              static_cast<int>(index), ", expected 0 <= index < ", static_cast<int>(device_count()),
              " (the count comes from ", kDeviceCountEnv, ")");
}

c10::DeviceIndex current_device() noexcept {
  return tls_current_device != kUnset ? tls_current_device : local_rank_device();
}

void set_current_device(c10::DeviceIndex index) {
  check_device_index(index, "set_device");
  tls_current_device = index;
}

void set_current_device_unchecked(c10::DeviceIndex index) noexcept { tls_current_device = index; }

c10::DeviceIndex resolve_device_index(c10::DeviceIndex index, const char* what) {
  const c10::DeviceIndex resolved = index < 0 ? current_device() : index;
  check_device_index(resolved, what);
  return resolved;
}

}  // namespace spyreccl::device
