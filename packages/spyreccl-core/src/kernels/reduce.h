// Reduction kernels and data-type facts of the core.
//
// This is the only place that knows how each (data type, reduce op) pair is computed;
// the algorithms in src/algorithms only decide *which* buffers are combined.
#pragma once

#include <cstddef>
#include <string>

#include "spyreccl/spyreccl.h"

namespace spyreccl::kernels {

// A resolved reduction: a built-in op, optionally with a pre-multiplication scalar
// (PreMulSum handles resolve to op == spyrecclSum, premul == true).
struct ReduceSpec {
  spyrecclDataType_t dtype = spyrecclFloat32;
  spyrecclRedOp_t op = spyrecclSum;  // one of spyrecclSum .. spyrecclBxor
  bool premul = false;               // multiply every source by `scalar` before summing
  double scalar = 1.0;
  int avgDivisor = 1;  // AVG divides the combined value by this (nranks)
};

// Bytes per element of `dtype`; 0 for an invalid value.
size_t dtypeSize(spyrecclDataType_t dtype);
// "float32", "bfloat16", ...; "invalid" for an invalid value.
const char* dtypeName(spyrecclDataType_t dtype);
// "sum", "prod", "max", "min", "avg", "band", "bor", "bxor", "premul_sum".
const char* opName(spyrecclRedOp_t op, bool premul);

// float16, float32, float64, bfloat16, float8_e4m3fn, float8_e5m2.
bool isFloatingType(spyrecclDataType_t dtype);
// int8, uint8, int16, int32, uint32, int64, uint64 (bool is neither).
bool isIntegerType(spyrecclDataType_t dtype);

// True when `spec` can be computed. Otherwise fills *why with a sentence such as
// "reduce op band is defined for integer and bool types only, got float32".
bool validate(const ReduceSpec& spec, std::string* why);

// dst[i] = op(srcs[0][i], ..., srcs[nsrc-1][i]) for i < count, combining the sources in
// index order (so every rank that calls it with the same sources in the same order gets
// bitwise identical results). float16/bfloat16/float8 accumulate in float32 and round
// once at the end (round-to-nearest-even). AVG divides the combined value by
// spec.avgDivisor (integers: truncation toward zero). dst may alias srcs[0] but no other
// source. nsrc >= 1. Precondition: validate(spec) holds.
void reduce(const ReduceSpec& spec, void* dst, const void* const* srcs, int nsrc, size_t count);

// reduce() whose output is written with non-temporal stores (fenced before returning), for
// outputs that will not stay in the last-level cache (see streamingPays()): the combined
// values of each block are computed into an L1-resident buffer and streamed out from there,
// which saves the read-for-ownership of every output line. Same results, same aliasing rule.
// Without `streaming`, or for short outputs, it is reduce().
void reduce(const ReduceSpec& spec, void* dst, const void* const* srcs, int nsrc, size_t count,
            bool streaming);

// memcpy(dst, src, bytes) with a plain vector loop. glibc's memcpy uses `rep movsb` for
// copies of 2 KiB up to about the L2 size, which on some x86 CPUs (AMD Zen among them) runs
// an order of magnitude slower when dst lies a few bytes above src modulo 4 KiB, e.g. a
// malloc'ed user buffer (16 bytes past a page) filled from page-aligned staging.
// With `streaming`, whole destination cache lines are written with non-temporal stores (no
// read-for-ownership, and the cache is not polluted; fenced before returning): for
// destinations that will not stay in the last-level cache. dst and src must not overlap.
void copy(void* dst, const void* src, size_t bytes, bool streaming = false);

// Size of the largest cache of CPU 0 in bytes (the last level), read once from sysfs:
// sysconf's _SC_LEVEL3_CACHE_SIZE comes from cpuid, which in a VM may describe the host's
// whole socket. 32 MiB when unknown. Decides when streaming stores pay off.
size_t lastLevelCacheBytes();

// Whether copies into the outputs of an operation whose ranks touch `workingSetBytes` in all
// (every rank's inputs, outputs and the staging they pass through) should use streaming
// stores: once the working set fills half the last-level cache, the outputs would not
// stay cached anyway (measured with the allreduce pipeline, algorithms/allreduce.cc).
// `inPlace`: the outputs are the inputs, so every output line was just read and costs no
// read-for-ownership; a streaming store then only evicts a line that the next operation on
// the same tensor would find cached. That pays only once the working set exceeds the whole
// cache (a 2-rank in-place all_reduce run back to back, 32 MiB L3: 2x slower with streaming
// at 5-10 MB, no difference at 16 MB, 20-40 % faster at 32 MB).
inline bool streamingPays(size_t workingSetBytes, bool inPlace = false) {
  return (inPlace ? workingSetBytes : 2 * workingSetBytes) >= lastLevelCacheBytes();
}

// streamingPays() for an operation in which each of `nranks` ranks has an input `send` and
// an output `recv` of `bytes` each (one buffer when they are the same).
inline bool streamingPaysFor(const void* send, const void* recv, size_t nranks, size_t bytes) {
  const bool inPlace = send == recv;
  return streamingPays((inPlace ? 1 : 2) * nranks * bytes, inPlace);
}

}  // namespace spyreccl::kernels
