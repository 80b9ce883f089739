// device_caps.h — which device types' memory the host may address directly.
//
// The shared-memory core reads and writes plain host memory. A tensor's data_ptr() is that
// only where the device says so: CPU tensors always; the emulated spyre device in its
// default `host` memory mode. A real Spyre runtime (torch_spyre) hands out a context object
// around a device address, which must never be dereferenced on the host: such tensors move
// through host buffers with the device's own copies (staging.h). The answer is declared by
// whoever owns the device (the emulated device sets it when it registers), never guessed
// from pointer values: an undeclared device type is not host-addressable.
#pragma once

#include <c10/core/DeviceType.h>

namespace spyreccl_torch {

// Whether the backend may hand data_ptr() of a tensor on `type` to the core as it is.
// CPU: yes unless declared otherwise; any other type: only once declared so.
bool hostAddressable(c10::DeviceType type);

// Declares `type`'s memory host-addressable (or not). Thread-safe; takes effect for
// operations enqueued afterwards.
void setHostAddressable(c10::DeviceType type, bool addressable);

// Whether copies between `type`'s memory and host memory run on the host's CPUs (the emulated
// device's memcpy) rather than on an engine of the device's own (a real card's DMA). The
// staged pipeline overlaps copies with the collective; copies that take a CPU overlap only
// where a spare core exists for them (staging.h). Undeclared: no (a device copies by DMA).
bool copiesUseHostCpu(c10::DeviceType type);
void setCopiesUseHostCpu(c10::DeviceType type, bool onHostCpu);

}  // namespace spyreccl_torch
