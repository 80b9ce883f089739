#include "transport/liveness.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace spyreccl::transport {
namespace {

#ifndef SYS_pidfd_open
constexpr long kSysPidfdOpen = 434;  // same number on every Linux architecture
#else
constexpr long kSysPidfdOpen = SYS_pidfd_open;
#endif

// State letter from /proc/<pid>/stat, or 0 when unreadable.
char procState(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[512];
  ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  // "pid (comm) S ..." -- comm may contain spaces and parentheses: use the last ')'.
  const char* close = std::strrchr(buf, ')');
  if (close == nullptr || close[1] != ' ') return 0;
  return close[2];
}

}  // namespace

PeerWatch::PeerWatch(pid_t pid) : pid_(pid) {
  long fd = ::syscall(kSysPidfdOpen, pid, 0);
  pidfd_ = fd >= 0 ? static_cast<int>(fd) : -1;
  if (pidfd_ >= 0) ::fcntl(pidfd_, F_SETFD, FD_CLOEXEC);
}

PeerWatch::~PeerWatch() {
  if (pidfd_ >= 0) ::close(pidfd_);
}

PeerWatch& PeerWatch::operator=(PeerWatch&& o) noexcept {
  if (this != &o) {
    if (pidfd_ >= 0) ::close(pidfd_);
    pid_ = o.pid_;
    pidfd_ = o.pidfd_;
    o.pidfd_ = -1;
  }
  return *this;
}

bool PeerWatch::dead() const {
  if (pid_ <= 0) return false;
  if (pidfd_ >= 0) {
    pollfd p{pidfd_, POLLIN, 0};
    int rc = ::poll(&p, 1, 0);
    return rc > 0 && (p.revents & (POLLIN | POLLHUP)) != 0;
  }
  if (::kill(pid_, 0) != 0 && errno == ESRCH) return true;
  char st = procState(pid_);
  return st == 'Z' || st == 'X';
}

}  // namespace spyreccl::transport
