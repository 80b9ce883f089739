// peer_pipeline.h — a staged send or receive larger than one staging chunk, moved as a chain
// of core messages whose device copies overlap the transfer (staging.h).
//
// A lone send or receive is posted and left in flight on the progress thread, so that rings
// of sends and receives progress (op_execution.h). A pipelined one keeps that: post() never
// waits for a peer (a receive from any source aside, below) and poll() never blocks on one.
// What changes is what the core moves:
//  - The message is split into chunks of stagingChunkElements() elements: the same plan on
//    both sides, from the element count, the element size and the chunk setting alone.
//  - Message 0 is a 64-byte header (the sender's byte count and dtype) followed by chunk 0,
//    sent as bytes; messages 1..n-1 carry the other chunks in the tensor's core dtype. The
//    core checks each message's size, but a message of 3 chunks against a receive of 4
//    chunks of the same size would pass those checks and take the first chunk of the
//    sender's next message: the header lets the receiver see the mismatch. Message 0 holds
//    more than one chunk's bytes, so no unpipelined receive (at most one chunk) can match
//    it: a receiver that does not pipeline fails with the core's mismatch instead.
//  - Sender: post() hands every chunk's device -> host copy to the copy thread and posts
//    chunk k's message once its copy is done, progressing the communicator while it waits:
//    the copy of chunk k+1 overlaps the transfer of chunk k. post() returns once all
//    messages are posted (it waits for copies only, never for the peer), so no later send
//    to the same peer slips between them: the core delivers a pair's messages in posting
//    order, and the receiver expects the chunks back to back.
//  - Receiver: post() posts every chunk's receive at once, taking their places in the
//    pair's order before any later receive; poll() hands each chunk that arrived to the
//    copy thread (host -> device), so the copy of chunk k overlaps the receipt of chunk
//    k+1. A header that names another size or dtype aborts the communicator (the sender's
//    other chunks, or the remaining posted receives, would otherwise be matched against
//    later messages of the pair) and fails with a message naming the argument and both
//    sizes.
//  - A receive from any source takes message 0 with spyrecclRecvAnySource (blocking, as such
//    a receive is anyway) and posts the rest from the rank that sent it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <future>
#include <string>
#include <vector>

#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <spyreccl/spyreccl.h>

#include "backend/communicator.h"
#include "backend/flight_recorder.h"
#include "backend/process_group_spyreccl.hpp"

namespace spyreccl_torch {

class PeerPipeline {
 public:
  // For the send or receive `step`, whose buffer is marked pipelined; `what` names it in
  // error messages ("recv seq 7 from rank 1 (tag 0)"). Takes what it needs from the step
  // (the step may move meanwhile).
  PeerPipeline(const Step& step, Communicator& comm, std::string what);
  // Waits for the copies still running (a failed pipeline's): none may outlive its buffers.
  ~PeerPipeline();
  PeerPipeline(const PeerPipeline&) = delete;
  PeerPipeline& operator=(const PeerPipeline&) = delete;

  // Posts every message (see above). Throws on failure.
  void post();

  // Progresses without waiting for the peer; true once the whole message moved (a
  // receiver's last copies are waited for then). Throws on failure.
  bool poll();

 private:
  size_t chunks() const { return requests_.size(); }
  int64_t chunkBegin(size_t k) const { return static_cast<int64_t>(k) * step_; }
  int64_t chunkLength(size_t k) const;
  std::string describeChunk(size_t k) const;
  // Posts message k as this pipeline's send or receive; throws the core's error.
  void postMessage(size_t k);
  void postSends();
  void postReceives(size_t first);
  void receiveFirstFromAnySource();
  void writeHeader();
  void checkHeader();
  // Whether message k completed; throws its error.
  bool test(size_t k);
  void submitCopy(size_t k, bool toHost);
  // Aborts the communicator when messages of this pipeline are still posted: they could
  // only be matched by later messages of the peer. Not for errors the core reported: it
  // then abandoned every pending message itself.
  void abortPosted(const std::string& reason);
  void waitCopies() noexcept;

  PeerCall call_;
  Communicator& comm_;
  std::string what_;
  flight::Ref trace_;
  at::Tensor user_;
  at::Tensor device_;    // the user's tensor as one dense run on its device
  at::Tensor host_;      // header + data, bytes
  at::Tensor hostData_;  // the data part, in the tensor's dtype
  spyrecclDataType_t dtype_;
  int64_t units_ = 1;  // core elements per tensor element
  int64_t numel_ = 0;  // tensor elements
  int64_t step_ = 0;   // tensor elements per chunk
  bool sends_ = false;
  int peer_ = -1;
  at::ThreadLocalState tls_;
  std::vector<spyrecclRequest_t> requests_;  // per message; nullptr once released
  std::vector<std::future<void>> copies_;    // per chunk
  size_t completed_ = 0;  // messages known complete (in order: a pair's messages are FIFO)
};

// Whether `step` is a send or receive that runs as a PeerPipeline.
bool pipelinedPeerStep(const Step& step);

}  // namespace spyreccl_torch
