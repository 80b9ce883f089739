// Where the emulated device's memory lives, and the one translation every piece of the
// device's own code applies before it touches spyre memory.
//
// SPYRECCL_SPYRE_MEMORY selects the memory model:
//   host      (default) a spyre tensor's data_ptr() is ordinary host memory; host_address()
//             is the identity.
//   discrete  as on real Spyre cards, data_ptr() is a device address that the host cannot
//             dereference: it lies in a window mapped with no access (reading it faults).
//             The same pages are mapped a second time, readable and writable, at a fixed
//             distance; the device's kernels, copies and fallback reach them through
//             host_address(). Code outside the device (the collective backend, a program
//             calling ctypes on data_ptr()) must move data with copy_, as on real cards.
// Both mappings share one sparse memfd, so the discrete mode costs one addition per
// pointer the device translates, not a copy.
#pragma once

#include <cstddef>
#include <cstdint>

namespace spyreccl::device {

enum class MemoryMode : std::uint8_t { kHost, kDiscrete };

// The mode chosen by SPYRECCL_SPYRE_MEMORY (read once). An unset, empty or unknown value
// means kHost; the Python layer warns about unknown values (see memory_mode_from_env).
MemoryMode memory_mode();

// "host" or "discrete".
const char* memory_mode_name(MemoryMode mode);

namespace detail {
// The no-access window of device addresses and its accessible twin. All zero in host mode
// (and until the first discrete allocation), which makes host_address() the identity.
struct DiscreteWindow {
  std::uintptr_t device_base = 0;
  std::uintptr_t host_base = 0;
  std::uintptr_t size = 0;
};
extern DiscreteWindow g_window;
}  // namespace detail

// The address through which the device's own code reads and writes the spyre memory at
// `ptr`: its accessible twin for a device address of the discrete window, `ptr` itself for
// anything else (host-mode spyre memory, CPU memory, null).
inline void* host_address(const void* ptr) {
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  const detail::DiscreteWindow& w = detail::g_window;
  if (address - w.device_base < w.size) {
    return reinterpret_cast<void*>(address - w.device_base + w.host_base);
  }
  return const_cast<void*>(ptr);
}

// The inverse: the device address of a pointer into the accessible twin, else `ptr`.
inline void* device_address(const void* ptr) {
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  const detail::DiscreteWindow& w = detail::g_window;
  if (address - w.host_base < w.size) {
    return reinterpret_cast<void*>(address - w.host_base + w.device_base);
  }
  return const_cast<void*>(ptr);
}

// Creates the discrete window if the mode is kDiscrete and it does not exist yet; throws a
// c10::Error naming SPYRECCL_SPYRE_MEMORY if the system refuses the memory.
void ensure_discrete_memory();

// A block of `nbytes` (> 0) of discrete memory: its device address, or nullptr when the
// window is exhausted. Blocks of at least kDiscretePageMinBytes are page aligned, the others
// 64-byte aligned.
void* discrete_allocate(std::size_t nbytes);

// Frees a block discrete_allocate returned (by its device address).
void discrete_free(void* device_ptr);

// Hands the pages of every free range back to the system (empty_cache); returns the bytes.
std::size_t discrete_trim();

// Blocks from this size on are whole pages (like the arena's) and count in the large pool.
inline constexpr std::size_t kDiscretePageMinBytes = 64 << 10;

}  // namespace spyreccl::device
