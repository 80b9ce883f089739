// fast_empty.h — the allocation call of inductor's generated Python wrappers for spyre.
#pragma once

#include <pybind11/pybind11.h>

namespace spyreccl_torch {

// Adds `_empty_strided_spyre(size: tuple[int, ...], stride: tuple[int, ...], dtype)` to
// `module`: an uninitialised spyre tensor on the current spyre device, like
// torch.empty_strided(size, stride, device="spyre", dtype=dtype), for the buffers of
// compiled graphs (spyreccl_torch.device._inductor emits it).
void addFastEmpty(pybind11::module_& module);

}  // namespace spyreccl_torch
