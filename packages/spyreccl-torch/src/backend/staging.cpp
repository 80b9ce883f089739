// staging.cpp — see staging.h.
#include "backend/staging.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>
#include <spyreccl/spyreccl.h>

#include "backend/device_caps.h"
#include "backend/tensor_translation.h"

namespace spyreccl_torch {
namespace {

constexpr size_t kDefaultChunkBytes = size_t{1} << 20;
constexpr size_t kMinChunkBytes = size_t{4} << 10;
constexpr int64_t kMaxChunks = 8;
// Host blocks are rounded up to this, so that buffers of similar sizes share blocks.
constexpr size_t kBlockGranule = size_t{64} << 10;
// Idle blocks kept for reuse; beyond this the pool frees the largest ones.
constexpr size_t kMaxCachedBytes = size_t{512} << 20;
// Small staged buffers (the targets' "small message": up to 64 KiB) take a preallocated slot.
constexpr size_t kSmallSlotBytes = size_t{64} << 10;
constexpr size_t kSmallSlots = 32;

// Staging blocks of at least this come from the core's shareable arena (spyrecclMemAlloc),
// whose collectives read the peers' blocks in place: one copy between processes instead of
// two through the communicator's segment, which halves the collective's share of a staged
// operation (a 4 MiB all_reduce of the core, 2 ranks: 195 us on ordinary memory, 98 us on
// the arena). Smaller messages are staged through the segment by the core whatever their
// memory (SPYRECCL_DIRECT_MIN_BYTES, 256 KiB).
constexpr size_t kArenaMinBytes = size_t{256} << 10;

// SPYRECCL_STAGING_ARENA=0 takes every staging block from the pinned allocator instead
// (for a device whose DMA needs pinned host memory more than the collective needs the arena).
bool arenaWanted() {
  static const bool wanted = [] {
    const char* v = std::getenv("SPYRECCL_STAGING_ARENA");
    if (v == nullptr || *v == '\0') {
      return true;
    }
    const std::string value(v);
    return !(value == "0" || value == "off" || value == "false" || value == "no");
  }();
  return wanted;
}

size_t chunkFromEnvironment() {
  const char* text = std::getenv("SPYRECCL_STAGING_CHUNK_BYTES");
  if (text == nullptr || *text == '\0') {
    return kDefaultChunkBytes;
  }
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  TORCH_CHECK(end != text && *end == '\0',
              "spyreccl: SPYRECCL_STAGING_CHUNK_BYTES must be a "
              "number of bytes, got '",
              text, "'");
  return std::max<size_t>(static_cast<size_t>(value), kMinChunkBytes);
}

enum class PipelineSetting : uint8_t { kAuto, kOn, kOff };

PipelineSetting parsePipelineSetting(const char* text, const char* what) {
  const std::string value(text);
  if (value.empty() || value == "auto") {
    return PipelineSetting::kAuto;
  }
  if (value == "1" || value == "on") {
    return PipelineSetting::kOn;
  }
  if (value == "0" || value == "off") {
    return PipelineSetting::kOff;
  }
  TORCH_CHECK(false, "spyreccl: ", what, " must be auto, 1 or 0, got '", value, "'");
}

std::atomic<PipelineSetting>& pipelineSetting() {
  static std::atomic<PipelineSetting> setting{[] {
    const char* text = std::getenv("SPYRECCL_STAGING_PIPELINE");
    return text == nullptr ? PipelineSetting::kAuto
                           : parsePipelineSetting(text, "SPYRECCL_STAGING_PIPELINE");
  }()};
  return setting;
}

std::atomic<size_t>& chunkSetting() {
  static std::atomic<size_t> bytes{chunkFromEnvironment()};
  return bytes;
}

struct AtomicCounters {
  std::atomic<uint64_t> stagedBuffers{0};
  std::atomic<uint64_t> bytesToHost{0};
  std::atomic<uint64_t> bytesFromHost{0};
  std::atomic<uint64_t> pipelinedOps{0};
  std::atomic<uint64_t> pipelineChunks{0};
  std::atomic<uint64_t> slotBuffers{0};
  std::atomic<uint64_t> arenaBuffers{0};
};
AtomicCounters gCounters;

// Idle pinned host blocks by size. Leaked on purpose: blocks may return from any thread
// until the process ends, static destruction included.
class HostPool {
 public:
  static HostPool& get() {
    static HostPool* pool = new HostPool();
    return *pool;
  }

