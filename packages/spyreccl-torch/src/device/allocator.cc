#include "allocator.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "block_map.h"
#include "device_memory.h"
#include "device_state.h"
#include "spyreccl/spyreccl.h"

namespace spyreccl::device {
namespace {

using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingAllocator::StatType;
using c10::CachingDeviceAllocator::DeviceStats;

// Large allocations come from spyreccl's shareable memory arena (spyrecclMemAlloc): the
// core's collectives then read peers' tensors in place instead of staging every byte
// through the communicator's shared segment (one copy between processes instead of two).
// Small ones stay in ordinary host memory: the arena hands out whole pages, and small
// collectives are staged anyway (below SPYRECCL_DIRECT_MIN_BYTES).
constexpr std::size_t kArenaMinBytes = 64 << 10;
// The arena's block granularity (spyreccl.h: blocks are page aligned).
constexpr std::size_t kArenaPageBytes = 4096;

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

// Where a block's memory came from. Statistics put arena blocks in the "large pool"
// and ordinary host memory in the "small pool", so memory_stats tells the two apart.
enum class BlockKind : std::uint8_t {
  kHost,      // posix_memalign, freed by release()
  kArena,     // spyrecclMemAlloc, freed by release()
  kAdopted,   // a CPU kernel's result relabelled as spyre memory, freed by its own deleter
  kDiscrete,  // discrete device memory (device_memory.h), freed by release()
};

// Large discrete blocks are whole pages like arena blocks, and count in the same pool, so
// that the statistics read the same in both memory modes.
bool page_granular(BlockKind kind, std::size_t nbytes) {
  return kind == BlockKind::kArena ||
         (kind == BlockKind::kDiscrete && nbytes >= kDiscretePageMinBytes);
}

// Bytes a block holds from the system: arena blocks are whole pages.
std::size_t reserved_bytes_of(BlockKind kind, std::size_t nbytes) {
  if (page_granular(kind, nbytes)) {
    return (nbytes + kArenaPageBytes - 1) / kArenaPageBytes * kArenaPageBytes;
  }
  return nbytes;
}

StatType pool_of(BlockKind kind, std::size_t nbytes) {
  return page_granular(kind, nbytes) ? StatType::LARGE_POOL : StatType::SMALL_POOL;
}

void for_aggregate_and(StatArray& stats, StatType pool, bool increase, std::size_t amount) {
  for (StatType type : {StatType::AGGREGATE, pool}) {
    Stat& stat = stats[static_cast<std::size_t>(type)];
    if (increase) {
      stat.increase(amount);
    } else {
      stat.decrease(amount);
    }
  }
}

// Statistics of one device. The allocator does not cache: a block is returned to
// the system when its last user frees it, so every allocated block is also a
// reserved segment and an active block, and nothing is ever inactive or split.
// allocated/active/requested bytes are the exact sizes asked for; reserved bytes
// add the arena's page rounding.
struct DeviceCounters {
  DeviceStats stats;

  void add(BlockKind kind, std::size_t nbytes, bool fresh_from_system) {
    const StatType pool = pool_of(kind, nbytes);
    const std::size_t reserved = reserved_bytes_of(kind, nbytes);
    for_aggregate_and(stats.allocation, pool, true, 1);
    for_aggregate_and(stats.segment, pool, true, 1);
    for_aggregate_and(stats.active, pool, true, 1);
    for_aggregate_and(stats.allocated_bytes, pool, true, nbytes);
    for_aggregate_and(stats.reserved_bytes, pool, true, reserved);
    for_aggregate_and(stats.active_bytes, pool, true, nbytes);
    for_aggregate_and(stats.requested_bytes, pool, true, nbytes);
    if (fresh_from_system) {
      ++stats.num_device_alloc;
    }
  }

  void remove(BlockKind kind, std::size_t nbytes, bool back_to_system) {
    const StatType pool = pool_of(kind, nbytes);
    const std::size_t reserved = reserved_bytes_of(kind, nbytes);
    for_aggregate_and(stats.allocation, pool, false, 1);
    for_aggregate_and(stats.segment, pool, false, 1);
    for_aggregate_and(stats.active, pool, false, 1);
    for_aggregate_and(stats.allocated_bytes, pool, false, nbytes);
    for_aggregate_and(stats.reserved_bytes, pool, false, reserved);
    for_aggregate_and(stats.active_bytes, pool, false, nbytes);
    for_aggregate_and(stats.requested_bytes, pool, false, nbytes);
    if (back_to_system) {
      ++stats.num_device_free;
    }
  }

