// One-way small broadcasts.
//
// A broadcast of at most Communicator::eagerMaxBytes() takes no step of the collective
// protocol. Its root copies the payload and the call's descriptor into the next slot of its
// ring (transport::EagerControl) and returns; each receiver waits for that slot, compares
// the slot's descriptor with its own call, copies the payload out and counts the slot read.
// The root reuses a slot only once every receiver has read it, so it runs up to
// transport::kEagerSlots calls ahead of the slowest receiver.
//
// Why: with more ranks than CPUs, a call in which every rank waits for every other costs a
// context switch (2.6-3.1 us for 3 ranks on a 2-vCPU machine), where Open MPI's one-way
// small broadcast costs 0.5 us (docs/notes/core-vs-open-mpi.md). A root that does not wait
// also leaves a receiver that arrives late to catch up alone.
//
// What a mismatch does (docs/design.md, "One-way small broadcasts"):
//   - a receiver whose call differs from the root's fails in that call, naming both calls:
//     from the slot's descriptor, or from the root's call history when the root called
//     something else (checked while the receiver waits);
//   - a rank that waits in any other collective fails there when a peer's history shows a
//     different call for the same sequence number (Communicator::checkPeerCalls);
//   - a root, which returned before any receiver read its slot, and ranks that could not
//     see the mismatch fail at their next collective that waits for every rank: its
//     descriptor carries a digest of the one-way broadcasts before it, or the receiver that
//     saw the mismatch has failed (its message is then named). A root also fails when it
//     next needs a slot that a receiver went past without reading, and at the start of its
//     next one-way broadcast when a receiver has failed.
// SPYRECCL_EAGER_BROADCAST_MAX_BYTES=0 on any rank keeps every broadcast on the step
// protocol, where every rank fails in the mismatched call itself.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm.h"

namespace spyreccl::algorithms {

// Whether a broadcast of `bytes` goes one-way on this communicator (the same answer on
// every rank whose call matches).
inline bool eagerBroadcastFits(const Communicator& c, size_t bytes) {
  return c.nranks() > 1 && static_cast<int64_t>(bytes) <= c.eagerMaxBytes();
}

// Runs broadcast `d` (already begun: its sequence number assigned) one-way. The root's
// `send` is copied into its slot and into `recv`; a receiver's `recv` gets the payload.
void eagerBroadcast(Communicator& c, const transport::Descriptor& d, const void* send, void* recv,
                    size_t bytes, int root);

}  // namespace spyreccl::algorithms
