#include "transport/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"

namespace spyreccl::transport {
namespace {

// Closes a descriptor on scope exit (the mapping keeps the shared memory alive).
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

void sleepUs(int64_t us) {
  timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>((us % 1000000) * 1000)};
  nanosleep(&ts, nullptr);
}

}  // namespace

std::string segmentName(const uint8_t nonce[16]) {
  static const char kHex[] = "0123456789abcdef";
  std::string name = "/spyreccl-";
  for (int i = 0; i < 16; ++i) {
    name.push_back(kHex[nonce[i] >> 4]);
    name.push_back(kHex[nonce[i] & 15]);
  }
  return name;
}

std::unique_ptr<Segment> Segment::create(const std::string& name, const Layout& layout,
                                         const uint8_t nonce[16]) {
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW, 0600);
  if (fd < 0) {
    int err = errno;
    if (err == EEXIST) {
      SPYRECCL_THROW(spyrecclInvalidUsage,
                     "shared memory segment %s already exists: the unique id was already used "
                     "by another spyrecclCommInitRank (ids are valid for one communicator only)",
                     name.c_str());
    }
    throwSystemError(err, __FILE__, __LINE__, "shm_open(" + name + ", O_CREAT|O_EXCL)");
  }
  FdCloser closer{fd};
  // From here on a failure must not leave the name behind.
  try {
    // fchmod in case a restrictive umask is not the issue but a permissive one is: the
    // mode must be exactly 0600 for the attach-side check.
    SPYRECCL_SYSCHECK(::fchmod(fd, 0600), "fchmod(" + name + ")");
    SPYRECCL_SYSCHECK(::ftruncate(fd, static_cast<off_t>(layout.totalBytes())),
                      format("ftruncate(%s, %zu)", name.c_str(), layout.totalBytes()));
    void* p = ::mmap(nullptr, layout.totalBytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      throwSystemError(errno, __FILE__, __LINE__,
                       format("mmap(%s, %zu bytes)", name.c_str(), layout.totalBytes()));
    }
    auto* base = static_cast<uint8_t*>(p);
    std::unique_ptr<Segment> seg(new Segment(name, base, layout.totalBytes()));

    // ftruncate zero-fills; construct the shared objects in place so their lifetime is
    // well defined (all start at zero).
    auto* h = new (base) SegmentHeader{};
    h->magic = kSegmentMagic;
    h->version = kSegmentVersion;
    std::memcpy(h->nonce, nonce, sizeof(h->nonce));
    h->nranks = static_cast<uint32_t>(layout.nranks());
    h->ownerUid = static_cast<uint32_t>(::geteuid());
    h->chunkBytes = layout.chunkBytes();
    h->p2pChunkBytes = layout.p2pChunkBytes();
    h->totalBytes = layout.totalBytes();
    for (int r = 0; r < layout.nranks(); ++r) {
      new (layout.rank(base, r)) RankControl{};
      for (int d = 0; d < layout.nranks(); ++d) new (layout.mailbox(base, r, d)) MailboxControl{};
    }
    return seg;
  } catch (...) {
    ::shm_unlink(name.c_str());
    throw;
  }
}