  template <typename F>
  void for_each_stat_array(F f) {
    for (StatArray* array :
         {&stats.allocation, &stats.segment, &stats.active, &stats.inactive_split,
          &stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
          &stats.inactive_split_bytes, &stats.requested_bytes}) {
      for (Stat& stat : *array) {
        f(stat);
      }
    }
  }
};

// One live block of the registry.
struct Block {
  std::size_t nbytes;
  c10::DeviceIndex device;
  BlockKind kind;
  // kAdopted blocks taken over whole (adopt()): the deleter the other allocator gave the
  // block, called with its address when the spyre storage frees it. Null otherwise.
  c10::DeleterFnPtr foreign_deleter;
};

// Live allocations by start address (so that getDeviceFromPtr can answer for interior
// pointers too) and the per-device statistics, under one mutex: emulated-device
// allocation rates are bounded by the CPU kernels that consume the memory, and the
// critical sections are a map update and a few counters (an uncontended lock costs a
// fraction of a CPU kernel's dispatch; measured in docs/notes/device-op-overhead.md).
class AllocationRegistry {
 public:
  AllocationRegistry() { spare_nodes_.reserve(kSpareNodes); }

  void add(const void* ptr, std::size_t nbytes, c10::DeviceIndex device, BlockKind kind,
           c10::DeleterFnPtr foreign_deleter = nullptr) {
    const auto address = reinterpret_cast<std::uintptr_t>(ptr);
    const Block block{nbytes, device, kind, foreign_deleter};
    std::lock_guard<std::mutex> lock(mutex_);
    if (spare_nodes_.empty()) {
      live_[address] = block;
    } else {
      // Reuse the node of a block freed earlier: most eager operators allocate one result
      // and free one temporary, and a fresh map node was a malloc/free pair per operator.
      Map::node_type node = std::move(spare_nodes_.back());
      spare_nodes_.pop_back();
      node.key() = address;
      node.mapped() = block;
      auto inserted = live_.insert(std::move(node));
      if (!inserted.inserted) {
        inserted.position->second = block;
        spare_nodes_.push_back(std::move(inserted.node));
      }
    }
    counters(device).add(kind, nbytes, /*fresh_from_system=*/kind != BlockKind::kAdopted);
  }

  // Forgets `ptr`; returns its block if it was live.
  std::optional<Block> remove(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == live_.end()) {
      return std::nullopt;
    }
    const Block block = it->second;
    Map::node_type node = live_.extract(it);
    if (spare_nodes_.size() < kSpareNodes) {
      spare_nodes_.push_back(std::move(node));  // within the reserved capacity: no allocation
    }
    counters(block.device).remove(block.kind, block.nbytes, /*back_to_system=*/true);
    return block;
  }

  void relabel(const void* ptr, c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == live_.end() || it->second.device == device) {
      return;
    }
    Block& entry = it->second;
    // The block moves between devices: it leaves one device's statistics and joins
    // the other's, without a system allocation or free.
    counters(entry.device).remove(entry.kind, entry.nbytes, /*back_to_system=*/false);
    counters(device).add(entry.kind, entry.nbytes, /*fresh_from_system=*/false);
    entry.device = device;
  }

  std::optional<c10::DeviceIndex> find(const void* ptr) const {
    const auto address = reinterpret_cast<std::uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = find_block(live_, address, [](const Block& b) { return b.nbytes; });
    if (it == live_.end()) {
      return std::nullopt;
    }
    return it->second.device;
  }

  DeviceStats stats(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    return counters(device).stats;
  }

  void reset_peak(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    counters(device).for_each_stat_array([](Stat& stat) { stat.reset_peak(); });
  }

  void reset_accumulated(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceCounters& c = counters(device);
    c.for_each_stat_array([](Stat& stat) { stat.reset_accumulated(); });
    c.stats.num_alloc_retries = 0;
    c.stats.num_ooms = 0;
    c.stats.num_device_alloc = 0;
    c.stats.num_device_free = 0;
  }

  void count_oom(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++counters(device).stats.num_ooms;
  }

 private:
  using Map = std::map<std::uintptr_t, Block>;
  // Map nodes kept for reuse: enough for the blocks a burst of operators frees before the
  // next allocations; more are returned to the heap.
  static constexpr std::size_t kSpareNodes = 64;

  // Caller holds mutex_.
  DeviceCounters& counters(c10::DeviceIndex device) {
    if (per_device_.empty()) {
      per_device_.resize(static_cast<std::size_t>(device_count()));
    }
    TORCH_INTERNAL_ASSERT(device >= 0 && static_cast<std::size_t>(device) < per_device_.size(),
                          "spyre allocator: device index ", static_cast<int>(device),
                          " out of range");
    return per_device_[static_cast<std::size_t>(device)];
  }

  mutable std::mutex mutex_;
  Map live_;
  std::vector<Map::node_type> spare_nodes_;
  std::vector<DeviceCounters> per_device_;
};

