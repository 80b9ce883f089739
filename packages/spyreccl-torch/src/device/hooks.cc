// PrivateUse1 hooks: what ATen asks an accelerator about (availability,
// generators, pointers, storage resizing). Registering them, together with
// torch.utils.rename_privateuse1_backend("spyre"), makes spyre the current
// accelerator.
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <exception>

#include "allocator.h"
#include "device_state.h"
#include "generator.h"
#include "pinned_allocator.h"

namespace spyreccl::device {
namespace {

class SpyreHooks final : public at::PrivateUse1HooksInterface {
 public:
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  void init() const override {}

  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    return default_generator(device_index);
  }

  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    return make_generator(device_index);
  }

  // Spyre memory is host memory: any host pointer is usable on every emulated
  // device. Pointers from the spyre allocator report the device they were
  // allocated for; any other pointer reports the current device.
  c10::Device getDeviceFromPtr(void* data) const override {
    return spyre_device(device_of_allocation(data).value_or(current_device()));
  }

  // Host memory needs no pinning: "pinned" buffers are ordinary CPU memory
  // that the pinned allocator registers, so that is_pinned() holds for what
  // pin_memory() returned (pinned_allocator.h).
  bool isPinnedPtr(const void* data) const override { return is_pinned_pointer(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }

  bool hasPrimaryContext(c10::DeviceIndex device_index) const override {
    check_device_index(device_index, "spyre hasPrimaryContext");
    return true;
  }

  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex device) const override { set_current_device(device); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }

  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const c10::DeviceIndex previous = current_device();
    if (device != previous) {
      set_current_device(device);
    }
    return previous;
  }

  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(*storage.unsafeGetStorageImpl(), newsize);
  }
};

// Registered while the shared library loads; never destroyed because ATen
// keeps the pointer for the life of the process. This runs inside dlopen, where
// an escaping exception would terminate the process: if another library owns
// PrivateUse1 already (the Python loader checks before loading, so only direct
// loads get here), report it and leave the existing hooks in place.
const bool registered = [] {
  if (at::isPrivateUse1HooksRegistered()) {
    std::fprintf(stderr,
                 "spyreccl: PrivateUse1 hooks are already registered by another library; the "
                 "emulated spyre device is not usable in this process\n");
    return false;
  }
  try {
    at::RegisterPrivateUse1HooksInterface(new SpyreHooks());
    return true;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "spyreccl: registering the spyre PrivateUse1 hooks failed: %s\n",
                 error.what());
    return false;
  }
}();

}  // namespace
}  // namespace spyreccl::device
