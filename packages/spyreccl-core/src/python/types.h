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

// The ReduceOp passed as argument 'op' of API call `api`. Members of the bound ReduceOp class
// are recognised by their type and read as the ints they are: pybind11's native-enum
// conversion looks attributes up and cost ~250 ns per call, a quarter of a small
// allreduce's time in Python. Anything else goes through that conversion, and a non-ReduceOp
// (a raw int included) raises TypeError naming the call.
ReduceOp reduce_op_arg(py::handle op, const char* api);

// Binds DataType, ReduceOp and Result as enum.IntEnum subclasses.
void bind_types(py::module_& m);

}  // namespace spyreccl_py