std::unique_ptr<Segment> Segment::attach(const std::string& name, const Layout& expected,
                                         const uint8_t nonce[16], int64_t deadlineNs,
                                         const std::string& who) {
  int64_t backoffUs = 100;
  auto backoff = [&](const char* waitingFor) {
    if (nowNs() >= deadlineNs) {
      SPYRECCL_THROW(spyrecclTimeout,
                     "%s timed out waiting for rank 0 to %s the communicator segment %s "
                     "(is rank 0 running spyrecclCommInitRank with the same id?)",
                     who.c_str(), waitingFor, name.c_str());
    }
    sleepUs(backoffUs);
    backoffUs = std::min<int64_t>(backoffUs * 2, 1000);
  };

  for (;;) {
    int fd = ::shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0);
    if (fd < 0) {
      if (errno != ENOENT) throwSystemError(errno, __FILE__, __LINE__, "shm_open(" + name + ")");
      backoff("create");
      continue;
    }
    FdCloser closer{fd};
    struct stat st;
    SPYRECCL_SYSCHECK(::fstat(fd, &st), "fstat(" + name + ")");
    // Never trust a segment someone else could have planted or could read.
    if (st.st_uid != ::geteuid() || (st.st_mode & 0777) != 0600) {
      SPYRECCL_THROW(spyrecclInvalidUsage,
                     "%s: stale or foreign segment %s (owner uid %u, mode %03o; expected uid %u "
                     "and mode 0600)",
                     who.c_str(), name.c_str(), static_cast<unsigned>(st.st_uid),
                     static_cast<unsigned>(st.st_mode & 0777), static_cast<unsigned>(::geteuid()));
    }
    if (static_cast<size_t>(st.st_size) < sizeof(SegmentHeader)) {
      backoff("size");  // rank 0 is between shm_open and ftruncate
      continue;
    }
    void* p = ::mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      throwSystemError(
          errno, __FILE__, __LINE__,
          format("mmap(%s, %zu bytes)", name.c_str(), static_cast<size_t>(st.st_size)));
    }
    std::unique_ptr<Segment> seg(new Segment(name, static_cast<uint8_t*>(p), st.st_size));
    SegmentHeader* h = seg->header();
    while (h->ready.load(std::memory_order_acquire) == 0) backoff("initialise");

    auto foreign = [&](const std::string& what) {
      SPYRECCL_THROW(spyrecclInvalidUsage, "%s: stale or foreign segment %s: %s", who.c_str(),
                     name.c_str(), what.c_str());
    };
    if (h->magic != kSegmentMagic) foreign(format("bad magic 0x%08x", h->magic));
    if (h->version != kSegmentVersion) {
      foreign(
          format("layout version %u, this library speaks version %u", h->version, kSegmentVersion));
    }
    if (std::memcmp(h->nonce, nonce, sizeof(h->nonce)) != 0) foreign("nonce differs from the id");
    if (h->ownerUid != ::geteuid()) foreign(format("created by uid %u", h->ownerUid));
    if (h->nranks != static_cast<uint32_t>(expected.nranks())) {
      SPYRECCL_THROW(spyrecclInvalidUsage,
                     "%s was given nranks=%d but rank 0 created the communicator with nranks=%u",
                     who.c_str(), expected.nranks(), h->nranks);
    }
    if (h->chunkBytes != expected.chunkBytes() || h->p2pChunkBytes != expected.p2pChunkBytes()) {
      SPYRECCL_THROW(spyrecclInvalidUsage,
                     "%s is configured with chunkBytes=%zu, p2pChunkBytes=%zu but rank 0 created "
                     "the communicator with chunkBytes=%llu, p2pChunkBytes=%llu (config and "
                     "SPYRECCL_*CHUNK_BYTES must agree on every rank)",
                     who.c_str(), expected.chunkBytes(), expected.p2pChunkBytes(),
                     static_cast<unsigned long long>(h->chunkBytes),
                     static_cast<unsigned long long>(h->p2pChunkBytes));
    }
    if (h->totalBytes != expected.totalBytes() ||
        static_cast<size_t>(st.st_size) != expected.totalBytes()) {
      foreign(format("size %zu bytes (header says %llu), expected %zu",
                     static_cast<size_t>(st.st_size),
                     static_cast<unsigned long long>(h->totalBytes), expected.totalBytes()));
    }
    return seg;
  }
}

Segment::~Segment() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

void Segment::unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    SPYRECCL_LOG(kWarn, nullptr, "shm_unlink(%s) failed: %s", name_.c_str(), std::strerror(errno));
  }
}

}  // namespace spyreccl::transport
