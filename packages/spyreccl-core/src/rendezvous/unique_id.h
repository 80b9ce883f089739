// Format of spyrecclUniqueId (128 bytes, plain old data, copied between processes as is).
#pragma once

#include <cstdint>
#include <string>

#include "spyreccl/spyreccl.h"

namespace spyreccl::rendezvous {

constexpr uint32_t kIdMagic = 0x44495053u;  // "SPID"
constexpr uint32_t kIdVersion = 1;

struct UniqueIdData {
  uint32_t magic;
  uint32_t version;
  uint8_t nonce[16];   // from getrandom(): names the segment, unguessable
  int32_t creatorPid;  // diagnostics only
  uint32_t hostHash;   // FNV-1a of the full hostname (covers names longer than `host`)
  char host[96];       // creator's hostname, NUL terminated (possibly truncated)
};
static_assert(sizeof(UniqueIdData) == SPYRECCL_UNIQUE_ID_BYTES, "unique id must be 128 bytes");

// A fresh id: random nonce from the kernel CSPRNG, this host, this pid.
UniqueIdData makeUniqueId();

// Decodes and checks magic/version (spyrecclInvalidUsage otherwise).
UniqueIdData decodeUniqueId(const spyrecclUniqueId& id);

// Throws spyrecclUnsupported when `id` was created on another host.
void checkSameHost(const UniqueIdData& id, int rank);

std::string hostName();

}  // namespace spyreccl::rendezvous
