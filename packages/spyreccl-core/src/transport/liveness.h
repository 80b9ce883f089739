// Peer liveness: has the process behind a rank died?
//
// Preferred: a pidfd opened at init (pidfd_open, Linux >= 5.3) becomes readable when the
// process exits, is immune to pid reuse and needs no /proc. Fallback: kill(pid, 0) plus the
// state letter in /proc/<pid>/stat ('Z' zombie, 'X' dead), since a killed child of a
// still-running parent stays a zombie and kill() alone would call it alive.
#pragma once

#include <sys/types.h>

namespace spyreccl::transport {

class PeerWatch {
 public:
  PeerWatch() = default;
  explicit PeerWatch(pid_t pid);
  ~PeerWatch();
  PeerWatch(PeerWatch&& o) noexcept : pid_(o.pid_), pidfd_(o.pidfd_) { o.pidfd_ = -1; }
  PeerWatch& operator=(PeerWatch&& o) noexcept;
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  pid_t pid() const { return pid_; }
  // True once the process is known to have exited. Never blocks.
  bool dead() const;

 private:
  pid_t pid_ = -1;
  int pidfd_ = -1;
};

}  // namespace spyreccl::transport
