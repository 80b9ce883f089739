// The host ("pinned") allocator of the spyre device type.
//
// torch.accelerator.empty_host_cache() and pin_memory() look up
// at::getHostAllocator(PrivateUse1), which is null (and crashes) unless a device
// registers one, and Tensor.is_pinned() asks the hooks' isPinnedPtr. Spyre
// memory is host memory already, so a pinned block is ordinary CPU memory; but
// torch checks that what it pinned reports pinned (DDP's reducer asserts it for
// the map of used parameters it copies to an accelerator: find_unused_parameters
// and static_graph failed with an INTERNAL ASSERT), so the blocks handed out
// here are registered, and is_pinned_pointer() answers from that registry. The
// allocator caches nothing: a block goes back to the system when freed.
#include "pinned_allocator.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstdint>
#include <map>
#include <mutex>

#include "block_map.h"
#include "device_state.h"

namespace spyreccl::device {
namespace {

// Live pinned blocks by start address, with their sizes. Pinned allocations are
// rare (staging buffers, a DataLoader's batches), so one mutex is enough.
class PinnedRegistry {
 public:
  void add(const void* ptr, std::size_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    live_[reinterpret_cast<std::uintptr_t>(ptr)] = nbytes;
  }

  void remove(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    live_.erase(reinterpret_cast<std::uintptr_t>(ptr));
  }

  bool contains(const void* ptr) const {
    const auto address = reinterpret_cast<std::uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mutex_);
    return find_block(live_, address, [](std::size_t nbytes) { return nbytes; }) != live_.end();
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> live_;
};

PinnedRegistry& registry() {
  // Leaked on purpose: pinned tensors may be freed during static destruction.
  static auto* instance = new PinnedRegistry();
  return *instance;
}

void free_pinned(void* ptr) {
  registry().remove(ptr);
  c10::free_cpu(ptr);
}

class SpyrePinnedAllocator final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(std::size_t nbytes) override {
    // Like CUDA's host allocator: an empty block has no memory, and a null
    // pointer is not pinned.
    if (nbytes == 0) {
      return {nullptr, nullptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
    }
    void* ptr = c10::alloc_cpu(nbytes);  // throws c10::OutOfMemoryError
    registry().add(ptr, nbytes);
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Spyre operators complete synchronously: no pending use to wait for. False
  // tells the caller that the block is not tracked by a caching allocator.
  bool record_event(void* /*ptr*/, void* /*ctx*/, c10::Stream /*stream*/) override { return false; }

  void empty_cache() override {}  // nothing is cached

  at::HostStats get_stats() override { return {}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};

SpyrePinnedAllocator g_pinned_allocator;

}  // namespace

c10::Allocator* pinned_allocator() { return &g_pinned_allocator; }

bool is_pinned_pointer(const void* ptr) { return ptr != nullptr && registry().contains(ptr); }

REGISTER_HOST_ALLOCATOR(kSpyreDeviceType, &g_pinned_allocator)

}  // namespace spyreccl::device
