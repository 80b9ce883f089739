// staging.h — moving tensors the host cannot address through host buffers.
//
// The core reads and writes host memory. A tensor on a device whose memory is not
// host-addressable (device_caps.h) is staged: its elements are copied into a (pinned, pooled)
// host buffer with the device's own copy_ (the runtime's DMA on real cards), the core works
// on the host buffer, and the result is copied back the same way.
//
//  - Small messages (at most one chunk) take the shortest route: CommBuffer::prepare copies
//    the whole tensor in, the core runs once, CommBuffer::commit copies it out.
//  - Larger all_reduce, broadcast, reduce, all_gather, reduce_scatter, gather, scatter and
//    all_to_all (equal splits, and split sizes: runStagedAllToAllv), where pipelineWanted says
//    so, run as a pipeline of chunks along one rank's block: while the
//    core works on chunk k, a copy thread brings chunk k+1 in and takes chunk k-1 out, so the
//    copies hide behind the collective (or the reverse).
//  - Larger sends and receives, where pipelineWanted says so, travel as a chain of chunk
//    messages on the same copy thread (peer_pipeline.h): the sender's copy of chunk k+1
//    overlaps the transfer of chunk k, the receiver's copy of chunk k the receipt of chunk
//    k+1, and the send or receive stays posted without blocking on its peer.
//
// Every rank must split an operation the same way: the decision and the chunk size depend
// only on the element count and the chunk setting (SPYRECCL_STAGING_CHUNK_BYTES, the same on
// every rank), never on pointers or timing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

namespace spyreccl_torch {

class CommBuffer;

// A contiguous host tensor of `numel` elements of `dtype` shaped like `sizes`: up to 64 KiB
// a preallocated slot (one atomic each way, see SmallSlots in staging.cpp), else a block of
// a process-wide pool of host blocks: from 256 KiB the core's shareable arena
// (spyrecclMemAlloc, read by the peers in place; SPYRECCL_STAGING_ARENA=0: no), else pinned
// (pageable where the device offers no pinning); the slot or block returns when the last
// view of it is dropped.
at::Tensor acquireHostBuffer(at::IntArrayRef sizes, at::ScalarType dtype);

// Bytes per pipeline chunk (of one rank's block); default 1 MiB, at least 4 KiB. A pipeline
// has at most 8 chunks: larger messages get larger chunks.
size_t stagingChunkBytes();
void setStagingChunkBytes(size_t bytes);

// What the staged path did in this process (tests and the benchmark read it).
struct StagingCounters {
  uint64_t stagedBuffers = 0;   // buffers staged whole (one copy each way)
  uint64_t bytesToHost = 0;     // device -> host bytes copied
  uint64_t bytesFromHost = 0;   // host -> device bytes copied
  uint64_t pipelinedOps = 0;    // operations run as a chunk pipeline
  uint64_t pipelineChunks = 0;  // chunks those pipelines ran
  uint64_t slotBuffers = 0;     // host buffers taken from the small preallocated slots
  uint64_t arenaBuffers = 0;    // host buffers in the core's arena (read by peers in place)
  uint64_t slotsInUse = 0;      // small slots held now (not reset: a state, not a count)
};
StagingCounters stagingCounters();
void resetStagingCounters();
void countCopy(bool toHost, size_t bytes);
void countStagedBuffer();
// One operation ran as a pipeline of `chunks` chunks (counted once it succeeded).
void countPipeline(size_t chunks);

// Elements per chunk of a pipeline along blocks of `block` elements of `elementSize` bytes:
// the chunk setting, grown so that no pipeline has more than 8 chunks. Depends only on its
// arguments and the setting, so every rank splits an operation alike.
int64_t stagingChunkElements(int64_t block, int64_t elementSize);

// The copy between `host` and `device` in the direction `toHost`, on the pipelines' copy
// thread, after the copies submitted before it, under `tls` (the issuing thread's grad mode,
// ...), and counted. The future reports its end and rethrows its error.
std::future<void> submitStagingCopy(const at::ThreadLocalState& tls, at::Tensor host,
                                    at::Tensor device, bool toHost);

// Whether an operation of a group of `groupSize` ranks on tensors of `type`, whose driving
// buffer holds `bytes`, runs as a pipeline: only past one chunk, and then as
// SPYRECCL_STAGING_PIPELINE says: `1` always, `0` never, `auto` (default) where the copies
// can overlap the collective — the device copies by its own engine (copiesUseHostCpu false),
// or this machine has two online CPUs per rank of the group (one for the collective, one for
// the copy thread). Where copies are memcpys competing for the collective's cores, the
// pipeline's hand-offs and extra core calls cost more than they hide (4 MiB all_reduce, 2
// ranks on 2 cores: 405 us pipelined, 220-260 us whole). Depends only on the group, the
// device type, the machine's CPU count and the settings, so the ranks of a node agree.
bool pipelineWanted(size_t bytes, c10::DeviceType type, int groupSize);

// pipelineWanted without the size test: whether an operation of this group on `type` may run
// as a pipeline at all. Operations whose ranks cannot tell each other's sizes (all_to_all with
// split sizes) decide on this, then agree on the chunk count (splitPipelineChunks).
bool pipelineAllowed(c10::DeviceType type, int groupSize);

// Chunks of a split-size all_to_all pipeline whose largest message between two ranks, over
// every rank, is `largestPairBytes` (agreed by the ranks): one up to the chunk setting, then
// one per chunk setting, at most 8 (as for the other pipelines).
int64_t splitPipelineChunks(uint64_t largestPairBytes);

// SPYRECCL_STAGING_PIPELINE as a setting: "auto", "1" or "0" (tests, the benchmark).
std::string stagingPipelineSetting();
void setStagingPipelineSetting(const std::string& setting);

// The sequence number of the operation whose steps this thread runs, for the pipeline's
// error messages: its chunks are core calls of their own, which the core numbers one by one,
// so the core's "seq" there is not the operation's. Set around each step's core call.
class OpSeqScope {
 public:
  explicit OpSeqScope(uint64_t seq);
  ~OpSeqScope();
  OpSeqScope(const OpSeqScope&) = delete;
  OpSeqScope& operator=(const OpSeqScope&) = delete;

