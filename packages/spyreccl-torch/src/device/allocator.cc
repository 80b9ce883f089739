#include "allocator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>

#include "device_state.h"

namespace spyreccl::device {
namespace {

// Live allocations by start address, so that getDeviceFromPtr can answer for
// interior pointers too. One mutex is enough: emulated-device allocation rates
// are bounded by the CPU kernels that consume the memory.
class AllocationRegistry {
 public:
  void add(const void* ptr, std::size_t nbytes, c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    live_[reinterpret_cast<std::uintptr_t>(ptr)] = Entry{nbytes, device};
  }

  void remove(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    live_.erase(reinterpret_cast<std::uintptr_t>(ptr));
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
  };
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, Entry> live_;
};

AllocationRegistry& registry() {
  // Leaked on purpose: storages may be freed during static destruction.
  static auto* instance = new AllocationRegistry();
  return *instance;
}

void release(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  registry().remove(ptr);
  std::free(ptr);
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
  const int rc = posix_memalign(&ptr, kAllocationAlignment, nbytes);
  TORCH_CHECK_WITH(OutOfMemoryError, rc == 0 && ptr != nullptr, "spyre allocator: cannot allocate ",
                   nbytes, " bytes of host memory for ", device, " (posix_memalign returned ", rc,
                   ")");
  registry().add(ptr, nbytes, index);
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
