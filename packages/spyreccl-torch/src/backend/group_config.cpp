// group_config.cpp — see group_config.h.
#include "backend/group_config.h"

#include <c10/util/Exception.h>

namespace spyreccl_torch {

spyrecclConfig_t makeConfig(const ProcessGroupSpyreccl::Options& options, const char* name) {
  spyrecclConfig_t config = SPYRECCL_CONFIG_INITIALIZER;
  config.timeoutMs = options.timeout.count();
  config.chunkBytes = options.chunk_bytes;
  config.p2pChunkBytes = options.p2p_chunk_bytes;
  config.name = name;
  config.yieldNs = options.yield_ns;
  return config;
}

void checkTimeout(std::chrono::milliseconds timeout, const char* what) {
  TORCH_CHECK(timeout.count() > 0, "spyreccl: ", what, " must be positive, got ", timeout.count(),
              " ms");
}

}  // namespace spyreccl_torch