AllocationRegistry& registry() {
  // Leaked on purpose: storages may be freed during static destruction.
  static auto* instance = new AllocationRegistry();
  return *instance;
}

// The one deleter of every kind of memory this allocator hands out and of the CPU
// kernels' results it takes over whole (c10's raw_deallocate calls raw_deleter() without
// the DataPtr, so the registry says which kind `ptr` is).
// In discrete mode it may be called with the accessible twin of a block (raw_deallocate of
// the alias growth allocator passes the data pointer): the registry knows device addresses.
void release(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  ptr = device_address(ptr);
  const std::optional<Block> block = registry().remove(ptr);
  const std::optional<BlockKind> kind =
      block.has_value() ? std::optional<BlockKind>(block->kind) : std::nullopt;
  if (kind == BlockKind::kArena) {
    // Cannot fail for a block the registry knows; a deleter must not throw anyway.
    (void)spyrecclMemFree(ptr);
  } else if (kind == BlockKind::kDiscrete) {
    discrete_free(ptr);
  } else if (kind == BlockKind::kAdopted) {
    // Only blocks taken over whole have `release` as their deleter (the others keep
    // release_adopted), and those always carry the other allocator's deleter.
    if (block->foreign_deleter != nullptr) {
      block->foreign_deleter(ptr);
    }
  } else {
    std::free(ptr);
  }
}

// A CPU kernel's result adopted as spyre memory whose DataPtr has a context of its own
// (not the data pointer): the original DataPtr lives on in this block until the spyre
// storage frees it.
struct AdoptedBlock {
  c10::DataPtr original;
};

void release_adopted(void* context) {
  auto* block = static_cast<AdoptedBlock*>(context);
  registry().remove(block->original.get());
  delete block;
}

// Free and total bytes of the host memory behind every emulated device: MemAvailable
// (what the kernel could give without swapping) and the physical memory size.
std::pair<std::size_t, std::size_t> host_memory_info() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  const std::size_t total =
      pages > 0 && page_size > 0 ? static_cast<std::size_t>(pages) * page_size : 0;
  std::size_t available = 0;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::size_t value_kib = 0;
  std::string unit;
  while (meminfo >> key >> value_kib >> unit) {
    if (key == "MemAvailable:") {
      available = value_kib * 1024;
      break;
    }
  }
  if (available == 0) {
    const long free_pages = sysconf(_SC_AVPHYS_PAGES);
    available =
        free_pages > 0 && page_size > 0 ? static_cast<std::size_t>(free_pages) * page_size : 0;
  }
  return {std::min(available, total), total};
}

class SpyreHostAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(std::size_t nbytes) override {
    return allocate_on(current_device(), nbytes);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  // Copy-on-write materialisation and Allocator::clone copy spyre memory here.
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(host_address(dest), host_address(src), count);
  }

  // Host memory needs no initialisation: ready once the library is loaded.
  bool initialized() override { return true; }

  // Freed blocks go straight back to the system or the arena; the arena keeps the pages of
  // freed blocks resident for reuse (up to SPYRECCL_ARENA_RETAIN_BYTES), which is what
  // torch.spyre.empty_cache() / torch.accelerator.empty_cache() hand back to the system,
  // like a caching allocator's cache. Private pools (CUDA graphs) do not exist here.
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {
    if (memory_mode() == MemoryMode::kDiscrete) {
      (void)discrete_trim();
    } else {
      (void)spyrecclMemTrim(nullptr);
    }
  }

  // Every spyre operator completes on the calling thread: a block can never be in
  // use by a later stream operation, so there is no dependency to record.
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream stream) override {
    TORCH_CHECK(stream.device_type() == kSpyreDeviceType,
                "spyre recordStream: expected a spyre stream, got one on ", stream.device());
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    return registry().stats(resolve_device_index(device, "spyre memory_stats"));
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    registry().reset_accumulated(resolve_device_index(device, "spyre reset_accumulated_stats"));
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    registry().reset_peak(resolve_device_index(device, "spyre reset_peak_stats"));
  }

  // Every emulated device is backed by the same host memory.
  std::pair<std::size_t, std::size_t> getMemoryInfo(c10::DeviceIndex device) override {
    resolve_device_index(device, "spyre get_memory_info");
    return host_memory_info();
  }
};

