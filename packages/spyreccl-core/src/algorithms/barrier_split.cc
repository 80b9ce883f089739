// barrier (a lone descriptor step) and the collective part of comm split.
#include <algorithm>
#include <cstring>
#include <vector>

#include "algorithms/collectives.h"
#include "algorithms/op_scope.h"

namespace spyreccl::algorithms {

void barrier(Communicator& c) {
  OpScope scope(c, makeDescriptor(Kind::kBarrier, spyrecclInt8, 0));
  const uint32_t s = c.beginStep();
  c.exchange(s, scope.desc());
  scope.succeed();
}

SplitPlan splitExchange(Communicator& c, int color, int key) {
  OpScope scope(c, makeDescriptor(Kind::kSplit, spyrecclInt8, 0));
  const int n = c.nranks();
  const int r = c.rank();

  // Step 1: allgather (color, key).
  uint32_t s = c.beginStep();
  auto* mine = reinterpret_cast<int32_t*>(c.staging(r, s));
  mine[0] = color;
  mine[1] = key;
  c.exchange(s, scope.desc());
  std::vector<int32_t> colors(n), keys(n);
  for (int q = 0; q < n; ++q) {
    const auto* theirs = reinterpret_cast<const int32_t*>(c.staging(q, s));
    colors[q] = theirs[0];
    keys[q] = theirs[1];
  }

  SplitPlan plan;
  int leader = -1;
  if (color != SPYRECCL_SPLIT_NOCOLOR) {
    std::vector<int> members;
    for (int q = 0; q < n; ++q) {
      if (colors[q] == color) members.push_back(q);
    }
    leader = members.front();  // lowest old rank of the color
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return keys[a] != keys[b] ? keys[a] < keys[b] : a < b; });
    plan.member = true;
    plan.newSize = static_cast<int>(members.size());
    plan.newRank = static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin());
  }

  // Step 2: every color's leader publishes a fresh unique id for its new communicator.
  s = c.beginStep();
  if (leader == r) {
    rendezvous::UniqueIdData id = rendezvous::makeUniqueId();
    std::memcpy(c.staging(r, s), &id, sizeof(id));
  }
  c.exchange(s);
  if (plan.member) std::memcpy(&plan.id, c.staging(leader, s), sizeof(plan.id));
  scope.succeed();
  return plan;
}

}  // namespace spyreccl::algorithms
