// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"):
// the counter-based generator behind every spyre random kernel. Keyed by the
// generator's seed; the counter is an element's position in the stream.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include <array>
#include <cstdint>

namespace at {
class Tensor;
}

namespace spyreccl::device {

using PhiloxBlock = std::array<uint32_t, 4>;

inline PhiloxBlock philox(uint64_t seed, uint64_t counter) {
  constexpr uint32_t kMul0 = 0xD2511F53u;
  constexpr uint32_t kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u;
  constexpr uint32_t kWeyl1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(counter);
  uint32_t c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0;
  uint32_t c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed);
  uint32_t k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t next0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t next2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = next0;
    c2 = next2;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {c0, c1, c2, c3};
}

// A dropout keep-mask (true with probability keep_prob) of shape `sizes` on
// spyre `device`, element i drawn from counter first + i of `seed`'s stream.
at::Tensor keep_mask(c10::IntArrayRef sizes, double keep_prob, c10::Device device, uint64_t seed,
                     uint64_t first);

// The same, reserving the counters from `device`'s default generator; returns
// the seed and first counter used, so that the mask can be rebuilt (backward).
at::Tensor reserve_keep_mask(c10::IntArrayRef sizes, double keep_prob, c10::Device device,
                             uint64_t& seed, uint64_t& first);

}  // namespace spyreccl::device