class AliasGrowthAllocator final : public c10::Allocator {
 public:
  // The CPU kernel works on the block, so its data pointer is the accessible twin in
  // discrete mode; the context (what release() receives) stays the device address.
  c10::DataPtr allocate(std::size_t nbytes) override {
    c10::DataPtr data = allocate_on(current_device(), nbytes);
    void* device_ptr = data.get();
    if (host_address(device_ptr) != device_ptr) {
      (void)data.release_context();  // the block lives on in the DataPtr below
      return {host_address(device_ptr), device_ptr, &release, c10::Device(c10::kCPU)};
    }
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

c10::DeviceAllocator* host_allocator() { return &g_allocator; }

c10::Allocator* alias_growth_allocator() { return &g_alias_growth_allocator; }

c10::DataPtr allocate_on(c10::DeviceIndex index, std::size_t nbytes) {
  const c10::Device device = spyre_device(index);
  if (nbytes == 0) {
    return {nullptr, nullptr, &release, device};
  }
  void* ptr = nullptr;
  if (memory_mode() == MemoryMode::kDiscrete) {
    // Discrete memory replaces both kinds below: its device addresses are not readable by
    // the collective library (nor anyone), so sharing the arena with peers has no point.
    ptr = discrete_allocate(nbytes);
    if (ptr == nullptr) {
      registry().count_oom(index);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr, "spyre allocator: cannot allocate ", nbytes,
                     " bytes of discrete device memory for ", device,
                     " (SPYRECCL_SPYRE_MEMORY=discrete: the device window is exhausted)");
    registry().add(ptr, nbytes, index, BlockKind::kDiscrete);
    return {ptr, ptr, &release, device};
  }
  if (nbytes >= kArenaMinBytes && arena_enabled() &&
      spyrecclMemAlloc(&ptr, nbytes) == spyrecclSuccess) {
    registry().add(ptr, nbytes, index, BlockKind::kArena);
    return {ptr, ptr, &release, device};
  }
  // No arena (or it is exhausted): ordinary memory, whose collectives are staged.
  const int rc = posix_memalign(&ptr, kAllocationAlignment, nbytes);
  if (rc != 0 || ptr == nullptr) {
    registry().count_oom(index);
  }
  TORCH_CHECK_WITH(OutOfMemoryError, rc == 0 && ptr != nullptr, "spyre allocator: cannot allocate ",
                   nbytes, " bytes of host memory for ", device, " (posix_memalign returned ", rc,
                   ")");
  registry().add(ptr, nbytes, index, BlockKind::kHost);
  return {ptr, ptr, &release, device};
}

void adopt(c10::DataPtr& data, std::size_t nbytes, c10::Device device) {
  if (device.type() == kSpyreDeviceType && data.get() != nullptr &&
      memory_mode() == MemoryMode::kDiscrete) {
    if (data.get_deleter() == &release) {
      // One of our blocks, maybe seen through its accessible twin (the alias growth
      // allocator's): the spyre storage holds its device address, which is the context.
      void* device_ptr = device_address(data.get());
      registry().relabel(device_ptr, device.index());
      if (device_ptr != data.get()) {
        void* context = data.release_context();
        data = c10::DataPtr(device_ptr, context, &release, device);
      }
    } else {
      // Host memory of another allocator (a CPU kernel's result) cannot become device
      // memory by relabelling: copy it into a device block.
      c10::DataPtr fresh = allocate_on(device.index(), nbytes);
      if (nbytes > 0) {
        std::memcpy(host_address(fresh.get()), data.get(), nbytes);
      }
      data = std::move(fresh);
    }
  } else if (device.type() == kSpyreDeviceType && data.get() != nullptr) {
    const c10::DeleterFnPtr deleter = data.get_deleter();
    if (deleter == &release || deleter == &release_adopted) {
      registry().relabel(data.get(), device.index());
    } else if (deleter != nullptr && data.get_context() == data.get()) {
      // Memory of another allocator whose context is the data pointer itself (CPU's
      // allocator, every plain malloc-style allocator): the spyre DataPtr takes it over
      // with `release` as its deleter, and the registry keeps the original deleter. No
      // context block to allocate per adopted result (most eager operators adopt one).
      // Registered first: if that throws, `data` still owns the block.
      void* ptr = data.get();
      registry().add(ptr, nbytes, device.index(), BlockKind::kAdopted, deleter);
      (void)data.release_context();
      data = c10::DataPtr(ptr, ptr, &release, device);
    } else {
      // Memory of another allocator with a context of its own (copy-on-write data, ...):
      // keep the DataPtr in a context that also takes the block out of the statistics
      // when it is freed.
      void* ptr = data.get();
      auto* block = new AdoptedBlock{std::move(data)};
      data = c10::DataPtr(ptr, block, &release_adopted, device);
      registry().add(ptr, nbytes, device.index(), BlockKind::kAdopted);
    }
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
    std::memcpy(host_address(fresh.get()), host_address(storage.data()), keep);
  }
  storage.set_data_ptr_noswap(std::move(fresh));
  storage.set_nbytes(nbytes);
}

REGISTER_ALLOCATOR(kSpyreDeviceType, &g_allocator)

}  // namespace spyreccl::device
