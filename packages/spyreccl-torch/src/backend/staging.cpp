// staging.cpp — see staging.h.
#include "backend/staging.h"

#include <unistd.h>

#include <algorithm>
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

  at::Tensor take(size_t bytes) {
    const size_t rounded = (bytes + kBlockGranule - 1) / kBlockGranule * kBlockGranule;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // The smallest idle block that fits without wasting more than half of it.
      auto it = idle_.lower_bound(rounded);
      if (it != idle_.end() && it->first <= 2 * rounded) {
        at::Tensor block = std::move(it->second);
        cachedBytes_ -= it->first;
        idle_.erase(it);
        return block;
      }
    }
    return allocate(rounded);
  }

  void give(at::Tensor block) {
    const auto bytes = static_cast<size_t>(block.numel());
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
  at::Tensor allocate(size_t bytes) {
    const auto size = static_cast<int64_t>(bytes);
    if (pinning_.load(std::memory_order_relaxed)) {
      try {
        // Pinned memory of the current accelerator: what its DMA engines copy fastest.
        return at::empty({size}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      } catch (const std::exception&) {
        // A runtime without a pinned-memory allocator: pageable memory works, slower.
        pinning_.store(false, std::memory_order_relaxed);
      }
    }
    return at::empty({size}, at::TensorOptions().dtype(at::kByte));
  }

  std::mutex mutex_;
  std::multimap<size_t, at::Tensor> idle_;
  size_t cachedBytes_ = 0;
  std::atomic<bool> pinning_{true};
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
  gCounters.pipelinedOps.fetch_add(1, std::memory_order_relaxed);
  gCounters.pipelineChunks.fetch_add(chunks.size(), std::memory_order_relaxed);
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

// Elements per chunk of a pipeline over `like` (one rank's block): the chunk setting, grown
// so that no pipeline has more than kMaxChunks chunks. Every chunk is a core call that waits
// for the peers and two hand-offs to the copy thread; past a few chunks more of them only
// add those waits (the copies already overlap all but one chunk's worth).
int64_t chunkElements(const at::Tensor& like) {
  const int64_t setting =
      std::max<int64_t>(1, static_cast<int64_t>(stagingChunkBytes()) / like.element_size());
  return std::max(setting, (like.numel() + kMaxChunks - 1) / kMaxChunks);
}

}  // namespace

at::Tensor acquireHostBuffer(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t size : sizes) {
    numel *= size;
  }
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  at::Tensor block = HostPool::get().take(std::max<size_t>(bytes, 1));
  // A view over the block whose release hands the block back to the pool.
  return at::from_blob(
      block.data_ptr(), sizes, [block](void*) mutable { HostPool::get().give(std::move(block)); },
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
  return counters;
}

void resetStagingCounters() {
  gCounters.stagedBuffers = 0;
  gCounters.bytesToHost = 0;
  gCounters.bytesFromHost = 0;
  gCounters.pipelinedOps = 0;
  gCounters.pipelineChunks = 0;
}

void countCopy(bool toHost, size_t bytes) {
  (toHost ? gCounters.bytesToHost : gCounters.bytesFromHost)
      .fetch_add(bytes, std::memory_order_relaxed);
}

void countStagedBuffer() { gCounters.stagedBuffers.fetch_add(1, std::memory_order_relaxed); }

bool pipelineWanted(size_t bytes) { return bytes > stagingChunkBytes(); }

OpSeqScope::OpSeqScope(uint64_t seq) : previous_(tOpSeq) { tOpSeq = seq; }

OpSeqScope::~OpSeqScope() { tOpSeq = previous_; }

void pipelineAllReduce(const CommBuffer& buffer, const char* opName, const InPlaceChunkCall& call) {
  const at::Tensor device = deviceFlat(buffer, /*fill=*/true);
  const at::Tensor host = hostFlat(buffer);
  const int64_t total = device.numel();
  const int64_t step = chunkElements(device);
  const auto units = static_cast<size_t>(buffer.units());
  std::vector<Chunk> chunks;
  for (int64_t offset = 0; offset < total; offset += step) {
    const int64_t n = std::min(step, total - offset);
    Chunk chunk;
    chunk.in = {{host.narrow(0, offset, n), device.narrow(0, offset, n)}};
    chunk.call = [&call, &host, offset, n, units](const std::string& what) {
      call(elementAddress(host, offset), static_cast<size_t>(n) * units, what);
    };
    chunk.out = {{device.narrow(0, offset, n), host.narrow(0, offset, n)}};
    chunks.push_back(std::move(chunk));
  }
  runPipeline(chunks, opName);
  finishDeviceFlat(buffer, device);
}

void pipelineBroadcast(const CommBuffer* source, const CommBuffer& destination, const char* opName,
                       const ChunkCall& call) {
  // On the root with one buffer the source is the destination and nothing changes.
  const bool sameBuffer = source == &destination;
  const at::Tensor sourceDevice = source ? deviceFlat(*source, /*fill=*/true) : at::Tensor();
  const at::Tensor sourceHost = source ? hostFlat(*source) : at::Tensor();
  const at::Tensor destinationDevice =
      sameBuffer ? at::Tensor() : deviceFlat(destination, /*fill=*/false);
  const at::Tensor destinationHost = sameBuffer ? sourceHost : hostFlat(destination);
  const int64_t total = destinationHost.numel();
  const int64_t step = chunkElements(destinationHost);
  const auto units = static_cast<size_t>(destination.units());
  std::vector<Chunk> chunks;
  for (int64_t offset = 0; offset < total; offset += step) {
    const int64_t n = std::min(step, total - offset);
    Chunk chunk;
    if (source) {
      chunk.in = {{sourceHost.narrow(0, offset, n), sourceDevice.narrow(0, offset, n)}};
    }
    chunk.call = [&call, &sourceHost, &destinationHost, offset, n, units](const std::string& what) {
      call(sourceHost.defined() ? elementAddress(sourceHost, offset) : nullptr,
           elementAddress(destinationHost, offset), static_cast<size_t>(n) * units, what);
    };
    if (!sameBuffer) {
      chunk.out = {{destinationDevice.narrow(0, offset, n), destinationHost.narrow(0, offset, n)}};
    }
    chunks.push_back(std::move(chunk));
  }
  runPipeline(chunks, opName);
  if (!sameBuffer) {
    finishDeviceFlat(destination, destinationDevice);
  }
}

void pipelineAllGather(const CommBuffer& input, const CommBuffer& output, int size,
                       const char* opName, const ChunkCall& call) {
  const at::Tensor inDevice = deviceFlat(input, /*fill=*/true);
  const at::Tensor outDevice = deviceFlat(output, /*fill=*/false);
  const at::Tensor inHost = hostFlat(input);
  const at::Tensor outHost = hostFlat(output);
  const int64_t block = inDevice.numel();
  const int64_t step = chunkElements(inDevice);
  const auto units = static_cast<size_t>(input.units());
  std::vector<Chunk> chunks;
  for (int64_t offset = 0; offset < block; offset += step) {
    const int64_t n = std::min(step, block - offset);
    // Chunk k's output is `size` runs of n elements at size * offset of the host output.
    const int64_t base = size * offset;
    Chunk chunk;
    chunk.in = {{inHost.narrow(0, offset, n), inDevice.narrow(0, offset, n)}};
    chunk.call = [&call, &inHost, &outHost, offset, base, n, units](const std::string& what) {
      call(elementAddress(inHost, offset), elementAddress(outHost, base),
           static_cast<size_t>(n) * units, what);
    };
    for (int r = 0; r < size; ++r) {
      chunk.out.emplace_back(outDevice.narrow(0, r * block + offset, n),
                             outHost.narrow(0, base + r * n, n));
    }
    chunks.push_back(std::move(chunk));
  }
  runPipeline(chunks, opName);
  finishDeviceFlat(output, outDevice);
}

void pipelineReduceScatter(const CommBuffer& input, const CommBuffer& output, int size,
                           const char* opName, const ChunkCall& call) {
  const at::Tensor inDevice = deviceFlat(input, /*fill=*/true);
  const at::Tensor outDevice = deviceFlat(output, /*fill=*/false);
  const at::Tensor inHost = hostFlat(input);
  const at::Tensor outHost = hostFlat(output);
  const int64_t block = outDevice.numel();
  const int64_t step = chunkElements(outDevice);
  const auto units = static_cast<size_t>(output.units());
  std::vector<Chunk> chunks;
  for (int64_t offset = 0; offset < block; offset += step) {
    const int64_t n = std::min(step, block - offset);
    // Chunk k's input is `size` runs of n elements (one per rank's block) at size * offset.
    const int64_t base = size * offset;
    Chunk chunk;
    for (int r = 0; r < size; ++r) {
      chunk.in.emplace_back(inHost.narrow(0, base + r * n, n),
                            inDevice.narrow(0, r * block + offset, n));
    }
    chunk.call = [&call, &inHost, &outHost, offset, base, n, units](const std::string& what) {
      call(elementAddress(inHost, base), elementAddress(outHost, offset),
           static_cast<size_t>(n) * units, what);
    };
    chunk.out = {{outDevice.narrow(0, offset, n), outHost.narrow(0, offset, n)}};
    chunks.push_back(std::move(chunk));
  }
  runPipeline(chunks, opName);
  finishDeviceFlat(output, outDevice);
}

}  // namespace spyreccl_torch
