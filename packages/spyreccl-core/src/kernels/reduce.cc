// Reduction kernels: every (data type, reduce op) pair of the C API.
//
// Structure, from the outside in:
//  - reduce() picks one entry function per data type from a table (no per-element switch);
//  - each entry function is compiled several times for different x86-64 levels
//    (target_clones: the loader picks the best one for the CPU once, through an ifunc);
//  - inside it, a switch on the reduce op selects a Kernel<Codec, Op, Pre, Post>
//    instantiation whose loops are always inlined into the clone, so that each clone
//    vectorises them for its own instruction set.
//
// A Codec describes how a storage element widens to the accumulation type and narrows back
// (identity for native types, float32 for float16/bfloat16/float8, 0/1 for bool, a wider
// integer for integer AVG). Pre is applied to every source element (PreMulSum's scalar),
// Post once to the combined value (AVG's division).
//
// The kernels are memory-bound: each source is read exactly once and dst written once.
// Two sources are combined in a single fused loop; more sources go through an accumulator
// block on the stack that stays in L1 while every source streams through it. Loops run
// over fixed-size blocks so that GCC vectorises them even at -O2 (whose "very cheap" cost
// model refuses loops with a runtime trip count); only the tail of a call is scalar there.
#include "kernels/reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels/half.h"

// Results must not depend on which clone runs (nor on -O level): multiplications are never
// fused into additions, so a PreMulSum computes exactly sum_r(round(scalar * x_r)), like
// an unfused float reference (and like the default clone, which has no FMA).
#if defined(__clang__)
#define SPYRECCL_NO_FP_CONTRACT
#else
#define SPYRECCL_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define SPYRECCL_KERNEL_CLONES \
  __attribute__((              \
      target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) SPYRECCL_NO_FP_CONTRACT
#else
#define SPYRECCL_KERNEL_CLONES SPYRECCL_NO_FP_CONTRACT
#endif

#define SPYRECCL_ALWAYS_INLINE inline __attribute__((always_inline))

#if defined(__clang__)
#define SPYRECCL_COLD_PATH __attribute__((noinline))
#else
#define SPYRECCL_COLD_PATH __attribute__((noinline, optimize("no-tree-vectorize")))
#endif

namespace spyreccl::kernels {
namespace {

// Elements are processed in blocks of this many bytes of accumulator: small enough that
// the accumulator stays in L1 while the sources stream through, large enough to amortise
// the per-block loop over sources.
constexpr size_t kBlockBytes = 8192;

// ------------------------------------------------------------------------------------
// Codecs: storage type <-> accumulation type
// ------------------------------------------------------------------------------------

template <class T>
struct NativeCodec {
  using Storage = T;
  using Acc = T;
  static SPYRECCL_ALWAYS_INLINE Acc load(Storage v) { return v; }
  static SPYRECCL_ALWAYS_INLINE Storage store(Acc a) { return a; }
  static constexpr bool kLossless = true;  // load/store round-trips every bit pattern
};

struct Float16Codec {
  using Storage = uint16_t;
  using Acc = float;
  static SPYRECCL_ALWAYS_INLINE Acc load(Storage v) { return halfToFloat(v); }
  static SPYRECCL_ALWAYS_INLINE Storage store(Acc a) { return floatToHalf(a); }
  static constexpr bool kLossless = false;  // NaN payloads are canonicalised
};

struct Bfloat16Codec {
  using Storage = uint16_t;
  using Acc = float;
  static SPYRECCL_ALWAYS_INLINE Acc load(Storage v) { return bf16ToFloat(v); }
  static SPYRECCL_ALWAYS_INLINE Storage store(Acc a) { return floatToBf16(a); }
  static constexpr bool kLossless = false;
};

struct Float8e4m3Codec {
  using Storage = uint8_t;
  using Acc = float;
  static SPYRECCL_ALWAYS_INLINE Acc load(Storage v) { return e4m3fnToFloat(v); }
  static SPYRECCL_ALWAYS_INLINE Storage store(Acc a) { return floatToE4m3fn(a); }
  static constexpr bool kLossless = false;
};

struct Float8e5m2Codec {
  using Storage = uint8_t;
  using Acc = float;
  static SPYRECCL_ALWAYS_INLINE Acc load(Storage v) { return e5m2ToFloat(v); }
  static SPYRECCL_ALWAYS_INLINE Storage store(Acc a) { return floatToE5m2(a); }
  static constexpr bool kLossless = false;
};

// bool is one byte; any non-zero byte reads as true and results are written as 0/1.
struct BoolCodec {
  using Storage = uint8_t;
  using Acc = uint8_t;
  static SPYRECCL_ALWAYS_INLINE Acc load(Storage v) { return v != 0; }
  static SPYRECCL_ALWAYS_INLINE Storage store(Acc a) { return a; }
  static constexpr bool kLossless = false;  // normalises to 0/1
};

// Integer AVG: sums in a type wide enough that no realistic number of sources can overflow
// it (int64 for <= 32-bit types, 128-bit for 64-bit types), so the quotient is the exact
// sum divided by n, which always fits the storage type again.
template <class T, class Wide>
struct WidenedCodec {
  using Storage = T;
  using Acc = Wide;
  static SPYRECCL_ALWAYS_INLINE Acc load(Storage v) { return Acc(v); }
  static SPYRECCL_ALWAYS_INLINE Storage store(Acc a) { return Storage(a); }
  static constexpr bool kLossless = true;
};

// ------------------------------------------------------------------------------------
// Binary operations on the accumulation type
// ------------------------------------------------------------------------------------

// Integer arithmetic wraps around (two's complement): compute in an unsigned type at least
// as wide as unsigned int, so that neither signed overflow nor the promotion of small
// unsigned types to int can invoke undefined behaviour.
template <class A>
using WrapType = std::common_type_t<std::make_unsigned_t<A>, unsigned>;

struct SumOp {
  template <class A>
  static SPYRECCL_ALWAYS_INLINE A apply(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      return A(WrapType<A>(a) + WrapType<A>(b));
    } else {
      return a + b;
    }
  }
};

struct ProdOp {
  template <class A>
  static SPYRECCL_ALWAYS_INLINE A apply(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      return A(WrapType<A>(a) * WrapType<A>(b));
    } else {
      return a * b;
    }
  }
};

// Sum in a widened accumulator (WidenedCodec): cannot overflow, and the 128-bit types are
// not std::is_integral in strict C++17 mode, so plain + on purpose.
struct ExactSumOp {
  template <class A>
  static SPYRECCL_ALWAYS_INLINE A apply(A a, A b) {
    return a + b;
  }
};

// Floating MAX/MIN follow torch.maximum/torch.minimum: a NaN in either operand yields NaN,
// and when the operands compare equal (+0 and -0) the first one (the earlier source) wins.
struct MaxOp {
  template <class A>
  static SPYRECCL_ALWAYS_INLINE A apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) {
      // `|`, not `||`: both comparisons are evaluated unconditionally, which lets GCC
      // turn this into a vector blend (it may not speculate a possibly-trapping compare).
      return ((b > a) | (b != b)) ? b : a;
    } else {
      return b > a ? b : a;
    }
  }
};

