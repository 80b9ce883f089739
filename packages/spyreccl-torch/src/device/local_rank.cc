#include "local_rank.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <string>

#include "device_state.h"

namespace spyreccl::device {
namespace {

// The largest index a c10::DeviceIndex (int8) holds; torch-spyre's limit for LOCAL_RANK.
constexpr long long kMaxDeviceIndex = 127;

struct LocalRank {
  c10::DeviceIndex device = 0;
  // Empty when LOCAL_RANK is unset or names a device; else the reason it does not.
  std::string error;
};

std::string trimmed(const char* text) {
  std::string value(text);
  const auto not_space = [](unsigned char c) { return !std::isspace(c); };
  value.erase(value.begin(), std::find_if(value.begin(), value.end(), not_space));
  value.erase(std::find_if(value.rbegin(), value.rend(), not_space).base(), value.end());
  return value;
}

LocalRank read_local_rank() {
  LocalRank result;
  const char* text = std::getenv(kLocalRankEnv);
  if (text == nullptr) {
    return result;
  }
  const std::string value = trimmed(text);
  if (value.empty()) {
    return result;  // set but empty: no rank given, as when unset
  }
  const int count = device_count();
  // Each message starts with torch-spyre's wording for the same case (programs and
  // torch-spyre's tests match on it); our explanation follows.
  const std::string quoted = std::string(kLocalRankEnv) + "='" + text + "'";
  const std::string expected =
      " must be the process's spyre device index on its node, 0 <= " + std::string(kLocalRankEnv) +
      " < " + std::to_string(count);
  errno = 0;
  char* end = nullptr;
  const long long rank = std::strtoll(value.c_str(), &end, 10);
  if (end == value.c_str() || *end != '\0') {
    result.error = std::string(kLocalRankEnv) + " is not a valid integer: '" + text +
                   "'. spyre device initialisation failed: " + quoted + expected +
                   " (torchrun sets it)";
  } else if (rank < 0 || errno == ERANGE) {
    result.error = std::string(kLocalRankEnv) + " value is out of range: " + value +
                   ". spyre device initialisation failed: " + quoted + expected;
  } else if (rank > kMaxDeviceIndex) {
    result.error = std::string(kLocalRankEnv) + " value " + value +
                   " exceeds the maximum supported device index (" +
                   std::to_string(kMaxDeviceIndex) +
                   "). spyre device initialisation failed: " + quoted + expected +
                   " (emulated spyre devices: " + kDeviceCountEnv + ")";
  } else if (rank >= count) {
    // torch-spyre's wording for a logical device beyond the visible ones.
    result.error = "Device index out of bounds. " + quoted + " selects logical_device_id=" + value +
                   ", number of visible devices=" + std::to_string(count) +
                   " (emulated spyre devices: " + kDeviceCountEnv + ")";
  } else {
    result.device = static_cast<c10::DeviceIndex>(rank);
  }
  return result;
}

const LocalRank& local_rank() {
  static const LocalRank value = read_local_rank();
  return value;
}

void op_init() { check_local_rank(); }

}  // namespace

c10::DeviceIndex local_rank_device() noexcept {
  try {
    return local_rank().device;
  } catch (...) {
    return 0;  // only std::bad_alloc while formatting a message can get here
  }
}

void check_local_rank() {
  const LocalRank& value = local_rank();
  TORCH_CHECK(value.error.empty(), value.error);
}

// torch.spyre._lazy_init() calls this when torch initialises the device (first
// spyre tensor, first device query).
TORCH_LIBRARY_FRAGMENT(spyreccl_device, m) { m.def("init() -> ()", &op_init); }

}  // namespace spyreccl::device
