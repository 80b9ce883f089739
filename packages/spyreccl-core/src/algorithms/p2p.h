// Point-to-point messages through the per-pair mailboxes (staged, or copied straight from
// the sender's memory arena): one progress engine for blocking calls, groups and the
// non-blocking requests of the C API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms/p2p_op.h"
#include "comm.h"

namespace spyreccl::algorithms {

// Appends `op` (validated by api.cc) to its communicator's pending list, in posting order.
// The operation must stay at its address until it finished (its owner: a request, or the
// vector of a blocking call). Operations on the same (peer, direction) complete in posting
// order (FIFO), whichever call posted them.
void post(P2POp& op);

// One non-blocking pass over the operations pending on `c`: each eligible one moves by at
// most one chunk (fair between concurrent streams); finished ones leave the list. Returns
// whether anything moved. On an error every operation pending on `c` is abandoned with it
// (result/error set, finished), `c` is marked failed, and the error is rethrown. An
// already failed communicator abandons its pending operations the same way.
bool progress(Communicator& c);

// Blocks until an operation pending on `c` can move, wakeProgress(c) was called, or
// maxWaitNs passed; moves nothing itself. Bounded like every wait: throws on abort, on the
// failure of a peer a pending operation needs, and once a pending operation is older than
// the communicator's timeout (after abandoning them all, as progress() does).
void waitProgress(Communicator& c, int64_t maxWaitNs);

// Ends a waitProgress() on `c` early (from any thread).
void wakeProgress(Communicator& c);

// Posts `ops` and progresses every pending operation of their communicators until all of
// `ops` finished (blocking send/recv, spyrecclGroupEnd). On the first error every
// communicator involved is marked failed and the error is rethrown.
void runP2P(std::vector<P2POp>& ops);

// Blocks until `op` (pending on its communicator) finished, progressing everything pending
// there. Returns normally also when the operation was abandoned (see op.result).
void waitFor(P2POp& op);

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