 private:
  uint64_t previous_;
};

// The pipelined form. A pipelined step names its input and output buffers (a side is
// absent where this rank has none: gather's output off the root, scatter's input off the
// root, broadcast's source off the root) and how the core sees each: one run of elements
// (kFlat), or `size` blocks of equal length (kBlocked: all_gather's and gather's output,
// reduce_scatter's and scatter's input, both sides of an all_to_all). The pipeline walks one
// rank's block (a flat side's elements, a blocked side's elements / size) in chunks; a
// chunk of a blocked side is the chunk's range of every block, and the core gets it as
// `size` consecutive runs. The same buffer on both sides runs in place (all_reduce; a
// broadcast root's tensor, with copyBack false: its values do not change).
//
// `call` issues the core call for one chunk: host pointers (nullptr for an absent side),
// the chunk's element count per block in core elements, and what to call it in an error
// message ("allreduce seq 7, chunk 3 of 4"). Buffers are CommBuffers marked pipelined (their
// prepare/commit do nothing; the pipeline does the copies).
enum class StagedLayout { kFlat, kBlocked };

struct StagedSide {
  const CommBuffer* buffer = nullptr;
  StagedLayout layout = StagedLayout::kFlat;
  bool copyBack = true;  // output side: copy the results back into the device tensor
};

using ChunkCall =
    std::function<void(const void* in, void* out, size_t count, const std::string& what)>;

void runStagedPipeline(const StagedSide& input, const StagedSide& output, int size,
                       const char* opName, const ChunkCall& call);

// The pipelined all_to_all with split sizes: `sendElements[p]` elements go to rank p and
// `recvElements[p]` come from it, packed in rank order on both sides. Every rank cuts each
// pair's message into the same `chunks` pieces (piece k of c elements: [c*k/chunks,
// c*(k+1)/chunks)), which both ends of a pair derive from the pair's own count, so chunk k is
// one core all-to-all with per-peer counts on every rank. `chunks` must be the same on every
// rank (splitPipelineChunks of an agreed maximum). One chunk runs on the calling thread (the
// whole message in, the call, the whole message out), without the copy thread's hand-offs.
// `call` gets host base pointers and per-peer counts and displacements in core elements.
using SplitChunkCall = std::function<void(
    const void* in, const size_t* sendCounts, const size_t* sendDispls, void* out,
    const size_t* recvCounts, const size_t* recvDispls, const std::string& what)>;

void runStagedAllToAllv(const CommBuffer& input, const CommBuffer& output,
                        const std::vector<int64_t>& sendElements,
                        const std::vector<int64_t>& recvElements, int64_t chunks,
                        const char* opName, const SplitChunkCall& call);

}  // namespace spyreccl_torch
