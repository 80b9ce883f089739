#include "rendezvous/bootstrap.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "transport/liveness.h"
#include "transport/segment.h"
#include "transport/wait.h"

namespace spyreccl::rendezvous {

using transport::Layout;
using transport::RankControl;
using transport::Segment;

namespace {

// Claims slot `rank` and returns the number of ranks attached so far (including us).
uint32_t registerRank(Segment& seg, const Layout& layout, int rank) {
  RankControl* rc = layout.rank(seg.base(), rank);
  if (rc->attached.exchange(1, std::memory_order_acq_rel) != 0) {
    SPYRECCL_THROW(spyrecclInvalidUsage,
                   "spyrecclCommInitRank: rank %d joined this communicator twice (pid %d was "
                   "first); every process must pass a distinct rank",
                   rank, rc->pid.load(std::memory_order_relaxed));
  }
  rc->pid.store(static_cast<int32_t>(::getpid()), std::memory_order_relaxed);
  rc->cpuMaskKnown = transport::ownCpuMask(rc->cpuMask, transport::kCpuMaskWords) ? 1 : 0;
  // The release of the count publishes the fields above to the ranks that see it complete.
  return seg.header()->attached.fetch_add(1, std::memory_order_acq_rel) + 1;
}

// How many CPUs the ranks may run on between them: the union of their affinity masks. A
// launcher that binds each rank to a core of its own (mpirun's default, Slurm's
// --cpu-bind, numactl per rank) leaves every process one CPU: counting this process's
// alone would make ranks that never share a CPU look oversubscribed, and their waits would
// yield at once instead of spinning (2 ranks on cores 0 and 1 of a 2-vCPU AMD EPYC machine: 8-byte
// all_reduce median 1.0 us and mean 11 us, against 0.4 and 1.1 unbound). Any rank whose
// mask is unknown: this process's own count, as before.
int cpusOfRanks(Segment& seg, const Layout& layout) {
  uint64_t all[transport::kCpuMaskWords] = {};
  for (int r = 0; r < layout.nranks(); ++r) {
    const RankControl* rc = layout.rank(seg.base(), r);
    if (rc->cpuMaskKnown == 0) return transport::usableCpus();
    for (int w = 0; w < transport::kCpuMaskWords; ++w) all[w] |= rc->cpuMask[w];
  }
  int n = 0;
  for (uint64_t w : all) n += __builtin_popcountll(w);
  return std::max(n, 1);
}

// A rank that attached and then died (or failed) will never complete the bootstrap:
// report it instead of waiting for the timeout.
void checkAttachedRanks(Segment& seg, const Layout& layout, int rank) {
  for (int r = 0; r < layout.nranks(); ++r) {
    RankControl* rc = layout.rank(seg.base(), r);
    if (r == rank || rc->attached.load(std::memory_order_acquire) == 0) continue;
    int pid = rc->pid.load(std::memory_order_relaxed);
    bool failed = rc->status.load(std::memory_order_acquire) != transport::kStatusActive;
    if (failed || (pid > 0 && transport::PeerWatch(pid).dead())) {
      SPYRECCL_THROW(spyrecclRemoteError,
                     "spyrecclCommInitRank: rank %d (pid %d) %s before every rank joined", r, pid,
                     failed ? "failed" : "died");
    }
  }
}

void waitForAll(Segment& seg, const Layout& layout, int rank, int64_t deadlineNs,
                int64_t timeoutMs) {
  int64_t backoffUs = 20;
  int64_t nextCheck = nowNs() + transport::kCheckIntervalNs;
  const uint32_t n = static_cast<uint32_t>(layout.nranks());
  while (seg.header()->attached.load(std::memory_order_acquire) < n) {
    if (nowNs() >= nextCheck) {
      checkAttachedRanks(seg, layout, rank);
      nextCheck = nowNs() + transport::kCheckIntervalNs;
    }
    if (nowNs() >= deadlineNs) {
      std::string missing;
      for (int r = 0; r < layout.nranks(); ++r) {
        if (layout.rank(seg.base(), r)->attached.load(std::memory_order_acquire) == 0) {
          missing += missing.empty() ? "" : ", ";
          missing += std::to_string(r);
        }
      }
      SPYRECCL_THROW(spyrecclTimeout,
                     "spyrecclCommInitRank: rank %d timed out after %lld ms waiting for rank(s) "
                     "%s of %d to join",
                     rank, static_cast<long long>(timeoutMs), missing.c_str(), layout.nranks());
    }
    timespec ts{0, static_cast<long>(backoffUs * 1000)};
    nanosleep(&ts, nullptr);
    backoffUs = std::min<int64_t>(backoffUs * 2, 1000);
  }
}

}  // namespace

std::unique_ptr<spyrecclComm> bootstrap(int nranks, const UniqueIdData& id, int rank,
                                        const CommConfig& config) {
  const Layout layout(nranks, config.chunkBytes, config.p2pChunkBytes);
  const std::string name = transport::segmentName(id.nonce);
  const int64_t deadlineNs = nowNs() + config.timeoutMs * kNsPerMs;
  std::string who = format("rank %d", rank);

  std::unique_ptr<Segment> seg;
  if (rank == 0) {
    seg = Segment::create(name, layout, id.nonce);
  } else {
    seg = Segment::attach(name, layout, id.nonce, deadlineNs, who);
  }
  bool registered = false;
  try {
    uint32_t attached = registerRank(*seg, layout, rank);
    registered = true;
    if (rank == 0) seg->publishReady();
    if (attached == static_cast<uint32_t>(nranks)) seg->unlink();
    waitForAll(*seg, layout, rank, deadlineNs, config.timeoutMs);
  } catch (...) {
    // Leave nothing behind in /dev/shm; ranks that have not attached yet time out.
    seg->unlink();
    if (registered) {
      // Lets the ranks still waiting for the others fail fast (checkAttachedRanks).
      layout.rank(seg->base(), rank)
          ->status.store(transport::kStatusFailed, std::memory_order_release);
    }
    throw;
  }

  std::vector<pid_t> pids(nranks);
  for (int r = 0; r < nranks; ++r) {
    pids[r] = layout.rank(seg->base(), r)->pid.load(std::memory_order_relaxed);
  }
  const int cpus = cpusOfRanks(*seg, layout);
  transport::noteJobCpus(cpus);
  size_t bytes = seg->size();
  auto comm =
      std::make_unique<spyrecclComm>(rank, nranks, config, std::move(seg), std::move(pids), cpus);
  // Collective: every rank of a new communicator runs it at the same point.
  comm->probeCma();
  SPYRECCL_LOG(kInfo, comm->who().c_str(),
               "communicator ready: segment %s, %.1f MiB, chunk %zu B, p2p chunk %zu B, %d ranks "
               "on %d CPUs, %s waits",
               name.c_str(), bytes / 1048576.0, config.chunkBytes, config.p2pChunkBytes, nranks,
               cpus, comm->spin().spin ? "spinning" : "yielding (ranks oversubscribe the CPUs)");
  return comm;
}

}  // namespace spyreccl::rendezvous
