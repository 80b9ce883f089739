// group_split.cpp — ProcessGroupSpyreccl::split: a subgroup whose communicator the core
// derives from this group's (spyrecclCommSplit), run in queue order on the progress thread.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "backend/communicator.h"
#include "backend/errors.h"
#include "backend/group_config.h"
#include "backend/input_checks.h"
#include "backend/process_group_spyreccl.hpp"

namespace spyreccl_torch {

c10::intrusive_ptr<c10d::Backend> ProcessGroupSpyreccl::split(
    const c10::intrusive_ptr<c10d::Store>& /*store*/, const std::vector<int>& ranks,
    const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  std::vector<int> members = ranks;
  std::sort(members.begin(), members.end());
  TORCH_CHECK(!members.empty(), "spyreccl split: argument 'ranks' is empty");
  TORCH_CHECK(std::adjacent_find(members.begin(), members.end()) == members.end(),
              "spyreccl split: argument 'ranks' contains duplicate ranks");
  for (int member : members) {
    checkRank(member, size_, "split", "ranks");
  }
  const auto self = std::find(members.begin(), members.end(), rank_);
  const bool isMember = self != members.end();
  // The subgroups of one split are disjoint, so the smallest member names each of them.
  const int color = isMember ? members.front() : SPYRECCL_SPLIT_NOCOLOR;
  const int newRank = isMember ? static_cast<int>(self - members.begin()) : -1;

  // The new group's options: ours, overridden by what the caller passed.
  c10::intrusive_ptr<Options> newOptions;
  if (auto* own = dynamic_cast<Options*>(opts.get())) {
    newOptions = own->copy();
  } else {
    newOptions = options_->copy();
    if (opts) {
      newOptions->timeout = opts->timeout;
      newOptions->group_name = opts->group_name;
      newOptions->group_desc = compat::groupDesc(*opts);
      newOptions->global_ranks_in_group = opts->global_ranks_in_group;
    }
  }
  checkTimeout(newOptions->timeout, "the split group's timeout");
  if (newOptions->global_ranks_in_group.empty() ||
      newOptions->global_ranks_in_group.size() != members.size()) {
    newOptions->global_ranks_in_group.clear();
    for (int member : members) {
      const auto& parentGlobal = options_->global_ranks_in_group;
      newOptions->global_ranks_in_group.push_back(
          parentGlobal.size() == static_cast<size_t>(size_) ? parentGlobal[member] : member);
    }
  }

  const std::string name = "process group '" + newOptions->group_name + "' (rank " +
                           std::to_string(newRank) + " of " + std::to_string(members.size()) +
                           ", split from " + label() + ")";
  const spyrecclConfig_t config = makeConfig(*newOptions, name.c_str());
  spyrecclComm_t newComm = nullptr;
  runSynchronously("split", newOptions->timeout, [&](spyrecclComm_t comm) {
    checkCore(spyrecclCommSplit(comm, color, isMember ? newRank : 0, &newComm, &config), comm,
              "split of " + label());
  });
  if (!isMember) {
    if (newComm != nullptr) {
      (void)spyrecclCommDestroy(newComm);
    }
    return nullptr;
  }
  TORCH_CHECK(newComm != nullptr, "spyreccl split: the core returned no communicator for rank ",
              rank_, " of ", label());
  auto communicator = std::make_shared<Communicator>(newComm, newOptions->timeout, name);
  auto group = c10::intrusive_ptr<ProcessGroupSpyreccl>::unsafe_steal_from_new(
      new ProcessGroupSpyreccl(SplitTag{}, std::move(communicator), newRank,
                               static_cast<int>(members.size()), newOptions));
  group->setGroupUid(newOptions->group_name);
  group->setGroupDesc(newOptions->group_desc);
  return group;
}

}  // namespace spyreccl_torch
