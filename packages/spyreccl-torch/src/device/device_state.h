// Device enumeration and the per-thread current device of the host-emulated
// "spyre" device (PrivateUse1).
//
// The emulated device has no hardware behind it: every "device" is a label on
// host memory. The count comes from SPYRECCL_SPYRE_DEVICE_COUNT so that tests
// can model nodes with different numbers of cards.
#pragma once

#include <c10/core/Device.h>

namespace spyreccl::device {

inline constexpr c10::DeviceType kSpyreDeviceType = c10::DeviceType::PrivateUse1;
inline constexpr c10::DeviceIndex kDefaultDeviceCount = 8;
inline constexpr const char* kDeviceCountEnv = "SPYRECCL_SPYRE_DEVICE_COUNT";

// Number of emulated devices, read once from SPYRECCL_SPYRE_DEVICE_COUNT
// (default 8). An unparsable value is reported once on stderr and the default
// is used: this function backs noexcept interfaces and must not throw.
c10::DeviceIndex device_count() noexcept;

// Throws a c10::Error naming `what` when `index` is not a valid device index.
void check_device_index(c10::DeviceIndex index, const char* what);

// The calling thread's current device, like cudaGetDevice: until the thread
// sets one, the process's device (LOCAL_RANK's under torchrun, else 0).
c10::DeviceIndex current_device() noexcept;

// Checked and unchecked setters of the calling thread's current device.
void set_current_device(c10::DeviceIndex index);
void set_current_device_unchecked(c10::DeviceIndex index) noexcept;

// Index -1 means "the current device": resolves it and validates the result.
c10::DeviceIndex resolve_device_index(c10::DeviceIndex index, const char* what);

inline c10::Device spyre_device(c10::DeviceIndex index) {
  return c10::Device(kSpyreDeviceType, index);
}

}  // namespace spyreccl::device