struct MinOp {
  template <class A>
  static SPYRECCL_ALWAYS_INLINE A apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) {
      return ((b < a) | (b != b)) ? b : a;
    } else {
      return b < a ? b : a;
    }
  }
};

struct AndOp {
  template <class A>
  static SPYRECCL_ALWAYS_INLINE A apply(A a, A b) {
    return A(a & b);
  }
};

struct OrOp {
  template <class A>
  static SPYRECCL_ALWAYS_INLINE A apply(A a, A b) {
    return A(a | b);
  }
};

struct XorOp {
  template <class A>
  static SPYRECCL_ALWAYS_INLINE A apply(A a, A b) {
    return A(a ^ b);
  }
};

// ------------------------------------------------------------------------------------
// Element-wise transforms before (Pre) and after (Post) combining
// ------------------------------------------------------------------------------------

struct Identity {
  static constexpr bool kIsIdentity = true;
  template <class A>
  SPYRECCL_ALWAYS_INLINE A operator()(A a) const {
    return a;
  }
};

// PreMulSum: scalar applied in the accumulation type.
template <class A>
struct Scale {
  static constexpr bool kIsIdentity = false;
  A scalar;
  SPYRECCL_ALWAYS_INLINE A operator()(A a) const { return a * scalar; }
};

// AVG: floating types divide (not multiply by 1/n, which rounds differently); integer
// types truncate toward zero, as C++ division does.
template <class A>
struct Divide {
  static constexpr bool kIsIdentity = false;
  A divisor;
  SPYRECCL_ALWAYS_INLINE A operator()(A a) const { return a / divisor; }
};

