#include "device_memory.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

namespace spyreccl::device {

namespace detail {
DiscreteWindow g_window;
}  // namespace detail

namespace {

constexpr const char* kMemoryEnv = "SPYRECCL_SPYRE_MEMORY";
constexpr std::size_t kPageBytes = 4096;
constexpr std::size_t kSmallGranule = 64;  // kAllocationAlignment of allocator.h
// Freed large blocks whose pages stay resident for reuse, as the core's arena keeps them
// (its default budget): touching pages that went back to the system costs a page fault and
// a zeroed page per 4 KiB.
constexpr std::size_t kRetainCap = std::size_t{1} << 30;

std::size_t round_up(std::size_t n, std::size_t granule) {
  return (n + granule - 1) / granule * granule;
}

std::size_t physical_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page)
                               : std::size_t{16} << 30;
}

MemoryMode parse_mode() {
  const char* raw = std::getenv(kMemoryEnv);
  if (raw == nullptr) {
    return MemoryMode::kHost;
  }
  std::string value;
  for (const char* c = raw; *c != '\0'; ++c) {
    if (std::isspace(static_cast<unsigned char>(*c)) == 0) {
      value += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
    }
  }
  // Unknown values fall back to host memory: the Python layer warns (never failing
  // `import torch`, which loads this library).
  return value == "discrete" ? MemoryMode::kDiscrete : MemoryMode::kHost;
}

// Best fit over one part of the window, in units of `granule` bytes (offsets from the part's
// start). The small part never returns pages on free (its blocks share pages); the large
// part punches freed blocks beyond the retain budget.
class Pool {
 public:
  Pool(std::size_t base, std::size_t size, std::size_t granule, bool punches)
      : base_(base), size_(size), granule_(granule), punches_(punches) {
    add_free(0, size);
  }

  // Offset in the window, or npos.
  std::size_t allocate(std::size_t nbytes) {
    const std::size_t len = round_up(nbytes, granule_);
    std::lock_guard<std::mutex> lock(mutex_);
    auto fit = free_by_length_.lower_bound(len);
    if (fit == free_by_length_.end()) {
      return npos;
    }
    const std::size_t off = fit->second;
    const std::size_t have = fit->first;
    remove_free(free_by_offset_.find(off));
    if (have > len) {
      add_free(off + len, have - len);
    }
    live_.emplace(off, len);
    if (off < high_water_) {
      retained_ -= std::min(retained_, std::min(len, high_water_ - off));
    }
    high_water_ = std::max(high_water_, off + len);
    return base_ + off;
  }

  bool owns(std::size_t window_offset) const { return window_offset - base_ < size_; }

  void release(std::size_t window_offset, int fd, std::size_t retain_budget) {
    std::size_t off = window_offset - base_;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(off);
    TORCH_INTERNAL_ASSERT(it != live_.end(), "spyre discrete memory: freeing an unknown block");
    std::size_t len = it->second;
    live_.erase(it);
    if (punches_ && shareable_ && retained_ + len > retain_budget) {
      punch(fd, base_ + off, len);
    } else {
      retained_ += len;
    }
    auto next = free_by_offset_.lower_bound(off);
    if (next != free_by_offset_.end() && next->first == off + len) {
      len += next->second;
      remove_free(next);
    }
    auto after = free_by_offset_.lower_bound(off);
    if (after != free_by_offset_.begin()) {
      auto prev = std::prev(after);
      if (prev->first + prev->second == off) {
        off = prev->first;
        len += prev->second;
        remove_free(prev);
      }
    }
    add_free(off, len);
  }

  std::size_t trim(int fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!shareable_) {
      return 0;  // a forked child's pages are its parent's
    }
    std::size_t punched = 0;
    for (const auto& [off, len] : free_by_offset_) {
      if (off >= high_water_) {
        break;  // never touched above it
      }
      punched += punch(fd, base_ + off, std::min(off + len, high_water_) - off);
    }
    retained_ = 0;
    return punched;
  }

  std::mutex& mutex() { return mutex_; }
  void set_private() { shareable_ = false; }

  static constexpr std::size_t npos = ~std::size_t{0};

 private:
  // Only whole pages inside [offset, offset + len): punching a partial page zeroes the part
  // of it that a live neighbour may hold.
  static std::size_t punch(int fd, std::size_t offset, std::size_t len) {
    const std::size_t begin = round_up(offset, kPageBytes);
    const std::size_t end = (offset + len) / kPageBytes * kPageBytes;
    if (end <= begin) {
      return 0;
    }
    // Best effort: if the kernel refuses, the pages merely stay resident.
    (void)::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(begin),
                      static_cast<off_t>(end - begin));
    return end - begin;
  }

  void add_free(std::size_t off, std::size_t len) {
    free_by_offset_.emplace(off, len);
    free_by_length_.emplace(len, off);
  }

  void remove_free(std::map<std::size_t, std::size_t>::iterator it) {
    auto range = free_by_length_.equal_range(it->second);
    for (auto j = range.first; j != range.second; ++j) {
      if (j->second == it->first) {
        free_by_length_.erase(j);
        break;
      }
    }
    free_by_offset_.erase(it);
  }

  const std::size_t base_;
  const std::size_t size_;
  const std::size_t granule_;
  const bool punches_;
  std::mutex mutex_;
  std::map<std::size_t, std::size_t> free_by_offset_;       // offset -> length
  std::multimap<std::size_t, std::size_t> free_by_length_;  // length -> offset
  std::unordered_map<std::size_t, std::size_t> live_;       // offset -> length
  std::size_t high_water_ = 0;
  std::size_t retained_ = 0;
  bool shareable_ = true;
};

