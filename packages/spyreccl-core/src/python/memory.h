// memory.h — binding of spyrecclMemAlloc / spyrecclMemFree: SharedBuffer, a block of the
// process's memory arena exposed through the buffer protocol (numpy wraps it in
// spyreccl_core.empty).
#pragma once

#include <pybind11/pybind11.h>

namespace spyreccl_py {

namespace py = pybind11;

void bind_memory(py::module_& m);

}  // namespace spyreccl_py
