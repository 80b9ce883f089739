// device_caps.cpp — see device_caps.h.
#include "backend/device_caps.h"

#include <array>
#include <atomic>
#include <cstdint>

namespace spyreccl_torch {
namespace {

// Zero (static initialisation) means undeclared.
enum Declared : uint8_t { kUndeclared = 0, kNotAddressable = 1, kAddressable = 2 };

constexpr size_t kTypes = static_cast<size_t>(c10::COMPILE_TIME_MAX_DEVICE_TYPES);

// Read for every tensor of every operation: a lock-free table indexed by device type.
std::array<std::atomic<uint8_t>, kTypes> gDeclared{};
// Per device type: 1 when its copies to and from the host run on the host's CPUs.
std::array<std::atomic<uint8_t>, kTypes> gCopiesOnHostCpu{};

}  // namespace

bool hostAddressable(c10::DeviceType type) {
  const auto index = static_cast<size_t>(type);
  if (index >= kTypes) {
    return false;
  }
  switch (gDeclared[index].load(std::memory_order_acquire)) {
    case kAddressable:
      return true;
    case kNotAddressable:
      return false;
    default:
      return type == c10::DeviceType::CPU;
  }
}

void setHostAddressable(c10::DeviceType type, bool addressable) {
  const auto index = static_cast<size_t>(type);
  if (index < kTypes) {
    gDeclared[index].store(addressable ? kAddressable : kNotAddressable, std::memory_order_release);
  }
}

bool copiesUseHostCpu(c10::DeviceType type) {
  const auto index = static_cast<size_t>(type);
  return index < kTypes && gCopiesOnHostCpu[index].load(std::memory_order_acquire) != 0;
}

void setCopiesUseHostCpu(c10::DeviceType type, bool onHostCpu) {
  const auto index = static_cast<size_t>(type);
  if (index < kTypes) {
    gCopiesOnHostCpu[index].store(onHostCpu ? 1 : 0, std::memory_order_release);
  }
}

}  // namespace spyreccl_torch
