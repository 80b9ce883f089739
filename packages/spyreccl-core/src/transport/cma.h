// Cross-memory attach (CMA): one copy straight out of a peer process's pages.
//
// process_vm_readv(2) copies from another process's address space into ours without a
// shared mapping: the kernel pins the peer's pages and copies them, so a buffer that was
// never shared (an ordinary numpy array, a malloc'ed tensor) crosses between processes
// once instead of twice (staged: sender -> segment -> receiver). Open MPI's shared-memory
// transport uses the same mechanism for its single-copy path.
//
// It needs the permission to ptrace-read the peer (same user, or CAP_SYS_PTRACE; Yama's
// ptrace_scope; no seccomp filter denying the call; both processes in pid namespaces where
// the peer's pid is visible). Communicators find out at init whether every pair of ranks
// may use it (Communicator::probeCma) and fall back to staging otherwise.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace spyreccl::transport {

// Copies `len` bytes at address `remote` of process `pid` into `dst`. Returns 0, or the
// errno of the failed call (ESRCH: the process is gone; EFAULT: the range is not mapped
// there; EPERM: not permitted). Partial transfers are continued; never blocks on the peer.
int cmaRead(pid_t pid, void* dst, uint64_t remote, size_t len);

// Whether this rank's CPUs are contended: more runnable tasks than CPUs it may use, now or
// over the last minute (/proc/loadavg, read at most every 20 ms; the ranks of a busy
// collective count themselves). The staged paths need every rank running at once, step
// after step; when other work takes the cores they stall at every step, while a single
// copy needs only the reading rank. Measured on a shared 2-vCPU AMD EPYC machine: staged
// send/recv of 2 MiB 60-80 us when quiet, 0.8-1.6 ms when loaded, where the single copy
// took 0.14 ms quiet and 0.9 ms loaded (docs/notes/core-single-copy.md, "Single copy for any
// memory").
bool cpusContended();

// Lets any process of this user ptrace-attach (and so process_vm_readv) this one when
// Yama's ptrace_scope is 1 (restricted to descendants), which would otherwise refuse every
// rank that is not its peer's ancestor. Open MPI does the same. No-op without Yama or
// under other scopes (0 allows it anyway, 2 and 3 cannot be relaxed by the process).
void allowPeerAccess();

}  // namespace spyreccl::transport