// ------------------------------------------------------------------------------------
// The loops
// ------------------------------------------------------------------------------------

template <class Codec, class Op, class Pre, class Post>
struct Kernel {
  using S = typename Codec::Storage;
  using A = typename Codec::Acc;
  static constexpr size_t kBlock = kBlockBytes / sizeof(A);

  Pre pre;
  Post post;

  SPYRECCL_ALWAYS_INLINE A in(S v) const { return pre(Codec::load(v)); }
  SPYRECCL_ALWAYS_INLINE S out(A a) const { return Codec::store(post(a)); }

  // d = out(in(x))
  SPYRECCL_ALWAYS_INLINE void copy(S* __restrict d, const S* __restrict x, size_t n) const {
    for (size_t i = 0; i < n; ++i) d[i] = out(in(x[i]));
  }
  SPYRECCL_ALWAYS_INLINE void copyInPlace(S* __restrict d, size_t n) const {
    for (size_t i = 0; i < n; ++i) d[i] = out(in(d[i]));
  }
  // d = out(op(in(x), in(y)))
  SPYRECCL_ALWAYS_INLINE void combine2(S* __restrict d, const S* __restrict x,
                                       const S* __restrict y, size_t n) const {
    for (size_t i = 0; i < n; ++i) d[i] = out(Op::apply(in(x[i]), in(y[i])));
  }
  SPYRECCL_ALWAYS_INLINE void combine2InPlace(S* __restrict d, const S* __restrict y,
                                              size_t n) const {
    for (size_t i = 0; i < n; ++i) d[i] = out(Op::apply(in(d[i]), in(y[i])));
  }
  // Accumulator steps for three or more sources.
  SPYRECCL_ALWAYS_INLINE void start(A* __restrict acc, const S* __restrict x, const S* __restrict y,
                                    size_t n) const {
    for (size_t i = 0; i < n; ++i) acc[i] = Op::apply(in(x[i]), in(y[i]));
  }
  SPYRECCL_ALWAYS_INLINE void accumulate(A* __restrict acc, const S* __restrict x, size_t n) const {
    for (size_t i = 0; i < n; ++i) acc[i] = Op::apply(acc[i], in(x[i]));
  }
  SPYRECCL_ALWAYS_INLINE void finish(S* __restrict d, const A* __restrict acc,
                                     const S* __restrict x, size_t n) const {
    for (size_t i = 0; i < n; ++i) d[i] = out(Op::apply(acc[i], in(x[i])));
  }

  // Two or more sources, elements [off, off + n).
  SPYRECCL_ALWAYS_INLINE void block(S* d, const S* const* srcs, int nsrc, size_t off,
                                    size_t n) const {
    if (nsrc == 2) {
      if (d == srcs[0]) {
        combine2InPlace(d + off, srcs[1] + off, n);
      } else {
        combine2(d + off, srcs[0] + off, srcs[1] + off, n);
      }
    } else {
      // srcs[0] (which d may alias) is fully read by start() before finish() writes d.
      alignas(64) A acc[kBlock];
      start(acc, srcs[0] + off, srcs[1] + off, n);
      for (int k = 2; k < nsrc - 1; ++k) accumulate(acc, srcs[k] + off, n);
      finish(d + off, acc, srcs[nsrc - 1] + off, n);
    }
  }

  // Any number of sources and any length <= kBlock: the tail of a call and the
  // single-source case. Kept out of line, out of the per-ISA clones and unvectorised: it
  // handles less than one block per call, and at -O3 its runtime-length loops would
  // otherwise be versioned and vectorised into most of this file's code size.
  SPYRECCL_COLD_PATH void anyLength(S* d, const S* const* srcs, int nsrc, size_t off,
                                    size_t n) const {
    if (nsrc == 1) {
      if (d == srcs[0]) {
        copyInPlace(d + off, n);
      } else {
        copy(d + off, srcs[0] + off, n);
      }
    } else {
      block(d, srcs, nsrc, off, n);
    }
  }

