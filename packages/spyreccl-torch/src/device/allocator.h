// Host-memory allocator behind every spyre storage.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Storage.h>

#include <cstddef>
#include <optional>

namespace spyreccl::device {

// Alignment of every allocation: a cache line, and enough for any vector ISA
// the collective kernels use on these buffers.
inline constexpr std::size_t kAllocationAlignment = 64;

// The PrivateUse1 allocator (also registered with c10::SetAllocator). Data
// pointers are plain host addresses, directly readable by the collective
// library — except in discrete memory mode (device_memory.h), where they are
// device addresses that only host_address() makes readable; the DataPtr is
// labelled with the calling thread's current device.
// It is a c10::DeviceAllocator, so torch.accelerator.memory_* works: it keeps
// per-device statistics of every block that backs a spyre storage (its own
// blocks and CPU-kernel results adopted through adopt()).
c10::DeviceAllocator* host_allocator();

// Allocator for CPU aliases of spyre storages (see host_alias.h): the same
// host memory and deleter as host_allocator(), labelled CPU so that the CPU
// kernel growing an alias sees a CPU storage; HostAliasScope::commit()
// relabels the block when it hands it to the spyre storage.
c10::Allocator* alias_growth_allocator();

// Allocates `nbytes` of host memory labelled as spyre device `device`.
c10::DataPtr allocate_on(c10::DeviceIndex device, std::size_t nbytes);

// Moves `data` (`nbytes` long) to spyre device `device` (memory stays where it
// is; only the label changes), keeping the allocation registry and statistics in
// step. Memory from another allocator (a CPU kernel's fresh result) is wrapped so
// that the spyre statistics count it until it is freed.
void adopt(c10::DataPtr& data, std::size_t nbytes, c10::Device device);

// Device of the live spyre allocation containing `ptr` (from host_allocator()
// or adopted), if any.
std::optional<c10::DeviceIndex> device_of_allocation(const void* ptr);

// Grows or shrinks a spyre storage to `nbytes`, keeping the common prefix.
// Shared by resize_ and the hooks' resizePrivateUse1Bytes.
void resize_storage_bytes(c10::StorageImpl& storage, std::size_t nbytes);

}  // namespace spyreccl::device
