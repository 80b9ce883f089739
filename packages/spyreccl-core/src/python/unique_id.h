// unique_id.h — the Python UniqueId: a fresh spyrecclUniqueId, transportable as bytes.
#pragma once

#include <pybind11/pybind11.h>
#include <spyreccl/spyreccl.h>

namespace spyreccl_py {

namespace py = pybind11;

struct UniqueId {
  spyrecclUniqueId id{};
};

void bind_unique_id(py::module_& m);

}  // namespace spyreccl_py
