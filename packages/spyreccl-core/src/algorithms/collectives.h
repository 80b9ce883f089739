// Collective algorithms over the step protocol of Communicator.
//
// Preconditions (checked by api.cc before any communication): valid data type, valid
// reduce spec, root in range, non-NULL buffers where count > 0, no illegal overlap, and
// the communicator is usable. Every function starts with a descriptor step (also for
// count 0) so that mismatched calls are detected, and throws spyreccl::Error on failure.
#pragma once

#include <cstddef>
#include <memory>

#include "comm.h"
#include "kernels/reduce.h"
#include "rendezvous/unique_id.h"

namespace spyreccl::algorithms {

void allReduce(Communicator& c, const void* send, void* recv, size_t count,
               spyrecclDataType_t dtype, spyrecclRedOp_t op, const kernels::ReduceSpec& spec);
void reduce(Communicator& c, const void* send, void* recv, size_t count, spyrecclDataType_t dtype,
            spyrecclRedOp_t op, const kernels::ReduceSpec& spec, int root);
void reduceScatter(Communicator& c, const void* send, void* recv, size_t recvcount,
                   spyrecclDataType_t dtype, spyrecclRedOp_t op, const kernels::ReduceSpec& spec);

void broadcast(Communicator& c, const void* send, void* recv, size_t count,
               spyrecclDataType_t dtype, int root);
void scatter(Communicator& c, const void* send, void* recv, size_t recvcount,
             spyrecclDataType_t dtype, int root);
void allGather(Communicator& c, const void* send, void* recv, size_t sendcount,
               spyrecclDataType_t dtype);
void gather(Communicator& c, const void* send, void* recv, size_t sendcount,
            spyrecclDataType_t dtype, int root);

void allToAll(Communicator& c, const void* send, void* recv, size_t count,
              spyrecclDataType_t dtype);
void allToAllv(Communicator& c, const void* send, const size_t* sendcounts, const size_t* sdispls,
               void* recv, const size_t* recvcounts, const size_t* rdispls,
               spyrecclDataType_t dtype);

void barrier(Communicator& c);

// The collective part of spyrecclCommSplit: exchanges (color, key) and, per color, a fresh
// unique id made by the color's lowest old rank. The caller then bootstraps the new
// communicator (a failure there does not break the parent).
struct SplitPlan {
  bool member = false;  // false for SPYRECCL_SPLIT_NOCOLOR
  int newRank = -1;
  int newSize = 0;
  rendezvous::UniqueIdData id{};
};
SplitPlan splitExchange(Communicator& c, int color, int key);

}  // namespace spyreccl::algorithms
