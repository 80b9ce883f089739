// unique_id.cc — UniqueId creation, byte round trip, equality and pickling.
#include "unique_id.h"

#include <cstring>
#include <string>

#include "errors.h"

namespace spyreccl_py {
namespace {

UniqueId fresh_unique_id() {
  UniqueId uid;
  check_result(spyrecclGetUniqueId(&uid.id), nullptr);
  return uid;
}

py::bytes to_bytes(const UniqueId& uid) {
  return py::bytes(uid.id.internal, sizeof(uid.id.internal));
}

UniqueId from_bytes(const py::bytes& data) {
  char* buffer = nullptr;
  Py_ssize_t length = 0;
  if (PyBytes_AsStringAndSize(data.ptr(), &buffer, &length) != 0) throw py::error_already_set();
  if (static_cast<size_t>(length) != sizeof(spyrecclUniqueId::internal)) {
    throw_invalid_argument("UniqueId.from_bytes", "argument 'data' has " + std::to_string(length) +
                                                      " bytes, expected exactly " +
                                                      std::to_string(SPYRECCL_UNIQUE_ID_BYTES));
  }
  UniqueId uid;
  std::memcpy(uid.id.internal, buffer, sizeof(uid.id.internal));
  return uid;
}

bool equal(const UniqueId& a, const UniqueId& b) {
  return std::memcmp(a.id.internal, b.id.internal, sizeof(a.id.internal)) == 0;
}

}  // namespace

void bind_unique_id(py::module_& m) {
  py::class_<UniqueId> cls(m, "UniqueId",
                           "Token naming one communicator-to-be. Rank 0 creates it and hands its "
                           "bytes to the other ranks (file, socket, store). Valid for one "
                           "communicator initialisation.");
  cls.attr("SIZE") = SPYRECCL_UNIQUE_ID_BYTES;
  cls.def(py::init(&fresh_unique_id), "Creates a fresh id (random nonce, host, version).")
      .def_static("from_bytes", &from_bytes, py::arg("data"),
                  "Rebuilds an id from the exact bytes produced by to_bytes().")
      .def("to_bytes", &to_bytes)
      .def("__bytes__", &to_bytes)
      .def("__eq__",
           [](const UniqueId& self, py::object other) -> py::object {
             if (!py::isinstance<UniqueId>(other))
               return py::reinterpret_borrow<py::object>(Py_NotImplemented);
             return py::bool_(equal(self, other.cast<const UniqueId&>()));
           })
      .def("__hash__", [](const UniqueId& self) { return py::hash(to_bytes(self)); })
      // The bytes contain the secret nonce that makes the shared-memory name unguessable, so
      // the repr deliberately does not show them.
      .def("__repr__", [](const UniqueId&) { return std::string("<spyreccl_core.UniqueId>"); })
      .def(py::pickle([](const UniqueId& self) { return to_bytes(self); },
                      [](const py::bytes& state) { return from_bytes(state); }));
}

}  // namespace spyreccl_py
