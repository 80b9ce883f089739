// Unit tests of the reduction kernels (src/kernels), compiled into their own executable
// together with src/kernels/reduce.cc: the library exports the C API only.
//
//   kernels.convert/<type>   float32 <-> float16/bfloat16/float8 conversions against a
//                            brute-force reference (nearest representable value, ties to even,
//                            overflow rules of torch), on every narrow value and on every
//                            rounding boundary.
//   kernels.reduce/<type>    reduce() for every op, 1..5 sources, odd sizes around the
//                            kernels' block size, in place and not: bit-exact against the
//                            specified semantics (float32 accumulation in source order,
//                            one rounding), and within tolerance of float64.
//   kernels.reduce_streaming/<type>
//                            reduce() with non-temporal output stores: the same bytes as
//                            reduce(), around the cut-off, (mis)aligned outputs, in place.
//   kernels.copy             copy() at odd sizes and (mis)alignments, streaming or not,
//                            against the source bytes; nothing written outside dst.
//   kernels.special          NaN propagation, signed zeros, overflow and saturation.
//   kernels.validate         validate() verdicts and messages; names and sizes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "data.h"
#include "kernels/half.h"
#include "kernels/reduce.h"
#include "multiproc.h"

namespace {

using namespace spyreccl_test;
namespace k = spyreccl::kernels;

// ---------------------------------------------------------------------------------------
// Brute-force reference rounding of a float32 value to a narrow format
// ---------------------------------------------------------------------------------------

struct NarrowFormat {
  const TypeInfo* t;
  std::vector<double> values;  // value of every positive finite encoding, increasing
};

const NarrowFormat& narrowFormat(const TypeInfo& t) {
  static std::map<spyrecclDataType_t, NarrowFormat> cache;
  auto it = cache.find(t.dtype);
  if (it != cache.end()) return it->second;
  NarrowFormat f{&t, {}};
  const uint64_t expMask = (1ull << t.expBits) - 1;
  const uint64_t maxFinite =
      t.ieee ? (expMask << t.manBits) - 1 : (expMask << t.manBits) | ((1ull << t.manBits) - 2);
  for (uint64_t enc = 0; enc <= maxFinite; ++enc) f.values.push_back(decodeFloat(t, enc));
  return cache.emplace(t.dtype, std::move(f)).first->second;
}

// Expected encoding of `v` (a float32 value) in t: nearest value, ties to the even
// encoding; IEEE formats overflow to infinity from max + ulp/2 up, float8_e4m3fn saturates
// at +-448 (torch 2.13's behaviour). NaN maps to the format's canonical NaN.
uint64_t roundReference(const TypeInfo& t, double v) {
  const uint64_t signBit = 1ull << (t.expBits + t.manBits);
  const uint64_t sign = std::signbit(v) ? signBit : 0;
  if (std::isnan(v)) return sign | nanBits(t);
  const NarrowFormat& f = narrowFormat(t);
  const double a = std::fabs(v);
  const uint64_t maxEnc = f.values.size() - 1;
  const double maxVal = f.values.back();
  if (t.ieee) {
    const double halfUlp = (maxVal - f.values[maxEnc - 1]) / 2;
    // The first encoding past the finite ones is infinity (exponent all ones).
    if (a >= maxVal + halfUlp) return sign | uint64_t(f.values.size());
  } else if (a >= maxVal) {
    return sign | maxEnc;
  }
  const auto it = std::upper_bound(f.values.begin(), f.values.end(), a);
  const uint64_t lo = uint64_t(it - f.values.begin()) - 1;
  if (lo == maxEnc) return sign | maxEnc;  // only reachable below the overflow threshold
  const double dlo = a - f.values[lo];
  const double dhi = f.values[lo + 1] - a;
  uint64_t enc;
  if (dlo < dhi) {
    enc = lo;
  } else if (dhi < dlo) {
    enc = lo + 1;
  } else {
    enc = (lo % 2 == 0) ? lo : lo + 1;
  }
  return sign | enc;
}

// The library's conversions for `t`.
float widen(const TypeInfo& t, uint64_t bits) {
  switch (t.dtype) {
    case spyrecclFloat16:
      return k::halfToFloat(uint16_t(bits));
    case spyrecclBfloat16:
      return k::bf16ToFloat(uint16_t(bits));
    case spyrecclFloat8e4m3:
      return k::e4m3fnToFloat(uint8_t(bits));
    default:
      return k::e5m2ToFloat(uint8_t(bits));
  }
}

uint64_t narrow(const TypeInfo& t, float f) {
  switch (t.dtype) {
    case spyrecclFloat16:
      return k::floatToHalf(f);
    case spyrecclBfloat16:
      return k::floatToBf16(f);
    case spyrecclFloat8e4m3:
      return k::floatToE4m3fn(f);
    default:
      return k::floatToE5m2(f);
  }
}

bool sameEncoding(const TypeInfo& t, uint64_t got, uint64_t want) {
  if (std::isnan(decodeFloat(t, want))) {
    // Any NaN of the same sign is a correct result.
    return std::isnan(decodeFloat(t, got)) && ((got ^ want) >> (t.expBits + t.manBits)) == 0;
  }
  return got == want;
}

void conversionTest(const TypeInfo& t) {
  // Widening: every encoding, exactly.
  size_t bad = 0;
  for (uint64_t enc = 0; enc < (1ull << t.bits()); ++enc) {
    const double want = decodeFloat(t, enc);
    const float got = widen(t, enc);
    const bool ok = std::isnan(want)
                        ? std::isnan(got) && std::signbit(got) == std::signbit(want)
                        : double(got) == want && std::signbit(got) == std::signbit(want);
    if (!ok && bad++ < 3) {
      recordFailure(__FILE__, __LINE__,
                    format("%s widen(0x%llx) = %.9g, expected %.9g", t.name,
                           (unsigned long long)enc, double(got), want));
    }
  }

  // Narrowing: every representable value, every midpoint between neighbours and the float32
  // values just around it, the overflow region, specials and random bit patterns.
  std::vector<float> inputs;
  const NarrowFormat& f = narrowFormat(t);
  for (size_t i = 0; i + 1 < f.values.size(); ++i) {
    const float lo = float(f.values[i]);
    const float mid = float((f.values[i] + f.values[i + 1]) / 2);  // exact in float32
    for (float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      inputs.push_back(x);
      inputs.push_back(-x);
    }
  }
  const float maxVal = float(f.values.back());
  for (float x = maxVal; x < 1e30f; x *= 1.01f) {
    for (float y : {x, std::nextafter(x, 0.0f), std::nextafter(x, INFINITY)}) {
      inputs.push_back(y);
      inputs.push_back(-y);
    }
  }
  for (float x : {INFINITY, -INFINITY, NAN, -NAN, 0.0f, -0.0f, 1e-45f, -1e-45f, 1.17549435e-38f,
                  3.4028235e38f}) {
    inputs.push_back(x);
  }
  for (uint64_t i = 0; i < 2000000; ++i) {
    const uint32_t bits = uint32_t(splitmix64(currentSeed() + i));
    float x;
    std::memcpy(&x, &bits, 4);
    inputs.push_back(x);
  }
  for (float x : inputs) {
    const uint64_t want = roundReference(t, double(x));
    const uint64_t got = narrow(t, x);
    if (!sameEncoding(t, got, want) && bad++ < 6) {
      uint32_t xb;
      std::memcpy(&xb, &x, 4);
      recordFailure(__FILE__, __LINE__,
                    format("%s narrow(%.9g = 0x%08x) = 0x%llx, expected 0x%llx", t.name, double(x),
                           xb, (unsigned long long)got, (unsigned long long)want));
    }
  }
  SPY_CHECK(bad == 0, "%s: %zu conversion(s) wrong (first ones above)", t.name, bad);
}

// ---------------------------------------------------------------------------------------
// reduce()
// ---------------------------------------------------------------------------------------

k::ReduceSpec specFor(const TypeInfo& t, Red red, double scalar, int nsrc) {
  k::ReduceSpec spec;
  spec.dtype = t.dtype;
  spec.op = red == Red::PreMulSum ? spyrecclSum : builtinOp(red);
  spec.premul = red == Red::PreMulSum;
  spec.scalar = scalar;
  spec.avgDivisor = nsrc;
  return spec;
}

// The specified result for floating types, computed independently of the kernels: a left
// fold in source order in the accumulation type (float32 for the 16/8-bit types, without
// fused multiply-adds: `volatile` keeps every product and sum rounded on its own), then
// one rounding to the output type.
template <class Acc>
uint64_t floatSemantics(const TypeInfo& t, Red red, double scalar, const uint64_t* values, int n) {
  const Acc s = Acc(scalar);
  auto load = [&](uint64_t bits) -> Acc {
    volatile Acc x = Acc(decodeFloat(t, bits));
    if (red == Red::PreMulSum) x = x * s;
    return x;
  };
  volatile Acc acc = load(values[0]);
  for (int i = 1; i < n; ++i) {
    const Acc x = load(values[i]);
    switch (red) {
      case Red::Sum:
      case Red::Avg:
      case Red::PreMulSum:
        acc = acc + x;
        break;
      case Red::Prod:
        acc = acc * x;
        break;
      case Red::Max:
        acc = (x > acc || std::isnan(x)) ? x : Acc(acc);
        break;
      case Red::Min:
        acc = (x < acc || std::isnan(x)) ? x : Acc(acc);
        break;
      default:
        break;
    }
  }
  if (red == Red::Avg) acc = acc / Acc(n);
  if (t.size == 4 || t.size == 8) {
    Acc result = acc;
    uint64_t bits = 0;
    std::memcpy(&bits, &result, sizeof result);
    return bits;
  }
  return roundReference(t, double(acc));
}

void reduceTest(const TypeInfo& t) {
  const size_t sizes[] = {0, 1, 7, 33, 2048 + 5, 8192 + 3};
  uint64_t caseNo = 0;
  for (Red red : validReds(t)) {
    for (int nsrc = 1; nsrc <= 5; ++nsrc) {
      for (size_t count : sizes) {
        for (bool inPlace : {false, true}) {
          const uint64_t seed = mix(currentSeed(), ++caseNo);
          const double scalar = premulScalar(seed);
          const std::string what = format("reduce %s %s nsrc=%d count=%zu %s", t.name, redName(red),
                                          nsrc, count, inPlace ? "in-place" : "out-of-place");
          std::vector<Buffer> srcs;
          std::vector<const void*> ptrs;
          for (int r = 0; r < nsrc; ++r) {
            srcs.emplace_back(t, count);
            fillInput(t, red, seed, r, srcs.back().data(), count);
          }
          for (Buffer& b : srcs) ptrs.push_back(b.data());
          Buffer out(t, count);
          void* dst = inPlace ? srcs[0].data() : out.data();

          std::vector<Expected> ex(count);
          std::vector<uint64_t> exact(count);
          for (size_t i = 0; i < count; ++i) {
            uint64_t values[8];
            for (int r = 0; r < nsrc; ++r) values[r] = inputBits(t, red, seed, r, i);
            ex[i] = reduceReference(t, red, values, nsrc, scalar);
            if (t.isFloat()) {
              exact[i] = t.size == 8 ? floatSemantics<double>(t, red, scalar, values, nsrc)
                                     : floatSemantics<float>(t, red, scalar, values, nsrc);
            } else {
              exact[i] = ex[i].bits;
            }
            if (!inPlace) storeBits(t, dst, i, poisonBits(t, exact[i]));
          }

          k::reduce(specFor(t, red, scalar, nsrc), dst, ptrs.data(), nsrc, count);

          OutputChecker semantics(t, what + " (bit-exact semantics)");
          OutputChecker accuracy(t, what + " (float64 reference)");
          for (size_t i = 0; i < count; ++i) {
            Expected e;
            e.bits = exact[i];
            // max/min may return either zero of +0/-0 ties; the value check covers those.
            if (!(t.isFloat() && (red == Red::Max || red == Red::Min))) semantics.expect(dst, i, e);
            accuracy.expect(dst, i, ex[i]);
          }
          semantics.report(__FILE__, __LINE__);
          accuracy.report(__FILE__, __LINE__);
          for (int r = inPlace ? 1 : 0; r < nsrc; ++r) {
            OutputChecker intact(t, what + format(": source %d modified", r));
            for (size_t i = 0; i < count; ++i) {
              intact.expectBits(srcs[size_t(r)].data(), i, inputBits(t, red, seed, r, i));
            }
            intact.report(__FILE__, __LINE__);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// copy(): memcpy with a vector loop, optionally streaming
// ---------------------------------------------------------------------------------------

void copyTest() {
  // Page-aligned bases, then offsets that include the ones that make glibc's `rep movsb`
  // slow (dst 16 bytes above src modulo 4 KiB) and unaligned heads and tails.
  const size_t sizes[] = {0, 1, 15, 63, 64, 65, 127, 2048 + 5, 16384 + 7, 200003};
  const size_t srcOffs[] = {0, 1, 16};
  const size_t dstOffs[] = {0, 16, 63, 4096 + 16};
  constexpr size_t kGuard = 80;
  constexpr size_t kSpan = 200003 + 4096 + 64 + 2 * kGuard;
  std::vector<uint8_t> srcMem(kSpan + 4096), dstMem(kSpan + 4096);
  auto pageAlign = [](uint8_t* p) {
    return p + (4096 - reinterpret_cast<uintptr_t>(p) % 4096) % 4096;
  };
  uint8_t* srcBase = pageAlign(srcMem.data());
  uint8_t* dstBase = pageAlign(dstMem.data());
  uint64_t caseNo = 0;
  for (size_t bytes : sizes) {
    for (size_t so : srcOffs) {
      for (size_t dof : dstOffs) {
        for (bool streaming : {false, true}) {
          const uint64_t seed = mix(currentSeed(), ++caseNo);
          const uint8_t* src = srcBase + so;
          uint8_t* dst = dstBase + kGuard + dof;
          for (size_t i = 0; i < bytes; ++i) {
            srcBase[so + i] = uint8_t(randomBits(seed, 0, i));
          }
          std::memset(dstBase, 0xA5, kSpan);
          k::copy(dst, src, bytes, streaming);
          size_t bad = 0, firstBad = 0;
          for (size_t i = 0; i < bytes; ++i) {
            if (dst[i] != uint8_t(randomBits(seed, 0, i)) && bad++ == 0) firstBad = i;
          }
          size_t outside = 0;
          for (size_t i = 0; i < kSpan; ++i) {
            const bool inside = i >= kGuard + dof && i < kGuard + dof + bytes;
            if (!inside && dstBase[i] != 0xA5) ++outside;
          }
          SPY_CHECK(bad == 0, "copy %zu bytes src+%zu dst+%zu%s: %zu wrong byte(s), first [%zu]",
                    bytes, so, dof, streaming ? " streaming" : "", bad, firstBad);
          SPY_CHECK(outside == 0, "copy %zu bytes src+%zu dst+%zu%s: %zu byte(s) written outside",
                    bytes, so, dof, streaming ? " streaming" : "", outside);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// reduce(..., streaming): non-temporal output stores, same bits as reduce()
// ---------------------------------------------------------------------------------------

void reduceStreamingTest(const TypeInfo& t) {
  // Sizes below the streaming cut-off (8 kernel blocks, 64 KiB) and above it, with a partial
  // last chunk; outputs at a line boundary and one or a few elements past it (plain stores up
  // to the next boundary). Outputs are element-aligned, as reduce() requires.
  const size_t cut = (size_t{64} << 10) / t.size;
  const size_t counts[] = {cut - 1, cut + 1, 3 * cut + 17};
  const size_t dstOffs[] = {0, t.size, 5 * t.size};
  constexpr size_t kGuard = 128;
  const size_t maxBytes = (3 * cut + 17) * t.size;
  uint64_t caseNo = 0;
  for (Red red : {Red::Sum, Red::Max, t.isFloat() ? Red::Avg : Red::Bxor}) {
    if (t.kind == Kind::Bool && red == Red::Avg) continue;
    for (int nsrc : {2, 3}) {
      for (size_t count : counts) {
        for (size_t dof : dstOffs) {
          for (bool inPlace : {false, true}) {
            const uint64_t seed = mix(currentSeed(), ++caseNo);
            const size_t bytes = count * t.size;
            std::vector<std::vector<uint8_t>> in(nsrc, std::vector<uint8_t>(maxBytes + 64));
            // Finite inputs: NaN payloads may legitimately differ between the vector and
            // the scalar tail loops, which the chunking moves around.
            for (int k = 0; k < nsrc; ++k) fillInput(t, red, seed, k, in[k].data(), count);
            k::ReduceSpec spec;
            spec.dtype = t.dtype;
            spec.op = builtinOp(red);
            spec.avgDivisor = nsrc;
            std::vector<const void*> srcs(nsrc);
            for (int k = 0; k < nsrc; ++k) srcs[k] = in[k].data();
            std::vector<uint8_t> expected(bytes);
            k::reduce(spec, expected.data(), srcs.data(), nsrc, count);
            // The output: a 64-byte aligned base plus the offset, poisoned with guards.
            std::vector<uint8_t> mem(maxBytes + 2 * kGuard + 128, 0xA5);
            uint8_t* base = mem.data() + (64 - reinterpret_cast<uintptr_t>(mem.data()) % 64);
            uint8_t* dst = base + kGuard + dof;
            if (inPlace) {
              std::memcpy(dst, in[0].data(), bytes);
              srcs[0] = dst;
            }
            k::reduce(spec, dst, srcs.data(), nsrc, count, /*streaming=*/true);
            size_t bad = 0, firstBad = 0;
            for (size_t i = 0; i < bytes; ++i) {
              if (dst[i] != expected[i] && bad++ == 0) firstBad = i;
            }
            size_t outside = 0;
            for (uint8_t* p = mem.data(); p < mem.data() + mem.size(); ++p) {
              if ((p < dst || p >= dst + bytes) && *p != 0xA5) ++outside;
            }
            SPY_CHECK(bad == 0,
                      "%s %s x%d, %zu elements, dst+%zu%s: %zu wrong byte(s), first [%zu]", t.name,
                      redName(red), nsrc, count, dof, inPlace ? " in place" : "", bad, firstBad);
            SPY_CHECK(outside == 0, "%s %s x%d, %zu elements, dst+%zu: %zu byte(s) written outside",
                      t.name, redName(red), nsrc, count, dof, outside);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Special values
// ---------------------------------------------------------------------------------------

template <class T>
T reduce2(spyrecclDataType_t dtype, spyrecclRedOp_t op, T a, T b) {
  k::ReduceSpec spec;
  spec.dtype = dtype;
  spec.op = op;
  spec.avgDivisor = 2;
  const void* srcs[2] = {&a, &b};
  T out;
  k::reduce(spec, &out, srcs, 2, 1);
  return out;
}

void specialValuesTest() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // MAX/MIN propagate NaN from either side (torch.maximum/minimum).
  SPY_CHECK(std::isnan(reduce2<float>(spyrecclFloat32, spyrecclMax, nan, 1.0f)), "max(nan, 1)");
  SPY_CHECK(std::isnan(reduce2<float>(spyrecclFloat32, spyrecclMax, 1.0f, nan)), "max(1, nan)");
  SPY_CHECK(std::isnan(reduce2<float>(spyrecclFloat32, spyrecclMin, nan, 1.0f)), "min(nan, 1)");
  SPY_CHECK(std::isnan(reduce2<double>(spyrecclFloat64, spyrecclMin, 1.0, double(nan))),
            "min(1, nan) in float64");
  SPY_CHECK(reduce2<float>(spyrecclFloat32, spyrecclMax, -INFINITY, -1.0f) == -1.0f, "max(-inf)");
  // float16: NaN survives a sum, overflow goes to infinity.
  SPY_CHECK((reduce2<uint16_t>(spyrecclFloat16, spyrecclSum, 0x7e00, 0x3c00) & 0x7c00) == 0x7c00 &&
                (reduce2<uint16_t>(spyrecclFloat16, spyrecclSum, 0x7e00, 0x3c00) & 0x3ff) != 0,
            "float16 nan + 1 must be NaN");
  SPY_CHECK(reduce2<uint16_t>(spyrecclFloat16, spyrecclSum, 0x7bff, 0x7bff) == 0x7c00,
            "float16 65504 + 65504 must be +inf");
  // bfloat16 65504+65504 is representable (8-bit exponent).
  SPY_CHECK(reduce2<uint16_t>(spyrecclBfloat16, spyrecclSum, 0x4780, 0x4780) == 0x4800,
            "bfloat16 65536 + 65536 = 131072");
  // float8_e4m3fn saturates (no infinity): 448 + 448 -> 448, -448 * 2 -> -448.
  SPY_CHECK(reduce2<uint8_t>(spyrecclFloat8e4m3, spyrecclSum, 0x7e, 0x7e) == 0x7e,
            "e4m3fn 448 + 448 must saturate to 448");
  SPY_CHECK(reduce2<uint8_t>(spyrecclFloat8e4m3, spyrecclProd, 0xfe, 0x40) == 0xfe,
            "e4m3fn -448 * 2 must saturate to -448");
  SPY_CHECK((reduce2<uint8_t>(spyrecclFloat8e4m3, spyrecclSum, 0x7f, 0x38) & 0x7f) == 0x7f,
            "e4m3fn nan + 1 must be NaN");
  // float8_e5m2 overflows to infinity.
  SPY_CHECK(reduce2<uint8_t>(spyrecclFloat8e5m2, spyrecclSum, 0x7b, 0x7b) == 0x7c,
            "e5m2 57344 + 57344 must be +inf");
  // Integer AVG: exact sum, truncated toward zero; wrap-around of SUM.
  SPY_CHECK(reduce2<int8_t>(spyrecclInt8, spyrecclAvg, 127, 127) == 127, "int8 avg(127, 127)");
  SPY_CHECK(reduce2<int8_t>(spyrecclInt8, spyrecclAvg, -128, -1) == -64, "int8 avg(-128, -1)");
  SPY_CHECK(reduce2<int32_t>(spyrecclInt32, spyrecclAvg, -3, 0) == -1, "int32 avg(-3, 0)");
  SPY_CHECK(reduce2<uint64_t>(spyrecclUint64, spyrecclAvg, ~0ull, ~0ull) == ~0ull,
            "uint64 avg(max, max)");
  SPY_CHECK(reduce2<int64_t>(spyrecclInt64, spyrecclAvg, INT64_MIN, INT64_MIN) == INT64_MIN,
            "int64 avg(min, min)");
  SPY_CHECK(reduce2<int16_t>(spyrecclInt16, spyrecclSum, 32767, 1) == -32768, "int16 wrap");
  SPY_CHECK(reduce2<uint32_t>(spyrecclUint32, spyrecclProd, 0x10000u, 0x10000u) == 0,
            "uint32 product wrap");
  // bool normalises non-zero bytes.
  SPY_CHECK(reduce2<uint8_t>(spyrecclBool, spyrecclBxor, 2, 1) == 0, "bool xor(2, 1) = false");
  SPY_CHECK(reduce2<uint8_t>(spyrecclBool, spyrecclSum, 0, 7) == 1, "bool or(0, 7) = true");
}

// ---------------------------------------------------------------------------------------
// validate() and names
// ---------------------------------------------------------------------------------------

void validateTest() {
  for (const TypeInfo& t : allTypes()) {
    SPY_CHECK(k::dtypeSize(t.dtype) == t.size, "dtypeSize(%s)", t.name);
    SPY_CHECK(std::string(k::dtypeName(t.dtype)) == t.name, "dtypeName(%s) = %s", t.name,
              k::dtypeName(t.dtype));
    for (int op = 0; op < spyrecclNumOps; ++op) {
      for (bool premul : {false, true}) {
        if (premul && op != spyrecclSum) continue;
        k::ReduceSpec spec;
        spec.dtype = t.dtype;
        spec.op = spyrecclRedOp_t(op);
        spec.premul = premul;
        spec.avgDivisor = 3;
        const Red red = premul ? Red::PreMulSum : Red(op);
        const std::vector<Red> valid = validReds(t);
        const bool expected = std::find(valid.begin(), valid.end(), red) != valid.end();
        std::string why;
        const bool ok = k::validate(spec, &why);
        SPY_CHECK(ok == expected, "validate(%s, %s) = %d", t.name, redName(red), int(ok));
        if (!ok) {
          SPY_CHECK(why.find(redName(red)) != std::string::npos &&
                        (red == Red::Avg || why.find(t.name) != std::string::npos),
                    "message should name the op and the type: \"%s\"", why.c_str());
        }
      }
    }
  }
  // Data types and ops outside their enums never reach the kernels: api.cc rejects them from
  // the raw integers (test_api.cc), and building such an enum value here would itself be
  // undefined behaviour (UBSan's enum check in `nox -s sanitize`).
  k::ReduceSpec spec;
  std::string why;
  spec.dtype = spyrecclFloat32;
  spec.op = spyrecclAvg;
  spec.avgDivisor = 0;
  SPY_CHECK(!k::validate(spec, &why), "avg with divisor 0 must be rejected");
  SPY_CHECK(std::string(k::opName(spyrecclSum, true)) == "premul_sum", "opName(premul)");
  SPY_CHECK(k::dtypeSize(spyrecclDataType_t(-1)) == 0, "dtypeSize(invalid)");
}

[[maybe_unused]] const bool registered = [] {
  for (const TypeInfo& t : allTypes()) {
    const TypeInfo* type = &t;
    if (t.narrow())
      registerTest(format("kernels.convert/%s", t.name), [=] { conversionTest(*type); });
    registerTest(format("kernels.reduce/%s", t.name), [=] { reduceTest(*type); });
    registerTest(format("kernels.reduce_streaming/%s", t.name),
                 [=] { reduceStreamingTest(*type); });
  }
  registerTest("kernels.copy", copyTest);
  registerTest("kernels.special", specialValuesTest);
  registerTest("kernels.validate", validateTest);
  return true;
}();

}  // namespace

int main(int argc, char** argv) { return spyreccl_test::runTests(argc, argv); }