  SPYRECCL_ALWAYS_INLINE void run(void* dst, const void* const* srcs_, int nsrc,
                                  size_t count) const {
    S* d = static_cast<S*>(dst);
    const S* const* srcs = reinterpret_cast<const S* const*>(srcs_);
    if (nsrc == 1) {
      if constexpr (Codec::kLossless && Pre::kIsIdentity && Post::kIsIdentity) {
        // Nothing to apply: a copy (or nothing at all, in place).
        if (d != srcs[0]) std::memcpy(d, srcs[0], count * sizeof(S));
        return;
      }
      // A single source only happens for a communicator of one rank: not worth a clone.
      for (size_t off = 0; off < count; off += kBlock) {
        anyLength(d, srcs, 1, off, count - off < kBlock ? count - off : kBlock);
      }
      return;
    }
    // Full blocks: the trip count is the constant kBlock once inlined, which is what lets
    // even -O2 vectorise these loops.
    size_t off = 0;
    for (; off + kBlock <= count; off += kBlock) block(d, srcs, nsrc, off, kBlock);
    if (off < count) anyLength(d, srcs, nsrc, off, count - off);
  }
};

template <class Codec, class Op, class Pre = Identity, class Post = Identity>
SPYRECCL_ALWAYS_INLINE void runKernel(void* dst, const void* const* srcs, int nsrc, size_t count,
                                      Pre pre = Pre{}, Post post = Post{}) {
  Kernel<Codec, Op, Pre, Post>{pre, post}.run(dst, srcs, nsrc, count);
}

[[noreturn]] void unsupported(const ReduceSpec& spec) {
  // Reached only when a caller skipped validate(): a bug in the caller, not user input.
  std::string why;
  validate(spec, &why);
  throw std::logic_error("spyreccl::kernels::reduce called with an invalid spec: " + why);
}

// ------------------------------------------------------------------------------------
// Per type-family op selection
// ------------------------------------------------------------------------------------

// float32 and float64 (accumulate in themselves) and the 16/8-bit floats (in float32).
template <class Codec>
SPYRECCL_ALWAYS_INLINE void reduceFloating(const ReduceSpec& spec, void* dst,
                                           const void* const* srcs, int nsrc, size_t count) {
  using A = typename Codec::Acc;
  switch (spec.op) {
    case spyrecclSum:
      if (spec.premul) {
        runKernel<Codec, SumOp>(dst, srcs, nsrc, count, Scale<A>{A(spec.scalar)}, Identity{});
      } else {
        runKernel<Codec, SumOp>(dst, srcs, nsrc, count);
      }
      return;
    case spyrecclProd:
      if (spec.premul) break;
      runKernel<Codec, ProdOp>(dst, srcs, nsrc, count);
      return;
    case spyrecclMax:
      if (spec.premul) break;
      runKernel<Codec, MaxOp>(dst, srcs, nsrc, count);
      return;
    case spyrecclMin:
      if (spec.premul) break;
      runKernel<Codec, MinOp>(dst, srcs, nsrc, count);
      return;
    case spyrecclAvg:
      if (spec.premul || spec.avgDivisor < 1) break;
      runKernel<Codec, SumOp>(dst, srcs, nsrc, count, Identity{}, Divide<A>{A(spec.avgDivisor)});
      return;
    default:
      break;
  }
  unsupported(spec);
}

template <class T>
struct WideFor {
  using type = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
};
template <>
struct WideFor<int64_t> {
  __extension__ using type = __int128;
};
template <>
struct WideFor<uint64_t> {
  __extension__ using type = unsigned __int128;
};

template <class T>
SPYRECCL_ALWAYS_INLINE void reduceInteger(const ReduceSpec& spec, void* dst,
                                          const void* const* srcs, int nsrc, size_t count) {
  using Codec = NativeCodec<T>;
  if (spec.premul) unsupported(spec);
  switch (spec.op) {
    case spyrecclSum:
      runKernel<Codec, SumOp>(dst, srcs, nsrc, count);
      return;
    case spyrecclProd:
      runKernel<Codec, ProdOp>(dst, srcs, nsrc, count);
      return;
    case spyrecclMax:
      runKernel<Codec, MaxOp>(dst, srcs, nsrc, count);
      return;
    case spyrecclMin:
      runKernel<Codec, MinOp>(dst, srcs, nsrc, count);
      return;
    case spyrecclAvg: {
      if (spec.avgDivisor < 1) break;
      using W = typename WideFor<T>::type;
      runKernel<WidenedCodec<T, W>, ExactSumOp>(dst, srcs, nsrc, count, Identity{},
                                                Divide<W>{W(spec.avgDivisor)});
      return;
    }
    case spyrecclBand:
      runKernel<Codec, AndOp>(dst, srcs, nsrc, count);
      return;
    case spyrecclBor:
      runKernel<Codec, OrOp>(dst, srcs, nsrc, count);
      return;
    case spyrecclBxor:
      runKernel<Codec, XorOp>(dst, srcs, nsrc, count);
      return;
    default:
      break;
  }
  unsupported(spec);
}

