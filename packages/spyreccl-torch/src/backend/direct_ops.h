// direct_ops.h — dispatcher operators called from inductor's generated Python wrappers
// without torch's Python operator layer.
#pragma once

#include <pybind11/pybind11.h>

namespace spyreccl_torch {

// Adds `_direct_op(overload)` to `module`. Given an OpOverload (e.g.
// torch.ops._c10d_functional.all_reduce_.default) whose schema takes only Tensor,
// Tensor[], str, int, SymInt, int[], SymInt[] and Any (passed a str) arguments and returns
// nothing, a Tensor or a Tensor[], it returns a C callable that calls the same dispatcher
// operator with the same arguments: the same kernels (spyreccl's PrivateUse1 ones for spyre
// tensors), profiler events, dispatch modes and errors, with the GIL released around the
// call as torch's own operator call does. A call it cannot convert (keyword arguments it
// does not know, a Tensor subclass, an argument of another type, an active
// __torch_function__ mode) goes to `overload` itself. For any other schema it returns
// `overload` unchanged. `_direct_op(overload, wait_follows=True)` binds a function for
// callers whose next step is the collective's wait_tensor (WaitFollowsScope).
void addDirectOps(pybind11::module_& module);

}  // namespace spyreccl_torch
