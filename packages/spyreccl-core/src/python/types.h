// types.h — DataType / ReduceOp / Result as Python IntEnums and helpers around them.
#pragma once

#include <pybind11/pybind11.h>
#include <spyreccl/spyreccl.h>

#include <cstddef>

namespace spyreccl_py {

namespace py = pybind11;

// The reduction operations offered to Python. SUM..BXOR carry the C values unchanged;
// PREMUL_SUM has no C value (the C API creates a per-communicator handle for it), so it
// takes the first value after the C range and is resolved by ReductionHandle at call time.
enum class ReduceOp : int {
  kSum = spyrecclSum,
  kProd = spyrecclProd,
  kMax = spyrecclMax,
  kMin = spyrecclMin,
  kAvg = spyrecclAvg,
  kBand = spyrecclBand,
  kBor = spyrecclBor,
  kBxor = spyrecclBxor,
  kPremulSum = spyrecclNumOps,
};

// Bytes per element of `dtype` (spyrecclGetDataTypeSize: 0 for values outside the enum).
size_t dtype_itemsize(spyrecclDataType_t dtype);
// The library's name of `dtype` (spyrecclGetDataTypeName: "float32", "bfloat16",
// "float8_e4m3fn", ...), as used in error messages; "<invalid dtype>" outside the enum.
const char* dtype_name(spyrecclDataType_t dtype);
// The Python member name of `op` ("SUM", "PREMUL_SUM", ...).
const char* reduce_op_name(ReduceOp op);

// Binds DataType, ReduceOp and Result as enum.IntEnum subclasses.
void bind_types(py::module_& m);

}  // namespace spyreccl_py