SPYRECCL_ALWAYS_INLINE void reduceBoolean(const ReduceSpec& spec, void* dst,
                                          const void* const* srcs, int nsrc, size_t count) {
  if (spec.premul) unsupported(spec);
  switch (spec.op) {
    case spyrecclSum:
    case spyrecclMax:
    case spyrecclBor:
      runKernel<BoolCodec, OrOp>(dst, srcs, nsrc, count);
      return;
    case spyrecclProd:
    case spyrecclMin:
    case spyrecclBand:
      runKernel<BoolCodec, AndOp>(dst, srcs, nsrc, count);
      return;
    case spyrecclBxor:
      runKernel<BoolCodec, XorOp>(dst, srcs, nsrc, count);
      return;
    default:
      break;
  }
  unsupported(spec);
}

// ------------------------------------------------------------------------------------
// One entry point per data type
// ------------------------------------------------------------------------------------

using EntryFn = void (*)(const ReduceSpec&, void*, const void* const*, int, size_t);

// float32/float64/float16/bfloat16 (the gradients of training) get one clone per x86-64
// level. Integer, bool and float8 reductions are rare and already vectorised with SSE2 in
// the default build; cloning them too would triple their share of the code size (float8's
// widening conversions alone would be a third of this file's object code) and its compile
// time for little gain in a memory-bound loop.
#define SPYRECCL_DEFINE_ENTRY(attrs, name, body)                                        \
  attrs void name(const ReduceSpec& spec, void* dst, const void* const* srcs, int nsrc, \
                  size_t count) {                                                       \
    body(spec, dst, srcs, nsrc, count);                                                 \
  }
#define SPYRECCL_NO_ATTRS

SPYRECCL_DEFINE_ENTRY(SPYRECCL_NO_ATTRS, reduceInt8, reduceInteger<int8_t>)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_NO_ATTRS, reduceUint8, reduceInteger<uint8_t>)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_NO_ATTRS, reduceInt16, reduceInteger<int16_t>)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_NO_ATTRS, reduceInt32, reduceInteger<int32_t>)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_NO_ATTRS, reduceUint32, reduceInteger<uint32_t>)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_NO_ATTRS, reduceInt64, reduceInteger<int64_t>)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_NO_ATTRS, reduceUint64, reduceInteger<uint64_t>)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_NO_ATTRS, reduceBool, reduceBoolean)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_NO_ATTRS, reduceFloat8e4m3, reduceFloating<Float8e4m3Codec>)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_NO_ATTRS, reduceFloat8e5m2, reduceFloating<Float8e5m2Codec>)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_KERNEL_CLONES, reduceFloat16, reduceFloating<Float16Codec>)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_KERNEL_CLONES, reduceFloat32, reduceFloating<NativeCodec<float>>)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_KERNEL_CLONES, reduceFloat64, reduceFloating<NativeCodec<double>>)
SPYRECCL_DEFINE_ENTRY(SPYRECCL_KERNEL_CLONES, reduceBfloat16, reduceFloating<Bfloat16Codec>)

#undef SPYRECCL_NO_ATTRS
#undef SPYRECCL_DEFINE_ENTRY

// Indexed by spyrecclDataType_t.
constexpr EntryFn kEntries[spyrecclNumTypes] = {
    reduceInt8,       reduceUint8,      reduceInt32,   reduceUint32,  reduceInt64,
    reduceUint64,     reduceFloat16,    reduceFloat32, reduceFloat64, reduceBfloat16,
    reduceFloat8e4m3, reduceFloat8e5m2, reduceInt16,   reduceBool,
};

bool validDtype(spyrecclDataType_t dtype) {
  return static_cast<int>(dtype) >= 0 && dtype < spyrecclNumTypes;
}

}  // namespace

size_t dtypeSize(spyrecclDataType_t dtype) {
  switch (dtype) {
    case spyrecclInt8:
    case spyrecclUint8:
    case spyrecclFloat8e4m3:
    case spyrecclFloat8e5m2:
    case spyrecclBool:
      return 1;
    case spyrecclFloat16:
    case spyrecclBfloat16:
    case spyrecclInt16:
      return 2;
    case spyrecclInt32:
    case spyrecclUint32:
    case spyrecclFloat32:
      return 4;
    case spyrecclInt64:
    case spyrecclUint64:
    case spyrecclFloat64:
      return 8;
    default:
      return 0;
  }
}

