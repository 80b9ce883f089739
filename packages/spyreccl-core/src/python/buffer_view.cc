// buffer_view.cc — buffer-protocol checks and data-type inference.
#include "buffer_view.h"

#include <cstring>
#include <string>

#include "errors.h"
#include "types.h"

namespace spyreccl_py {
namespace {

struct FormatInfo {
  std::optional<spyrecclDataType_t> dtype;  // empty: no spyreccl type (e.g. uint16)
  bool integer_view = false;                // may be reinterpreted by a dtype= override
  bool recognised = false;                  // false: format we cannot interpret at all
};

constexpr bool kLittleEndian = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;

// Interprets a single-element struct format ("<f", "=i", "e", "?", "B", ...). Multi-byte
// types in non-native byte order are rejected: the library reduces native values.
FormatInfo parse_format(const char* format, size_t itemsize) {
  FormatInfo info;
  if (format == nullptr) format = "B";  // the buffer protocol's default: unsigned bytes
  char order = '@';
  if (format[0] != '\0' && std::strchr("@=<>!", format[0]) != nullptr) order = *format++;
  if (format[0] == '\0' || format[1] != '\0') return info;  // structs, arrays, sub-formats
  const bool foreign_order =
      (order == '>' || order == '!') ? kLittleEndian : (order == '<' ? !kLittleEndian : false);
  if (foreign_order && itemsize > 1) return info;

  const char code = format[0];
  info.recognised = true;
  switch (code) {
    case 'e':
      info.dtype = spyrecclFloat16;
      return info;
    case 'f':
      info.dtype = spyrecclFloat32;
      return info;
    case 'd':
      info.dtype = spyrecclFloat64;
      return info;
    case '?':
      info.dtype = spyrecclBool;
      return info;
    default:
      break;
  }
  const bool is_signed = std::strchr("bhilqn", code) != nullptr;
  const bool is_unsigned = std::strchr("BHILQNc", code) != nullptr;
  if (!is_signed && !is_unsigned) {
    info.recognised = false;
    return info;
  }
  info.integer_view = true;
  switch (itemsize) {
    case 1:
      info.dtype = is_signed ? spyrecclInt8 : spyrecclUint8;
      break;
    case 2:
      if (is_signed) info.dtype = spyrecclInt16;
      break;  // no uint16 in spyreccl
    case 4:
      info.dtype = is_signed ? spyrecclInt32 : spyrecclUint32;
      break;
    case 8:
      info.dtype = is_signed ? spyrecclInt64 : spyrecclUint64;
      break;
    default:
      info.recognised = false;
      break;
  }
  return info;
}

std::string describe_format(const Py_buffer& view) {
  return "'" + std::string(view.format != nullptr ? view.format : "B") + "' (itemsize " +
         std::to_string(view.itemsize) + ")";
}

}  // namespace

BufferView BufferView::acquire(py::handle obj, const char* op, const char* arg, Access access,
                               std::optional<spyrecclDataType_t> dtype) {
  if (obj.is_none() || !PyObject_CheckBuffer(obj.ptr())) {
    throw_type_error(op, std::string("argument '") + arg +
                             "' must be a C-contiguous buffer (numpy array, bytearray, "
                             "memoryview), got " +
                             std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  BufferView result;
  result.arg_ = arg;
  if (PyObject_GetBuffer(obj.ptr(), &result.view_, PyBUF_RECORDS_RO) != 0) {
    result.view_.obj = nullptr;  // nothing to release
    throw py::error_already_set();
  }
  const Py_buffer& view = result.view_;

  if (access == Access::kWrite && view.readonly) {
    throw_invalid_argument(
        op, std::string("argument '") + arg + "' is read-only; the output buffer must be writable");
  }
  if (!PyBuffer_IsContiguous(&view, 'C')) {
    throw_invalid_argument(op, std::string("argument '") + arg +
                                   "' is not C-contiguous; pass numpy.ascontiguousarray(x)");
  }
  if (view.itemsize <= 0) {
    throw_type_error(op, std::string("argument '") + arg + "' has an invalid item size");
  }

  const FormatInfo format = parse_format(view.format, static_cast<size_t>(view.itemsize));
  if (!format.recognised) {
    throw_type_error(op, std::string("argument '") + arg + "' has unsupported buffer format " +
                             describe_format(view) +
                             "; expected a native-endian bool, integer or float element");
  }
  if (dtype.has_value()) {
    const size_t wanted = dtype_itemsize(*dtype);
    if (wanted == 0) throw_invalid_argument(op, "argument 'dtype' is not a valid DataType");
    const bool same = format.dtype.has_value() && *format.dtype == *dtype;
    if (!same && !(format.integer_view && wanted == static_cast<size_t>(view.itemsize))) {
      throw_type_error(
          op, std::string("dtype=") + dtype_name(*dtype) + " cannot reinterpret argument '" + arg +
                  "' with format " + describe_format(view) + "; pass an integer view of width " +
                  std::to_string(wanted) + " bytes (e.g. uint" + std::to_string(wanted * 8) + ")");
    }
    result.dtype_ = *dtype;
  } else if (format.dtype.has_value()) {
    result.dtype_ = *format.dtype;
  } else {
    throw_type_error(op, std::string("argument '") + arg + "' has format " + describe_format(view) +
                             " which has no spyreccl data type; for bfloat16 pass the uint16 "
                             "view with dtype=DataType.BFLOAT16");
  }
  result.count_ = static_cast<size_t>(view.len) / static_cast<size_t>(view.itemsize);
  return result;
}

BufferView::BufferView(BufferView&& other) noexcept
    : view_(other.view_), count_(other.count_), dtype_(other.dtype_), arg_(other.arg_) {
  other.view_.obj = nullptr;
}

BufferView::~BufferView() {
  if (view_.obj != nullptr) PyBuffer_Release(&view_);
}

void require_same_dtype(const char* op, const BufferView& first, const BufferView& other) {
  if (first.dtype() != other.dtype()) {
    throw_type_error(op, std::string("argument '") + other.arg() + "' has dtype " +
                             dtype_name(other.dtype()) + " but '" + first.arg() + "' has " +
                             dtype_name(first.dtype()) + "; both must have the same dtype");
  }
}

bool overlaps(const BufferView& a, const BufferView& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  return a.begin() < b.end() && b.begin() < a.end();
}

}  // namespace spyreccl_py
