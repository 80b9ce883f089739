// group_config.h — the core configuration a group's communicator is created with (from the
// group's Options) and the check of the timeouts it is given; shared by the construction
// of a group (process_group_spyreccl.cpp) and split (group_split.cpp).
#pragma once

#include <chrono>

#include <spyreccl/spyreccl.h>

#include "backend/process_group_spyreccl.hpp"

namespace spyreccl_torch {

spyrecclConfig_t makeConfig(const ProcessGroupSpyreccl::Options& options, const char* name);

void checkTimeout(std::chrono::milliseconds timeout, const char* what);

}  // namespace spyreccl_torch