const char* dtypeName(spyrecclDataType_t dtype) {
  switch (dtype) {
    case spyrecclInt8:
      return "int8";
    case spyrecclUint8:
      return "uint8";
    case spyrecclInt32:
      return "int32";
    case spyrecclUint32:
      return "uint32";
    case spyrecclInt64:
      return "int64";
    case spyrecclUint64:
      return "uint64";
    case spyrecclFloat16:
      return "float16";
    case spyrecclFloat32:
      return "float32";
    case spyrecclFloat64:
      return "float64";
    case spyrecclBfloat16:
      return "bfloat16";
    case spyrecclFloat8e4m3:
      return "float8_e4m3fn";
    case spyrecclFloat8e5m2:
      return "float8_e5m2";
    case spyrecclInt16:
      return "int16";
    case spyrecclBool:
      return "bool";
    default:
      return "invalid";
  }
}

const char* opName(spyrecclRedOp_t op, bool premul) {
  if (premul) return "premul_sum";
  switch (op) {
    case spyrecclSum:
      return "sum";
    case spyrecclProd:
      return "prod";
    case spyrecclMax:
      return "max";
    case spyrecclMin:
      return "min";
    case spyrecclAvg:
      return "avg";
    case spyrecclBand:
      return "band";
    case spyrecclBor:
      return "bor";
    case spyrecclBxor:
      return "bxor";
    default:
      return "invalid";
  }
}

bool isFloatingType(spyrecclDataType_t dtype) {
  switch (dtype) {
    case spyrecclFloat16:
    case spyrecclFloat32:
    case spyrecclFloat64:
    case spyrecclBfloat16:
    case spyrecclFloat8e4m3:
    case spyrecclFloat8e5m2:
      return true;
    default:
      return false;
  }
}

bool isIntegerType(spyrecclDataType_t dtype) {
  switch (dtype) {
    case spyrecclInt8:
    case spyrecclUint8:
    case spyrecclInt16:
    case spyrecclInt32:
    case spyrecclUint32:
    case spyrecclInt64:
    case spyrecclUint64:
      return true;
    default:
      return false;
  }
}

bool validate(const ReduceSpec& spec, std::string* why) {
  auto fail = [why](std::string msg) {
    if (why) *why = std::move(msg);
    return false;
  };
  if (!validDtype(spec.dtype)) {
    return fail("invalid data type " + std::to_string(static_cast<int>(spec.dtype)) +
                " (expected 0.." + std::to_string(spyrecclNumTypes - 1) + ")");
  }
  const std::string type = dtypeName(spec.dtype);
  if (spec.premul) {
    if (spec.op != spyrecclSum) {
      return fail(std::string("premul_sum must resolve to reduce op sum, got ") +
                  opName(spec.op, false));
    }
    if (!isFloatingType(spec.dtype)) {
      return fail("reduce op premul_sum is defined for floating-point types only, got " + type);
    }
    return true;
  }
  switch (spec.op) {
    case spyrecclSum:
    case spyrecclProd:
    case spyrecclMax:
    case spyrecclMin:
      return true;
    case spyrecclAvg:
      if (spec.dtype == spyrecclBool) {
        return fail("reduce op avg is not defined for bool");
      }
      if (spec.avgDivisor < 1) {
        return fail("reduce op avg needs a divisor >= 1, got " + std::to_string(spec.avgDivisor));
      }
      return true;
    case spyrecclBand:
    case spyrecclBor:
    case spyrecclBxor:
      if (!isIntegerType(spec.dtype) && spec.dtype != spyrecclBool) {
        return fail(std::string("reduce op ") + opName(spec.op, false) +
                    " is defined for integer and bool types only, got " + type);
      }
      return true;
    default:
      return fail("invalid reduce op " + std::to_string(static_cast<int>(spec.op)) +
                  " (expected sum, prod, max, min, avg, band, bor or bxor)");
  }
}

void reduce(const ReduceSpec& spec, void* dst, const void* const* srcs, int nsrc, size_t count) {
  if (!validDtype(spec.dtype) || nsrc < 1) {
    throw std::logic_error("spyreccl::kernels::reduce: invalid data type " +
                           std::to_string(static_cast<int>(spec.dtype)) + " or source count " +
                           std::to_string(nsrc));
  }
  if (count == 0) return;
  kEntries[spec.dtype](spec, dst, srcs, nsrc, count);
}

