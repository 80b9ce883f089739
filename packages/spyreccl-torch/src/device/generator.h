// Random number generators of the emulated spyre device.
//
// Random kernels run on the CPU, and CPU kernels only accept CPUGeneratorImpl.
// A spyre generator therefore owns a CPU generator (the engine state) and
// carries the spyre device and dispatch key so that it routes random ops to the
// spyre fallback, which hands the owned CPU generator to the CPU kernel. This
// keeps torch.spyre.manual_seed independent of torch's CPU generator, like
// torch.cuda.manual_seed.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

#include <mutex>

namespace spyreccl::device {

class SpyreGeneratorImpl final : public c10::GeneratorImpl {
 public:
  SpyreGeneratorImpl(c10::DeviceIndex device, uint64_t seed);
  SpyreGeneratorImpl(c10::DeviceIndex device, at::Generator engine);

  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;

  // The CPU generator holding the state; pass it to CPU kernels.
  const at::Generator& engine() const { return engine_; }

 private:
  SpyreGeneratorImpl* clone_impl() const override;
  std::mutex& engine_mutex() const;

  at::Generator engine_;
};

// Default generator of device `index` (-1: current device). Lives forever.
const at::Generator& default_generator(c10::DeviceIndex index);

// A fresh generator for device `index` (-1: current device).
at::Generator make_generator(c10::DeviceIndex index);

// The CPU generator to hand to a CPU kernel in place of `generator`, which
// must be a spyre generator; `op` names the operator for the error message.
at::Generator engine_of(const at::Generator& generator, const char* op);

}  // namespace spyreccl::device
