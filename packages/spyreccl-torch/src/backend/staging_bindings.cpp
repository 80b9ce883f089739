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
      "_set_staging_pipeline",
      [](const std::string& setting) { setStagingPipelineSetting(setting); }, py::arg("setting"),
      "When staged operations run as chunk pipelines (SPYRECCL_STAGING_PIPELINE): 'auto' (where "
      "the copies can overlap the collective), '1' (always past one chunk) or '0' (never); must "
      "be the same on every rank.");
  module.def("_staging_pipeline", &stagingPipelineSetting,
             "The staging pipeline setting: 'auto', '1' or '0'.");
  module.def(
      "_set_copies_use_host_cpu",
      [](const std::string& device, bool onHostCpu) {
        setCopiesUseHostCpu(parseDeviceType(device), onHostCpu);
      },
      py::arg("device"), py::arg("on_host_cpu"),
      "Declares whether copies between `device`'s memory and the host run on the host's CPUs "
      "(the device's owner calls it; undeclared: no, the device copies by DMA). Staged "
      "pipelines of such a device run only where a spare core per rank exists.");
  module.def(
      "_copies_use_host_cpu",
      [](const std::string& device) { return copiesUseHostCpu(parseDeviceType(device)); },
      py::arg("device"), "Whether `device`'s copies to and from the host take a host CPU.");
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
        counters["arena_buffers"] = c.arenaBuffers;
        counters["slots_in_use"] = c.slotsInUse;
        return counters;
      },
      "What the staged path did in this process: buffers staged whole, bytes copied to and "
      "from the host, operations run as chunk pipelines and their chunks, host buffers taken from "
      "the small preallocated slots, host buffers in the core's shareable arena, and the slots "
      "held now.");
  module.def("_reset_staging_counters", &resetStagingCounters,
             "Sets the staging counters to zero.");
}

}  // namespace spyreccl_torch
