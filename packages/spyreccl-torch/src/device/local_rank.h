// LOCAL_RANK selects the process's spyre device, as in torch-spyre's runtime.
//
// torchrun starts one process per device of a node and gives each its rank on
// the node in LOCAL_RANK. torch-spyre's runtime binds the process to the
// device of that logical index when it starts (an explicit set_device() made
// before takes precedence) and refuses an index beyond the visible devices
// ("Device index out of bounds"). The emulated device does the same: every
// thread of the process starts on device LOCAL_RANK (0 when it is unset), and
// device initialisation rejects a LOCAL_RANK that is not a device index,
// naming the variable and its value. Reading the variable never fails: the
// error is raised when the device is first used, never at `import torch`.
#pragma once

#include <c10/core/Device.h>

namespace spyreccl::device {

inline constexpr const char* kLocalRankEnv = "LOCAL_RANK";

// The device threads start on: LOCAL_RANK when it names a device, else 0.
// Read once per process.
c10::DeviceIndex local_rank_device() noexcept;

// Device initialisation: throws a c10::Error (RuntimeError in Python) naming
// LOCAL_RANK and its value when LOCAL_RANK is set but is not an integer, is
// negative, or exceeds the largest device index.
void check_local_rank();

}  // namespace spyreccl::device
