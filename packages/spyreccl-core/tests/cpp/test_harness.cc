// Self-tests of the harness (multiproc.h): a hung rank, a crashed rank, a failed check in a
// rank and a leaked /dev/shm segment must each fail the run that contains them. Each test
// runs such a run, takes the failures it produced out of the list and checks them.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "multiproc.h"

namespace {

using namespace spyreccl_test;

// Runs `body` and returns the failures it caused (removing them from the test's list).
std::vector<std::string> failuresOf(RunOptions opts, const Body& body) {
  const size_t before = failures().size();
  const bool passed = runRanks(opts, body);
  std::vector<std::string> caused(failures().begin() + long(before), failures().end());
  failures().resize(before);
  SPY_CHECK(passed == caused.empty(), "runRanks returned %d with %zu failure(s)", int(passed),
            caused.size());
  return caused;
}

bool anyContains(const std::vector<std::string>& messages, const std::string& needle) {
  for (const std::string& m : messages) {
    if (m.find(needle) != std::string::npos) return true;
  }
  return false;
}

std::string joined(const std::vector<std::string>& messages) {
  std::string all;
  for (const std::string& m : messages) all += "\n      " + m;
  return all;
}

SPY_TEST(harness_reports_rank_failures) {
  RunOptions opts;
  opts.nranks = 3;
  auto caused = failuresOf(
      opts, [](RankContext& ctx) { SPY_CHECK(ctx.rank != 2, "rank %d disagrees", ctx.rank); });
  SPY_CHECK(caused.size() == 1 && anyContains(caused, "[rank 2]") &&
                anyContains(caused, "rank 2 disagrees"),
            "expected one failure from rank 2, got:%s", joined(caused).c_str());
}

SPY_TEST(harness_kills_hung_ranks_at_the_deadline) {
  RunOptions opts;
  opts.nranks = 2;
  opts.deadlineMs = 500;
  const int64_t start = monotonicNs();
  auto caused = failuresOf(opts, [](RankContext& ctx) {
    if (ctx.rank == 1) sleepMs(60000);
  });
  const int64_t ms = (monotonicNs() - start) / 1000000;
  SPY_CHECK(anyContains(caused, "deadline") && anyContains(caused, "1 still running"),
            "expected a deadline failure naming rank 1, got:%s", joined(caused).c_str());
  SPY_CHECK(ms < 5000, "the hung rank was killed only after %lld ms", (long long)ms);
}

SPY_TEST(harness_reports_crashed_ranks) {
  RunOptions opts;
  opts.nranks = 2;
  // SIGABRT (what a failed assertion raises): sanitizers leave it alone, while ASan turns
  // a SIGSEGV into its own report and a normal exit.
  auto caused = failuresOf(opts, [](RankContext& ctx) {
    if (ctx.rank == 0) ::raise(SIGABRT);
  });
  SPY_CHECK(anyContains(caused, "rank 0 was killed by signal 6"),
            "expected a crash report for rank 0, got:%s", joined(caused).c_str());

  // ... unless the rank was declared to die.
  opts.mayDie = {0};
  opts.initComm = false;
  caused = failuresOf(opts, [](RankContext& ctx) {
    if (ctx.rank == 0) ::raise(SIGKILL);
  });
  SPY_CHECK(caused.empty(), "a rank allowed to die was reported:%s", joined(caused).c_str());
}

SPY_TEST(harness_detects_leaked_segments) {
  // A rank creates a spyreccl-named segment and exits without unlinking it.
  const std::string name =
      format("spyreccl-harness-selftest-%d-%llu", int(getpid()), (unsigned long long)currentSeed());
  RunOptions opts;
  opts.nranks = 2;
  opts.initComm = false;
  auto caused = failuresOf(opts, [name](RankContext& ctx) {
    if (ctx.rank != 0) return;
    const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    SPY_REQUIRE(fd >= 0, "shm_open failed: %s", std::strerror(errno));
    ::close(fd);
  });
  shm_unlink(("/" + name).c_str());
  SPY_CHECK(anyContains(caused, name), "expected the leaked segment %s to be reported, got:%s",
            name.c_str(), joined(caused).c_str());
}

}  // namespace
