// Point-to-point messages through the per-pair mailboxes (staged, or copied straight from
// the sender's memory arena), and GroupStart/End batching.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "comm.h"

namespace spyreccl::algorithms {

// One send or receive as a non-blocking state machine (validated by api.cc).
struct P2POp {
  Communicator* comm = nullptr;
  bool isSend = false;
  int peer = -1;
  int tag = 0;
  spyrecclDataType_t dtype = spyrecclFloat32;
  size_t count = 0;
  const uint8_t* sendBuf = nullptr;
  uint8_t* recvBuf = nullptr;

  // progress
  size_t done = 0;       // payload bytes transferred
  bool started = false;  // first chunk handled (message number assigned)
  bool finished = false;
  uint64_t msgSeq = 0;  // per-pair message number
  // A send posted as one direct chunk (index `directChunk` of the pair's stream): it
  // finishes once the receiver consumed that chunk, i.e. copied the message out of our
  // arena.
  bool direct = false;
  uint32_t directChunk = 0;

  std::string describe() const;
};

// Progresses `ops` round-robin until all complete. Operations between the same pair in
// the same direction complete in list order (FIFO). On the first error every communicator
// involved is marked failed (with the message) and the error is rethrown.
void runP2P(std::vector<P2POp>& ops);

// Receives the next message with `tag` from whichever peer sends first (lowest rank on a
// tie) and returns that rank.
int recvAnySource(Communicator& c, void* recv, size_t count, spyrecclDataType_t dtype, int tag);

// Per-thread GroupStart/End state.
struct GroupState {
  int depth = 0;
  std::vector<P2POp> ops;
};
GroupState& threadGroup();

}  // namespace spyreccl::algorithms