  // A block of host memory (bytes of kByte) and whether it lies in the core's arena.
  struct Block {
    at::Tensor memory;
    bool arena = false;
  };

  Block take(size_t bytes) {
    const size_t rounded = (bytes + kBlockGranule - 1) / kBlockGranule * kBlockGranule;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // The smallest idle block that fits without wasting more than half of it.
      auto it = idle_.lower_bound(rounded);
      if (it != idle_.end() && it->first <= 2 * rounded) {
        Block block = std::move(it->second);
        cachedBytes_ -= it->first;
        idle_.erase(it);
        return block;
      }
    }
    return allocate(rounded, /*arenaAllowed=*/true);
  }

  // A fresh block of `bytes` outside the arena (SmallSlots: its messages are small enough
  // for the core to stage whatever the memory), not taken from nor returned to the idle set.
  at::Tensor allocateBlock(size_t bytes) { return allocate(bytes, /*arenaAllowed=*/false).memory; }

  void give(Block block) {
    const auto bytes = static_cast<size_t>(block.memory.numel());
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.emplace(bytes, std::move(block));
    cachedBytes_ += bytes;
    while (cachedBytes_ > kMaxCachedBytes && !idle_.empty()) {
      auto largest = std::prev(idle_.end());
      cachedBytes_ -= largest->first;
      idle_.erase(largest);
    }
  }

 private:
  Block allocate(size_t bytes, bool arenaAllowed) {
    const auto size = static_cast<int64_t>(bytes);
    if (arenaAllowed && bytes >= kArenaMinBytes && arenaWanted()) {
      void* ptr = nullptr;
      if (spyrecclMemAlloc(&ptr, bytes) == spyrecclSuccess) {
        return {at::from_blob(
                    ptr, {size}, [](void* block) { spyrecclMemFree(block); },
                    at::TensorOptions().dtype(at::kByte).device(at::kCPU)),
                true};
      }
      // No arena here (no memfd, exhausted): the pinned allocator below; the collectives on
      // its blocks are staged by the core, only slower.
    }
    if (pinning_.load(std::memory_order_relaxed)) {
      try {
        // Pinned memory of the current accelerator: what its DMA engines copy fastest.
        return {at::empty({size}, at::TensorOptions().dtype(at::kByte).pinned_memory(true))};
      } catch (const std::exception&) {
        // A runtime without a pinned-memory allocator: pageable memory works, slower.
        pinning_.store(false, std::memory_order_relaxed);
      }
    }
    return {at::empty({size}, at::TensorOptions().dtype(at::kByte))};
  }

  std::mutex mutex_;
  std::multimap<size_t, Block> idle_;
  size_t cachedBytes_ = 0;
  std::atomic<bool> pinning_{true};
};

// Preallocated host slots for small staged buffers, the shortest route. From HostPool a
// small buffer costs two mutex round trips, a map node allocated and freed and a deleter
// closure (too little to resolve on one rank beside the two copies, see
// docs/notes/staged-path-costs.md), and groups staging on several threads meet on the
// pool's mutex. A slot is taken with one compare-and-swap and handed back by the tensor's
// deleter with one store; its tensor's storage points at the slot directly (no closure),
// and the counters show that every slot comes back. Process-wide, like HostPool: every group
// stages on its own thread, and a group runs one operation at a time, so a few slots per
// group in flight are enough; when all are taken (many groups at once, a batch of many
// point-to-point operations) a buffer comes from the pool as before. Allocated on the first
// small staged buffer, never in host mode. Leaked on purpose (see HostPool).
class SmallSlots {
 public:
  static SmallSlots& get() {
    static SmallSlots* slots = new SmallSlots();
    return *slots;
  }

