// Conversions between float32 and the 16/8-bit floating types of the C API
// (float16, bfloat16, float8_e4m3fn, float8_e5m2).
//
// The reduction kernels widen every 16/8-bit source to float32, combine in float32 and
// narrow once at the end, so these two directions are the only arithmetic on the narrow
// formats. They are written as straight-line integer/float code with selects instead of
// branches so that GCC can vectorise the loops that call them (no F16C or AVX512-BF16
// instructions are required; the default x86-64 clone vectorises them with SSE2).
//
// Rounding is round-to-nearest-even everywhere. Special values follow torch 2.13 on CPU,
// which the tests check against:
//  - float16 / bfloat16 / float8_e5m2: overflow rounds to +-infinity, NaN stays NaN
//    (canonical quiet NaN with the input's sign).
//  - float8_e4m3fn has no infinity: every finite value of magnitude >= 448 and +-inf
//    saturate to +-448 (0x7e / 0xfe); NaN becomes 0x7f / 0xff.
// Subnormals of the narrow types are produced and consumed exactly (this code assumes the
// default floating-point environment, i.e. no flush-to-zero).
#pragma once

#include <cstdint>
#include <cstring>

// Always inlined: the reduction kernels are large functions in which GCC would otherwise
// stop inlining these, and an out-of-line call inside a loop prevents its vectorisation.
#define SPYRECCL_CONVERT_INLINE inline __attribute__((always_inline))

namespace spyreccl::kernels {

SPYRECCL_CONVERT_INLINE uint32_t floatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

SPYRECCL_CONVERT_INLINE float bitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

namespace detail {

// Branch-free select. The FP arithmetic feeding these selects must stay unconditional:
// with a plain ?: GCC sinks it into a branch, and then (under the default
// -ftrapping-math) refuses to if-convert the loop, which kills vectorisation.
SPYRECCL_CONVERT_INLINE uint32_t select(bool cond, uint32_t ifTrue, uint32_t ifFalse) {
  const uint32_t mask = 0u - uint32_t(cond);
  return (ifTrue & mask) | (ifFalse & ~mask);
}

// A narrow binary floating-point format with `ExpBits` exponent and `ManBits` mantissa
// bits and a sign bit on top. `Ieee` formats reserve the all-ones exponent for inf/NaN;
// otherwise (float8_e4m3fn) only the all-ones pattern is NaN and there is no infinity.
template <int ExpBits, int ManBits, bool Ieee>
struct MiniFloat {
  static constexpr int kBias = (1 << (ExpBits - 1)) - 1;
  static constexpr uint32_t kMagMask = (1u << (ExpBits + ManBits)) - 1;
  static constexpr uint32_t kSignBit = 1u << (ExpBits + ManBits);
  static constexpr int kShift = 23 - ManBits;                  // float32 mantissa bits dropped
  static constexpr int kSignShift = 31 - (ExpBits + ManBits);  // narrow sign -> bit 31
  // Encoded magnitude of the smallest normal number (exponent field 1).
  static constexpr uint32_t kMinNormal = 1u << ManBits;
  // Encoded magnitude at which inf/NaN start (Ieee) or the single NaN pattern (fn).
  static constexpr uint32_t kSpecial = Ieee ? (((1u << ExpBits) - 1) << ManBits) : kMagMask;
  // Largest finite encoded magnitude.
  static constexpr uint32_t kMaxFinite = Ieee ? kSpecial - 1 : kMagMask - 1;
  // Canonical NaN (without sign): quiet bit set for Ieee formats, all ones for fn.
  static constexpr uint32_t kNaN = Ieee ? (kSpecial | (1u << (ManBits - 1))) : kMagMask;

