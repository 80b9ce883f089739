#include "rendezvous/unique_id.h"

#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>

#include "common/error.h"

namespace spyreccl::rendezvous {
namespace {

uint32_t fnv1a(const std::string& s) {
  uint32_t h = 2166136261u;
  for (unsigned char c : s) {
    h ^= c;
    h *= 16777619u;
  }
  return h;
}

}  // namespace

std::string hostName() {
  char buf[HOST_NAME_MAX + 1] = {};
  SPYRECCL_SYSCHECK(::gethostname(buf, sizeof(buf) - 1), "gethostname");
  return buf;
}

UniqueIdData makeUniqueId() {
  UniqueIdData id;
  std::memset(&id, 0, sizeof(id));
  id.magic = kIdMagic;
  id.version = kIdVersion;
  size_t got = 0;
  while (got < sizeof(id.nonce)) {
    ssize_t n = ::getrandom(id.nonce + got, sizeof(id.nonce) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throwSystemError(errno, __FILE__, __LINE__, "getrandom");
    }
    got += static_cast<size_t>(n);
  }
  id.creatorPid = static_cast<int32_t>(::getpid());
  std::string host = hostName();
  id.hostHash = fnv1a(host);
  std::strncpy(id.host, host.c_str(), sizeof(id.host) - 1);
  return id;
}

UniqueIdData decodeUniqueId(const spyrecclUniqueId& raw) {
  UniqueIdData id;
  std::memcpy(&id, raw.internal, sizeof(id));
  if (id.magic != kIdMagic) {
    SPYRECCL_THROW(spyrecclInvalidUsage,
                   "spyrecclCommInitRank: argument 'id' is not a spyreccl unique id (magic "
                   "0x%08x, expected 0x%08x); create it with spyrecclGetUniqueId on rank 0 and "
                   "pass its 128 bytes unchanged",
                   id.magic, kIdMagic);
  }
  if (id.version != kIdVersion) {
    SPYRECCL_THROW(spyrecclInvalidUsage,
                   "spyrecclCommInitRank: argument 'id' has format version %u, this library "
                   "understands version %u (mixed spyreccl versions?)",
                   id.version, kIdVersion);
  }
  id.host[sizeof(id.host) - 1] = '\0';
  return id;
}

void checkSameHost(const UniqueIdData& id, int rank) {
  std::string host = hostName();
  if (fnv1a(host) != id.hostHash || std::strncmp(host.c_str(), id.host, sizeof(id.host) - 1) != 0) {
    SPYRECCL_THROW(spyrecclUnsupported,
                   "spyrecclCommInitRank: rank %d runs on host %s but rank 0 created the id on "
                   "host %s; spyreccl connects ranks of one host only",
                   rank, host.c_str(), id.host);
  }
}

}  // namespace spyreccl::rendezvous
