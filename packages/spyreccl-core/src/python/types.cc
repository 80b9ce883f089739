// types.cc — the Python enums mirroring the C API's enums.
#include "types.h"

#include <pybind11/native_enum.h>

namespace spyreccl_py {

size_t dtype_itemsize(spyrecclDataType_t dtype) { return spyrecclGetDataTypeSize(dtype); }

const char* dtype_name(spyrecclDataType_t dtype) {
  // One spelling everywhere: the library's (torch's dtype names), as in its own messages.
  const char* name = spyrecclGetDataTypeName(dtype);
  return name != nullptr ? name : "<invalid dtype>";
}

namespace {

// The Python members of ReduceOp: the single table behind both the enum and
// reduce_op_name, so the name in a message is always the member's name.
struct ReduceOpMember {
  ReduceOp op;
  const char* name;
  const char* doc;
};

constexpr ReduceOpMember kReduceOpMembers[] = {
    {ReduceOp::kSum, "SUM", nullptr},
    {ReduceOp::kProd, "PROD", nullptr},
    {ReduceOp::kMax, "MAX", nullptr},
    {ReduceOp::kMin, "MIN", nullptr},
    {ReduceOp::kAvg, "AVG", "floating: sum/size; integers: truncated toward zero"},
    {ReduceOp::kBand, "BAND", nullptr},
    {ReduceOp::kBor, "BOR", nullptr},
    {ReduceOp::kBxor, "BXOR", nullptr},
    {ReduceOp::kPremulSum, "PREMUL_SUM", "sum over ranks of scalar * x"},
};

}  // namespace

const char* reduce_op_name(ReduceOp op) {
  for (const ReduceOpMember& member : kReduceOpMembers) {
    if (member.op == op) return member.name;
  }
  return "<invalid op>";
}

namespace {
PyTypeObject* g_reduce_op_type = nullptr;  // the bound ReduceOp class, kept alive for good
}  // namespace

ReduceOp reduce_op_arg(py::handle op, const char* api) {
  if (g_reduce_op_type != nullptr && Py_TYPE(op.ptr()) == g_reduce_op_type) {
    return static_cast<ReduceOp>(PyLong_AsLong(op.ptr()));
  }
  try {
    return op.cast<ReduceOp>();
  } catch (const py::cast_error&) {
    throw py::type_error(std::string(api) + ": argument 'op' must be a ReduceOp, got " +
                         std::string(py::str(py::type::handle_of(op).attr("__name__"))));
  }
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

  py::native_enum<ReduceOp> reduce_op(m, "ReduceOp", "enum.IntEnum",
                                      "Reduction operations; PREMUL_SUM needs `scalar=`.");
  for (const ReduceOpMember& member : kReduceOpMembers) {
    reduce_op.value(member.name, member.op, member.doc);
  }
  reduce_op.finalize();
  py::object reduce_op_class = m.attr("ReduceOp");
  g_reduce_op_type = reinterpret_cast<PyTypeObject*>(reduce_op_class.release().ptr());

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
