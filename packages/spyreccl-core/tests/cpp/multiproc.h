// multiproc.h — a small forking multi-process test harness for spyreccl (header only).
//
// In the spirit of gloo's multiproc_test.h: a test body runs on N real processes (forked
// from the test runner), each of which joins one fresh communicator with
// spyrecclCommInitRank before the body starts. Ranks report failures back to the parent
// through a pipe; the parent enforces a deadline (killing every rank that is still running
// when it expires), reaps every child, and checks that no /dev/shm/spyreccl-* segment was
// left behind.
//
// It also contains the minimal test registry and runner used by every test_*.cc file of
// this directory (no GoogleTest dependency):
//
//   SPY_TEST(barrier_orders_ranks) {
//     spyreccl_test::RunOptions opts;
//     opts.nranks = 3;
//     spyreccl_test::runRanks(opts, [](spyreccl_test::RankContext& ctx) {
//       SPY_CHECK_OK(spyrecclBarrier(ctx.comm), ctx.comm);
//     });
//   }
//
// Parametrised tests register closures with spyreccl_test::registerTest() from a static
// initialiser. The runner (main in main.cc) takes --filter=PATTERN[,PATTERN...] (a
// substring, or a glob over the whole name when it contains '*'), --list and --seed=N; every test
// run draws a fresh seed (printed with every failure; set SPYRECCL_TEST_SEED or --seed to replay
// one).
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "spyreccl/spyreccl.h"

namespace spyreccl_test {

// ---------------------------------------------------------------------------------------
// Formatting and failure recording (one list per process: the runner's, or a rank's)
// ---------------------------------------------------------------------------------------

inline std::string vformat(const char* fmt, va_list ap) {
  va_list copy;
  va_copy(copy, ap);
  int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(&out[0], out.size() + 1, fmt, ap);
  return out;
}

inline std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  return s;
}

inline std::vector<std::string>& failures() {
  static std::vector<std::string> list;
  return list;
}

// Prefix of every message recorded in this process ("[rank 2] ", or "" in the runner).
inline std::string& failurePrefix() {
  static std::string prefix;
  return prefix;
}

inline void recordFailure(const char* file, int line, const std::string& what) {
  const char* base = std::strrchr(file, '/');
  failures().push_back(failurePrefix() + format("%s:%d: ", base ? base + 1 : file, line) + what);
}

// Thrown by the SPY_REQUIRE* macros to stop the current body after a failure that makes
// the rest of it meaningless (e.g. a collective failed, so the communicator is broken).
struct AbortBody {};

// Seed of the current test (fresh per run unless replayed).
inline uint64_t& currentSeed() {
  static uint64_t seed = 0;
  return seed;
}

}  // namespace spyreccl_test

// Records a failure (with printf-style context) and continues.
#define SPY_CHECK(cond, ...)                                                                \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      ::spyreccl_test::recordFailure(                                                       \
          __FILE__, __LINE__,                                                               \
          std::string("check failed: " #cond ": ") + ::spyreccl_test::format(__VA_ARGS__)); \
    }                                                                                       \
  } while (0)

// Records a failure and stops the body.
#define SPY_REQUIRE(cond, ...)            \
  do {                                    \
    if (!(cond)) {                        \
      SPY_CHECK(cond, __VA_ARGS__);       \
      throw ::spyreccl_test::AbortBody{}; \
    }                                     \
  } while (0)

// `call` must return `expected`; otherwise records the result and the communicator's last
// error message (`comm` may be NULL for calls without a communicator).
#define SPY_CHECK_RC(call, expected, comm)                                                         \
  ([&]() -> bool {                                                                                 \
    const spyrecclResult_t spy_rc_ = (call);                                                       \
    if (spy_rc_ == (expected)) return true;                                                        \
    ::spyreccl_test::recordFailure(                                                                \
        __FILE__, __LINE__,                                                                        \
        ::spyreccl_test::format("%s returned %s, expected %s; last error: \"%s\"", #call,          \
                                spyrecclGetErrorString(spy_rc_), spyrecclGetErrorString(expected), \
                                spyrecclGetLastError(comm)));                                      \
    return false;                                                                                  \
  }())

#define SPY_CHECK_OK(call, comm) SPY_CHECK_RC(call, spyrecclSuccess, comm)