// One memfd mapped twice: [device_base, +size) with no access, [host_base, +size) read-write.
// The first half of the window serves small blocks, the second half page-aligned large ones.
class DiscreteMemory {
 public:
  DiscreteMemory(int fd, std::size_t half)
      : fd_(fd),
        retain_budget_(std::min(kRetainCap, half / 8)),
        small_(0, half, kSmallGranule, /*punches=*/false),
        large_(half, half, kPageBytes, /*punches=*/true) {}

  void* allocate(std::size_t nbytes) {
    Pool& pool = nbytes >= kDiscretePageMinBytes ? large_ : small_;
    const std::size_t offset = pool.allocate(nbytes);
    return offset == Pool::npos ? nullptr
                                : reinterpret_cast<void*>(detail::g_window.device_base + offset);
  }

  void release(void* device_ptr) {
    const std::size_t offset =
        reinterpret_cast<std::uintptr_t>(device_ptr) - detail::g_window.device_base;
    (large_.owns(offset) ? large_ : small_).release(offset, fd_, retain_budget_);
  }

  std::size_t trim() { return small_.trim(fd_) + large_.trim(fd_); }

  void lock_for_fork() {
    small_.mutex().lock();
    large_.mutex().lock();
  }

  void unlock_after_fork() {
    large_.mutex().unlock();
    small_.mutex().unlock();
  }

  void privatize_in_child() {
    // As the core's arena does for its blocks: the child's accessible twin becomes a private
    // copy-on-write mapping of the same file at the same address (O(1) at fork), so nothing
    // a forked child writes reaches its parent's tensors and it never punches its pages.
    const detail::DiscreteWindow& w = detail::g_window;
    void* at = ::mmap(reinterpret_cast<void*>(w.host_base), w.size, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_NORESERVE | MAP_FIXED, fd_, 0);
    if (at == MAP_FAILED) {
      static const char msg[] =
          "spyreccl: cannot give the forked child a private copy of the spyre device memory\n";
      (void)!::write(2, msg, sizeof(msg) - 1);
      ::_exit(127);
    }
    small_.set_private();
    large_.set_private();
    unlock_after_fork();
  }

 private:
  int fd_;
  std::size_t retain_budget_;
  Pool small_;
  Pool large_;
};

DiscreteMemory* g_memory = nullptr;
std::once_flag g_memory_once;

void lock_for_fork() { g_memory->lock_for_fork(); }
void unlock_after_fork() { g_memory->unlock_after_fork(); }
void privatize_in_child() { g_memory->privatize_in_child(); }

[[noreturn]] void fail(const char* what, int err) {
  TORCH_CHECK(false, kMemoryEnv, "=discrete: cannot set up the emulated spyre device memory (",
              what, ": ", std::strerror(err), "); unset ", kMemoryEnv,
              " or set it to 'host' to use host memory");
}

void create_discrete_memory() {
  // Sparse: only touched pages cost memory. Each half may hold as much as the machine has.
  const std::size_t half = round_up(physical_bytes(), std::size_t{2} << 20);
  const std::size_t size = 2 * half;
  const int fd =
      static_cast<int>(::syscall(SYS_memfd_create, "spyreccl-spyre-device", MFD_CLOEXEC));
  if (fd < 0) {
    fail("memfd_create", errno);
  }
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int err = errno;
    ::close(fd);
    fail("ftruncate", err);
  }
  // MAP_NORESERVE: address space, not a commitment of memory.
  void* host = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (host == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    fail("mmap of the accessible mapping", err);
  }
  // The addresses handed out as data_ptr(): the same pages, no access at all.
  void* device = ::mmap(nullptr, size, PROT_NONE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (device == MAP_FAILED) {
    const int err = errno;
    ::munmap(host, size);
    ::close(fd);
    fail("mmap of the device mapping", err);
  }
  g_memory = new DiscreteMemory(fd, half);  // never freed: storages outlive static destruction
  detail::g_window.host_base = reinterpret_cast<std::uintptr_t>(host);
  detail::g_window.device_base = reinterpret_cast<std::uintptr_t>(device);
  detail::g_window.size = size;
  ::pthread_atfork(&lock_for_fork, &unlock_after_fork, &privatize_in_child);
}

}  // namespace

MemoryMode memory_mode() {
  static const MemoryMode mode = parse_mode();
  return mode;
}

const char* memory_mode_name(MemoryMode mode) {
  return mode == MemoryMode::kDiscrete ? "discrete" : "host";
}

void ensure_discrete_memory() {
  if (memory_mode() == MemoryMode::kDiscrete) {
    std::call_once(g_memory_once, &create_discrete_memory);
  }
}

void* discrete_allocate(std::size_t nbytes) {
  ensure_discrete_memory();
  return g_memory->allocate(nbytes);
}

void discrete_free(void* device_ptr) { g_memory->release(device_ptr); }

std::size_t discrete_trim() { return g_memory != nullptr ? g_memory->trim() : 0; }

}  // namespace spyreccl::device
