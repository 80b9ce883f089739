#include "memory/arena.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>

#include "common/env.h"
#include "common/log.h"

namespace spyreccl::memory {
namespace {

constexpr size_t kGranule = 4096;
// Freed blocks stay resident for reuse, up to a budget of freed memory; beyond it freed
// pages go back to the system (punched out of the file), and spyrecclMemTrim returns all
// of them. So the process's footprint is its live memory plus at most the budget, like a
// caching device allocator's until its cache is emptied. Why resident: re-touching punched
// pages of a shared file costs a page fault and a zeroed page per 4 KiB, about 2.8 us each
// on a 2-vCPU machine: a 64 MiB tensor allocated and filled took 46 ms against 3.9 ms for
// the same fill of resident memory, which a training loop that frees and reallocates its
// activations, or a collective that allocates its output, would pay on every step. The
// budget used to be 32 MiB with every block of 32 MiB or more punched (glibc's largest
// mmap threshold), which put exactly the large tensors on that slow path.
constexpr const char* kRetainEnv = "SPYRECCL_ARENA_RETAIN_BYTES";
constexpr size_t kDefaultRetainCap = size_t{1} << 30;

size_t reserveBytes() {
  // Sparse: only touched pages cost memory. A process cannot use more than the machine
  // has, so reserving the physical memory size never limits a real workload.
  long pages = sysconf(_SC_PHYS_PAGES);
  long page = sysconf(_SC_PAGESIZE);
  size_t phys = pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page)
                                      : size_t{16} << 30;
  return (phys + kGranule - 1) / kGranule * kGranule;
}

// The budget of freed memory kept resident: SPYRECCL_ARENA_RETAIN_BYTES, else an eighth of
// physical memory, at most 1 GiB. Read once, when the arena is created; a malformed value
// is reported and the default used (the arena backs every large tensor of the emulated
// device: failing here would only move them to slower, unshareable memory).
size_t retainBudgetFor(size_t physical) {
  const size_t fallback = std::min(kDefaultRetainCap, physical / 8);
  try {
    return envBytes(kRetainEnv, fallback);
  } catch (const std::exception& e) {
    SPYRECCL_LOG(kWarn, "arena", "%s; keeping up to %zu freed bytes resident", e.what(), fallback);
    return fallback;
  }
}

int memfdCreate(const char* name) {
#ifdef SYS_memfd_create
  return static_cast<int>(::syscall(SYS_memfd_create, name, MFD_CLOEXEC));
#else
  errno = ENOSYS;
  return -1;
#endif
}

}  // namespace

struct Arena::Impl {
  std::mutex mu;
  std::map<size_t, size_t> freeByOffset;       // offset -> length
  std::multimap<size_t, size_t> freeByLength;  // length -> offset (best fit)
  std::unordered_map<size_t, size_t> live;     // offset -> length
  size_t inUse = 0;
  // End of the highest block ever handed out: pages above it were never touched.
  size_t highWater = 0;
  // Estimate of freed bytes whose pages are still resident (see kRetainBytes): grows when
  // a block is freed without punching, shrinks when an allocation reuses space below the
  // high-water mark (best fit hands out recently freed blocks first).
  size_t retained = 0;

  void addFree(size_t off, size_t len) {
    freeByOffset.emplace(off, len);
    freeByLength.emplace(len, off);
  }
  void removeFree(std::map<size_t, size_t>::iterator it) {
    auto range = freeByLength.equal_range(it->second);
    for (auto j = range.first; j != range.second; ++j) {
      if (j->second == it->first) {
        freeByLength.erase(j);
        break;
      }
    }
    freeByOffset.erase(it);
  }
};

Arena* Arena::instance() {
  static Arena* arena = []() -> Arena* {
    int fd = memfdCreate("spyreccl-arena");
    if (fd < 0) return nullptr;
    const size_t size = reserveBytes();
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      ::close(fd);
      return nullptr;
    }
    // MAP_NORESERVE: the reservation is address space, not a commitment of memory.
    void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (base == MAP_FAILED) {
      ::close(fd);
      return nullptr;
    }
    auto* created = new Arena(fd, static_cast<uint8_t*>(base), size);
    created->retainBudget_ = retainBudgetFor(size);
    ::pthread_atfork(&Arena::lockForFork, &Arena::unlockAfterFork, &Arena::privatizeInChild);
    return created;
  }();
  existingArena().store(arena, std::memory_order_release);
  return arena;
}

std::atomic<Arena*>& Arena::existingArena() {
  static std::atomic<Arena*> a{nullptr};
  return a;
}

Arena* Arena::existing() { return existingArena().load(std::memory_order_acquire); }

Arena::Arena(int fd, uint8_t* base, size_t size)
    : fd_(fd), base_(base), size_(size), impl_(new Impl) {
  impl_->addFree(0, size);
}

