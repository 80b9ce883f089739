// One send or receive as a non-blocking state machine. Its own header (no Communicator
// definition needed) because the communicator keeps the operations pending on it: its
// pending list and the requests of the C API (spyrecclIsend/spyrecclIrecv) it owns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "spyreccl/spyreccl.h"

namespace spyreccl {
class Communicator;
}

namespace spyreccl::algorithms {

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
  // Sender: the PathAdvisor's sample of this message (timedKind 0: none; its kind index
  // otherwise): when it started, and the time spent copying into the staging slots.
  uint32_t timedKind = 0;
  int64_t timedNs = 0;
  int64_t copyNs = 0;

  // While pending on its communicator (algorithms/p2p.h post()): the operation posted
  // before it on the same (peer, direction), which has to finish first so that each
  // pair's stream stays FIFO; null once that one finished (or if there was none).
  P2POp* pred = nullptr;
  int64_t postedNs = 0;  // when it was posted: the group timeout counts from here
  // Outcome once finished: spyrecclSuccess, or the error that abandoned it (the first
  // error on a communicator abandons every operation pending on it).
  spyrecclResult_t result = spyrecclSuccess;
  std::string error;

  std::string describe() const;
};

}  // namespace spyreccl::algorithms