  // A host tensor over a free slot, or an undefined tensor when `bytes` exceeds a slot or
  // every slot is taken.
  at::Tensor take(at::IntArrayRef sizes, at::ScalarType dtype, size_t bytes) {
    if (bytes > kSmallSlotBytes) {
      return {};
    }
    // Before any slot is marked taken: an allocation failure must not leave one taken.
    std::call_once(allocated_, [this] {
      block_ = HostPool::get().allocateBlock(kSmallSlotBytes * kSmallSlots);
    });
    // First fit from the lowest slot: the slot an operation just gave back is the next one
    // taken, still in the cache (a rotating start would walk the whole 2 MiB).
    for (size_t i = 0; i < kSmallSlots; ++i) {
      Slot& slot = slots_[i];
      bool expected = false;
      if (slot.busy.load(std::memory_order_relaxed) ||
          !slot.busy.compare_exchange_strong(expected, true, std::memory_order_acquire)) {
        continue;
      }
      inUse_.fetch_add(1, std::memory_order_relaxed);
      c10::DataPtr data(address(slot), &slot, &SmallSlots::release, c10::Device(c10::kCPU));
      c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data),
                           /*allocator=*/nullptr, /*resizable=*/false);
      at::Tensor tensor = at::detail::make_tensor<c10::TensorImpl>(
          std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
          c10::scalarTypeToTypeMeta(dtype));
      tensor.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
      return tensor;
    }
    return {};
  }

  size_t inUse() const { return inUse_.load(std::memory_order_relaxed); }

 private:
  // One cache line per flag: threads taking and releasing neighbouring slots do not
  // invalidate each other's lines.
  struct alignas(64) Slot {
    std::atomic<bool> busy{false};
    SmallSlots* owner = nullptr;
    size_t index = 0;
  };

  SmallSlots() {
    for (size_t i = 0; i < kSmallSlots; ++i) {
      slots_[i].owner = this;
      slots_[i].index = i;
    }
  }

  // The block is allocated on first use (pinned, see HostPool::allocate, in take()): host
  // mode and processes that never stage small buffers allocate nothing.
  void* address(const Slot& slot) {
    return static_cast<unsigned char*>(block_.data_ptr()) + slot.index * kSmallSlotBytes;
  }

  static void release(void* context) {
    auto* slot = static_cast<Slot*>(context);
    slot->owner->inUse_.fetch_sub(1, std::memory_order_relaxed);
    slot->busy.store(false, std::memory_order_release);
  }

  std::array<Slot, kSmallSlots> slots_;
  std::atomic<size_t> inUse_{0};
  std::once_flag allocated_;
  at::Tensor block_;
};

// The thread that runs a pipeline's copies, in submission order, beside the thread that runs
// its core calls. One per process (leaked, see HostPool); a forked child makes its own.
class CopyThread {
 public:
  static CopyThread& get() {
    static std::mutex mutex;
    static CopyThread* instance = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> lock(mutex);
    if (instance == nullptr || owner != getpid()) {
      instance = new CopyThread();  // a parent's instance has no thread in a child: leak it
      owner = getpid();
    }
    return *instance;
  }

  std::future<void> submit(std::function<void()> fn) {
    std::packaged_task<void()> task(std::move(fn));
    std::future<void> done = task.get_future();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(task));
    }
    ready_.notify_one();
    return done;
  }

 private:
  CopyThread() {
    std::thread([this] { loop(); }).detach();
  }

  [[noreturn]] void loop() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return !queue_.empty(); });
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();  // exceptions land in the task's future
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::packaged_task<void()>> queue_;
};

// (destination, source) pairs of one direction of one chunk.
using Copies = std::vector<std::pair<at::Tensor, at::Tensor>>;

// Adds the copy between `host` and `device` in the direction `toHost` to `copies`.
void addCopy(Copies& copies, at::Tensor host, at::Tensor device, bool toHost) {
  if (toHost) {
    copies.emplace_back(std::move(host), std::move(device));
  } else {
    copies.emplace_back(std::move(device), std::move(host));
  }
}

