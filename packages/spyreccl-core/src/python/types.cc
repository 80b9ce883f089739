// types.cc — the Python enums mirroring the C API's enums.
#include "types.h"

#include <pybind11/native_enum.h>

namespace spyreccl_py {

size_t dtype_itemsize(spyrecclDataType_t dtype) {
  switch (dtype) {
    case spyrecclInt8:
    case spyrecclUint8:
    case spyrecclFloat8e4m3:
    case spyrecclFloat8e5m2:
    case spyrecclBool:
      return 1;
    case spyrecclInt16:
    case spyrecclFloat16:
    case spyrecclBfloat16:
      return 2;
    case spyrecclInt32:
    case spyrecclUint32:
    case spyrecclFloat32:
      return 4;
    case spyrecclInt64:
    case spyrecclUint64:
    case spyrecclFloat64:
      return 8;
    case spyrecclNumTypes:
      break;
  }
  return 0;
}

const char* dtype_name(spyrecclDataType_t dtype) {
  switch (dtype) {
    case spyrecclInt8:
      return "int8";
    case spyrecclUint8:
      return "uint8";
    case spyrecclInt16:
      return "int16";
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
      return "float8_e4m3";
    case spyrecclFloat8e5m2:
      return "float8_e5m2";
    case spyrecclBool:
      return "bool";
    case spyrecclNumTypes:
      break;
  }
  return "<invalid dtype>";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "SUM";
    case ReduceOp::kProd:
      return "PROD";
    case ReduceOp::kMax:
      return "MAX";
    case ReduceOp::kMin:
      return "MIN";
    case ReduceOp::kAvg:
      return "AVG";
    case ReduceOp::kBand:
      return "BAND";
    case ReduceOp::kBor:
      return "BOR";
    case ReduceOp::kBxor:
      return "BXOR";
    case ReduceOp::kPremulSum:
      return "PREMUL_SUM";
  }
  return "<invalid op>";
}

void bind_types(py::module_& m) {
  py::native_enum<spyrecclDataType_t>(m, "DataType", "enum.IntEnum",
                                      "Element types, numbered like the C spyrecclDataType_t.")
      .value("INT8", spyrecclInt8)
      .value("UINT8", spyrecclUint8)
      .value("INT32", spyrecclInt32)
      .value("UINT32", spyrecclUint32)
      .value("INT64", spyrecclInt64)
      .value("UINT64", spyrecclUint64)
      .value("FLOAT16", spyrecclFloat16)
      .value("FLOAT32", spyrecclFloat32)
      .value("FLOAT64", spyrecclFloat64)
      .value("BFLOAT16", spyrecclBfloat16)
      .value("FLOAT8_E4M3", spyrecclFloat8e4m3, "float8_e4m3fn: no infinities")
      .value("FLOAT8_E5M2", spyrecclFloat8e5m2)
      .value("INT16", spyrecclInt16)
      .value("BOOL", spyrecclBool)
      .finalize();

  py::native_enum<ReduceOp>(m, "ReduceOp", "enum.IntEnum",
                            "Reduction operations; PREMUL_SUM needs `scalar=`.")
      .value("SUM", ReduceOp::kSum)
      .value("PROD", ReduceOp::kProd)
      .value("MAX", ReduceOp::kMax)
      .value("MIN", ReduceOp::kMin)
      .value("AVG", ReduceOp::kAvg, "floating: sum/size; integers: truncated toward zero")
      .value("BAND", ReduceOp::kBand)
      .value("BOR", ReduceOp::kBor)
      .value("BXOR", ReduceOp::kBxor)
      .value("PREMUL_SUM", ReduceOp::kPremulSum, "sum over ranks of scalar * x")
      .finalize();

  py::native_enum<spyrecclResult_t>(m, "Result", "enum.IntEnum",
                                    "Result codes of the C API (spyrecclResult_t).")
      .value("SUCCESS", spyrecclSuccess)
      .value("SYSTEM_ERROR", spyrecclSystemError)
      .value("INTERNAL_ERROR", spyrecclInternalError)
      .value("INVALID_ARGUMENT", spyrecclInvalidArgument)
      .value("INVALID_USAGE", spyrecclInvalidUsage)
      .value("REMOTE_ERROR", spyrecclRemoteError)
      .value("TIMEOUT", spyrecclTimeout)
      .value("ABORTED", spyrecclAborted)
      .value("MISMATCH", spyrecclMismatch)
      .value("UNSUPPORTED", spyrecclUnsupported)
      .finalize();
}

}  // namespace spyreccl_py