namespace {

#if defined(__SSE2__)
// dst[0, bytes) = src[0, bytes) for bytes a multiple of 64, with unaligned SSE2 loads and
// either plain stores or (kStream, dst 16-byte aligned) non-temporal ones. (An AVX variant
// measured no faster in the allreduce pipeline.)
template <bool kStream>
void copyLines(uint8_t* d, const uint8_t* s, size_t bytes) {
  for (size_t i = 0; i < bytes; i += 64) {
    __m128i v[4];
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16 * k));
    }
    for (int k = 0; k < 4; ++k) {
      auto* out = reinterpret_cast<__m128i*>(d + i + 16 * k);
      if constexpr (kStream) {
        _mm_stream_si128(out, v[k]);
      } else {
        _mm_storeu_si128(out, v[k]);
      }
    }
  }
}
#endif

}  // namespace

void copy(void* dst, const void* src, size_t bytes, bool streaming) {
#if defined(__SSE2__)
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  if (streaming) {
    // Streaming pays only for whole lines: align the destination to one first.
    const size_t head = std::min(bytes, (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64);
    std::memcpy(d, s, head);
    d += head;
    s += head;
    bytes -= head;
  }
  const size_t body = bytes / 64 * 64;
  if (streaming) {
    copyLines<true>(d, s, body);
    // Non-temporal stores are weakly ordered: fence them before any later (release) store
    // that may publish them.
    _mm_sfence();
  } else {
    copyLines<false>(d, s, body);
  }
  std::memcpy(d + body, s + body, bytes - body);
#else
  (void)streaming;
  std::memcpy(dst, src, bytes);
#endif
}

void reduce(const ReduceSpec& spec, void* dst, const void* const* srcs, int nsrc, size_t count,
            bool streaming) {
#if defined(__SSE2__)
  const size_t esize = dtypeSize(spec.dtype);
  constexpr size_t kChunkBytes = kBlockBytes;
  auto* d = static_cast<uint8_t*>(dst);
  // Below a few chunks the fence and the extra pass through L1 are not worth it; an output
  // that is not element-aligned cannot be brought to a cache-line boundary.
  if (!streaming || esize == 0 || count * esize < 8 * kChunkBytes ||
      reinterpret_cast<uintptr_t>(d) % esize != 0) {
    reduce(spec, dst, srcs, nsrc, count);
    return;
  }
  // Head: plain stores up to the first cache-line boundary of the output.
  const size_t head = (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64 / esize;
  reduce(spec, d, srcs, nsrc, head);
  std::vector<const void*> at(static_cast<size_t>(nsrc));
  alignas(64) uint8_t block[kChunkBytes];
  const size_t chunk = kChunkBytes / esize;
  for (size_t off = head; off < count; off += chunk) {
    const size_t len = std::min(chunk, count - off);
    for (int k = 0; k < nsrc; ++k) at[k] = static_cast<const uint8_t*>(srcs[k]) + off * esize;
    // Every source of this chunk is read before its output is written, so dst may still
    // alias srcs[0].
    reduce(spec, block, at.data(), nsrc, len);
    const size_t bytes = len * esize;
    const size_t body = bytes / 64 * 64;  // whole lines; only the last chunk has a tail
    copyLines<true>(d + off * esize, block, body);
    std::memcpy(d + off * esize + body, block + body, bytes - body);
  }
  _mm_sfence();  // once for the whole output, as in copy()
#else
  (void)streaming;
  reduce(spec, dst, srcs, nsrc, count);
#endif
}

size_t lastLevelCacheBytes() {
  static const size_t bytes = [] {
    size_t best = 0;
    for (int i = 0; i < 8; ++i) {
      char path[64];
      std::snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
      FILE* f = std::fopen(path, "r");
      if (f == nullptr) continue;
      unsigned long long v = 0;
      char unit = 0;
      if (std::fscanf(f, "%llu%c", &v, &unit) >= 1) {
        if (unit == 'K') v <<= 10;
        if (unit == 'M') v <<= 20;
        best = std::max<size_t>(best, v);
      }
      std::fclose(f);
    }
    return best ? best : size_t{32} << 20;
  }();
  return bytes;
}

}  // namespace spyreccl::kernels