struct Chunk {
  Copies in;
  std::function<void(const std::string& what)> call;
  Copies out;
};

thread_local uint64_t tOpSeq = 0;

std::string describeChunk(const char* opName, size_t chunk, size_t chunks) {
  std::string what = opName;
  if (tOpSeq != 0) {
    what += " seq " + std::to_string(tOpSeq);
  }
  return what + ", chunk " + std::to_string(chunk + 1) + " of " + std::to_string(chunks) +
         " of the staged pipeline";
}

std::function<void()> copyTask(const at::ThreadLocalState& tls, Copies copies, bool toHost) {
  return [tls, copies = std::move(copies), toHost] {
    // Inference mode, grad mode, ... of the thread that issued the operation.
    at::ThreadLocalStateGuard guard(tls);
    for (const auto& [destination, source] : copies) {
      destination.copy_(source);
      countCopy(toHost, static_cast<size_t>(source.numel()) * source.element_size());
    }
  };
}

// Runs the chunks as a pipeline: the copy thread brings chunk k+1 in while this thread runs
// chunk k's core call, and takes chunk k out while chunk k+1's call runs. On failure (a core
// error: timeout, abort, peer death, mismatch) the copies already submitted finish before
// the error is rethrown, so none runs after the operation completed.
void runPipeline(std::vector<Chunk>& chunks, const char* opName) {
  const at::ThreadLocalState tls;
  CopyThread& copier = CopyThread::get();
  std::vector<std::future<void>> inDone(chunks.size());
  std::vector<std::future<void>> outDone(chunks.size());
  try {
    if (!chunks.empty()) {
      inDone[0] = copier.submit(copyTask(tls, std::move(chunks[0].in), true));
    }
    for (size_t k = 0; k < chunks.size(); ++k) {
      if (k + 1 < chunks.size()) {
        inDone[k + 1] = copier.submit(copyTask(tls, std::move(chunks[k + 1].in), true));
      }
      inDone[k].get();
      chunks[k].call(describeChunk(opName, k, chunks.size()));
      outDone[k] = copier.submit(copyTask(tls, std::move(chunks[k].out), false));
    }
    for (auto& done : outDone) {
      done.get();
    }
  } catch (...) {
    for (auto* list : {&inDone, &outDone}) {
      for (auto& done : *list) {
        if (done.valid()) {
          done.wait();
        }
      }
    }
    throw;
  }
  countPipeline(chunks.size());
}

// A pipelined buffer's tensor as one flat run of elements on its device: the tensor itself
// when contiguous, else a dense device copy (inputs) or a dense device temporary that
// finishDeviceFlat copies back (outputs).
at::Tensor deviceFlat(const CommBuffer& buffer, bool fill) {
  const at::Tensor& user = buffer.userTensor();
  if (user.is_contiguous()) {
    return user.view({-1});
  }
  at::Tensor dense = fill ? user.contiguous() : at::empty(user.sizes(), user.options());
  return dense.view({-1});
}

void finishDeviceFlat(const CommBuffer& buffer, const at::Tensor& flat) {
  const at::Tensor& user = buffer.userTensor();
  if (!user.is_contiguous()) {
    user.copy_(flat.view(user.sizes()));
  }
}

at::Tensor hostFlat(const CommBuffer& buffer) {
  const at::Tensor& user = buffer.userTensor();
  return acquireHostBuffer({user.numel()}, user.scalar_type());
}

void* elementAddress(const at::Tensor& flat, int64_t offset) {
  return static_cast<unsigned char*>(flat.data_ptr()) + offset * flat.element_size();
}

// One side (input or output) of a pipelined step, on its device and its host buffer. Every
// pipeline walks one rank's block (`block` elements) chunk by chunk; chunk [offset, offset+n)
// of the side is
//  - kFlat: the n elements at `offset` (host: at `offset` too);
//  - kBlocked: n elements of each of the `size` blocks (device: r * block + offset), laid
//    side by side in the host buffer at size * offset (block r's run at size * offset +
//    r * n), which is how the core sees a chunk of a blocked buffer: `size` runs of n.
struct Side {
  at::Tensor device;
  at::Tensor host;
  StagedLayout layout = StagedLayout::kFlat;

