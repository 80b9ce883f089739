// staging_bindings.cpp — see staging_bindings.h.
#include "backend/staging_bindings.h"

#include <string>

#include <c10/core/Device.h>

#include "backend/device_caps.h"
#include "backend/staging.h"

namespace py = pybind11;

namespace spyreccl_torch {
namespace {

// "cpu", "spyre", "spyre:0", ...: the device type (PrivateUse1 answers to its renamed name).
c10::DeviceType parseDeviceType(const std::string& device) { return c10::Device(device).type(); }

}  // namespace

void addStagingBindings(py::module_& module) {
  module.def(
      "_set_host_addressable",
      [](const std::string& device, bool addressable) {
        setHostAddressable(parseDeviceType(device), addressable);
      },
      py::arg("device"), py::arg("addressable"),
      "Declares whether the memory of `device`'s type is host memory the backend may hand to "
      "the core as it is (the device's owner calls it; an undeclared device other than cpu is "
      "not host-addressable and is staged through host buffers).");
  module.def(
      "_host_addressable",
      [](const std::string& device) { return hostAddressable(parseDeviceType(device)); },
      py::arg("device"), "Whether the backend treats `device`'s memory as host memory.");
  module.def(
      "_set_staging_chunk_bytes", [](size_t bytes) { setStagingChunkBytes(bytes); },
      py::arg("bytes"),
      "Chunk size of the staged pipeline (SPYRECCL_STAGING_CHUNK_BYTES; at least 4096); must "
      "be the same on every rank.");
  module.def("_staging_chunk_bytes", &stagingChunkBytes,
             "Chunk size of the staged pipeline, in bytes.");
  module.def(
      "_staging_counters",
      [] {
        const StagingCounters c = stagingCounters();
        py::dict counters;
        counters["staged_buffers"] = c.stagedBuffers;
        counters["bytes_to_host"] = c.bytesToHost;
        counters["bytes_from_host"] = c.bytesFromHost;
        counters["pipelined_ops"] = c.pipelinedOps;
        counters["pipeline_chunks"] = c.pipelineChunks;
        counters["slot_buffers"] = c.slotBuffers;
        counters["slots_in_use"] = c.slotsInUse;
        return counters;
      },
      "What the staged path did in this process: buffers staged whole, bytes copied to and "
      "from the host, operations run as chunk pipelines and their chunks, host buffers taken from "
      "the small preallocated slots, and the slots held now.");
  module.def("_reset_staging_counters", &resetStagingCounters,
             "Sets the staging counters to zero.");
}

}  // namespace spyreccl_torch
