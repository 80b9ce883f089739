// The host ("pinned") allocator of the spyre device type.
//
// torch.accelerator.empty_host_cache() and pin_memory() look up
// at::getHostAllocator(PrivateUse1), which is null (and crashes) unless a device
// registers one. Spyre memory is host memory already, so "pinned" buffers are
// ordinary CPU memory: this allocator hands out CPU-allocator blocks, caches
// nothing and keeps no statistics of its own (they are CPU memory).
#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/CPUAllocator.h>

#include "device_state.h"

namespace spyreccl::device {
namespace {

class SpyrePinnedAllocator final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(std::size_t nbytes) override {
    return c10::GetCPUAllocator()->allocate(nbytes);
  }

  c10::DeleterFnPtr raw_deleter() const override { return c10::GetCPUAllocator()->raw_deleter(); }

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

REGISTER_HOST_ALLOCATOR(kSpyreDeviceType, &g_pinned_allocator)

}  // namespace spyreccl::device