// Like SPY_CHECK_OK, but a failure stops the body.
#define SPY_REQUIRE_OK(call, comm)                    \
  do {                                                \
    if (!SPY_CHECK_RC(call, spyrecclSuccess, comm)) { \
      throw ::spyreccl_test::AbortBody{};             \
    }                                                 \
  } while (0)

namespace spyreccl_test {

// ---------------------------------------------------------------------------------------
// Clocks
// ---------------------------------------------------------------------------------------

// CLOCK_MONOTONIC in ns: comparable across the processes of one machine.
inline int64_t monotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

inline void sleepMs(int64_t ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// ---------------------------------------------------------------------------------------
// /dev/shm bookkeeping
// ---------------------------------------------------------------------------------------

// The segment of a communicator is /dev/shm/spyreccl-<hex of the id's 16-byte nonce>, the
// nonce being bytes [8, 24) of the unique id (docs/design.md, "Unique id and bootstrap").
inline std::string segmentNameOf(const spyrecclUniqueId& id) {
  static const char kHex[] = "0123456789abcdef";
  std::string name = "spyreccl-";
  for (int i = 8; i < 24; ++i) {
    auto b = static_cast<unsigned char>(id.internal[i]);
    name.push_back(kHex[b >> 4]);
    name.push_back(kHex[b & 15]);
  }
  return name;
}

inline std::set<std::string> listShmSegments() {
  std::set<std::string> names;
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) {
      if (std::strncmp(e->d_name, "spyreccl-", 9) == 0) names.insert(e->d_name);
    }
    closedir(dir);
  }
  return names;
}

// True when some live process maps /dev/shm/<name> or holds it open. Other jobs on this
// machine create segments too; a segment that nobody holds any more is a leak for sure,
// whoever made it, while one that is held belongs to a communicator that is still
// bootstrapping (its name disappears once every rank attached).
inline bool segmentHeldByAnyProcess(const std::string& name) {
  const std::string path = "/dev/shm/" + name;
  DIR* proc = opendir("/proc");
  if (!proc) return true;  // cannot tell: do not accuse anyone
  bool held = false;
  while (!held) {
    dirent* e = readdir(proc);
    if (!e) break;
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const std::string pidDir = std::string("/proc/") + e->d_name;
    std::ifstream maps(pidDir + "/maps");
    std::string line;
    while (!held && std::getline(maps, line)) held = line.find(path) != std::string::npos;
    // Between shm_open and mmap the creator holds only a descriptor.
    if (DIR* fds = opendir((pidDir + "/fd").c_str())) {
      while (!held) {
        dirent* f = readdir(fds);
        if (!f) break;
        char target[512];
        const ssize_t n =
            readlink((pidDir + "/fd/" + f->d_name).c_str(), target, sizeof target - 1);
        if (n > 0) {
          target[n] = '\0';
          held = path == target;
        }
      }
      closedir(fds);
    }
  }
  closedir(proc);
  return held;
}

