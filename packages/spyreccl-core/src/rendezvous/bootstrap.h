// Bootstrap of a communicator from a unique id: segment creation/attachment, rank
// registration, wait for all ranks, unlink.
#pragma once

#include <memory>

#include "comm.h"
#include "rendezvous/unique_id.h"

namespace spyreccl::rendezvous {

// Collective over the `nranks` processes passing the same id. Rank 0 creates the segment;
// the others attach. Returns once every rank has attached; the segment name is unlinked by
// the last rank to attach (and by any rank that fails after creating/attaching), so no
// name outlives the bootstrap.
std::unique_ptr<spyrecclComm> bootstrap(int nranks, const UniqueIdData& id, int rank,
                                        const CommConfig& config);

}  // namespace spyreccl::rendezvous
