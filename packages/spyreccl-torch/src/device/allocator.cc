#include "allocator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>

#include "device_state.h"
#include "spyreccl/spyreccl.h"

namespace spyreccl::device {
namespace {

// Large allocations come from spyreccl's shareable memory arena (spyrecclMemAlloc): the
// core's collectives then read peers' tensors in place instead of staging every byte
// through the communicator's shared segment (one copy between processes instead of two).
// Small ones stay in ordinary host memory: the arena hands out whole pages, and small
// collectives are staged anyway (below SPYRECCL_DIRECT_MIN_BYTES).
constexpr std::size_t kArenaMinBytes = 64 << 10;

// SPYRECCL_DEVICE_ARENA=0 keeps every allocation in ordinary host memory (to compare
// the two transfer paths, or if the arena is unwanted). Read once.
bool arena_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("SPYRECCL_DEVICE_ARENA");
    return v == nullptr || !(std::strcmp(v, "0") == 0 || std::strcmp(v, "off") == 0 ||
                             std::strcmp(v, "false") == 0 || std::strcmp(v, "no") == 0);
  }();
  return enabled;
}

// Live allocations by start address, so that getDeviceFromPtr can answer for
// interior pointers too. One mutex is enough: emulated-device allocation rates
// are bounded by the CPU kernels that consume the memory.
class AllocationRegistry {
 public:
  void add(const void* ptr, std::size_t nbytes, c10::DeviceIndex device, bool arena) {
    std::lock_guard<std::mutex> lock(mutex_);
    live_[reinterpret_cast<std::uintptr_t>(ptr)] = Entry{nbytes, device, arena};
  }

  // Forgets `ptr`; returns whether it came from the arena.
  bool remove(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == live_.end()) {
      return false;
    }
    const bool arena = it->second.arena;
    live_.erase(it);
    return arena;
  }

  void relabel(const void* ptr, c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it != live_.end()) {
      it->second.device = device;
    }
  }

  std::optional<c10::DeviceIndex> find(const void* ptr) const {
    const auto address = reinterpret_cast<std::uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.upper_bound(address);
    if (it == live_.begin()) {
      return std::nullopt;
    }
    it = std::prev(it);
    if (address - it->first < it->second.nbytes) {
      return it->second.device;
    }
    return std::nullopt;
  }

 private:
  struct Entry {
    std::size_t nbytes;
    c10::DeviceIndex device;
    bool arena;  // from spyrecclMemAlloc (else posix_memalign)
  };
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, Entry> live_;
};

AllocationRegistry& registry() {
  // Leaked on purpose: storages may be freed during static destruction.
  static auto* instance = new AllocationRegistry();
  return *instance;
}

// The one deleter of both kinds of memory (c10's raw_deallocate calls raw_deleter()
// without the DataPtr, so the registry says which kind `ptr` is).
void release(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  if (registry().remove(ptr)) {
    // Cannot fail for a block the registry knows; a deleter must not throw anyway.
    (void)spyrecclMemFree(ptr);
  } else {
    std::free(ptr);
  }
}

class SpyreHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t nbytes) override {
    return allocate_on(current_device(), nbytes);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

class AliasGrowthAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t nbytes) override {
    c10::DataPtr data = allocate_on(current_device(), nbytes);
    data.unsafe_set_device(c10::Device(c10::kCPU));
    return data;
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

SpyreHostAllocator g_allocator;
AliasGrowthAllocator g_alias_growth_allocator;

}  // namespace

c10::Allocator* host_allocator() { return &g_allocator; }

c10::Allocator* alias_growth_allocator() { return &g_alias_growth_allocator; }

c10::DataPtr allocate_on(c10::DeviceIndex index, std::size_t nbytes) {
  const c10::Device device = spyre_device(index);
  if (nbytes == 0) {
    return {nullptr, nullptr, &release, device};
  }
  void* ptr = nullptr;
  if (nbytes >= kArenaMinBytes && arena_enabled() &&
      spyrecclMemAlloc(&ptr, nbytes) == spyrecclSuccess) {
    registry().add(ptr, nbytes, index, /*arena=*/true);
    return {ptr, ptr, &release, device};
  }
  // No arena (or it is exhausted): ordinary memory, whose collectives are staged.
  const int rc = posix_memalign(&ptr, kAllocationAlignment, nbytes);
  TORCH_CHECK_WITH(OutOfMemoryError, rc == 0 && ptr != nullptr, "spyre allocator: cannot allocate ",
                   nbytes, " bytes of host memory for ", device, " (posix_memalign returned ", rc,
                   ")");
  registry().add(ptr, nbytes, index, /*arena=*/false);
  return {ptr, ptr, &release, device};
}

void relabel(c10::DataPtr& data, c10::Device device) {
  if (device.type() == kSpyreDeviceType && data.get_deleter() == &release &&
      data.get() != nullptr) {
    registry().relabel(data.get(), device.index());
  }
  data.unsafe_set_device(device);
}

std::optional<c10::DeviceIndex> device_of_allocation(const void* ptr) {
  return registry().find(ptr);
}

void resize_storage_bytes(c10::StorageImpl& storage, std::size_t nbytes) {
  TORCH_CHECK(storage.resizable(), "spyre: trying to resize a storage that is not resizable (",
              storage.nbytes(), " -> ", nbytes, " bytes)");
  const c10::Device device = storage.device();
  TORCH_CHECK(device.type() == kSpyreDeviceType,
              "spyre: resize_storage_bytes expects a spyre storage, got one on ", device);
  c10::DataPtr fresh = allocate_on(device.index(), nbytes);
  const std::size_t keep = std::min(nbytes, storage.nbytes());
  if (keep > 0) {
    std::memcpy(fresh.get(), storage.data(), keep);
  }
  storage.set_data_ptr_noswap(std::move(fresh));
  storage.set_nbytes(nbytes);
}

REGISTER_ALLOCATOR(kSpyreDeviceType, &g_allocator)

}  // namespace spyreccl::device
