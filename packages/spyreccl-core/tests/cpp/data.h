// data.h — deterministic inputs, independent references and per-type tolerances for the
// C++ tests.
//
// Every element of every rank's input is a pure function of (seed, rank, index), so each
// rank can compute the inputs of all the others and therefore the expected result of any
// collective on its own, in float64 (floating types) or exact integer arithmetic.
//
// The floating formats are handled through their bit layout (exponent and mantissa
// widths) only: inputs are drawn directly as bit patterns and decoded with ldexp, so this
// file shares no conversion code with the library (src/kernels/half.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "multiproc.h"
#include "spyreccl/spyreccl.h"

namespace spyreccl_test {

// ---------------------------------------------------------------------------------------
// Types
// ---------------------------------------------------------------------------------------

enum class Kind { Signed, Unsigned, Bool, Float };

struct TypeInfo {
  spyrecclDataType_t dtype;
  const char* name;
  size_t size;  // bytes
  Kind kind;
  int expBits = 0;  // Float only
  int manBits = 0;
  bool ieee = true;  // false: float8_e4m3fn (no infinities, only S.1111.111 is NaN)

  int bits() const { return int(size * 8); }
  int bias() const { return (1 << (expBits - 1)) - 1; }
  bool isFloat() const { return kind == Kind::Float; }
  bool isInteger() const { return kind == Kind::Signed || kind == Kind::Unsigned; }
  bool narrow() const { return isFloat() && size <= 2; }  // accumulates in float32
};

inline const std::vector<TypeInfo>& allTypes() {
  static const std::vector<TypeInfo> types = {
      {spyrecclInt8, "int8", 1, Kind::Signed},
      {spyrecclUint8, "uint8", 1, Kind::Unsigned},
      {spyrecclInt16, "int16", 2, Kind::Signed},
      {spyrecclInt32, "int32", 4, Kind::Signed},
      {spyrecclUint32, "uint32", 4, Kind::Unsigned},
      {spyrecclInt64, "int64", 8, Kind::Signed},
      {spyrecclUint64, "uint64", 8, Kind::Unsigned},
      {spyrecclFloat16, "float16", 2, Kind::Float, 5, 10, true},
      {spyrecclBfloat16, "bfloat16", 2, Kind::Float, 8, 7, true},
      {spyrecclFloat32, "float32", 4, Kind::Float, 8, 23, true},
      {spyrecclFloat64, "float64", 8, Kind::Float, 11, 52, true},
      {spyrecclFloat8e4m3, "float8_e4m3fn", 1, Kind::Float, 4, 3, false},
      {spyrecclFloat8e5m2, "float8_e5m2", 1, Kind::Float, 5, 2, true},
      {spyrecclBool, "bool", 1, Kind::Bool},
  };
  return types;
}

inline const TypeInfo& typeInfo(spyrecclDataType_t dtype) {
  for (const TypeInfo& t : allTypes()) {
    if (t.dtype == dtype) return t;
  }
  throw std::runtime_error("typeInfo: unknown data type " + std::to_string(int(dtype)));
}

// ---------------------------------------------------------------------------------------
// Reduce operations
// ---------------------------------------------------------------------------------------

enum class Red { Sum, Prod, Max, Min, Avg, Band, Bor, Bxor, PreMulSum };

inline const char* redName(Red r) {
  switch (r) {
    case Red::Sum:
      return "sum";
    case Red::Prod:
      return "prod";
    case Red::Max:
      return "max";
    case Red::Min:
      return "min";
    case Red::Avg:
      return "avg";
    case Red::Band:
      return "band";
    case Red::Bor:
      return "bor";
    case Red::Bxor:
      return "bxor";
    case Red::PreMulSum:
      return "premul_sum";
  }
  return "?";
}

// The built-in op of the C API (PreMulSum needs a handle: see RedOpHandle).
inline spyrecclRedOp_t builtinOp(Red r) {
  switch (r) {
    case Red::Sum:
      return spyrecclSum;
    case Red::Prod:
      return spyrecclProd;
    case Red::Max:
      return spyrecclMax;
    case Red::Min:
      return spyrecclMin;
    case Red::Avg:
      return spyrecclAvg;
    case Red::Band:
      return spyrecclBand;
    case Red::Bor:
      return spyrecclBor;
    case Red::Bxor:
      return spyrecclBxor;
    case Red::PreMulSum:
      break;
  }
  return spyrecclNumOps;
}

// Every reduction the header defines for `t`.
inline std::vector<Red> validReds(const TypeInfo& t) {
  switch (t.kind) {
    case Kind::Float:
      return {Red::Sum, Red::Prod, Red::Max, Red::Min, Red::Avg, Red::PreMulSum};
    case Kind::Bool:
      return {Red::Sum, Red::Prod, Red::Max, Red::Min, Red::Band, Red::Bor, Red::Bxor};
    default:
      return {Red::Sum, Red::Prod, Red::Max, Red::Min, Red::Avg, Red::Band, Red::Bor, Red::Bxor};
  }
}

// ---------------------------------------------------------------------------------------
// Deterministic randomness
// ---------------------------------------------------------------------------------------

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t mix(uint64_t a, uint64_t b) { return splitmix64(a ^ splitmix64(b)); }

// 64 random bits for element `index` of rank `rank` under `seed`.
inline uint64_t randomBits(uint64_t seed, int rank, uint64_t index) {
  return mix(mix(seed, uint64_t(rank) + 0x51ull), index);
}

// ---------------------------------------------------------------------------------------
// Raw element access (the buffers hold little-endian values of t.size bytes)
// ---------------------------------------------------------------------------------------

inline uint64_t mask(const TypeInfo& t) {
  return t.size == 8 ? ~0ull : ((1ull << (t.size * 8)) - 1);
}

inline uint64_t loadBits(const TypeInfo& t, const void* buf, size_t i) {
  uint64_t v = 0;
  std::memcpy(&v, static_cast<const char*>(buf) + i * t.size, t.size);
  return v;
}

inline void storeBits(const TypeInfo& t, void* buf, size_t i, uint64_t bits) {
  std::memcpy(static_cast<char*>(buf) + i * t.size, &bits, t.size);
}

inline int64_t signExtend(const TypeInfo& t, uint64_t bits) {
  const int shift = 64 - t.bits();
  return shift == 0 ? int64_t(bits) : int64_t(bits << shift) >> shift;
}

// Value of a floating-point bit pattern (NaN for NaN patterns, +-inf for infinities).
inline double decodeFloat(const TypeInfo& t, uint64_t bits) {
  const uint64_t manMask = (1ull << t.manBits) - 1;
  const uint64_t expMask = (1ull << t.expBits) - 1;
  const bool negative = (bits >> (t.expBits + t.manBits)) & 1;
  const uint64_t e = (bits >> t.manBits) & expMask;
  const uint64_t m = bits & manMask;
  double v;
  if (t.ieee && e == expMask) {
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (!t.ieee && e == expMask && m == manMask) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(double(m), 1 - t.bias() - t.manBits);
  } else {
    v = std::ldexp(double(m | (1ull << t.manBits)), int(e) - t.bias() - t.manBits);
  }
  return negative ? -v : v;
}

// A quiet NaN pattern (the poison of floating outputs).
inline uint64_t nanBits(const TypeInfo& t) {
  const uint64_t expMask = (1ull << t.expBits) - 1;
  if (!t.ieee) return (expMask << t.manBits) | ((1ull << t.manBits) - 1);
  return (expMask << t.manBits) | (1ull << (t.manBits - 1));
}

// Spacing of representable values of `t` at magnitude |v| (the subnormal spacing below
// the smallest normal number).
inline double ulpAt(const TypeInfo& t, double v) {
  const int minExp = 1 - t.bias();
  int e;
  std::frexp(std::fabs(v), &e);  // |v| in [2^(e-1), 2^e)
  const int exponent = std::max(e - 1, minExp);
  return std::ldexp(1.0, exponent - t.manBits);
}

// ---------------------------------------------------------------------------------------
// Inputs
// ---------------------------------------------------------------------------------------

// A floating bit pattern with a random sign and mantissa and a magnitude in
// [2^lo, 2^hi), or +0 / -0 with probability 1/16.
inline uint64_t randomFloatBits(const TypeInfo& t, uint64_t r, int lo, int hi) {
  const uint64_t sign = (r & 1) << (t.expBits + t.manBits);
  if (((r >> 1) & 15) == 0) return sign;  // signed zero
  const uint64_t span = uint64_t(hi - lo);
  const uint64_t e = uint64_t(t.bias() + lo) + (r >> 5) % span;
  const uint64_t m = (r >> 13) & ((1ull << t.manBits) - 1);
  // float64 needs 52 mantissa bits but only 51 are left above bit 13: draw them again.
  const uint64_t mm = t.manBits > 51 ? splitmix64(r) & ((1ull << t.manBits) - 1) : m;
  return sign | (e << t.manBits) | mm;
}

// Raw bits of element `index` of rank `rank`'s input for a reduction `red`.
// Floating magnitudes stay in ranges where no sum, product or average of up to four ranks
// can overflow even float8_e4m3fn (max 448); integers use their full range so that wrap
// around is exercised.
inline uint64_t inputBits(const TypeInfo& t, Red red, uint64_t seed, int rank, uint64_t index) {
  const uint64_t r = randomBits(seed, rank, index);
  switch (t.kind) {
    case Kind::Bool:
      return r & 1;
    case Kind::Signed:
    case Kind::Unsigned:
      return r & mask(t);
    case Kind::Float:
      if (red == Red::Prod) return randomFloatBits(t, r, -1, 1);  // [0.5, 2)
      return randomFloatBits(t, r, -3, 3);                        // [1/8, 8)
  }
  return 0;
}

// Fills `count` elements of `buf` with rank `rank`'s input elements [first, first + count).
inline void fillInput(const TypeInfo& t, Red red, uint64_t seed, int rank, void* buf, size_t count,
                      size_t first = 0) {
  for (size_t i = 0; i < count; ++i) storeBits(t, buf, i, inputBits(t, red, seed, rank, first + i));
}

// Arbitrary bit patterns (NaNs and all), for operations that must copy bit-exactly.
inline uint64_t anyBits(const TypeInfo& t, uint64_t seed, int rank, uint64_t index) {
  return randomBits(seed, rank, index) & mask(t);
}

inline void fillAnyBits(const TypeInfo& t, uint64_t seed, int rank, void* buf, size_t count,
                        size_t first = 0) {
  for (size_t i = 0; i < count; ++i) storeBits(t, buf, i, anyBits(t, seed, rank, first + i));
}

// Poison for an output element whose expected value has bits `expected`: NaN for floating
// types, the complement of the expected value for integers (so an element that is never
// written can never pass by chance), 0xA5 for bool (neither 0 nor 1).
inline uint64_t poisonBits(const TypeInfo& t, uint64_t expected) {
  switch (t.kind) {
    case Kind::Float:
      return nanBits(t);
    case Kind::Bool:
      return 0xA5;
    default:
      return ~expected & mask(t);
  }
}

// ---------------------------------------------------------------------------------------
// References
// ---------------------------------------------------------------------------------------

// The scalar of a PreMulSum for a case (same on every rank).
inline double premulScalar(uint64_t seed) {
  static const double kScalars[] = {0.5, -1.25, 0.3, 3.0};
  return kScalars[splitmix64(seed) % 4];
}

struct Expected {
  bool exact = true;   // integers/bool, float max/min and copies: bits must match
  uint64_t bits = 0;   // exact: the expected bits; otherwise unused
  double value = 0.0;  // floating: the float64 reference
  double tol = 0.0;    // floating: allowed |got - value|
};

// Expected result of reducing `values` (raw bits of the sources, in rank order) with `red`.
inline Expected reduceReference(const TypeInfo& t, Red red, const uint64_t* values, int n,
                                double scalar) {
  Expected ex;
  if (t.kind == Kind::Bool) {
    uint64_t acc = values[0] != 0;
    for (int k = 1; k < n; ++k) {
      const uint64_t v = values[k] != 0;
      switch (red) {
        case Red::Sum:
        case Red::Max:
        case Red::Bor:
          acc |= v;
          break;
        case Red::Prod:
        case Red::Min:
        case Red::Band:
          acc &= v;
          break;
        case Red::Bxor:
          acc ^= v;
          break;
        default:
          break;
      }
    }
    ex.bits = acc;
    return ex;
  }
  if (t.isInteger()) {
    const uint64_t m = mask(t);
    const bool isSigned = t.kind == Kind::Signed;
    uint64_t acc = values[0];
    __int128 wide = isSigned ? __int128(signExtend(t, values[0])) : __int128(values[0]);
    for (int k = 1; k < n; ++k) {
      const uint64_t v = values[k];
      switch (red) {
        case Red::Sum:
          acc += v;
          break;
        case Red::Prod:
          acc *= v;
          break;
        case Red::Band:
          acc &= v;
          break;
        case Red::Bor:
          acc |= v;
          break;
        case Red::Bxor:
          acc ^= v;
          break;
        case Red::Max:
          if (isSigned ? signExtend(t, v) > signExtend(t, acc) : v > acc) acc = v;
          break;
        case Red::Min:
          if (isSigned ? signExtend(t, v) < signExtend(t, acc) : v < acc) acc = v;
          break;
        case Red::Avg:
          wide += isSigned ? __int128(signExtend(t, v)) : __int128(v);
          break;
        default:
          break;
      }
    }
    // AVG: the exact sum divided by n, truncated toward zero (C division).
    if (red == Red::Avg) acc = uint64_t(wide / n);
    ex.bits = acc & m;
    return ex;
  }

  // Floating point: float64 reference plus a bound on the library's error, which
  // accumulates in float32 for the 16/8-bit types and float32, float64 for float64, and
  // rounds once to the output type.
  const double accUnit = t.size == 8 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
  if (red == Red::Max || red == Red::Min) {
    size_t best = 0;
    for (int k = 1; k < n; ++k) {
      const double v = decodeFloat(t, values[k]);
      const double b = decodeFloat(t, values[best]);
      if (red == Red::Max ? v > b : v < b) best = size_t(k);
    }
    ex.exact = false;  // +0 and -0 compare equal; either is a correct max/min
    ex.value = decodeFloat(t, values[best]);
    ex.tol = 0.0;
    return ex;
  }
  ex.exact = false;
  double acc = 0.0;
  double absAcc = 0.0;
  if (red == Red::Prod) {
    acc = 1.0;
    for (int k = 0; k < n; ++k) acc *= decodeFloat(t, values[k]);
    ex.value = acc;
    ex.tol = (n + 1) * accUnit * std::fabs(acc) + ulpAt(t, acc);
    return ex;
  }
  const double s = red == Red::PreMulSum ? scalar : 1.0;
  for (int k = 0; k < n; ++k) {
    const double x = decodeFloat(t, values[k]) * s;
    acc += x;
    absAcc += std::fabs(x);
  }
  // Each float32/float64 addition (and the scalar's rounding plus each product, for
  // PreMulSum) contributes at most one unit of the accumulation type relative to the
  // magnitudes involved; the final rounding to the output type at most one ulp.
  double tol = (n + 2) * accUnit * absAcc;
  if (red == Red::Avg) {
    acc /= n;
    tol = tol / n + accUnit * std::fabs(acc);
  }
  ex.value = acc;
  ex.tol = tol + ulpAt(t, acc);
  return ex;
}

// Checks one output element; returns an empty string when it is correct.
inline std::string checkElement(const TypeInfo& t, uint64_t got, const Expected& ex) {
  if (ex.exact) {
    if ((got & mask(t)) == (ex.bits & mask(t))) return "";
    if (t.isFloat()) {
      return format("got %.9g (0x%llx), expected %.9g (0x%llx)", decodeFloat(t, got),
                    (unsigned long long)got, decodeFloat(t, ex.bits), (unsigned long long)ex.bits);
    }
    if (t.kind == Kind::Signed) {
      return format("got %lld, expected %lld", (long long)signExtend(t, got),
                    (long long)signExtend(t, ex.bits));
    }
    return format("got %llu (0x%llx), expected %llu (0x%llx)", (unsigned long long)got,
                  (unsigned long long)got, (unsigned long long)ex.bits,
                  (unsigned long long)ex.bits);
  }
  const double g = decodeFloat(t, got);
  if (std::isfinite(g) && std::fabs(g - ex.value) <= ex.tol) return "";
  return format("got %.9g (0x%llx), expected %.9g within %.3g", g, (unsigned long long)got,
                ex.value, ex.tol);
}

// Accumulates element mismatches of one output buffer into a single failure message that
// names the case and shows the first few offending elements.
class OutputChecker {
 public:
  OutputChecker(const TypeInfo& t, std::string what) : t_(t), what_(std::move(what)) {}