  // float32 bit patterns used by the narrowing direction.
  // 2^(1 - bias): the smallest normal value of the narrow format.
  static constexpr uint32_t kMinNormalF32 = uint32_t(127 + 1 - kBias) << 23;
  // 2^(1 - bias - ManBits): the narrow format's subnormal ulp.
  static constexpr uint32_t kSubnormalUlpF32 = uint32_t(127 + 1 - kBias - ManBits) << 23;
  // Adding this float to a value below kMinNormalF32 leaves exactly the narrow format's
  // subnormal ulp (2^(1 - bias - ManBits)) as the float32 ulp, so the FPU performs the
  // round-to-nearest-even and the low bits are the encoded subnormal (or kMinNormal).
  static constexpr uint32_t kSubnormalMagicF32 = uint32_t(127 + 23 + 1 - kBias - ManBits) << 23;
  // float32 bits of the largest finite value (exponent field of kMaxFinite).
  static constexpr uint32_t kMaxFiniteF32 =
      ((uint32_t(kMaxFinite >> ManBits) + 127 - kBias) << 23) |
      ((kMaxFinite & ((1u << ManBits) - 1)) << kShift);
  // Ieee: magnitudes from max + half an ulp up round to infinity (the largest finite value
  // has an odd mantissa, so the tie goes up as well).
  static constexpr uint32_t kOverflowF32 = kMaxFiniteF32 + (1u << (kShift - 1));
};

}  // namespace detail

// Widens a narrow encoding (in the low bits of `v`) to float32, exactly.
template <class F>
SPYRECCL_CONVERT_INLINE float miniToFloat(uint32_t v) {
  const uint32_t sign = (v & F::kSignBit) << F::kSignShift;
  const uint32_t mag = v & F::kMagMask;
  // Normal numbers: move the fields into place and re-bias the exponent.
  uint32_t r = (mag << F::kShift) + (uint32_t(127 - F::kBias) << 23);
  // inf/NaN (Ieee) keep their mantissa payload under an all-ones float32 exponent.
  const uint32_t special =
      F::kSpecial == F::kMagMask ? 0x7fc00000u : ((mag << F::kShift) | 0x7f800000u);
  r = detail::select(mag >= F::kSpecial, special, r);
  // Subnormals and zero: the integer mantissa times the subnormal ulp (exact in float32).
  const float sub = float(int32_t(mag)) * bitsFloat(F::kSubnormalUlpF32);
  r = detail::select(mag < F::kMinNormal, floatBits(sub), r);
  return bitsFloat(r | sign);
}

// Narrows float32 to the format `F` with round-to-nearest-even (see the file comment for
// overflow and NaN rules). Returns the encoding in the low bits.
template <class F>
SPYRECCL_CONVERT_INLINE uint32_t floatToMini(float f) {
  const uint32_t u = floatBits(f);
  const uint32_t sign = (u & 0x80000000u) >> F::kSignShift;
  const uint32_t a = u & 0x7fffffffu;
  // Normal range: re-bias, then round to nearest even by adding half an ulp minus one
  // plus the lowest kept bit, and shift the dropped bits out. A carry out of the mantissa
  // correctly bumps the exponent.
  uint32_t r = (a - (uint32_t(127 - F::kBias) << 23) + ((1u << (F::kShift - 1)) - 1) +
                ((a >> F::kShift) & 1u)) >>
               F::kShift;
  // Below the smallest normal: let the FPU round at the subnormal ulp.
  const float magic = bitsFloat(F::kSubnormalMagicF32);
  const uint32_t sub = floatBits(bitsFloat(a) + magic) - F::kSubnormalMagicF32;
  r = detail::select(a < F::kMinNormalF32, sub, r);
  if constexpr (F::kSpecial != F::kMagMask) {
    r = detail::select(a >= F::kOverflowF32, F::kSpecial, r);  // overflow and inf -> inf
  } else {
    r = detail::select(a >= F::kMaxFiniteF32, F::kMaxFinite, r);  // saturate, inf included
  }
  r = detail::select(a > 0x7f800000u, F::kNaN, r);
  return r | sign;
}

using Float16Format = detail::MiniFloat<5, 10, true>;
using Float8e5m2Format = detail::MiniFloat<5, 2, true>;
using Float8e4m3fnFormat = detail::MiniFloat<4, 3, false>;

SPYRECCL_CONVERT_INLINE float halfToFloat(uint16_t h) { return miniToFloat<Float16Format>(h); }
SPYRECCL_CONVERT_INLINE uint16_t floatToHalf(float f) {
  return uint16_t(floatToMini<Float16Format>(f));
}

SPYRECCL_CONVERT_INLINE float e5m2ToFloat(uint8_t v) { return miniToFloat<Float8e5m2Format>(v); }
SPYRECCL_CONVERT_INLINE uint8_t floatToE5m2(float f) {
  return uint8_t(floatToMini<Float8e5m2Format>(f));
}

SPYRECCL_CONVERT_INLINE float e4m3fnToFloat(uint8_t v) {
  return miniToFloat<Float8e4m3fnFormat>(v);
}
SPYRECCL_CONVERT_INLINE uint8_t floatToE4m3fn(float f) {
  return uint8_t(floatToMini<Float8e4m3fnFormat>(f));
}

// bfloat16 is the upper half of a float32: widening is a shift.
SPYRECCL_CONVERT_INLINE float bf16ToFloat(uint16_t h) { return bitsFloat(uint32_t(h) << 16); }

SPYRECCL_CONVERT_INLINE uint16_t floatToBf16(float f) {
  const uint32_t u = floatBits(f);
  // Round to nearest even on the dropped 16 bits; overflow carries into infinity.
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
  r = detail::select((u & 0x7fffffffu) > 0x7f800000u, nan, r);
  return uint16_t(r);
}

}  // namespace spyreccl::kernels
