// Control operators of the emulated device (torch.ops.spyreccl_device.*).
// Exposing them through the dispatcher keeps this library free of Python
// bindings: the loader only needs torch.ops.load_library. torch.spyre calls
// them only where torch has no direct path: on hot paths and under dispatch
// modes it reads the device count and the current device through torch's
// accelerator API, and the random state through torch.Generator's methods.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>

#include "device_state.h"
#include "generator.h"

namespace spyreccl::device {
namespace {

c10::DeviceIndex checked_index(int64_t device, const char* what) {
  TORCH_CHECK(device >= -1 && device < device_count(), what, ": invalid spyre device index ",
              device, ", expected -1 (current) or 0 <= index < ", static_cast<int>(device_count()));
  return resolve_device_index(static_cast<c10::DeviceIndex>(device), what);
}

int64_t op_device_count() { return device_count(); }

int64_t op_current_device() { return current_device(); }

void op_set_device(int64_t device) {
  TORCH_CHECK(device >= 0 && device < device_count(), "set_device: invalid spyre device index ",
              device, ", expected 0 <= index < ", static_cast<int>(device_count()));
  set_current_device(static_cast<c10::DeviceIndex>(device));
}

// The default generator itself (torch.spyre.default_generators). The Python
// side fetches each once and then seeds, reads and restores it through
// torch.Generator's methods, which call the generator directly: no operator is
// dispatched on the random state (see _random.py).
at::Generator op_default_generator(int64_t device) {
  return default_generator(checked_index(device, "default_generator"));
}

}  // namespace

TORCH_LIBRARY(spyreccl_device, m) {
  m.def("device_count() -> int", &op_device_count);
  m.def("current_device() -> int", &op_current_device);
  m.def("set_device(int device) -> ()", &op_set_device);
  m.def("default_generator(int device) -> Generator?", &op_default_generator);
}

}  // namespace spyreccl::device