// A leaked segment: it exists and nobody holds it, still after a grace period that lets a
// bootstrapping communicator of another job finish (its name is unlinked then).
inline bool segmentLeaked(const std::string& name) {
  const std::string path = "/dev/shm/" + name;
  for (int attempt = 0; attempt < 20; ++attempt) {
    if (access(path.c_str(), F_OK) != 0) return false;
    if (segmentHeldByAnyProcess(name)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return access(path.c_str(), F_OK) == 0 && !segmentHeldByAnyProcess(name);
}

// ---------------------------------------------------------------------------------------
// Running a body on N forked ranks
// ---------------------------------------------------------------------------------------

struct RankContext {
  int rank = 0;
  int nranks = 0;
  spyrecclComm_t comm = nullptr;  // NULL when RunOptions::initComm is false
  spyrecclUniqueId id{};          // the id every rank was given
  spyrecclConfig_t config{};      // the config passed to spyrecclCommInitRank
  uint64_t seed = 0;              // the test's seed (same on every rank)
};

inline spyrecclConfig_t defaultTestConfig() {
  spyrecclConfig_t config = SPYRECCL_CONFIG_INITIALIZER;
  // Small staging areas, so that "larger than the staging area" stays a fast test.
  config.chunkBytes = 16 * 1024;
  config.p2pChunkBytes = 16 * 1024;
  config.timeoutMs = 30000;
  config.name = "cpp-test";
  return config;
}

struct RunOptions {
  int nranks = 2;
  // Every rank must have finished within this time, otherwise all are killed.
  int64_t deadlineMs = 30000;
  // Call spyrecclCommInitRank before the body (and spyrecclCommDestroy after it).
  bool initComm = true;
  spyrecclConfig_t config = defaultTestConfig();
  // Ranks that are expected to die (e.g. SIGKILL themselves): their exit status is ignored.
  std::set<int> mayDie;
  // A label for failure messages ("allreduce float32 ws3").
  std::string label;
};

using Body = std::function<void(RankContext&)>;

namespace detail {

// Runs in the child: never returns.
[[noreturn]] inline void rankMain(const RunOptions& opts, const Body& body, int rank,
                                  const spyrecclUniqueId& id, int writeFd) {
  // Die with the runner, so that a killed or crashed runner leaves no orphan ranks behind.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  failures().clear();
  failurePrefix() = format("[rank %d] ", rank);

  RankContext ctx;
  ctx.rank = rank;
  ctx.nranks = opts.nranks;
  ctx.id = id;
  ctx.config = opts.config;
  ctx.seed = currentSeed();
  try {
    if (opts.initComm) {
      SPY_REQUIRE_OK(spyrecclCommInitRank(&ctx.comm, opts.nranks, id, rank, &ctx.config), nullptr);
    }
    body(ctx);
  } catch (const AbortBody&) {
  } catch (const std::exception& e) {
    recordFailure(__FILE__, __LINE__, format("uncaught exception: %s", e.what()));
  } catch (...) {
    recordFailure(__FILE__, __LINE__, "uncaught non-standard exception");
  }
  if (ctx.comm != nullptr) {
    SPY_CHECK_OK(spyrecclCommDestroy(ctx.comm), nullptr);
  }

  // Messages travel as NUL-terminated strings; the runner reads until EOF.
  std::string payload;
  for (const std::string& f : failures()) {
    payload += f;
    payload.push_back('\0');
  }
  const char* p = payload.data();
  size_t left = payload.size();
  while (left > 0) {
    ssize_t n = ::write(writeFd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    p += n;
    left -= static_cast<size_t>(n);
  }
  ::close(writeFd);
  // _exit: no atexit handlers or static destructors of the runner's image in the child.
  ::_exit(failures().empty() ? 0 : 1);
}

inline std::string describeStatus(int status) {
  if (WIFEXITED(status)) return format("exited with status %d", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return format("was killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
  }
  return format("ended with wait status 0x%x", status);
}

}  // namespace detail

// The segment that test_harness.cc's leak self-test leaves behind on purpose is named
// "spyreccl-harness-selftest-<pid>-<seed>". Another test executable running at the same time
// (ctest -j) must not report it as its own leak; the self-test's own run (same pid) must.
inline bool foreignSelftestSegment(const std::string& name) {
  static const std::string prefix = "spyreccl-harness-selftest-";
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  return std::atoi(name.c_str() + prefix.size()) != static_cast<int>(::getpid());
}

// Forks opts.nranks processes running `body` and waits for them. Every problem (a failed
// check in a rank, a crash, the deadline, a leftover segment) is recorded as a failure of
// the calling test; returns true when there was none.
inline bool runRanks(const RunOptions& opts, const Body& body) {
  const size_t failuresBefore = failures().size();
  const std::string label = opts.label.empty() ? "" : "(" + opts.label + ") ";
  auto fail = [&](const std::string& msg) {
    failures().push_back(label + msg + format(" [seed %llu]", (unsigned long long)currentSeed()));
  };

  spyrecclUniqueId id;
  if (spyrecclGetUniqueId(&id) != spyrecclSuccess) {
    fail(format("spyrecclGetUniqueId failed: %s", spyrecclGetLastError(nullptr)));
    return false;
  }
  const std::set<std::string> shmBefore = listShmSegments();

  struct Child {
    pid_t pid = -1;
    int fd = -1;
    std::string data;
    bool reaped = false;
    int status = 0;
  };
  std::vector<Child> children(static_cast<size_t>(opts.nranks));
  std::fflush(nullptr);  // or buffered output would be written by every child again
  for (int r = 0; r < opts.nranks; ++r) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) {
      fail(format("pipe2 failed: %s", std::strerror(errno)));
      break;
    }
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      for (int q = 0; q < r; ++q) ::close(children[static_cast<size_t>(q)].fd);
      detail::rankMain(opts, body, r, id, fds[1]);
    }
    ::close(fds[1]);
    if (pid < 0) {
      ::close(fds[0]);
      fail(format("fork failed: %s", std::strerror(errno)));
      break;
    }
    children[static_cast<size_t>(r)].pid = pid;
    children[static_cast<size_t>(r)].fd = fds[0];
  }

  // Collect messages until every pipe is closed and every child reaped, or the deadline.
  const int64_t deadline = monotonicNs() + opts.deadlineMs * 1000000;
  bool timedOut = false;
  for (;;) {
    std::vector<pollfd> pfds;
    std::vector<size_t> owners;
    for (size_t i = 0; i < children.size(); ++i) {
      if (children[i].fd >= 0) {
        pfds.push_back(pollfd{children[i].fd, POLLIN, 0});
        owners.push_back(i);
      }
    }
    bool allReaped = true;
    for (Child& c : children) {
      if (c.pid > 0 && !c.reaped) {
        if (::waitpid(c.pid, &c.status, WNOHANG) == c.pid) {
          c.reaped = true;
        } else {
          allReaped = false;
        }
      }
    }
    if (pfds.empty() && allReaped) break;
    const int64_t now = monotonicNs();
    if (now >= deadline) {
      timedOut = true;
      break;
    }
    // Once all pipes are closed, only reaping is left: poll() on nothing just sleeps.
    const int waitMs = static_cast<int>(std::min<int64_t>((deadline - now) / 1000000 + 1, 20));
    int n = ::poll(pfds.data(), pfds.size(), waitMs);
    if (n < 0 && errno != EINTR) {
      fail(format("poll failed: %s", std::strerror(errno)));
      timedOut = true;
      break;
    }
    for (size_t k = 0; n > 0 && k < pfds.size(); ++k) {
      if (!(pfds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Child& c = children[owners[k]];
      char buf[4096];
      ssize_t got = ::read(c.fd, buf, sizeof buf);
      if (got > 0) {
        c.data.append(buf, static_cast<size_t>(got));
      } else if (got == 0 || errno != EINTR) {
        ::close(c.fd);
        c.fd = -1;
      }
    }
  }

  if (timedOut) {
    std::string running;
    for (size_t r = 0; r < children.size(); ++r) {
      if (children[r].pid > 0 && !children[r].reaped) running += format(" %zu", r);
    }
    fail(format("deadline of %lld ms exceeded; rank(s)%s still running were killed",
                (long long)opts.deadlineMs, running.c_str()));
  }
  for (size_t r = 0; r < children.size(); ++r) {
    Child& c = children[r];
    if (c.pid > 0 && !c.reaped) {
      ::kill(c.pid, SIGKILL);
      while (::waitpid(c.pid, &c.status, 0) < 0 && errno == EINTR) {
      }
      c.reaped = true;
    }
    if (c.fd >= 0) {
      // Whatever the rank managed to report before it was killed.
      char buf[4096];
      ssize_t got;
      while ((got = ::read(c.fd, buf, sizeof buf)) > 0) c.data.append(buf, size_t(got));
      ::close(c.fd);
      c.fd = -1;
    }
    for (size_t pos = 0; pos < c.data.size();) {
      size_t end = c.data.find('\0', pos);
      if (end == std::string::npos) end = c.data.size();
      fail(c.data.substr(pos, end - pos));
      pos = end + 1;
    }
    if (c.pid <= 0 || opts.mayDie.count(static_cast<int>(r))) continue;
    const bool clean = WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
    const bool reported = WIFEXITED(c.status) && WEXITSTATUS(c.status) == 1 && !c.data.empty();
    if (!clean && !reported && !(timedOut && WIFSIGNALED(c.status))) {
      fail(format("rank %zu %s", r, detail::describeStatus(c.status).c_str()));
    }
  }

  // Leak check. The communicator of this run is checked by its exact name; any other
  // segment that appeared meanwhile (a split's child communicator, or another job's) is a
  // leak only when no live process holds it any more.
  const std::string own = segmentNameOf(id);
  if (access(("/dev/shm/" + own).c_str(), F_OK) == 0) {
    fail("segment /dev/shm/" + own + " of this communicator was left behind");
    shm_unlink(("/" + own).c_str());  // keep later tests (and other users) clean
  }
  for (const std::string& name : listShmSegments()) {
    if (shmBefore.count(name) || name == own || foreignSelftestSegment(name)) continue;
    if (segmentLeaked(name)) {
      fail("segment /dev/shm/" + name + " appeared during the test and is held by no process");
    }
  }
  return failures().size() == failuresBefore;
}

// ---------------------------------------------------------------------------------------
// Registry and runner
// ---------------------------------------------------------------------------------------

struct TestCase {
  std::string name;
  std::function<void()> fn;
};

inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}

inline bool registerTest(std::string name, std::function<void()> fn) {
  registry().push_back(TestCase{std::move(name), std::move(fn)});
  return true;
}

inline uint64_t freshSeed() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

// Runs the registered tests whose name contains one of `filters` (all when empty).
inline int runTests(int argc, char** argv) {
  std::vector<std::string> filters;
  bool list = false;
  bool haveSeed = false;
  uint64_t seed = 0;
  if (const char* env = std::getenv("SPYRECCL_TEST_SEED")) {
    seed = std::strtoull(env, nullptr, 0);
    haveSeed = true;
  }
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--filter=", 0) == 0) {
      std::string spec = arg.substr(9);
      for (size_t pos = 0; pos <= spec.size();) {
        size_t end = spec.find(',', pos);
        if (end == std::string::npos) end = spec.size();
        if (end > pos) filters.push_back(spec.substr(pos, end - pos));
        pos = end + 1;
      }
    } else if (arg == "--list") {
      list = true;
    } else if (arg.rfind("--seed=", 0) == 0) {
      seed = std::strtoull(arg.c_str() + 7, nullptr, 0);
      haveSeed = true;
    } else {
      std::fprintf(stderr, "usage: %s [--filter=PATTERN[,PATTERN...]] [--list] [--seed=N]\n",
                   argv[0]);
      return 2;
    }
  }
  // A filter with a '*' is a glob over the whole name, otherwise a substring.
  auto selected = [&](const std::string& name) {
    if (filters.empty()) return true;
    for (const std::string& f : filters) {
      if (f.find('*') != std::string::npos ? fnmatch(f.c_str(), name.c_str(), 0) == 0
                                           : name.find(f) != std::string::npos) {
        return true;
      }
    }
    return false;
  };

  int run = 0;
  std::vector<std::string> failed;
  for (const TestCase& t : registry()) {
    if (!selected(t.name)) continue;
    if (list) {
      std::printf("%s\n", t.name.c_str());
      continue;
    }
    ++run;
    currentSeed() = haveSeed ? seed : freshSeed();
    failures().clear();
    std::printf("[ RUN      ] %s (seed %llu)\n", t.name.c_str(), (unsigned long long)currentSeed());
    std::fflush(stdout);
    const int64_t start = monotonicNs();
    try {
      t.fn();
    } catch (const AbortBody&) {
    } catch (const std::exception& e) {
      failures().push_back(format("uncaught exception in the runner: %s", e.what()));
    }
    const double ms = double(monotonicNs() - start) / 1e6;
    if (failures().empty()) {
      std::printf("[       OK ] %s (%.0f ms)\n", t.name.c_str(), ms);
    } else {
      for (const std::string& f : failures()) std::printf("    %s\n", f.c_str());
      std::printf("[  FAILED  ] %s (%.0f ms)\n", t.name.c_str(), ms);
      failed.push_back(t.name);
    }
    std::fflush(stdout);
  }
  if (list) return 0;
  if (run == 0) {
    std::printf("no test matches the filter\n");
    return 1;
  }
  std::printf("%d test(s) run, %zu failed\n", run, failed.size());
  for (const std::string& name : failed) std::printf("  FAILED: %s\n", name.c_str());
  return failed.empty() ? 0 : 1;
}

}  // namespace spyreccl_test

#define SPY_TEST_CONCAT_(a, b) a##b
#define SPY_TEST_CONCAT(a, b) SPY_TEST_CONCAT_(a, b)

// Defines and registers a test named `name` (runs in the runner process; use runRanks).
#define SPY_TEST(name)                                   \
  static void name();                                    \
  static const bool SPY_TEST_CONCAT(name, _registered) = \
      ::spyreccl_test::registerTest(#name, name);        \
  static void name()
