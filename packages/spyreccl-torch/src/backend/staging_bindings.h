// staging_bindings.h — Python bindings of device_caps.h and staging.h.
#pragma once

#include <pybind11/pybind11.h>

namespace spyreccl_torch {

// _set_host_addressable / _host_addressable, _set_staging_chunk_bytes /
// _staging_chunk_bytes, _staging_counters / _reset_staging_counters.
void addStagingBindings(pybind11::module_& module);

}  // namespace spyreccl_torch
