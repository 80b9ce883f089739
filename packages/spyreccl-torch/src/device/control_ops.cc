// Operators behind the Python `torch.spyre` module. Exposing them through the
// dispatcher (torch.ops.spyreccl_device.*) keeps this library free of Python
// bindings: the loader only needs torch.ops.load_library.
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

// Seeds travel as int64 (the schema type) and are reinterpreted as the
// uint64 that generators use; the Python side maps them back.
at::Generator generator_for(int64_t device, const char* what) {
  return default_generator(checked_index(device, what));
}

int64_t op_device_count() { return device_count(); }

int64_t op_current_device() { return current_device(); }

void op_set_device(int64_t device) {
  TORCH_CHECK(device >= 0 && device < device_count(), "set_device: invalid spyre device index ",
              device, ", expected 0 <= index < ", static_cast<int>(device_count()));
  set_current_device(static_cast<c10::DeviceIndex>(device));
}

void op_manual_seed(int64_t device, int64_t seed) {
  at::Generator gen = generator_for(device, "manual_seed");
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(static_cast<uint64_t>(seed));
}

int64_t op_seed(int64_t device) {
  at::Generator gen = generator_for(device, "seed");
  std::lock_guard<std::mutex> lock(gen.mutex());
  return static_cast<int64_t>(gen.seed());
}

int64_t op_initial_seed(int64_t device) {
  at::Generator gen = generator_for(device, "initial_seed");
  std::lock_guard<std::mutex> lock(gen.mutex());
  return static_cast<int64_t>(gen.current_seed());
}

at::Tensor op_get_rng_state(int64_t device) {
  at::Generator gen = generator_for(device, "get_rng_state");
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void op_set_rng_state(int64_t device, const at::Tensor& state) {
  TORCH_CHECK(state.device().type() == c10::kCPU && state.scalar_type() == at::kByte,
              "set_rng_state: expected a CPU torch.uint8 tensor, got ", state.scalar_type(), " on ",
              state.device());
  at::Generator gen = generator_for(device, "set_rng_state");
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state.contiguous());
}

// The default generator itself (torch.spyre.default_generators), e.g. for
// torch.compile's graph-safe RNG, which swaps its state.
at::Generator op_default_generator(int64_t device) {
  return generator_for(device, "default_generator");
}

}  // namespace

TORCH_LIBRARY(spyreccl_device, m) {
  m.def("device_count() -> int", &op_device_count);
  m.def("current_device() -> int", &op_current_device);
  m.def("set_device(int device) -> ()", &op_set_device);
  m.def("manual_seed(int device, int seed) -> ()", &op_manual_seed);
  m.def("seed(int device) -> int", &op_seed);
  m.def("initial_seed(int device) -> int", &op_initial_seed);
  m.def("get_rng_state(int device) -> Tensor", &op_get_rng_state);
  m.def("set_rng_state(int device, Tensor state) -> ()", &op_set_rng_state);
  m.def("default_generator(int device) -> Generator?", &op_default_generator);
}

}  // namespace spyreccl::device