void* Arena::allocate(size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes > size_) return nullptr;
  const size_t len = (bytes + kGranule - 1) / kGranule * kGranule;
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto fit = impl_->freeByLength.lower_bound(len);
  if (fit == impl_->freeByLength.end()) return nullptr;
  const size_t off = fit->second;
  const size_t have = fit->first;
  impl_->removeFree(impl_->freeByOffset.find(off));
  if (have > len) impl_->addFree(off + len, have - len);
  impl_->live.emplace(off, len);
  impl_->inUse += len;
  if (off < impl_->highWater) {
    impl_->retained -= std::min(impl_->retained, std::min(len, impl_->highWater - off));
  }
  impl_->highWater = std::max(impl_->highWater, off + len);
  return base_ + off;
}

bool Arena::release(void* p) {
  const int64_t at = offsetOf(p, 0);
  if (at < 0) return false;
  size_t off = static_cast<size_t>(at);
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->live.find(off);
  if (it == impl_->live.end()) return false;
  size_t len = it->second;
  impl_->live.erase(it);
  impl_->inUse -= len;
  // Punching frees the file's pages, which a forked child (private mapping of the same
  // file) must never do: they are its parent's.
  if (impl_->retained + len > retainBudget_ && shareable_) {
    punch(off, len);
  } else {
    impl_->retained += len;
  }
  // Coalesce with the free neighbours on both sides.
  auto next = impl_->freeByOffset.lower_bound(off);
  if (next != impl_->freeByOffset.end() && next->first == off + len) {
    len += next->second;
    impl_->removeFree(next);
  }
  auto after = impl_->freeByOffset.lower_bound(off);
  if (after != impl_->freeByOffset.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == off) {
      off = prev->first;
      len += prev->second;
      impl_->removeFree(prev);
    }
  }
  impl_->addFree(off, len);
  return true;
}

void Arena::lockForFork() {
  if (Arena* a = existing()) a->impl_->mu.lock();
}

void Arena::unlockAfterFork() {
  if (Arena* a = existing()) a->impl_->mu.unlock();
}

void Arena::privatizeInChild() {
  Arena* a = existing();
  if (a == nullptr) return;
  // Only this thread exists in the child; the mutex was taken in the prepare handler.
  // Remapping the same file MAP_PRIVATE at the same address makes every page copy-on-write
  // for the child: O(1) at fork (no copy of the live blocks, which may be a whole model),
  // and nothing the child writes reaches the parent. The child's arena is no longer
  // shareable: its blocks are not what the file holds, so peers must never map it.
  void* at = ::mmap(a->base_, a->size_, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_NORESERVE | MAP_FIXED, a->fd_, 0);
  if (at == MAP_FAILED) {
    // Without a private mapping the child would write into its parent's memory: refuse to
    // continue rather than corrupt data silently.
    static const char msg[] = "spyreccl: cannot give the forked child a private memory arena\n";
    (void)!::write(2, msg, sizeof(msg) - 1);
    ::_exit(127);
  }
  a->shareable_ = false;
  a->impl_->mu.unlock();
}

void Arena::punch(size_t off, size_t len) const {
  // Best effort: if the kernel refuses, the pages merely stay resident.
  (void)::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(off),
                    static_cast<off_t>(len));
}

size_t Arena::trim() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!shareable_) return 0;  // a forked child's pages are its parent's (see release)
  size_t punched = 0;
  for (const auto& [off, len] : impl_->freeByOffset) {
    if (off >= impl_->highWater) break;  // above it nothing was ever touched
    const size_t end = std::min(off + len, impl_->highWater);
    punch(off, end - off);
    punched += end - off;
  }
  impl_->retained = 0;
  return punched;
}

size_t Arena::bytesInUse() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->inUse;
}

const uint8_t* mapPeerArena(pid_t pid, int fd, size_t* bytes, int* err) {
  int local = -1;
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (pidfd >= 0) {
    local = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, fd, 0));
    *err = errno;
    ::close(pidfd);
  } else {
    *err = errno;
  }
#endif
  if (local < 0) {
    // Kernels before 5.6 have no pidfd_getfd; /proc gives the same file under the same
    // ptrace access check.
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/%d/fd/%d", static_cast<int>(pid), fd);
    local = ::open(path, O_RDONLY | O_CLOEXEC);
    if (local < 0) {
      *err = errno;
      return nullptr;
    }
  }
  struct stat st{};
  if (::fstat(local, &st) != 0 || st.st_size <= 0) {
    *err = errno ? errno : EINVAL;
    ::close(local);
    return nullptr;
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED | MAP_NORESERVE,
                   local, 0);
  *err = errno;
  ::close(local);
  if (p == MAP_FAILED) return nullptr;
  *bytes = static_cast<size_t>(st.st_size);
  *err = 0;
  return static_cast<const uint8_t*>(p);
}

}  // namespace spyreccl::memory