  bool present() const { return host.defined(); }

  int64_t hostOffset(int64_t offset, int size) const {
    return layout == StagedLayout::kFlat ? offset : size * offset;
  }

  // (host, device) pairs of chunk [offset, offset + n), in the direction given by toHost.
  Copies copies(int64_t offset, int64_t n, int64_t block, int size, bool toHost) const {
    Copies out;
    const int runs = layout == StagedLayout::kFlat ? 1 : size;
    const int64_t base = hostOffset(offset, size);
    for (int r = 0; r < runs; ++r) {
      addCopy(out, host.narrow(0, base + r * n, n), device.narrow(0, r * block + offset, n),
              toHost);
    }
    return out;
  }
};

Side stagedSide(const StagedSide& side, bool isOutput) {
  Side staged;
  if (side.buffer != nullptr) {
    staged.device = deviceFlat(*side.buffer, /*fill=*/!isOutput);
    staged.host = hostFlat(*side.buffer);
    staged.layout = side.layout;
  }
  return staged;
}

}  // namespace

at::Tensor acquireHostBuffer(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t size : sizes) {
    numel *= size;
  }
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  if (at::Tensor slot = SmallSlots::get().take(sizes, dtype, bytes); slot.defined()) {
    gCounters.slotBuffers.fetch_add(1, std::memory_order_relaxed);
    return slot;
  }
  HostPool::Block block = HostPool::get().take(std::max<size_t>(bytes, 1));
  if (block.arena) {
    gCounters.arenaBuffers.fetch_add(1, std::memory_order_relaxed);
  }
  void* data = block.memory.data_ptr();
  // A view over the block whose release hands the block back to the pool.
  return at::from_blob(
      data, sizes,
      [block = std::move(block)](void*) mutable { HostPool::get().give(std::move(block)); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

size_t stagingChunkBytes() { return chunkSetting().load(std::memory_order_relaxed); }

void setStagingChunkBytes(size_t bytes) {
  chunkSetting().store(std::max(bytes, kMinChunkBytes), std::memory_order_relaxed);
}

StagingCounters stagingCounters() {
  StagingCounters counters;
  counters.stagedBuffers = gCounters.stagedBuffers.load();
  counters.bytesToHost = gCounters.bytesToHost.load();
  counters.bytesFromHost = gCounters.bytesFromHost.load();
  counters.pipelinedOps = gCounters.pipelinedOps.load();
  counters.pipelineChunks = gCounters.pipelineChunks.load();
  counters.slotBuffers = gCounters.slotBuffers.load();
  counters.arenaBuffers = gCounters.arenaBuffers.load();
  counters.slotsInUse = SmallSlots::get().inUse();
  return counters;
}

void resetStagingCounters() {
  gCounters.stagedBuffers = 0;
  gCounters.bytesToHost = 0;
  gCounters.bytesFromHost = 0;
  gCounters.pipelinedOps = 0;
  gCounters.pipelineChunks = 0;
  gCounters.slotBuffers = 0;
  gCounters.arenaBuffers = 0;
}

void countCopy(bool toHost, size_t bytes) {
  (toHost ? gCounters.bytesToHost : gCounters.bytesFromHost)
      .fetch_add(bytes, std::memory_order_relaxed);
}

void countStagedBuffer() { gCounters.stagedBuffers.fetch_add(1, std::memory_order_relaxed); }

void countPipeline(size_t chunks) {
  gCounters.pipelinedOps.fetch_add(1, std::memory_order_relaxed);
  gCounters.pipelineChunks.fetch_add(chunks, std::memory_order_relaxed);
}

// Elements per chunk of a pipeline over blocks of `block` elements of `elementSize` bytes
// (one rank's block): the chunk setting, grown so that no pipeline has more than kMaxChunks
// chunks. Every chunk is a core call that waits for the peers and two hand-offs to the copy
// thread; past a few chunks more of them only add those waits (the copies already overlap
// all but one chunk's worth).
int64_t stagingChunkElements(int64_t block, int64_t elementSize) {
  const int64_t setting =
      std::max<int64_t>(1, static_cast<int64_t>(stagingChunkBytes()) / elementSize);
  return std::max(setting, (block + kMaxChunks - 1) / kMaxChunks);
}

std::future<void> submitStagingCopy(const at::ThreadLocalState& tls, at::Tensor host,
                                    at::Tensor device, bool toHost) {
  Copies copies;
  addCopy(copies, std::move(host), std::move(device), toHost);
  return CopyThread::get().submit(copyTask(tls, std::move(copies), toHost));
}

bool pipelineWanted(size_t bytes, c10::DeviceType type, int groupSize) {
  return bytes > stagingChunkBytes() && pipelineAllowed(type, groupSize);
}

bool pipelineAllowed(c10::DeviceType type, int groupSize) {
  switch (pipelineSetting().load(std::memory_order_relaxed)) {
    case PipelineSetting::kOn:
      return true;
    case PipelineSetting::kOff:
      return false;
    case PipelineSetting::kAuto:
      break;
  }
  if (!copiesUseHostCpu(type)) {
    return true;
  }
  static const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  return cpus >= 2L * std::max(groupSize, 1);
}

std::string stagingPipelineSetting() {
  switch (pipelineSetting().load(std::memory_order_relaxed)) {
    case PipelineSetting::kOn:
      return "1";
    case PipelineSetting::kOff:
      return "0";
    case PipelineSetting::kAuto:
      break;
  }
  return "auto";
}

void setStagingPipelineSetting(const std::string& setting) {
  pipelineSetting().store(parsePipelineSetting(setting.c_str(), "the staging pipeline setting"),
                          std::memory_order_relaxed);
}

OpSeqScope::OpSeqScope(uint64_t seq) : previous_(tOpSeq) { tOpSeq = seq; }

OpSeqScope::~OpSeqScope() { tOpSeq = previous_; }

void runStagedPipeline(const StagedSide& input, const StagedSide& output, int size,
                       const char* opName, const ChunkCall& call) {
  // The same buffer on both sides (in place): one device view and one host buffer.
  const bool inPlace = input.buffer != nullptr && input.buffer == output.buffer;
  const Side in = stagedSide(input, /*isOutput=*/false);
  Side out = inPlace ? in : stagedSide(output, /*isOutput=*/true);
  const CommBuffer& any = input.buffer != nullptr ? *input.buffer : *output.buffer;
  const Side& sized = in.present() ? in : out;
  const int64_t block =
      sized.layout == StagedLayout::kFlat ? sized.host.numel() : sized.host.numel() / size;
  const int64_t step = stagingChunkElements(block, any.userTensor().element_size());
  const auto units = static_cast<size_t>(any.units());
  std::vector<Chunk> chunks;
  for (int64_t offset = 0; offset < block; offset += step) {
    const int64_t n = std::min(step, block - offset);
    Chunk chunk;
    if (in.present()) {
      chunk.in = in.copies(offset, n, block, size, /*toHost=*/true);
    }
    chunk.call = [&call, &in, &out, offset, n, size, units](const std::string& what) {
      call(in.present() ? elementAddress(in.host, in.hostOffset(offset, size)) : nullptr,
           out.present() ? elementAddress(out.host, out.hostOffset(offset, size)) : nullptr,
           static_cast<size_t>(n) * units, what);
    };
    if (output.buffer != nullptr && output.copyBack) {
      chunk.out = out.copies(offset, n, block, size, /*toHost=*/false);
    }
    chunks.push_back(std::move(chunk));
  }
  runPipeline(chunks, opName);
  if (output.buffer != nullptr && output.copyBack) {
    finishDeviceFlat(*output.buffer, out.device);
  }
}

int64_t splitPipelineChunks(uint64_t largestPairBytes) {
  const uint64_t chunk = stagingChunkBytes();
  if (largestPairBytes <= chunk) {
    return 1;
  }
  return static_cast<int64_t>(
      std::min<uint64_t>(kMaxChunks, (largestPairBytes + chunk - 1) / chunk));
}

void runStagedAllToAllv(const CommBuffer& input, const CommBuffer& output,
                        const std::vector<int64_t>& sendElements,
                        const std::vector<int64_t>& recvElements, int64_t chunks,
                        const char* opName, const SplitChunkCall& call) {
  const at::Tensor inDevice = deviceFlat(input, /*fill=*/true);
  const at::Tensor inHost = hostFlat(input);
  at::Tensor outDevice = deviceFlat(output, /*fill=*/false);
  const at::Tensor outHost = hostFlat(output);
  const auto units = static_cast<size_t>(input.units());
  const size_t peers = sendElements.size();
  // Where each peer's run starts on either side (elements; the same on device and host).
  std::vector<int64_t> sendStart(peers), recvStart(peers);
  for (size_t p = 1; p < peers; ++p) {
    sendStart[p] = sendStart[p - 1] + sendElements[p - 1];
    recvStart[p] = recvStart[p - 1] + recvElements[p - 1];
  }
  // Piece k of a pair's c elements: [c*k/chunks, c*(k+1)/chunks), known to both ends.
  auto pieceStart = [chunks](int64_t c, int64_t k) { return c * k / chunks; };
  // (destination, source) copies of chunk k in one direction, skipping empty pieces.
  auto copies = [&](int64_t k, const std::vector<int64_t>& counts,
                    const std::vector<int64_t>& starts, const at::Tensor& device,
                    const at::Tensor& host, bool toHost) {
    Copies out;
    for (size_t p = 0; p < peers; ++p) {
      const int64_t begin = starts[p] + pieceStart(counts[p], k);
      const int64_t n = pieceStart(counts[p], k + 1) - pieceStart(counts[p], k);
      if (n == 0) {
        continue;
      }
      addCopy(out, host.narrow(0, begin, n), device.narrow(0, begin, n), toHost);
    }
    return out;
  };
  std::vector<Chunk> pieces;
  pieces.reserve(static_cast<size_t>(chunks));
  for (int64_t k = 0; k < chunks; ++k) {
    Chunk chunk;
    chunk.in = copies(k, sendElements, sendStart, inDevice, inHost, /*toHost=*/true);
    chunk.call = [&, k](const std::string& what) {
      std::vector<size_t> sc(peers), sd(peers), rc(peers), rd(peers);
      for (size_t p = 0; p < peers; ++p) {
        const int64_t s0 = pieceStart(sendElements[p], k);
        const int64_t r0 = pieceStart(recvElements[p], k);
        sc[p] = static_cast<size_t>(pieceStart(sendElements[p], k + 1) - s0) * units;
        sd[p] = static_cast<size_t>(sendStart[p] + s0) * units;
        rc[p] = static_cast<size_t>(pieceStart(recvElements[p], k + 1) - r0) * units;
        rd[p] = static_cast<size_t>(recvStart[p] + r0) * units;
      }
      call(inHost.data_ptr(), sc.data(), sd.data(), outHost.data_ptr(), rc.data(), rd.data(), what);
    };
    chunk.out = copies(k, recvElements, recvStart, outDevice, outHost, /*toHost=*/false);
    pieces.push_back(std::move(chunk));
  }
  if (chunks == 1) {
    // Nothing to overlap: the whole message in, the call, out, on this thread.
    const at::ThreadLocalState tls;
    copyTask(tls, std::move(pieces[0].in), true)();
    pieces[0].call(opName);
    copyTask(tls, std::move(pieces[0].out), false)();
    countStagedBuffer();
    countStagedBuffer();
  } else {
    runPipeline(pieces, opName);
  }
  finishDeviceFlat(output, outDevice);
}

}  // namespace spyreccl_torch
