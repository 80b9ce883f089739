// Environment variables read by the core (all optional):
//   SPYRECCL_DEBUG                 WARN | INFO | TRACE   logging to stderr
//   SPYRECCL_CHUNK_BYTES           collective staging bytes per rank per slot (default 1 MiB)
//   SPYRECCL_P2P_CHUNK_BYTES       send/recv staging bytes per pair per slot (default 256 KiB)
//   SPYRECCL_ALLREDUCE_ONESHOT_MAX largest allreduce (bytes) using the one-shot algorithm
//                                  (default: 64 KiB at 2 ranks, 16 KiB at more)
//   SPYRECCL_DIRECT                0 disables direct transfers (arenas and cross-memory attach)
//   SPYRECCL_CMA                   0 disables single-copy transfers of ordinary memory
//                                  (process_vm_readv); default on where the init probe allows
//   SPYRECCL_CMA_CONTENDED         auto | 1 | 0: whether this rank's CPUs count as contended
//                                  (lower CMA thresholds, algorithms/direct.h); auto: loadavg
//   SPYRECCL_SPIN_MAX_NS           longest extended spin of a wait (default 30000; <= 2000: none,
//                                  and no spin of point-to-point waits with more ranks than CPUs)
//   SPYRECCL_EAGER_BROADCAST_MAX_BYTES  largest one-way broadcast (default and at most 256; 0:
//                                  off; the ranks use the smallest value; algorithms/eager.h)
//   SPYRECCL_YIELD_NS              how long a wait yields before it sleeps (default 2000000)
//   SPYRECCL_CMA_MIN_BYTES         one threshold for them for every operation (default: the
//                                  measured per-operation thresholds, algorithms/direct.cc)
//   SPYRECCL_DIRECT_MIN_BYTES      smallest collective (bytes per rank) or send/recv message
//                                  (also larger than two p2p chunks) using them (256 KiB)
//   SPYRECCL_DUMP_DIR              directory receiving state dumps on timeouts/peer failures
//   SPYRECCL_ARENA_RETAIN_BYTES    freed memory-arena bytes kept resident for reuse (default
//                                  an eighth of physical memory, at most 1 GiB; memory/arena.cc)
#pragma once

#include <cstddef>
#include <optional>
#include <string>

namespace spyreccl {

// Value of `name`, or nullopt when unset or empty.
std::optional<std::string> envString(const char* name);

// A byte count such as "65536", "64K", "1M", "1g". Unset → `fallback`. A malformed value
// throws spyrecclInvalidUsage naming the variable (silently ignoring a typo in a tuning
// knob would make performance investigations miserable).
size_t envBytes(const char* name, size_t fallback);

// A switch: 1/0, on/off, true/false, yes/no (any case). Unset → `fallback`; anything else
// throws spyrecclInvalidUsage naming the variable.
bool envFlag(const char* name, bool fallback);

}  // namespace spyreccl