  void expect(const void* buf, size_t index, const Expected& ex) {
    const std::string problem = checkElement(t_, loadBits(t_, buf, index), ex);
    if (problem.empty()) return;
    if (bad_ < 3) detail_ += format("\n      [%zu] %s", index, problem.c_str());
    ++bad_;
  }

  void expectBits(const void* buf, size_t index, uint64_t bits) {
    Expected ex;
    ex.bits = bits;
    expect(buf, index, ex);
  }

  // Records one failure for all mismatches; returns true when there were none.
  bool report(const char* file, int line) {
    if (bad_ == 0) return true;
    recordFailure(file, line,
                  format("%s: %zu wrong element(s)%s", what_.c_str(), bad_, detail_.c_str()));
    return false;
  }

 private:
  const TypeInfo& t_;
  std::string what_;
  size_t bad_ = 0;
  std::string detail_;
};

// A byte buffer of `count` elements of `t` (always at least one byte, so that its data()
// is a valid non-NULL pointer even for count 0).
// Where Buffers live: ordinary host memory (collectives are staged through the
// communicator's segment) or spyreccl's memory arena (spyrecclMemAlloc: large collectives
// read peers' buffers directly). Set per test process before the ranks are forked.
enum class Memory { kHost, kArena };
inline Memory& bufferMemory() {
  static Memory memory = Memory::kHost;
  return memory;
}

// At least one byte, so that data() is never NULL (count 0 still passes a valid pointer).
class Buffer {
 public:
  Buffer(const TypeInfo& t, size_t count)
      : size_(std::max<size_t>(count * t.size, 1)), memory_(bufferMemory()) {
    if (memory_ == Memory::kArena) {
      void* p = nullptr;
      if (spyrecclMemAlloc(&p, size_) != spyrecclSuccess) {
        std::fprintf(stderr, "spyrecclMemAlloc(%zu) failed: %s\n", size_,
                     spyrecclGetLastError(nullptr));
        std::abort();
      }
      data_ = static_cast<char*>(p);
    } else {
      host_.resize(size_);
      data_ = host_.data();
    }
  }
  ~Buffer() {
    if (memory_ == Memory::kArena && data_ != nullptr &&
        spyrecclMemFree(data_) != spyrecclSuccess) {
      std::fprintf(stderr, "spyrecclMemFree failed: %s\n", spyrecclGetLastError(nullptr));
      std::abort();
    }
  }
  // Movable (tests keep vectors of buffers): a moved std::vector keeps its storage.
  Buffer(Buffer&& o) noexcept
      : size_(o.size_), memory_(o.memory_), host_(std::move(o.host_)), data_(o.data_) {
    o.data_ = nullptr;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer& operator=(Buffer&&) = delete;

  void* data() { return data_; }
  size_t size() const { return size_; }
  char* at(const TypeInfo& t, size_t index) { return data_ + index * t.size; }

 private:
  size_t size_;
  Memory memory_;
  std::vector<char> host_;
  char* data_ = nullptr;
};

// ---- helpers shared by the test files ------------------------------------------------------

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Expects `count` elements of `buf` to be rank `src`'s message under `seed` (anyBits).
inline void checkMessage(const TypeInfo& t, const void* buf, size_t count, uint64_t seed, int src,
                         const std::string& what) {
  OutputChecker check(t, what);
  for (size_t i = 0; i < count; ++i) check.expectBits(buf, i, anyBits(t, seed, src, i));
  check.report(__FILE__, __LINE__);
}

// Poison: the complement of the expected message, so no element can pass unwritten.
inline void poisonMessage(const TypeInfo& t, void* buf, size_t count, uint64_t seed, int src) {
  for (size_t i = 0; i < count; ++i) storeBits(t, buf, i, ~anyBits(t, seed, src, i) & mask(t));
}

// A call that started at `startNs` (monotonicNs) and returned `rc` while rank `victim` died:
// it must fail with spyrecclRemoteError within 2 s of the start, naming the dead rank.
inline void expectDeathReported(RankContext& ctx, spyrecclResult_t rc, int victim,
                                int64_t startNs) {
  const int64_t ms = (monotonicNs() - startNs) / 1000000;
  SPY_CHECK(rc == spyrecclRemoteError, "expected spyrecclRemoteError, got %s: \"%s\"",
            spyrecclGetErrorString(rc), spyrecclGetLastError(ctx.comm));
  SPY_CHECK(ms < 2100, "the death of rank %d was reported after %lld ms", victim, (long long)ms);
  const std::string msg = spyrecclGetLastError(ctx.comm);
  SPY_CHECK(contains(msg, "rank " + std::to_string(victim)),
            "the message should name the dead rank %d: \"%s\"", victim, msg.c_str());
}

}  // namespace spyreccl_test
