// DeviceGuardImpl for the emulated spyre device.
//
// The emulated device executes every operation synchronously on the calling
// host thread, so it has exactly one stream per device (the default stream),
// events complete the moment they are recorded, and every synchronisation is
// a no-op. Only the current-device bookkeeping and event timestamps carry
// state.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <chrono>

#include "device_state.h"

namespace spyreccl::device {
namespace {

void check_spyre(const c10::Device& device, const char* what) {
  TORCH_CHECK(device.type() == kSpyreDeviceType, what, ": expected a spyre device, got ", device);
}

struct HostEvent {
  std::chrono::steady_clock::time_point recorded_at;
};

class SpyreGuardImpl final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return kSpyreDeviceType; }

  c10::Device exchangeDevice(c10::Device device) const override {
    check_spyre(device, "spyre device guard");
    const c10::Device previous = getDevice();
    if (device.index() != previous.index()) {
      set_current_device(device.index());
    }
    return previous;
  }

  c10::Device getDevice() const override { return spyre_device(current_device()); }

  void setDevice(c10::Device device) const override {
    check_spyre(device, "spyre device guard");
    set_current_device(device.index());
  }

  void uncheckedSetDevice(c10::Device device) const noexcept override {
    set_current_device_unchecked(device.index());
  }

  c10::Stream getStream(c10::Device device) const override { return default_stream(device); }

  c10::Stream getDefaultStream(c10::Device device) const override { return default_stream(device); }

  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*high_priority*/) const override {
    return default_stream(device);
  }

  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return default_stream(device);
  }

  c10::Stream exchangeStream(c10::Stream stream) const override {
    return default_stream(stream.device());
  }

  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }

  // Every operator runs a CPU kernel on host memory, so every dtype the CPU
  // supports is supported (the default capability: all of them).
  c10::DeviceCapability getDeviceCapability(c10::Device device) const override {
    check_spyre(device, "spyre getDeviceCapability");
    return c10::DeviceCapability();
  }

  // Events carry only a host timestamp: work recorded before an event has
  // already run when record() is called, so events are complete immediately
  // and only elapsed_time needs state.
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag /*flag*/) const override {
    check_spyre(stream.device(), "spyre event record");
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(),
                "spyre event record: event belongs to device ", static_cast<int>(device_index),
                " but the stream is on ", stream.device());
    if (*event == nullptr) {
      *event = new HostEvent();
    }
    static_cast<HostEvent*>(*event)->recorded_at = std::chrono::steady_clock::now();
  }

  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<HostEvent*>(event);
  }

  double elapsedTime(void* start, void* end,
                     const c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(start != nullptr && end != nullptr,
                "spyre elapsed_time: both events must be recorded first");
    const auto delta =
        static_cast<HostEvent*>(end)->recorded_at - static_cast<HostEvent*>(start)->recorded_at;
    return std::chrono::duration<double, std::milli>(delta).count();
  }

  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  bool queryStream(const c10::Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    check_device_index(device_index, "spyre synchronize");
  }
  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/,
                             const c10::Stream& /*stream*/) const override {}

 private:
  static c10::Stream default_stream(const c10::Device& device) {
    check_spyre(device, "spyre stream");
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
};

}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, SpyreGuardImpl);

}  // namespace spyreccl::device
