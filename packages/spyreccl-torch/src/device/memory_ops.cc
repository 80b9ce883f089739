// torch.ops.spyreccl_device operators of the memory model (device_memory.h): the mode, and
// what inductor's generated code needs to reach discrete memory through host addresses.
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "device_memory.h"

namespace spyreccl::device {
namespace {

// "host" or "discrete"; creates the discrete memory on first use, so that a system that
// refuses it fails here (at device registration) with a message naming the variable.
std::string op_memory_mode() {
  ensure_discrete_memory();
  return memory_mode_name(memory_mode());
}

// [device_base, host_base, size] of the discrete window (all 0 in host mode): C++ wrappers
// that inductor generates translate their kernels' pointers with it (_cpp_wrapper.py).
std::vector<int64_t> op_discrete_window() {
  ensure_discrete_memory();
  const detail::DiscreteWindow& w = detail::g_window;
  return {static_cast<int64_t>(w.device_base), static_cast<int64_t>(w.host_base),
          static_cast<int64_t>(w.size)};
}

// Inductor's Python bindings of C++ kernels take each tensor's data pointer through one
// function of torch (guards.cpp), whose address they read when they are loaded. In discrete
// mode it is replaced by this one: torch's pointer, translated to its host address.
using TensorDataPtrFn = void* (*)(void*);
std::atomic<TensorDataPtrFn> g_torch_tensor_data_ptr{nullptr};

void* translated_tensor_data_ptr(void* object) {
  return host_address(g_torch_tensor_data_ptr.load(std::memory_order_relaxed)(object));
}

int64_t op_translating_tensor_data_ptr(int64_t torch_function) {
  TORCH_CHECK(torch_function != 0,
              "translating_tensor_data_ptr: expected the address of torch's tensor data "
              "pointer function, got 0");
  const auto ours = reinterpret_cast<TensorDataPtrFn>(&translated_tensor_data_ptr);
  const auto given = reinterpret_cast<TensorDataPtrFn>(static_cast<std::intptr_t>(torch_function));
  if (given != ours) {  // installing twice must not make the function call itself
    g_torch_tensor_data_ptr.store(given, std::memory_order_relaxed);
  }
  return static_cast<int64_t>(reinterpret_cast<std::intptr_t>(ours));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyreccl_device, m) {
  m.def("memory_mode() -> str", &op_memory_mode);
  m.def("discrete_window() -> int[]", &op_discrete_window);
  m.def("translating_tensor_data_ptr(int torch_function) -> int", &op_translating_tensor_data_ptr);
}

}  // namespace spyreccl::device
